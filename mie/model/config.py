"""The model's shape, read from a Hugging Face ``config.json``, and what mie refuses to run.

mie implements one decoder: pre-norm with RMSNorm, rotary embeddings, grouped-query attention
over every past token, and a SwiGLU MLP. Four Hugging Face families are that decoder:

* Llama (``LlamaForCausalLM``; also SmolLM2 and Llama 3.x), the plain form;
* Mistral (``MistralForCausalLM``), Llama-shaped, whose ``sliding_window`` (null: full
  attention) makes every layer attend to the last ``sliding_window`` positions only
  (``ModelConfig.sliding_window``; the kernels and the scheduler's released blocks follow);
* Qwen2 (``Qwen2ForCausalLM``), which adds biases to the q/k/v projections;
* Qwen3 (``Qwen3ForCausalLM``), which has no such biases but an RMSNorm over each head's
  query and key (``q_norm``, ``k_norm``) before RoPE.

RoPE may be unscaled or scaled by the ``linear``, ``dynamic``, ``llama3`` or ``yarn`` rule
(``mie.ops.RopeScaling``), read from ``rope_scaling`` or ``rope_parameters`` as transformers
reads them (``_rope``). A config asking for anything else (other scaling rules, Qwen's
per-layer sliding windows, other activations, extra biases) is refused with ``ConfigError``
rather than run as something subtly different.

So is every value the math cannot use: a size that is not a positive integer (or is past
``MAX_SIZE``), an ``rms_norm_eps`` or ``rope_theta`` that is not a finite positive number
(Python's ``json`` reads ``Infinity`` and ``NaN``; an infinite epsilon makes every hidden
state zero and the model emit token 0 forever), an explicit ``head_dim: 0``. The message
names the ``config.json`` key, and ``from_pretrained`` prefixes the file's path.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import numpy as np

from mie.checkpoint import listed, read_config, read_json
from mie.checks import as_float, is_int
from mie.checks import short_repr as _short
from mie.ops import ROPE_TYPES, RopeScaling, rope_inv_freq, yarn_attention_factor

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""``model_type`` -> the Hugging Face class name mie can stand in for."""
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
}
"""What each family's transformers config class (``LlamaConfig``, ...) assumes for a key
``config.json`` leaves out, where it is not the same for all: a config read with another
family's default would run another model (another context, window or head size) in silence."""

ROPE_PARAMETERS = {
    "default": {},
    "linear": {"factor": True},
    "dynamic": {"factor": True},
    "llama3": {
        "factor": True,
        "low_freq_factor": True,
        "high_freq_factor": True,
        "original_max_position_embeddings": False,  # transformers: max_position_embeddings
    },
    "yarn": {
        "factor": True,  # null: max_position_embeddings / original_max_position_embeddings
        "original_max_position_embeddings": False,
        "attention_factor": False,  # null or absent: ops.yarn_attention_factor
        "beta_fast": False,  # null, absent or 0: 32
        "beta_slow": False,  # null, absent or 0: 1
        "mscale": False,
        "mscale_all_dim": False,
        "truncate": False,  # absent: true
    },
}
"""``rope_type`` -> the parameters it reads (True: required), besides ``rope_type`` (or its
older spelling ``type``), ``rope_theta`` and ``partial_rotary_factor`` (which must be 1)."""

REFUSED_ROPE_TYPES = {
    "longrope": "it switches every frequency from short_factor to long_factor once a sequence "
    "passes original_max_position_embeddings, so the keys already cached would need other "
    "angles",
}
"""Scaling rules refused for a reason beyond 'not implemented yet'."""


MAX_SIZE = 2**31 - 1
"""Largest size (vocabulary, hidden, heads, layers, positions) accepted: every product of two
sizes then fits an int64, and no real model comes near it."""

MAX_RMS_NORM_EPS = 1.0
"""Largest ``rms_norm_eps`` accepted. The epsilon only keeps ``1 / sqrt(mean(x**2) + eps)``
finite; real models use 1e-5 or 1e-6, and one near float32's maximum scales every hidden
state to zero just as ``Infinity`` does."""

CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a checkpoint's ``config.json`` may declare (``torch_dtype`` / ``dtype``)."""

HF_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "eos_token_ids": "eos_token_id",
}
"""``ModelConfig`` field -> its ``config.json`` key, where the two differ."""


class ConfigError(ValueError):
    """The config is malformed or asks for a feature mie does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model's shape."""

    architecture: str  # a key of ARCHITECTURES: "llama", "mistral", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's own dtype: what dtype="auto" loads the weights as
    rope_scaling: RopeScaling | None = None  # None: unscaled RoPE
    # Mistral's: each query attends to its own and the sliding_window - 1 positions before
    # it, in every layer (None: full attention).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _validate({f.name: getattr(self, f.name) for f in fields(self)}, lambda field: field)

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 adds a bias to the q, k and v projections; the others do not."""
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalizes each head's query and key (``q_norm``, ``k_norm``, one weight
        of ``head_dim`` each, with ``rms_norm_eps``) before RoPE."""
        return self.architecture == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict, eos_token_ids: tuple[int, ...] | None = None) -> ModelConfig:
        """Build from a parsed Hugging Face ``config.json``, refusing unsupported features."""
        if not isinstance(hf, Mapping):
            raise ConfigError(f"the config is a {type(hf).__name__}, not a JSON object")
        model_type = hf.get("model_type")
        if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
            raise ConfigError(
                f"model_type {_short(model_type)} is not supported (only {sorted(ARCHITECTURES)})"
            )
        architectures = hf.get("architectures") or [ARCHITECTURES[model_type]]
        if architectures != [ARCHITECTURES[model_type]]:
            raise ConfigError(
                f"architectures {_short(architectures)}: for model_type {model_type!r} mie runs "
                f"only {ARCHITECTURES[model_type]}"
            )
        _refuse_unsupported(hf)
        num_heads = _required(hf, "num_attention_heads")
        hidden_size = _required(hf, "hidden_size")
        defaults = FAMILY_DEFAULTS[model_type]
        head_dim = hf.get("head_dim", defaults.get("head_dim"))
        labels = dict(HF_KEYS)
        if head_dim is None:  # as transformers does: hidden_size split evenly over the heads
            labels["head_dim"] = "head_dim (hidden_size // num_attention_heads)"
            if _is_size(hidden_size) and _is_size(num_heads):
                head_dim = hidden_size // num_heads
        num_kv_heads = hf.get("num_key_value_heads")
        if eos_token_ids is None:
            eos_token_ids = _token_ids(hf.get("eos_token_id"), "eos_token_id")
        rope_theta, labels["rope_theta"], rope_scaling = _rope(hf)
        tie = hf.get("tie_word_embeddings")
        # transformers 5 writes "dtype", 4 wrote "torch_dtype"; both may be null.
        dtype_key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
        labels["dtype"] = dtype_key
        dtype = hf.get(dtype_key) or "float32"
        values = {
            "architecture": model_type,
            "vocab_size": _required(hf, "vocab_size"),
            "hidden_size": hidden_size,
            "intermediate_size": _required(hf, "intermediate_size"),
            "num_layers": _required(hf, "num_hidden_layers"),
            "num_heads": num_heads,
            "num_kv_heads": num_heads if num_kv_heads is None else num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": rope_theta,
            "tie_word_embeddings": False if tie is None else tie,
            "max_position_embeddings": hf.get(
                "max_position_embeddings", defaults["max_position_embeddings"]
            ),
            "eos_token_ids": eos_token_ids,
            "dtype": dtype,
        }
        # Checked here with config.json's names, so the error names the key to fix.
        _validate(values, lambda field: labels.get(field, field))
        if model_type == "mistral":
            values["sliding_window"] = _sliding_window(  # left out: 4096; null: none
                hf.get("sliding_window", defaults["sliding_window"]),
                values["max_position_embeddings"],
            )
        values["rms_norm_eps"] = float(values["rms_norm_eps"])
        values["rope_theta"] = float(values["rope_theta"])
        values["rope_scaling"] = _rope_scaling(rope_scaling, values["max_position_embeddings"])
        _check_rope_frequencies(
            values["head_dim"], values["rope_theta"], values["rope_scaling"], rope_scaling[0]
        )
        return cls(**values)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` (and stop tokens from ``generation_config.json`` if present).

        A ``ConfigError`` names the file it is about.
        """
        config_path = os.path.join(directory, "config.json")
        generation_path = os.path.join(directory, "generation_config.json")
        hf = read_config(directory)
        eos = None
        if listed(generation_path):  # a dangling symlink is an error naming it, not absent
            try:
                eos = _token_ids(read_json(generation_path).get("eos_token_id"), "eos_token_id")
            except ConfigError as exc:
                raise ConfigError(f"{generation_path}: {exc}") from None
        try:  # config.json's own eos_token_id is not read when generation_config.json has one
            config = cls.from_hf(hf, eos_token_ids=() if eos else None)
        except ConfigError as exc:
            raise ConfigError(f"{config_path}: {exc}") from None
        if not eos:
            return config
        if any(i >= config.vocab_size for i in eos):
            raise ConfigError(
                f"{generation_path}: eos_token_id {_short(list(eos))} outside the vocabulary "
                f"({config_path}: vocab_size {config.vocab_size})"
            )
        return dataclasses.replace(config, eos_token_ids=eos)


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""The ``general.architecture`` values of GGUF files mie runs (llama.cpp's converter writes
Mistral checkpoints as ``llama``)."""

GGUF_ROPE_SCALING = {"none": "default", "linear": "linear", "yarn": "yarn"}
"""``<arch>.rope.scaling.type`` -> the Hugging Face ``rope_type`` it is."""


def config_from_gguf(metadata: Mapping[str, object], where: str) -> ModelConfig:
    """A GGUF file's hyperparameters (its ``<arch>.*`` keys) as a ``ModelConfig``;
    ``ConfigError`` naming ``where`` and the key for anything mie does not run.

    The keys are the ones llama.cpp's converter writes and llama.cpp reads: sizes from
    ``embedding_length``, ``feed_forward_length``, ``block_count``, ``attention.head_count``
    (``head_count_kv``: as many by default), the head size from ``attention.key_length``
    (default ``embedding_length / head_count``), ``context_length``, the norm epsilon, the RoPE
    base and scaling, and -- in a ``llama`` file, where a Mistral checkpoint ends up --
    ``attention.sliding_window`` if present. The vocabulary size is the token list's length
    (``<arch>.vocab_size`` where written); the stop tokens are the tokenizer's EOS, EOT and
    EOM ids (llama.cpp's end-of-generation tokens). ``dtype`` is float32: a GGUF file's
    matrices each carry their own type, which ``mie.model.gguf_weights`` reads per tensor.
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{where}: general.architecture {_short(arch)} is not supported (mie runs "
            f"{', '.join(GGUF_ARCHITECTURES)})"
        )

    def key(name: str) -> str:
        return f"{arch}.{name}"

    def get(name: str, default: object = None) -> object:
        return metadata.get(key(name), default)

    def required(name: str) -> object:
        if key(name) not in metadata:
            raise ConfigError(f"{where}: no {key(name)}")
        return metadata[key(name)]

    hidden, heads = required("embedding_length"), required("attention.head_count")
    head_dim = get("attention.key_length")
    if head_dim is None and _is_size(hidden) and _is_size(heads):
        head_dim = hidden // heads
    for name in ("attention.value_length", "rope.dimension_count"):
        if get(name, head_dim) != head_dim:
            raise ConfigError(
                f"{where}: {key(name)} {_short(get(name))} differs from the head size "
                f"{head_dim}: mie runs full-width rotary heads with values as wide as keys"
            )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise ConfigError(f"{where}: neither {key('vocab_size')} nor tokenizer.ggml.tokens")
    stop_keys = [f"tokenizer.ggml.{name}_token_id" for name in ("eos", "eot", "eom")]
    for name in stop_keys:
        if name in metadata and not _is_token_id(metadata[name]):
            raise ConfigError(f"{where}: {name} {_short(metadata[name])} is not a token id")
    eos = tuple(dict.fromkeys(metadata[name] for name in stop_keys if name in metadata))
    window = get("attention.sliding_window")
    labels = {
        "vocab_size": key("vocab_size") if get("vocab_size") else "tokenizer.ggml.tokens",
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_layers": key("block_count"),
        "num_heads": key("attention.head_count"),
        "num_kv_heads": key("attention.head_count_kv"),
        "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base"),
        "rope_scaling": key("rope.scaling.type"),
        "max_position_embeddings": key("context_length"),
        "eos_token_ids": "tokenizer.ggml.eos_token_id",
        "sliding_window": key("attention.sliding_window"),
    }
    values = {
        "architecture": "mistral" if arch == "llama" and window else arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_layers": required("block_count"),
        "num_heads": heads,
        "num_kv_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": required("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": False,  # set by the loader: whether the file has output.weight
        "max_position_embeddings": required("context_length"),
        "eos_token_ids": eos,
        "dtype": "float32",
        "sliding_window": window or None,
    }
    scaling = get("rope.scaling.type", "none")
    if not isinstance(scaling, str) or scaling not in GGUF_ROPE_SCALING:
        raise ConfigError(
            f"{where}: {key('rope.scaling.type')} {_short(scaling)} is not supported (mie "
            f"reads {', '.join(GGUF_ROPE_SCALING)})"
        )
    attn_factor = get("rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:  # llama.cpp scales RoPE's cos and sin by it: refused, not ignored
        raise ConfigError(
            f"{where}: {key('rope.scaling.attn_factor')} {_short(attn_factor)} is not "
            "supported (mie runs RoPE unscaled by an attention factor: 1.0 only)"
        )
    rope = {"rope_type": GGUF_ROPE_SCALING[scaling]}
    if scaling != "none":
        rope["factor"] = get("rope.scaling.factor")
        original = get("rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = original
    if scaling == "yarn":
        for name in ("beta_fast", "beta_slow"):
            if get(f"rope.scaling.yarn_{name}") is not None:
                rope[name] = get(f"rope.scaling.yarn_{name}")
    try:
        _validate(values, lambda field: labels.get(field, field))
        values["rms_norm_eps"] = float(values["rms_norm_eps"])
        values["rope_theta"] = float(values["rope_theta"])
        values["rope_scaling"] = _rope_scaling(
            (key("rope.scaling.*"), rope), values["max_position_embeddings"]
        )
        _check_rope_frequencies(
            values["head_dim"], values["rope_theta"], values["rope_scaling"], labels["rope_scaling"]
        )
        return ModelConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _refuse_unsupported(hf: dict) -> None:
    """Raise ``ConfigError`` for any config feature that would change the math."""
    activation = hf.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):  # transformers' two names of x * sigmoid(x)
        raise ConfigError(f"hidden_act {_short(activation)}: only 'silu' (SwiGLU) is implemented")
    if hf.get("use_sliding_window"):
        raise ConfigError(
            "use_sliding_window: Qwen's sliding windows on some layers only "
            "(max_window_layers, layer_types) are not implemented; mie runs a window in every "
            "layer, as Mistral's sliding_window"
        )
    layer_types = hf.get("layer_types") or []
    if not isinstance(layer_types, list) or any(k != "full_attention" for k in layer_types):
        raise ConfigError(
            f"layer_types {_short(layer_types)}: only full attention in every layer is "
            "implemented (Mistral's sliding_window is read from its own key)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag}: extra biases are not implemented")
    if hf.get("pretraining_tp", 1) != 1:
        raise ConfigError(f"pretraining_tp {_short(hf['pretraining_tp'])}: only 1 is implemented")


def _required(hf: dict, key: str):
    if key not in hf:
        raise ConfigError(f"missing {key!r}")
    return hf[key]


def _sliding_window(window: object, max_positions: int) -> int | None:
    """Mistral's ``sliding_window``: each query attends to the last ``sliding_window``
    positions (its own included). Null, or a window covering every position the model runs
    (``>= max_position_embeddings``), is full attention: None."""
    if window is not None and not _is_size(window):
        raise ConfigError(
            f"sliding_window must be null or an int from 1 to {MAX_SIZE}, got {_short(window)}"
        )
    if window is None or window >= max_positions:
        return None
    return window


def _rope(hf: dict) -> tuple[object, str, tuple[str, dict]]:
    """``(rope_theta, its key, (the scaling object's key, the object))``, read as
    transformers 5 reads them (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``).

    The scaling object is ``rope_scaling`` (transformers 4's spelling) when that is not empty,
    otherwise ``rope_parameters`` (5's); its ``rope_type`` (or older ``type``) defaults to
    ``"default"``. ``rope_theta`` is read from that object, else from the top level, else
    10000.
    """
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{key} {_short(rope)} is not a JSON object")
    original = hf.get("original_max_position_embeddings")
    if original is not None and rope.get("rope_type", rope.get("type")) in ("llama3", "yarn"):
        # A top-level value (Phi-3's habit) wins over the object's, as in transformers 5.
        rope = {**rope, "original_max_position_embeddings": original}
    if "rope_theta" in rope:
        return rope["rope_theta"], f"{key}.rope_theta", (key, rope)
    return hf.get("rope_theta", 10000.0), "rope_theta", (key, rope)


def _rope_scaling(rope: tuple[str, dict], max_positions: int) -> RopeScaling | None:
    """The ``RopeScaling`` of a ``(key, object)`` from ``_rope``, None for unscaled RoPE;
    ``ConfigError`` naming the key for a rule mie does not implement or a value it cannot
    use. Unknown parameters are refused rather than ignored (transformers only warns):
    they may mean a rule this code does not know."""
    key, rope = rope
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_PARAMETERS:
        why = REFUSED_ROPE_TYPES.get(rope_type, "not implemented") if _hashable(rope_type) else ""
        raise ConfigError(
            f"{key}: rope_type {_short(rope_type)} is not supported ({why or 'not a name'}; "
            f"mie implements default, {', '.join(ROPE_TYPES)})"
        )
    parameters = ROPE_PARAMETERS[rope_type]
    for name in set(rope) - set(parameters) - {"rope_type", "type", "rope_theta"}:
        if name == "partial_rotary_factor" and rope[name] in (1, 1.0) and rope[name] is not True:
            continue
        raise ConfigError(
            f"{key}: {name} {_short(rope[name])} is not implemented for rope_type "
            f"{rope_type!r} (mie reads {sorted(parameters) or 'no parameters'})"
        )
    for name, required in parameters.items():
        if required and name not in rope:
            raise ConfigError(f"{key}: rope_type {rope_type!r} needs {name!r}")
    if rope_type == "default":
        return None
    # Defaults as transformers' ROPE_INIT_FUNCTIONS take them; RopeScaling checks the values
    # (_finite_float gives None for anything that is not a finite number, refused there).
    original = rope.get("original_max_position_embeddings", max_positions)
    values: dict[str, object] = {"factor": _finite_float(rope["factor"])}
    if rope_type == "llama3":
        values["low_freq_factor"] = _finite_float(rope["low_freq_factor"])
        values["high_freq_factor"] = _finite_float(rope["high_freq_factor"])
        values["original_max_position_embeddings"] = original
    elif rope_type == "yarn":
        if rope["factor"] is None and _is_size(original):
            values["factor"] = max_positions / original
        values["original_max_position_embeddings"] = original
        values["beta_fast"] = _finite_float(rope.get("beta_fast") or 32.0)
        values["beta_slow"] = _finite_float(rope.get("beta_slow") or 1.0)
        values["truncate"] = rope.get("truncate", True)
        values["attention_factor"] = _yarn_attention_factor(key, rope, values["factor"])
    try:
        return RopeScaling(rope_type, **values)
    except ValueError as exc:
        raise ConfigError(f"{key} {_short(rope)}: {exc}") from None


def _check_rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, key: str
) -> None:
    """``ConfigError`` naming ``key`` unless the scaled RoPE frequencies are all finite and
    positive: each parameter may be in range alone and the rule still divide by a subnormal
    difference or take the floor of an infinite dimension (yarn's ``beta_fast`` 5e-324), and
    a NaN frequency would make every logit NaN."""
    if scaling is None:
        return
    try:
        with np.errstate(all="ignore"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
        usable = bool(np.isfinite(inv_freq).all() and (inv_freq > 0).all())
    except (ArithmeticError, ValueError):  # math.floor(inf), log of 0 or a negative
        usable = False
    if not usable:
        raise ConfigError(
            f"{key}: {scaling.rope_type} scaling with these parameters gives RoPE frequencies "
            f"that are not finite positive numbers ({scaling})"
        )


def _yarn_attention_factor(key: str, rope: dict, factor: float | None) -> float | None:
    """yarn's ``attention_factor`` as given, or transformers' default from ``factor`` (and
    ``mscale``, ``mscale_all_dim`` when both are non-zero); None where it cannot be
    computed, which ``RopeScaling`` then refuses by name."""
    if rope.get("attention_factor") is not None:
        return _finite_float(rope["attention_factor"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    for name, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None and _finite_float(value) is None:
            raise ConfigError(f"{key}: {name} must be a finite number, got {_short(value)}")
    if factor is None:
        return None
    try:
        return yarn_attention_factor(factor, mscale, mscale_all_dim)
    except ZeroDivisionError:
        raise ConfigError(
            f"{key}: mscale_all_dim {_short(mscale_all_dim)} makes the attention factor "
            "divide by zero"
        ) from None


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _is_size(value: object) -> bool:
    """A positive int no larger than ``MAX_SIZE`` (``True`` is not a size)."""
    return is_int(value) and 1 <= value <= MAX_SIZE


def _finite_float(value: object) -> float | None:
    """``value`` as a finite float, or None if it is not a (finite, representable) number."""
    number = as_float(value)  # an int of hundreds of digits is inf: refused with it
    return number if number is not None and math.isfinite(number) else None


def _validate(values: Mapping[str, object], name: Callable[[str], str]) -> None:
    """Raise ``ConfigError`` for the first value (by ``ModelConfig`` field) the forward pass
    cannot use; ``name`` turns a field into the name the message shows."""
    if not isinstance(values["architecture"], str) or values["architecture"] not in ARCHITECTURES:
        raise ConfigError(
            f"architecture {_short(values['architecture'])} is not one of {sorted(ARCHITECTURES)}"
        )
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        value = values[field]
        if not _is_size(value):
            raise ConfigError(
                f"{name(field)} must be an int from 1 to {MAX_SIZE}, got {_short(value)}"
            )
    heads, kv_heads, head_dim = values["num_heads"], values["num_kv_heads"], values["head_dim"]
    if heads % kv_heads:
        raise ConfigError(
            f"{name('num_heads')} {heads} is not a multiple of {name('num_kv_heads')} {kv_heads}"
        )
    if head_dim % 2:
        raise ConfigError(f"{name('head_dim')} must be even for rotary embeddings, got {head_dim}")
    eps = _finite_float(values["rms_norm_eps"])
    # The forward pass adds eps in float32: it must stay positive there.
    if eps is None or not 0 < eps <= MAX_RMS_NORM_EPS or np.float32(eps) == 0:
        raise ConfigError(
            f"{name('rms_norm_eps')} must be a finite number in (0, {MAX_RMS_NORM_EPS}] that "
            f"float32 does not round to 0, got {_short(values['rms_norm_eps'])}"
        )
    scaling = values.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, RopeScaling):
        raise ConfigError(f"{name('rope_scaling')} {_short(scaling)} is not a RopeScaling")
    theta = _finite_float(values["rope_theta"])
    # Frequencies are theta ** (-2i / head_dim), up to 1 / theta: that must be finite too.
    if theta is None or theta <= 0 or not math.isfinite(1.0 / theta):
        raise ConfigError(
            f"{name('rope_theta')} must be a finite positive number, got "
            f"{_short(values['rope_theta'])}"
        )
    if theta == 1 and scaling is not None and scaling.rope_type == "yarn":  # divides by ln(theta)
        raise ConfigError(f"{name('rope_theta')} must not be 1 with yarn RoPE scaling")
    _check_rope_frequencies(head_dim, theta, scaling, name("rope_scaling"))
    if not isinstance(values["tie_word_embeddings"], bool):
        raise ConfigError(
            f"{name('tie_word_embeddings')} must be true or false, got "
            f"{_short(values['tie_word_embeddings'])}"
        )
    if values["dtype"] not in CHECKPOINT_DTYPES:
        raise ConfigError(
            f"{name('dtype')} {_short(values['dtype'])} is not one of {list(CHECKPOINT_DTYPES)}"
        )
    window = values.get("sliding_window")
    if window is not None:
        if not _is_size(window):
            raise ConfigError(
                f"{name('sliding_window')} must be None or an int from 1 to {MAX_SIZE}, got "
                f"{_short(window)}"
            )
        if values["architecture"] != "mistral":
            raise ConfigError(
                f"{name('sliding_window')} {window}: only Mistral has a sliding window, not "
                f"{values['architecture']}"
            )
    eos = values["eos_token_ids"]
    if not isinstance(eos, tuple) or any(not _is_token_id(i) for i in eos):
        raise ConfigError(f"{name('eos_token_ids')} {_short(eos)} is not a tuple of token ids")
    if any(i >= values["vocab_size"] for i in eos):
        raise ConfigError(
            f"{name('eos_token_ids')} {_short(list(eos))} outside the vocabulary "
            f"({name('vocab_size')} {values['vocab_size']})"
        )


def _is_token_id(value: object) -> bool:
    return is_int(value) and value >= 0


def _token_ids(value: object, key: str) -> tuple[int, ...]:
    """``eos_token_id`` may be absent, one id, or a list of ids."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_is_token_id(i) for i in ids):
        raise ConfigError(f"{key} {_short(value)} is not a token id or list of them")
    return tuple(ids)
