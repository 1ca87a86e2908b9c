"""The model's shape, read from a Hugging Face ``config.json``, and what mie refuses to run.

mie implements exactly one family: a pre-norm decoder with RMSNorm, rotary embeddings (the
default, unscaled kind), grouped-query attention over every past token, and a SwiGLU MLP --
Llama, and Qwen2, which adds biases to the q/k/v projections. A config asking for anything
else (rope scaling, sliding windows, other activations, extra biases) is refused with
``ConfigError`` rather than run as something subtly different.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mie.checkpoint import read_config, read_json

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
"""``model_type`` -> the Hugging Face class name mie can stand in for."""


class ConfigError(ValueError):
    """The config is malformed or asks for a feature mie does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model's shape."""

    architecture: str  # "qwen2" or "llama"
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

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not one of {sorted(ARCHITECTURES)}"
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
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not _positive_number(self.rms_norm_eps) or not _positive_number(self.rope_theta):
            raise ConfigError(
                f"rms_norm_eps {self.rms_norm_eps!r} and rope_theta {self.rope_theta!r} must be "
                "positive numbers"
            )
        if any(not 0 <= i < self.vocab_size for i in self.eos_token_ids):
            raise ConfigError(f"eos_token_ids {self.eos_token_ids} outside the vocabulary")

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 adds a bias to the q, k and v projections; Llama does not."""
        return self.architecture == "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict, eos_token_ids: tuple[int, ...] | None = None) -> ModelConfig:
        """Build from a parsed Hugging Face ``config.json``, refusing unsupported features."""
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported (only {sorted(ARCHITECTURES)})"
            )
        architectures = hf.get("architectures") or [ARCHITECTURES[model_type]]
        if architectures != [ARCHITECTURES[model_type]]:
            raise ConfigError(
                f"architectures {architectures!r}: mie runs only {ARCHITECTURES[model_type]}"
            )
        _refuse_unsupported(hf)
        num_heads = _required(hf, "num_attention_heads")
        hidden_size = _required(hf, "hidden_size")
        head_dim = hf.get("head_dim") or (
            hidden_size // num_heads if isinstance(hidden_size, int) and num_heads else None
        )
        if eos_token_ids is None:
            eos_token_ids = _token_ids(hf.get("eos_token_id"))
        return cls(
            architecture=model_type,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(hf, "intermediate_size"),
            num_layers=_required(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` (and stop tokens from ``generation_config.json`` if present)."""
        hf = read_config(directory)
        generation = os.path.join(directory, "generation_config.json")
        try:
            eos = None
            if os.path.exists(generation):
                eos = _token_ids(read_json(generation).get("eos_token_id")) or None
            return cls.from_hf(hf, eos_token_ids=eos)
        except ConfigError as exc:
            raise ConfigError(f"{directory}: {exc}") from None


def _refuse_unsupported(hf: dict) -> None:
    """Raise ``ConfigError`` for any config feature that would change the math."""
    activation = hf.get("hidden_act", "silu")
    if activation != "silu":
        raise ConfigError(f"hidden_act {activation!r}: only 'silu' (SwiGLU) is implemented")
    if hf.get("rope_scaling"):
        raise ConfigError(f"rope_scaling {hf['rope_scaling']!r} is not implemented")
    rope = hf.get("rope_parameters") or {}
    if (
        not isinstance(rope, dict)
        or set(rope) - {"rope_type", "rope_theta"}
        or (rope.get("rope_type", "default") != "default")
    ):
        raise ConfigError(f"rope_parameters {rope!r}: only default, unscaled RoPE is implemented")
    if hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window: sliding-window attention is not implemented")
    layer_types = hf.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ConfigError(f"layer_types {layer_types!r}: only full attention is implemented")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag}: extra biases are not implemented")
    if hf.get("pretraining_tp", 1) != 1:
        raise ConfigError(f"pretraining_tp {hf['pretraining_tp']!r}: only 1 is implemented")


def _required(hf: dict, key: str):
    if key not in hf:
        raise ConfigError(f"missing {key!r}")
    return hf[key]


def _rope_theta(hf: dict) -> float:
    """``rope_theta`` lives at the top level (transformers 4) or in ``rope_parameters`` (5)."""
    rope = hf.get("rope_parameters") or {}
    return rope.get("rope_theta", hf.get("rope_theta", 10000.0))


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _token_ids(value: object) -> tuple[int, ...]:
    """``eos_token_id`` may be absent, one id, or a list of ids."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"eos_token_id {value!r} is not a token id or list of them")
    return tuple(ids)
