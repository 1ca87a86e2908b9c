"""Choosing the precision: dtype, quantization and kv_cache_dtype on the model, the engine,
the CLI and /metrics; what each stores, and what is refused.

The accuracy of each mode is pinned in tests/test_precision_accuracy.py; the kernels against
their references in tests/test_linear.py, test_fast_linear.py, test_ops.py, test_fast_ops.py.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import require_module
from model_runner import run_forward

from mie import LLM, LLMEngine, SamplingParams
from mie.backend import select
from mie.checkpoint import CheckpointError
from mie.linear import widen
from mie.model import Model, ModelConfig, bytes_per_block
from mie.model import weights as weights_module
from mie.model.config import ConfigError
from mie.serve.metrics import ServerMetrics

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
QWEN2_05B_KV = dict(  # Qwen2-0.5B's attention shape: what sizes its KV cache
    architecture="qwen2",
    vocab_size=64,
    hidden_size=896,
    intermediate_size=64,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
)
TINY = ModelConfig(
    architecture="qwen2",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
)


def stories_as(directory: Path, torch_dtype, edit=None) -> Path:
    """stories260K re-saved with every tensor in ``torch_dtype`` (and config.json saying so)."""
    safetensors_torch = require_module("safetensors.torch")
    tensors = safetensors_torch.load_file(STORIES / "model.safetensors")
    tensors = {name: t.to(torch_dtype) for name, t in tensors.items()}
    if edit:
        edit(tensors)
    directory.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(tensors, directory / "model.safetensors")
    config = json.loads((STORIES / "config.json").read_text())
    config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copy(STORIES / "tokenizer.json", directory / "tokenizer.json")
    return directory


@pytest.fixture(scope="module")
def stories_bf16(tmp_path_factory):
    return stories_as(tmp_path_factory.mktemp("bf16"), require_module("torch").bfloat16)


# -- what each choice stores --------------------------------------------------------------------


def test_a_bfloat16_checkpoint_loads_in_half_the_memory_by_default(stories_bf16):
    auto = Model.from_pretrained(stories_bf16)
    wide = Model.from_pretrained(stories_bf16, dtype="float32")
    assert auto.weights.format == "bfloat16" and wide.weights.format == "float32"
    # the embedding's 512 rows 16 interleaved (``in_row_groups``): bfloat16's bits
    assert auto.weights.embed.format == "bfloat16x16"
    # Only the float32 norm vectors (5 layers x 2 + 1, of 64) are not halved.
    norms = (5 * 2 + 1) * 64 * 4
    assert auto.weights.nbytes - norms == (wide.weights.nbytes - norms) // 2
    assert auto.weights.num_parameters == wide.weights.num_parameters


def test_a_bfloat16_checkpoint_computes_the_same_logits_as_bfloat16_or_float32(stories_bf16):
    """bfloat16 values widen exactly: only the order of float32 sums may differ."""
    prompt = [1, 403, 407, 261, 378, 10, 300, 46, 266, 1021 % 512]
    logits = {}
    for dtype in ("auto", "float32"):
        llm = LLM(stories_bf16, dtype=dtype)
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
        logits[dtype] = out.outputs[0].token_ids
    assert logits["auto"] == logits["float32"]
    narrow = Model.from_pretrained(stories_bf16)
    wide = Model.from_pretrained(stories_bf16, dtype="float32")
    x = np.random.default_rng(0).standard_normal((7, 64), dtype=np.float32)
    for a, b in [(narrow.weights.lm_head, wide.weights.lm_head)]:
        got = narrow.kernels.matmul(x, a.weight, a.scales)
        want = x @ b.weight.T
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("dtype", "quantization", "stored", "ratio"),
    [
        ("float32", None, np.float32, 1.0),
        ("bfloat16", None, ml_dtypes.bfloat16, 0.5),
        ("float16", None, np.float16, 0.5),
        ("float32", "int8", np.int8, 8.5 / 32),  # 8 bits + a 16-bit scale per 32 weights
        ("bfloat16", "int8", np.int8, 8.5 / 32),
    ],
)
def test_random_models_store_each_matrix_in_the_chosen_format(dtype, quantization, stored, ratio):
    model = Model.random(TINY, seed=3, dtype=dtype, quantization=quantization)
    reference = Model.random(TINY, seed=3)
    weights = model.weights
    matrices = [
        weights.embed,
        *(getattr(layer, n) for layer in weights.layers for n in ("qkv", "o", "gate_up", "down")),
    ]
    for linear in matrices:
        assert linear.weight.dtype == stored
        assert (linear.scales is not None) == (quantization == "int8")
    assert weights.lm_head is weights.embed or weights.lm_head.weight.dtype == stored
    for layer, ref in zip(weights.layers, reference.weights.layers, strict=True):
        assert layer.input_norm.dtype == np.float32 and layer.qkv_bias.dtype == np.float32
        np.testing.assert_array_equal(layer.qkv_bias, ref.qkv_bias)
    # The same float32 values, stored narrower: widened back, within the format's rounding.
    widened = weights.layers[1].down
    values = widen(widened.weight, widened.scales).astype(np.float32)
    exact = reference.weights.layers[1].down.weight
    relative = {"float32": 0, "bfloat16": 2**-8, "float16": 2**-11}[dtype]  # half an ulp
    if quantization == "int8":
        # rounded to dtype, then quantized: half a step of max|w| / 127, plus the step's
        # rounding to float16 (2^-11 of it) times the code (at most 127)
        relative += 1 / 254 + 2**-11
    bound = relative * np.abs(exact).max() * (1 + 1e-6)
    assert np.abs(values - exact).max() <= bound
    matrix_bytes = sum(m.nbytes for m in matrices)
    float32_bytes = sum(m.weight.size * 4 for m in matrices)
    # int8 scales round up per row (K not a multiple of 32): allow that slack.
    assert matrix_bytes == pytest.approx(float32_bytes * ratio, rel=0.15 if ratio < 0.3 else 0)


def test_float16_overflow_is_refused_naming_the_tensor(tmp_path):
    torch = require_module("torch")

    def plant(tensors):
        tensors["model.layers.2.mlp.up_proj.weight"][3, 5] = 1e5  # beyond float16's 65504

    directory = stories_as(tmp_path, torch.float32, edit=plant)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*65504"):
        Model.from_pretrained(directory, dtype="float16")
    model = Model.from_pretrained(directory, dtype="bfloat16")  # bfloat16's range holds it
    assert np.isfinite(model.weights.layers[2].gate_up.weight.astype(np.float32)).all()


def test_int8_refuses_non_finite_weights_even_when_allowed(tmp_path):
    torch = require_module("torch")

    def plant(tensors):
        tensors["model.layers.0.self_attn.o_proj.weight"][1, 1] = float("inf")

    directory = stories_as(tmp_path, torch.float32, edit=plant)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight.*NaN or infinite"):
        Model.from_pretrained(directory, quantization="int8", allow_non_finite_weights=True)


def test_the_kv_cache_dtype_halves_the_bytes_per_token():
    config = ModelConfig(**QWEN2_05B_KV)
    assert bytes_per_block(config, 1) == 24_576  # float32: 24 layers x K,V x 128 x 4 bytes
    for kv_cache_dtype in ("bfloat16", "float16"):
        assert bytes_per_block(config, 1, kv_cache_dtype) == 12_288  # the seed's figure
        assert bytes_per_block(config, 16, kv_cache_dtype) == 16 * 12_288
    assert bytes_per_block(config, 16, "auto") == bytes_per_block(config, 16, "float32")


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_the_same_kv_memory_holds_twice_the_tokens(kv_cache_dtype):
    wide = LLMEngine(STORIES, kv_cache_memory=1 << 20, backend="python")
    narrow = LLMEngine(
        STORIES, kv_cache_memory=1 << 20, backend="python", kv_cache_dtype=kv_cache_dtype
    )
    assert narrow.pool.num_blocks == 2 * wide.pool.num_blocks
    assert narrow.kv_cache.dtype == np.dtype(kv_cache_dtype)
    assert narrow.kv_cache.base is not None  # a view of the pool's arena, not a copy
    narrow.add_request("Once upon a time", SamplingParams(max_tokens=8, temperature=0))
    outputs = []
    while narrow.has_unfinished_requests():
        outputs += narrow.step()
    assert len(outputs[-1].outputs[0].token_ids) == 8


# -- refused ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value", "allowed"),
    [
        ("dtype", "float64", "['auto', 'float32', 'bfloat16', 'float16']"),
        ("dtype", "half", "['auto', 'float32', 'bfloat16', 'float16']"),
        ("dtype", None, "['auto', 'float32', 'bfloat16', 'float16']"),
        ("dtype", np.float32, "['auto', 'float32', 'bfloat16', 'float16']"),
        ("quantization", "int2", "[None, 'int8', 'int4']"),
        ("quantization", "fp8", "[None, 'int8', 'int4']"),
        ("quantization", "", "[None, 'int8', 'int4']"),
        ("kv_cache_dtype", "fp8", "['auto', 'float32', 'bfloat16', 'float16']"),
        ("kv_cache_dtype", "int8", "['auto', 'float32', 'bfloat16', 'float16']"),
        ("kv_cache_dtype", None, "['auto', 'float32', 'bfloat16', 'float16']"),
    ],
)
def test_unknown_values_are_refused_naming_the_allowed_ones(setting, value, allowed, monkeypatch):
    def no_loading(*args, **kwargs):  # the settings are checked before any file is read
        raise AssertionError("loaded a checkpoint despite a bad setting")

    monkeypatch.setattr(Model, "from_pretrained", no_loading)
    with pytest.raises(ValueError, match=f"{setting} must be one of {re.escape(allowed)}"):
        LLMEngine(STORIES, **{setting: value})


@pytest.mark.parametrize(("setting", "value"), [("dtype", "float64"), ("quantization", "q4")])
def test_model_constructors_refuse_unknown_values(setting, value):
    with pytest.raises(ValueError, match=f"{setting} must be one of"):
        Model.random(TINY, **{setting: value})
    with pytest.raises(ValueError, match=f"{setting} must be one of"):
        Model.from_pretrained(STORIES, **{setting: value})


def test_a_built_model_refuses_a_dtype_it_does_not_hold():
    model = Model.random(TINY, dtype="bfloat16")
    with pytest.raises(ValueError, match="already holds bfloat16 weights"):
        LLMEngine(model, dtype="float16")
    with pytest.raises(ValueError, match="already holds bfloat16 weights"):
        LLMEngine(model, quantization="int8")
    engine = LLMEngine(model, kv_cache_dtype="float16", num_blocks=8)  # the cache is the engine's
    assert engine.kv_cache.dtype == np.float16


@pytest.mark.parametrize("declared", ["float64", "int8", "fp8", 16])
def test_a_config_declaring_an_unknown_dtype_is_refused(tmp_path, declared):
    config = json.loads((STORIES / "config.json").read_text())
    config["torch_dtype"] = declared
    with pytest.raises(ConfigError, match="torch_dtype"):
        ModelConfig.from_hf(config)
    config.pop("torch_dtype")
    config["dtype"] = declared  # transformers 5's name for it
    with pytest.raises(ConfigError, match="'?dtype'? .* is not one of"):
        ModelConfig.from_hf(config)
    del config["dtype"]
    assert ModelConfig.from_hf(config).dtype == "float32"  # absent: float32


# -- reported -------------------------------------------------------------------------------------


def test_metrics_expose_the_weight_and_kv_bytes():
    engine = LLMEngine(Model.random(TINY, dtype="bfloat16"), num_blocks=10)
    metrics = ServerMetrics()
    metrics.update_engine(engine)
    text = metrics.render()
    weight_bytes = engine.model.weights.nbytes
    assert f"mie_model_weight_bytes {weight_bytes}" in text.replace(".0\n", "\n")
    assert re.search(rf"mie_kv_cache_bytes {10 * engine.pool.bytes_per_block}(\.0)?\n", text)
    float32_bytes = LLMEngine(Model.random(TINY), num_blocks=10).model.weights.nbytes
    assert weight_bytes < 0.6 * float32_bytes


def test_the_engine_logs_its_weight_memory(caplog):
    with caplog.at_level("INFO", logger="mie"):
        LLMEngine(STORIES, quantization="int8", kv_cache_dtype="bfloat16", backend="python")
    line = next(r.getMessage() for r in caplog.records if "Weights" in r.getMessage())
    assert re.search(r"Weights: int8, 0\.3 MiB; KV cache: bfloat16", line), line


def test_the_cli_takes_the_precision_flags():
    run = [sys.executable, "-m", "mie", "generate", "--model", str(STORIES)]
    run += ["--prompt", "Once upon a time", "--max-tokens", "8", "--temperature", "0"]
    plain = subprocess.run(run, capture_output=True, text=True, timeout=120)
    narrow = subprocess.run(
        [*run, "--dtype", "bfloat16", "--quantization", "int8", "--kv-cache-dtype", "float16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0 and narrow.returncode == 0, narrow.stderr
    assert narrow.stdout.startswith("Once upon a time")
    bad = subprocess.run([*run, "--dtype", "float64"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'float64'" in bad.stderr


# -- long 16-bit inputs: column panels ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["python", "fast"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_long_16_bit_inputs_are_stored_as_column_panels_that_compute_the_same(
    dtype, backend, monkeypatch
):
    """A 16-bit down projection of more than ``PANEL_INPUTS`` inputs is stored as column
    panels (TINY's 80 inputs, the limit lowered to 32: panels of 32, 32 and 16), holding
    exactly the matrix it was, with the same bytes; the model computes what the unsplit one
    computes, up to the order of float32 sums."""
    kernels = select(backend).kernels
    whole = Model.random(TINY, seed=5, dtype=dtype, kernels=kernels)
    monkeypatch.setattr(weights_module, "PANEL_INPUTS", 32)
    split = Model.random(TINY, seed=5, dtype=dtype, kernels=kernels)
    for layer, ref in zip(split.weights.layers, whole.weights.layers, strict=True):
        assert isinstance(layer.down, weights_module.Panels)
        assert [p.weight.shape for p in layer.down.parts] == [(48, 32), (48, 32), (48, 16)]
        assert all(p.weight.flags.c_contiguous for p in layer.down.parts)
        assert layer.down.format == dtype and layer.down.scales is None
        np.testing.assert_array_equal(
            layer.down.weight.view(np.uint16), ref.down.weight.view(np.uint16)
        )
        for m in (1, 3, 6):  # one row (contiguous slices) and several (strided ones)
            x = np.random.default_rng(m).standard_normal((m, 80), dtype=np.float32)
            want = x.astype(np.float64) @ widen(ref.down.weight).astype(np.float64).T
            got = layer.down.product(x, kernels.matmul)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for bad in (np.ones((1, 81), np.float32), np.ones((1, 79), np.float32), np.ones(80)):
            with pytest.raises(ValueError, match="matmul: x"):
                layer.down.product(bad, kernels.matmul)
    assert split.weights.nbytes == whole.weights.nbytes
    assert split.weights.num_parameters == whole.weights.num_parameters
    logits = {}
    for name, model in (("whole", whole), ("split", split)):
        pool = select(backend).BlockPool(4, bytes_per_block(TINY, 4))
        table = select(backend).BlockTable(pool, 4)
        table.append_tokens(9)
        chunk = ([3, 17, 42, 5, 88, 1, 60, 2, 9], 0, 9, table)
        logits[name] = run_forward(model, [chunk], all_positions=True)
    scale = np.abs(logits["whole"]).max()
    np.testing.assert_allclose(logits["split"], logits["whole"], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", "int8")])
def test_float32_and_quantized_matrices_are_not_split(dtype, quantization, monkeypatch):
    """float32 rows read as many weight bytes as input bytes and int8 / int4 multiply int8
    codes: neither gained from panels (bench/RESULTS.md), so neither is split."""
    monkeypatch.setattr(weights_module, "PANEL_INPUTS", 32)
    model = Model.random(TINY, seed=5, dtype=dtype, quantization=quantization)
    assert all(isinstance(layer.down, weights_module.Linear) for layer in model.weights.layers)


def test_qwen2_0_5b_s_down_projection_is_two_panels_of_2432_inputs():
    """The default limit on Qwen2-0.5B's intermediate size (4,864 inputs): two panels in
    float16; in bfloat16 one bfloat16x16 matrix, which reads its input once per 16 rows."""
    config = ModelConfig(**{**QWEN2_05B_KV, "intermediate_size": 4864, "num_layers": 1})
    down = Model.random(config, dtype="float16").weights.layers[0].down
    assert [p.weight.shape for p in down.parts] == [(896, 2432), (896, 2432)]
    assert Model.random(config, dtype="bfloat16").weights.layers[0].down.format == "bfloat16x16"
    assert not isinstance(
        Model.random(TINY, dtype="float16").weights.layers[0].down, weights_module.Panels
    )
