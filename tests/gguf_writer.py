"""Write a Hugging Face checkpoint directory as a GGUF file, the way llama.cpp's converter does,
with llama.cpp's own writer and quantizers (the ``gguf`` package).

For the tests that must run where llama.cpp's ``convert_hf_to_gguf.py`` is not installed (CI):
the same key names, tensor names (``gguf.TensorNameMap``, the table the converter renames
by), ``LlamaModel.permute`` of the llama q/k rows and tensor
types the converter writes, checked against converter-made files in tests/test_gguf_oracle.py
where the converter is present. The tensors are read with the ``safetensors`` package, not
with mie, so that mie's reader is not the source of what it is compared against.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

T = gguf.GGMLQuantizationType

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of convert_hf_to_gguf.py, verbatim in NumPy."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """``rope_freqs.weight`` as the converter's ``LlamaModel.generate_extra_tensors`` makes it
    for a Llama 3 RoPE, in the same float32 arithmetic; None for other configs."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = rope.get("rope_theta", 10000.0)
    freqs = np.float32(1.0) / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = np.float32(2 * np.pi) / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
            factors.append(np.float32(1) / ((1 - smooth) / np.float32(factor) + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(directory: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json, {GGUF name: float32 values})`` of a checkpoint, q/k permuted for
    llama-architecture files."""
    config = json.loads((directory / "config.json").read_text())
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    arch = GGUF_ARCH[config["model_type"]]
    # The converter's own renaming table (gguf.TensorNameMap), not a copy of mie's.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    out = {}
    for name, values in tensors.items():
        values = values.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = converter_permute(values, heads if "q_proj" in name else kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"the converter has no name for {name}"
        out[gguf_name] = values
    factors = llama3_rope_factors(config)
    if factors is not None:
        out["rope_freqs.weight"] = factors
    return config, out


def write_gguf(
    directory: Path,
    path: Path,
    matrix_type: T = T.F32,
    types: dict[str, T] | None = None,
    metadata: dict[str, object] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    raw: dict[str, tuple[T, np.ndarray]] | None = None,
) -> Path:
    """The checkpoint in ``directory`` as a GGUF file at ``path``: every matrix in
    ``matrix_type`` (``types`` overrides it by GGUF name; a matrix whose rows are not whole
    blocks of the type stays F32, as the converter's fallback keeps it unquantized), norms and
    biases F32; ``metadata`` adds or replaces keys, ``extra_tensors`` adds F32 tensors, ``raw``
    replaces tensors by ``(type, stored bytes (rows, bytes per row))`` -- for the types
    ``gguf.quants`` can dequantize but not quantize (the K-quants)."""
    config, tensors = gguf_tensors(directory)
    tensors.update(extra_tensors or {})
    arch = GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(path, arch)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    for key, value in (metadata or {}).items():
        _add(writer, key, value)
    for name, values in tensors.items():
        if name in (raw or {}):
            kind, data = raw[name]
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
            continue
        kind = (types or {}).get(name, matrix_type if values.ndim == 2 else T.F32)
        block, _ = gguf.GGML_QUANT_SIZES[kind]
        if values.shape[-1] % block:
            kind = T.F32
        if kind == T.F32:
            writer.add_tensor(name, values)
        elif kind == T.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            data = gguf.quants.quantize(values, kind)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if key in writer.kv_data[0]:
        del writer.kv_data[0][key]
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)
