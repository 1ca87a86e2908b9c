"""A GGUF file's tensors as mie's weights: names and layouts undone, each type loaded as the
closest mie format -- exactly, where mie holds that format itself.

**Names.** llama.cpp's converter renames every tensor (``model.layers.3.self_attn.q_proj.
weight`` -> ``blk.3.attn_q.weight``, ``GGUF_NAMES``); ``mie.model.weights.assemble`` asks for
Hugging Face names and gets the GGUF tensors. A file without ``output.weight`` ties the LM
head to the embedding, as llama.cpp does. A tensor mie would not read is refused by name
rather than ignored: in a GGUF file it means a computation mie does not do (``rope_freqs``:
Llama 3's per-frequency RoPE factors; biases where the architecture has none).

**Layout.** For the ``llama`` architecture the converter permutes the rows of ``attn_q`` and
``attn_k`` within each head, from Hugging Face's rotate-half RoPE layout (the first half of a
head's dimensions paired with the second) to the interleaved one ggml computes (dimension
``2i`` paired with ``2i + 1``) -- ``LlamaModel.permute`` in ``convert_hf_to_gguf.py``.
``unpermute`` reverses it. Rows are independent in every type, so this is done on the stored
rows, quantized or not, before anything is converted. Qwen2 and Qwen3 files are not permuted.

**Types** (``TYPE_FORMATS``):

* F32, F16, BF16: those values, stored as ``dtype`` and ``quantization`` say (``"auto"``: the
  file's own type), exactly as a safetensors checkpoint holding them would be.
* Q8_0 -> int8 and Q4_0 -> int4 **without requantizing**: a Q8_0 block is 32 int8 codes and
  a float16 scale, mie's int8 group and its scale; a Q4_0 block is byte for byte mie's int4
  block (``mie.linear``). Asking for the other of
  the two (``quantization="int4"`` on a Q8_0 file, say) requantizes.
* Any other type (the K-quants Q4_K, Q5_K, Q6_K, ..., Q4_1, Q5_0, IQ4_NL, ...): dequantized
  with ``gguf.quants`` (llama.cpp's own Python dequantizers) and quantized again by mie --
  to int4 for types of at most 4.5 bits per weight, to int8 above -- with one warning per
  file naming each conversion, since a second rounding adds its error to the first
  (docs/precision.md measures it). The embedding and LM head go to int6 instead of int4,
  as ``embedding_quantization`` has it for mie's own int4 -- except one the file holds in
  Q8_0 (what llama.cpp's quantizer makes of it in its 4-bit files), which stays int8 as it
  is: 8-bit codes rounded again to 6 bits would carry two roundings' error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import gguf
import ml_dtypes
import numpy as np

from mie.checkpoint import CheckpointError, all_finite
from mie.gguf_file import GGUFFile
from mie.model.config import ConfigError, ModelConfig
from mie.model.precision import resolve_dtype
from mie.model.weights import (
    EMBEDDING_ONLY,
    Linear,
    ModelWeights,
    assemble,
    embedding_quantization,
    storage,
)
from mie.ops import FREQUENCY_FACTORS, RopeScaling

logger = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
"""Hugging Face name (within a layer: after ``model.layers.N.``) -> GGUF name (within
``blk.N.``)."""

FLOAT_TYPES = {T.F32: "float32", T.F16: "float16", T.BF16: "bfloat16"}
"""Types held as float values, and the dtype ``dtype="auto"`` stores each as: its own."""

EXACT = {T.Q8_0: "int8", T.Q4_0: "int4"}
"""Block types that are mie formats already: loaded without requantizing."""


def gguf_name(name: str) -> str:
    """The GGUF name of a Hugging Face tensor name."""
    if name.startswith("model.layers."):
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        return f"blk.{index}.{GGUF_NAMES[rest]}"
    return GGUF_NAMES[name]


def requantized_format(kind: gguf.GGMLQuantizationType) -> str:
    """The mie format a block type mie does not hold becomes: int4 up to 4.5 bits a weight
    (Q4_K's 4.5, Q3_K, Q2_K, IQ4_*, ...), int8 above (Q5_*, Q6_K, Q8_K, ...)."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    return "int4" if 8 * block_bytes / block <= 4.5 else "int8"


def unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the converter's ``LlamaModel.permute`` of a q or k projection's rows: within each
    head, stored row ``2i + j`` is Hugging Face's row ``j * head_dim / 2 + i``."""
    head_dim = rows.shape[0] // num_heads
    shaped = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(shaped.swapaxes(1, 2).reshape(rows.shape))


def with_rope_factors(file: GGUFFile, config: ModelConfig) -> ModelConfig:
    """``config`` with the file's RoPE frequency factors, if it has them: llama.cpp's converter
    writes Llama 3's RoPE scaling as a tensor of one factor per frequency
    (``rope_freqs.weight``), which llama.cpp divides each frequency by; mie does the same
    (``RopeScaling("frequency_factors")``). ``CheckpointError`` naming the tensor for factors
    of the wrong size or type, or not finite and positive."""
    name = "rope_freqs.weight"
    if name not in file.tensors:
        return config
    kind, shape, _, _ = file.tensors[name]
    where = f"{file.path}, tensor {name!r}"
    if config.rope_scaling is not None:
        raise CheckpointError(
            f"{where}: frequency factors beside {config.rope_scaling.rope_type} scaling"
        )
    if kind != T.F32 or shape != (config.head_dim // 2,):
        raise CheckpointError(
            f"{where}: {kind.name} {list(shape)}, not F32 [{config.head_dim // 2}] (one factor "
            "per RoPE frequency)"
        )
    factors = tuple(float(f) for f in file.raw(name))
    try:
        scaling = RopeScaling(FREQUENCY_FACTORS, factor=1.0, frequency_factors=factors)
        return dataclasses.replace(config, rope_scaling=scaling)
    except (ValueError, ConfigError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def load_gguf_weights(
    file: GGUFFile,
    config: ModelConfig,
    *,
    dtype: str = "auto",
    quantization: str | None = None,
    allow_non_finite_weights: bool = False,
    refuse_requantization: bool = False,
) -> ModelWeights:
    """Read every tensor ``config`` calls for from ``file``; see the module docstring.

    ``dtype`` and ``quantization`` as for ``mie.model.weights.load_weights``, except that
    ``dtype="auto"`` means each float tensor's own type, and ``quantization=None`` keeps each
    block type's closest mie format (int8 or int4) rather than widening it. A missing,
    misshapen, unexpected or non-finite tensor is a ``CheckpointError`` naming it; so is a
    block type mie would requantize, with ``refuse_requantization`` (for users who want the
    file's numbers exactly or not at all).
    """
    conversions: Counter[tuple[str, str]] = Counter()
    expected = _expected_names(config)
    for name in file.tensors:
        if name not in expected:
            raise CheckpointError(
                f"{file.path}, tensor {name!r}: not part of a {config.architecture} model as "
                "mie computes it"
            )

    def stored(name: str, shape: tuple[int, ...]) -> tuple[gguf.GGMLQuantizationType, np.ndarray]:
        key = gguf_name(name)
        if key not in file.tensors:
            raise CheckpointError(f"{file.path}: no tensor {key!r}")
        kind, file_shape, _, _ = file.tensors[key]
        if file_shape != shape:
            raise CheckpointError(
                f"{file.path}, tensor {key!r}: shape {list(file_shape)}, the model's "
                f"hyperparameters need {list(shape)}"
            )
        rows = np.array(file.raw(key))  # a copy: the model keeps no view of the mapped file
        if config.architecture in ("llama", "mistral") and key.endswith(
            ("attn_q.weight", "attn_k.weight")
        ):
            heads = config.num_heads if "attn_q" in key else config.num_kv_heads
            rows = unpermute(rows, heads)
        return kind, rows

    def floats(key: str, kind: gguf.GGMLQuantizationType, rows: np.ndarray) -> np.ndarray:
        """A float tensor's values in its own dtype, or any other type dequantized."""
        if kind == T.BF16:
            values = rows.view(ml_dtypes.bfloat16)
        elif kind in FLOAT_TYPES:
            values = rows
        else:
            values = gguf.quants.dequantize(rows, kind)
        if not allow_non_finite_weights and not all_finite(values):
            raise CheckpointError(
                f"{file.path}, tensor {key!r}: holds NaN or infinite values; pass "
                "allow_non_finite_weights=True to load them anyway"
            )
        return values

    def matrix(name: str, shape: tuple[int, int], embedding: bool) -> Linear:
        kind, rows = stored(name, shape)
        key = gguf_name(name)
        wanted = embedding_quantization(quantization) if embedding else quantization
        if embedding and kind == T.Q8_0 and wanted == EMBEDDING_ONLY:
            wanted = "int8"  # finer than int6 already: kept, not rounded a second time
        if kind in EXACT and wanted in (None, EXACT[kind]):
            return _exact(file.path, key, kind, rows)
        if kind in FLOAT_TYPES:
            target = wanted
            values = floats(key, kind, rows)
            float_dtype = resolve_dtype(dtype, FLOAT_TYPES[kind])
        else:
            target = wanted or requantized_format(kind)
            if refuse_requantization and wanted is None:
                raise CheckpointError(
                    f"{file.path}, tensor {key!r}: type {kind.name} would be requantized to "
                    f"{target} (refuse_requantization is set; mie stores F32, F16, BF16, Q8_0 "
                    "and Q4_0 as they are)"
                )
            if embedding:
                target = embedding_quantization(target)
            values = floats(key, kind, rows)
            float_dtype = "float32"
            conversions[(kind.name, target)] += 1
        try:
            return storage(float_dtype, target)(key, values)
        except ValueError as exc:  # float16 overflow; int4 scale overflow
            raise CheckpointError(f"{file.path}: {exc}") from None

    def vector(name: str, size: int) -> np.ndarray:
        kind, rows = stored(name, (size,))
        if kind not in FLOAT_TYPES:
            raise CheckpointError(
                f"{file.path}, tensor {gguf_name(name)!r}: type {kind.name} for a vector "
                "(norm weights and biases are F32, F16 or BF16)"
            )
        return np.asarray(floats(gguf_name(name), kind, rows), dtype=np.float32)

    weights = assemble(config, matrix, vector)
    if conversions:
        done = ", ".join(f"{n} {kind} -> {fmt}" for (kind, fmt), n in sorted(conversions.items()))
        logger.warning(
            "%s: requantized tensors %s (dequantized by gguf.quants, quantized again by mie: "
            "a second rounding, docs/precision.md 'GGUF files against llama.cpp'; "
            "refuse_requantization=True refuses such a file instead)",
            file.path,
            done,
        )
    return weights


def _exact(path: str, key: str, kind: gguf.GGMLQuantizationType, rows: np.ndarray) -> Linear:
    """A Q8_0 or Q4_0 tensor's blocks as mie's int8 or int4: the codes and the float16 scales
    as they are."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rows.reshape(rows.shape[0], -1, block_bytes)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0]
    if not np.isfinite(scales).all():
        raise CheckpointError(
            f"{path}, tensor {key!r}: a {kind.name} block scale is NaN or infinite"
        )
    codes = np.ascontiguousarray(blocks[:, :, 2:]).reshape(rows.shape[0], -1)
    return Linear(codes.view(np.int8) if kind == T.Q8_0 else codes, np.ascontiguousarray(scales))


def _expected_names(config: ModelConfig) -> set[str]:
    """The GGUF names of every tensor the model reads (``output.weight`` when untied)."""
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    per_layer += ["ffn_gate", "ffn_up", "ffn_down"]
    names = {f"blk.{i}.{name}.weight" for i in range(config.num_layers) for name in per_layer}
    for i in range(config.num_layers):
        if config.qkv_bias:
            names |= {f"blk.{i}.attn_{x}.bias" for x in "qkv"}
        if config.qk_norm:
            names |= {f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"}
    names |= {"token_embd.weight", "output_norm.weight"}
    if config.rope_scaling is not None and config.rope_scaling.rope_type == FREQUENCY_FACTORS:
        names.add("rope_freqs.weight")  # read by with_rope_factors
    if not config.tie_word_embeddings:
        names.add("output.weight")
    return names
