"""Models from GGUF files: the same model as the checkpoint directory the file was made from.

The files are written by ``gguf``'s own writer and quantizers the way llama.cpp's converter
writes them (tests/gguf_writer.py: its names, its permutation of the llama q/k rows, its
types), from tiny random transformers checkpoints; the oracle is mie's loader of the
directory, itself checked against transformers in tests/test_model_hf.py. Against llama.cpp
and its real converter: tests/test_gguf_oracle.py.

* F32 files give the directory's logits exactly (so every name, every permutation and every
  hyperparameter was read right), F16 and BF16 the directory loaded in that dtype exactly;
* Q8_0 and Q4_0 load without requantizing: the weights are bit for bit ``gguf.quants``'
  dequantized values, and their codes and scales are those mie's own int8 and int4 give;
* other block types (Q4_K, Q6_K) are requantized to int4 / int8 with a warning naming them;
* greedy generation from the file equals the directory's through the engine, with
  preemption, on both backends;
* whatever the file gets wrong is a ``CheckpointError`` or ``ConfigError`` naming the file
  and the key or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import backend_named, require_module, run_to_completion
from gguf_writer import T, converter_permute, gguf_tensors, write_gguf
from model_runner import run_forward

from mie import linear
from mie.checkpoint import CheckpointError
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import SamplingParams
from mie.memory import BlockTable
from mie.model import Model
from mie.model.config import ConfigError

torch = require_module("torch")
transformers = require_module("transformers")
from test_model_hf import LLAMA3_ROPE, build_hf_model, kv_pool  # noqa: E402  (needs torch, transformers)

SPECS = {
    "llama": ("llama", torch.float32, 4, 2, 16, 64, 2, True),
    "llama-untied": ("llama", torch.float32, 4, 4, 16, 64, 1, False),
    "qwen2": ("qwen2", torch.float32, 4, 2, 16, 64, 2, False),
    "qwen3": ("qwen3", torch.float32, 4, 2, 32, 64, 2, True),
}
VOCAB = 320
TOKENS = np.random.default_rng(5).integers(0, VOCAB, 37).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, spec in SPECS.items():
        directory = tmp_path_factory.mktemp(name)
        build_hf_model(spec, seed=len(name)).save_pretrained(directory)
        out[name] = directory
    return out


def logits(model: Model, tokens: list[int] = TOKENS) -> np.ndarray:
    pool = kv_pool(model.config, 4, num_blocks=32)
    with BlockTable(pool, 4) as table:
        table.append_tokens(len(tokens))
        return run_forward(model, [(tokens, 0, len(tokens), table)], all_positions=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_an_f32_file_is_its_directory_exactly(checkpoints, tmp_path, name, backend):
    path = write_gguf(checkpoints[name], tmp_path / "m.gguf", T.F32)
    from_file = Model.from_pretrained(path, kernels=backend.kernels)
    from_dir = Model.from_pretrained(checkpoints[name], kernels=backend.kernels)
    # GGUF stores the epsilon as float32, the precision the forward pass adds it in.
    eps = from_dir.config.rms_norm_eps
    assert from_file.config == dataclasses.replace(from_dir.config, rms_norm_eps=np.float32(eps))
    np.testing.assert_array_equal(logits(from_file), logits(from_dir))


@pytest.mark.parametrize("kind, dtype", [(T.F16, "float16"), (T.BF16, "bfloat16")])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_16_bit_files_are_the_directory_in_that_dtype(checkpoints, tmp_path, name, kind, dtype):
    path = write_gguf(checkpoints[name], tmp_path / "m.gguf", kind)
    from_file = Model.from_pretrained(path)
    assert from_file.weights.format == dtype  # "auto": the file's own type
    from_dir = Model.from_pretrained(checkpoints[name], dtype=dtype)
    np.testing.assert_array_equal(logits(from_file), logits(from_dir))
    as_float32 = Model.from_pretrained(path, dtype="float32")
    assert as_float32.weights.format == "float32"


def gguf_values(directory: Path, kind: T) -> dict[str, np.ndarray]:
    """Each matrix as llama.cpp holds it after quantizing to ``kind``, dequantized by
    ``gguf.quants``, the q/k rows permuted back to Hugging Face's order."""
    config, tensors = gguf_tensors(directory)
    out = {}
    for name, values in tensors.items():
        if values.ndim == 2:
            out[name] = gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind)
    return config, out


def hf_order(config: dict, name: str, values: np.ndarray) -> np.ndarray:
    """Undo ``converter_permute`` by its definition: the permutation of row indices."""
    if config["model_type"] != "llama" or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return values
    heads = config["num_attention_heads"] if "attn_q" in name else config["num_key_value_heads"]
    order = converter_permute(np.arange(values.shape[0]), heads)
    restored = np.empty_like(values)
    restored[order] = values
    return restored


def by_row(matrix) -> tuple[np.ndarray, np.ndarray | None]:
    """A matrix's weight and scales, a row per output channel (row-grouped ones ungrouped)."""
    if matrix.format in linear.GROUPED.values():
        return linear.ungroup_rows(matrix.weight, matrix.scales)
    return matrix.weight, matrix.scales


def stored_matrices(model: Model) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """The model's matrices by GGUF name (fused ones split back), as stored (row-grouped ones
    ungrouped: ``by_row``)."""
    cfg, w = model.config, model.weights
    out = {"token_embd.weight": by_row(w.embed)}
    if w.lm_head is not w.embed:
        out["output.weight"] = by_row(w.lm_head)
    for i, layer in enumerate(w.layers):
        bounds = np.cumsum([0, cfg.q_size, cfg.kv_size, cfg.kv_size])
        qkv, qkv_scales = by_row(layer.qkv)
        for x, lo, hi in zip("qkv", bounds, bounds[1:], strict=False):
            out[f"blk.{i}.attn_{x}.weight"] = (qkv[lo:hi], qkv_scales[lo:hi])
        inter = cfg.intermediate_size
        gate_up, gate_up_scales = by_row(layer.gate_up)
        out[f"blk.{i}.ffn_gate.weight"] = (gate_up[:inter], gate_up_scales[:inter])
        out[f"blk.{i}.ffn_up.weight"] = (gate_up[inter:], gate_up_scales[inter:])
        out[f"blk.{i}.attn_output.weight"] = by_row(layer.o)
        out[f"blk.{i}.ffn_down.weight"] = by_row(layer.down)
    return out


@pytest.mark.parametrize("kind, fmt", [(T.Q8_0, "int8"), (T.Q4_0, "int4")])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_q8_0_and_q4_0_load_without_requantizing(checkpoints, tmp_path, name, kind, fmt):
    path = write_gguf(checkpoints[name], tmp_path / "m.gguf", kind)
    model = Model.from_pretrained(path)
    config, expected = gguf_values(checkpoints[name], kind)
    matrices = stored_matrices(model)
    assert set(matrices) == set(expected)
    for gguf_name, (weight, scales) in matrices.items():
        assert linear.weight_format(weight) == fmt, gguf_name
        np.testing.assert_array_equal(
            linear.widen(weight, scales),
            hf_order(config, gguf_name, expected[gguf_name]),
            err_msg=gguf_name,
        )
    # bit for bit what mie's own int8 / int4 makes of the same float32 values
    quantize = linear.quantize_int8 if kind == T.Q8_0 else linear.quantize_int4
    _, floats = gguf_tensors(checkpoints[name])
    for gguf_name, (weight, scales) in matrices.items():
        codes, ours = quantize(hf_order(config, gguf_name, floats[gguf_name]))
        np.testing.assert_array_equal(weight, codes, err_msg=gguf_name)
        np.testing.assert_array_equal(scales, ours, err_msg=gguf_name)


def random_blocks(kind: T, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random ``kind`` blocks (every bit pattern is a valid K-quant block once its float16
    super-block scales are finite): ``gguf.quants`` dequantizes K-quants but cannot make them."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    data = np.random.default_rng(seed).integers(0, 256, (rows, columns // block, block_bytes))
    data = data.astype(np.uint8)
    scale = np.float16(0.01).tobytes()
    # Q4_K: d and dmin lead the block; Q6_K: d ends it.
    offsets = {T.Q4_K: (0, 2), T.Q6_K: (block_bytes - 2,)}[kind]
    for offset in offsets:
        data[:, :, offset : offset + 2] = np.frombuffer(scale, np.uint8)
    return data.reshape(rows, -1)


def test_other_block_types_are_requantized_with_a_warning(tmp_path, caplog):
    """Q4_K (4.5 bits a weight) becomes int4 and Q6_K int8, each the closest mie format of
    ``gguf.quants``' dequantized values; a layer whose v projection is Q6_K beside Q4_K q
    and k (as llama.cpp's Q4_K_M makes some) is fused as int8."""
    directory = tmp_path / "wide"
    spec = ("qwen2", torch.float32, 4, 2, 64, 256, 1, True)
    build_hf_model(spec, seed=3).save_pretrained(directory)
    raw = {
        "blk.0.attn_q.weight": (T.Q4_K, random_blocks(T.Q4_K, 256, 256, 1)),
        "blk.0.attn_k.weight": (T.Q4_K, random_blocks(T.Q4_K, 128, 256, 2)),
        "blk.0.attn_v.weight": (T.Q6_K, random_blocks(T.Q6_K, 128, 256, 3)),
        "blk.0.attn_output.weight": (T.Q4_K, random_blocks(T.Q4_K, 256, 256, 4)),
        "token_embd.weight": (T.Q6_K, random_blocks(T.Q6_K, VOCAB, 256, 5)),
    }
    path = write_gguf(directory, tmp_path / "m.gguf", T.F32, raw=raw)
    with caplog.at_level(logging.WARNING, logger="mie.model.gguf_weights"):
        model = Model.from_pretrained(path)
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "3 Q4_K -> int4" in message and "2 Q6_K -> int8" in message, message
    assert str(path) in message
    layer = model.weights.layers[0]
    assert layer.o.format == "int4x16" and layer.gate_up.format == "float32"
    assert layer.qkv.format == "int8x16" and model.weights.embed.format == "int8x16"

    def dequantized(name: str) -> np.ndarray:
        return gguf.quants.dequantize(raw[name][1], raw[name][0])

    codes, scales = linear.quantize_int4(dequantized("blk.0.attn_output.weight"))
    np.testing.assert_array_equal(by_row(layer.o)[0], codes)
    np.testing.assert_array_equal(by_row(layer.o)[1], scales)
    embed = linear.quantize_int8(dequantized("token_embd.weight"))
    np.testing.assert_array_equal(by_row(model.weights.embed)[0], embed[0])
    # q and k were int4 first, then requantized to int8 beside v: within int8's step of it.
    q = dequantized("blk.0.attn_q.weight")
    qkv, qkv_scales = by_row(layer.qkv)
    restored = linear.widen(qkv[:256], qkv_scales[:256])
    step = np.repeat(qkv_scales[:256], linear.GROUP_SIZE, axis=1)
    int4_scales = np.abs(linear.quantize_int4(q)[1].astype(np.float32))
    int4_step = np.repeat(int4_scales, linear.GROUP_SIZE, axis=1)
    # (int4 rounds to half its step, except a clipped +8 code, a whole step from its value.)
    assert (np.abs(restored - q) <= step / 2 + int4_step + 1e-6).all()


@pytest.mark.parametrize("kind", [T.F16, T.Q8_0])
def test_a_fused_matrix_of_mixed_formats_is_widened_to_float32(checkpoints, tmp_path, kind, caplog):
    """An F32 file whose layer-0 v projection alone is F16 or Q8_0 (llama.cpp runs such
    files: a quantizer's per-tensor overrides make them): q/k/v are fused as float32, which
    holds each part's values exactly, so the logits are those of an all-F32 file holding
    the same values."""
    directory, name = checkpoints["qwen2"], "blk.0.attn_v.weight"
    mixed = write_gguf(directory, tmp_path / "mixed.gguf", T.F32, types={name: kind})
    v = gguf_tensors(directory)[1][name]
    values = gguf.quants.dequantize(gguf.quants.quantize(v, kind), kind).reshape(v.shape)
    same = write_gguf(directory, tmp_path / "same.gguf", T.F32, raw={name: (T.F32, values)})
    with caplog.at_level(logging.WARNING, logger="mie.model.weights"):
        model = Model.from_pretrained(mixed)
    assert "widened to float32" in caplog.text and "v_proj" in caplog.text, caplog.text
    assert model.weights.layers[0].qkv.format == "float32"
    np.testing.assert_array_equal(logits(model), logits(Model.from_pretrained(same)))


def test_requantization_is_refused_when_asked_to_be_exact(tmp_path):
    directory = tmp_path / "wide"
    build_hf_model(("qwen2", torch.float32, 4, 2, 64, 256, 1, True), seed=3).save_pretrained(
        directory
    )
    raw = {"blk.0.attn_output.weight": (T.Q4_K, random_blocks(T.Q4_K, 256, 256, 4))}
    path = write_gguf(directory, tmp_path / "m.gguf", T.Q8_0, raw=raw)
    with pytest.raises(CheckpointError, match="'blk.0.attn_output.weight': type Q4_K would be"):
        Model.from_pretrained(path, refuse_requantization=True)
    with pytest.raises(CheckpointError, match="type Q4_K would be requantized to int4"):
        LLMEngine(path, refuse_requantization=True)
    assert Model.from_pretrained(path).weights.layers[0].o.format == "int4x16"


def test_asking_for_another_quantization_converts_the_file(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"], tmp_path / "m.gguf", T.Q8_0)
    model = Model.from_pretrained(path, quantization="int4")
    # the Q8_0 embedding stays int8, as it is in the file (int4's own would be int6), in
    # int8x16 as the layers' int8 matrices
    assert model.weights.format == "int4" and model.weights.embed.format == "int8x16"
    f32 = write_gguf(checkpoints["llama"], tmp_path / "f.gguf", T.F32)
    assert Model.from_pretrained(f32, quantization="int8").weights.format == "int8"
    model = Model.from_pretrained(f32, quantization="int4")
    assert model.weights.format == "int4" and model.weights.embed.format == "int6x16"


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_greedy_generation_from_the_file_equals_the_directory_with_preemption(
    checkpoints, tmp_path, backend_name
):
    backend = backend_named(backend_name)
    path = write_gguf(checkpoints["qwen2"], tmp_path / "m.gguf", T.F32)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 17, 9, 30, 5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for model in (path, checkpoints["qwen2"]):
        engine = LLMEngine(model, backend=backend, num_blocks=12, block_size=4)
        for i, prompt in enumerate(prompts):
            engine.add_request({"prompt_token_ids": prompt}, params, request_id=str(i))
        done = run_to_completion(engine)
        assert engine.stats.preemptions > 0  # 12 blocks of 4 cannot hold them all
        outputs.append({rid: out.outputs[0].token_ids for rid, out in done.items()})
    assert outputs[0] == outputs[1]


# -- refusals -------------------------------------------------------------------------------------


def test_an_architecture_mie_does_not_run_is_refused_by_name(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"], tmp_path / "m.gguf")
    content = path.read_bytes().replace(b"llama", b"phi3_", 1)
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"{path}: general.architecture 'phi3_'"):
        Model.from_pretrained(path)


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"llama.attention.head_count": 0}, "llama.attention.head_count must be an int"),
        ({"llama.rope.scaling.type": "longrope"}, "llama.rope.scaling.type 'longrope'"),
        ({"llama.rope.scaling.attn_factor": 0.5}, "llama.rope.scaling.attn_factor 0.5 is not"),
        ({"llama.rope.dimension_count": 8}, "llama.rope.dimension_count 8 differs"),
        ({"llama.attention.layer_norm_rms_epsilon": -1.0}, "layer_norm_rms_epsilon must be"),
        ({"tokenizer.ggml.eos_token_id": 5000}, "outside the vocabulary"),
    ],
)
def test_bad_hyperparameters_are_refused_naming_the_key(checkpoints, tmp_path, metadata, message):
    path = write_gguf(checkpoints["llama"], tmp_path / "m.gguf", metadata=metadata)
    with pytest.raises(ConfigError, match=message) as info:
        Model.from_pretrained(path)
    assert str(path) in str(info.value)


def test_missing_unexpected_and_misshapen_tensors_are_named(checkpoints, tmp_path):
    directory = checkpoints["llama"]
    path = write_gguf(directory, tmp_path / "m.gguf")
    # A file of a model with one layer more than it holds: the first missing tensor is named.
    deeper = write_gguf(directory, tmp_path / "deeper.gguf", metadata={"llama.block_count": 3})
    with pytest.raises(CheckpointError, match=rf"{deeper}: no tensor 'blk.2.attn_norm.weight'"):
        Model.from_pretrained(deeper)
    shallower = write_gguf(directory, tmp_path / "shallow.gguf", metadata={"llama.block_count": 1})
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.attn_norm.weight': not part of"):
        Model.from_pretrained(shallower)
    wider = write_gguf(directory, tmp_path / "w.gguf", metadata={"llama.feed_forward_length": 64})
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.ffn_gate.weight': shape \[96, 64\]"):
        Model.from_pretrained(wider)
    assert Model.from_pretrained(path).config.num_layers == 2


def test_a_sliding_window_in_a_llama_file_is_mistrals(checkpoints, tmp_path, backend):
    """llama.cpp's converter writes Mistral as ``llama``; a file that keeps its
    ``attention.sliding_window`` is run with Mistral's window, as the directory is."""
    directory = tmp_path / "mistral"
    shutil.copytree(checkpoints["llama-untied"], directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    (directory / "config.json").write_text(json.dumps(config))
    window = {"llama.attention.sliding_window": 8}
    path = write_gguf(directory, tmp_path / "m.gguf", metadata=window)
    from_file = Model.from_pretrained(path, kernels=backend.kernels)
    assert from_file.config.architecture == "mistral" and from_file.config.sliding_window == 8
    from_dir = Model.from_pretrained(directory, kernels=backend.kernels)
    ours = logits(from_file)
    np.testing.assert_array_equal(ours, logits(from_dir))
    unwindowed = Model.from_pretrained(checkpoints["llama-untied"], kernels=backend.kernels)
    assert not np.array_equal(ours, logits(unwindowed))  # 37 tokens: the window matters


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama3")
    spec = ("llama", torch.float32, 4, 2, 16, 64, 2, False, {"rope_parameters": LLAMA3_ROPE})
    build_hf_model(spec, seed=9).save_pretrained(directory)
    return directory


def test_llama3_rope_factors_are_applied(llama3_checkpoint, tmp_path, backend):
    """llama.cpp's converter stores Llama 3's RoPE scaling as one factor per frequency
    (``rope_freqs.weight``, computed in float32): the file's logits are the directory's,
    whose llama3 rule is computed from the parameters in float64 -- and far from those of
    the same weights with the factors left out."""
    path = write_gguf(llama3_checkpoint, tmp_path / "m.gguf")
    from_file = Model.from_pretrained(path, kernels=backend.kernels)
    assert from_file.config.rope_scaling.rope_type == "frequency_factors"
    from_dir = Model.from_pretrained(llama3_checkpoint, kernels=backend.kernels)
    ours, theirs = logits(from_file), logits(from_dir)
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * scale)
    unscaled = Model(
        dataclasses.replace(from_file.config, rope_scaling=None), from_file.weights, backend.kernels
    )
    assert np.abs(logits(unscaled) - theirs).max() > 100 * 1e-5 * scale


@pytest.mark.parametrize(
    "factors, message",
    [
        (np.ones(4, np.float32), r"F32 \[4\], not F32 \[8\]"),
        (np.array([1, 2, 0, 1, 1, 1, 1, 1], np.float32), "finite positive floats"),
        (np.full(8, np.inf, np.float32), "finite positive floats"),
    ],
)
def test_bad_rope_factors_are_refused_naming_the_tensor(checkpoints, tmp_path, factors, message):
    extra = {"rope_freqs.weight": factors}
    path = write_gguf(checkpoints["llama-untied"], tmp_path / "m.gguf", extra_tensors=extra)
    with pytest.raises(CheckpointError, match=rf"tensor 'rope_freqs.weight': .*{message}"):
        Model.from_pretrained(path, allow_non_finite_weights=True)


def test_non_finite_weights_are_refused_unless_allowed(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"], tmp_path / "m.gguf")
    model = Model.from_pretrained(path)
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(path)
    norm = next(t for t in reader.tensors if t.name == "blk.1.ffn_norm.weight")
    data[norm.data_offset : norm.data_offset + 4] = np.float32(np.nan).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_norm.weight': holds NaN"):
        Model.from_pretrained(path)
    loaded = Model.from_pretrained(path, allow_non_finite_weights=True)
    assert np.isnan(loaded.weights.layers[1].post_norm[0])
    assert model.config == loaded.config


def test_a_nan_q8_0_scale_is_refused(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"], tmp_path / "m.gguf", T.Q8_0)
    data = bytearray(path.read_bytes())
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    data[tensor.data_offset : tensor.data_offset + 2] = np.float16(np.inf).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up.weight': a Q8_0 block scale"):
        Model.from_pretrained(path)


def test_a_quantized_norm_is_refused(checkpoints, tmp_path):
    path = write_gguf(
        checkpoints["qwen3"], tmp_path / "m.gguf", types={"blk.0.attn_q_norm.weight": T.Q8_0}
    )
    with pytest.raises(CheckpointError, match=r"'blk.0.attn_q_norm.weight': type Q8_0"):
        Model.from_pretrained(path)
