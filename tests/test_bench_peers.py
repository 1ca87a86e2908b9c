"""The peers section (``python -m mie.bench --peers``): the GGUF writer and llama.cpp as an oracle.

The ``peers`` extra (gguf, llama-cpp-python) is opt-in. ``gguf`` is a small pure-Python
package and also a test extra, so the GGUF writer is tested everywhere (``require_module``:
under CI a missing gguf fails). llama-cpp-python is not: it compiles llama.cpp from source,
which takes minutes, so the two tests that run llama.cpp skip, saying so, wherever it is not
installed -- CI included; they are the one exception to "nothing but the GPU skips in CI",
and run wherever ``pip install -e ".[peers]"`` was done. What runs everywhere: the section
without the extra says how to install it, and the bench still succeeds.
"""

import argparse

import numpy as np
import pytest
from conftest import require_module

from mie.bench import __main__ as bench_main
from mie.bench import peers, throughput
from mie.model import Model, ModelConfig, random_weights

LLAMA_CPP_MISSING = (
    'needs llama-cpp-python, the opt-in peers extra (compiles llama.cpp): pip install -e ".[peers]"'
)

TINY_QWEN2 = dict(
    throughput.QWEN2_05B,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def test_without_the_extra_the_section_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(peers, "missing_packages", lambda: ["llama_cpp"])
    result = peers.run(argparse.Namespace(quick=True, seed=0, backend=None))
    assert 'pip install -e ".[peers]"' in result.report and "llama_cpp" in result.report
    assert bench_main.main(["--peers", "--quick"]) == 0  # the bench itself still succeeds
    assert 'pip install -e ".[peers]"' in capsys.readouterr().out


def expected_tensors(config: ModelConfig, weights) -> dict[str, np.ndarray]:
    """llama.cpp's names for mie's float32 weights, matrices (out, in) as PyTorch has them:
    written out here by hand from llama.cpp's qwen2 tensor list, not from the writer."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    tensors = {"token_embd.weight": weights.embed.weight, "output_norm.weight": weights.final_norm}
    for i, layer in enumerate(weights.layers):
        tensors |= {
            f"blk.{i}.attn_norm.weight": layer.input_norm,
            f"blk.{i}.attn_q.weight": layer.qkv.weight[:q],
            f"blk.{i}.attn_k.weight": layer.qkv.weight[q : q + kv],
            f"blk.{i}.attn_v.weight": layer.qkv.weight[q + kv :],
            f"blk.{i}.attn_q.bias": layer.qkv_bias[:q],
            f"blk.{i}.attn_k.bias": layer.qkv_bias[q : q + kv],
            f"blk.{i}.attn_v.bias": layer.qkv_bias[q + kv :],
            f"blk.{i}.attn_output.weight": layer.o.weight,
            f"blk.{i}.ffn_norm.weight": layer.post_norm,
            f"blk.{i}.ffn_gate.weight": layer.gate_up.weight[:inter],
            f"blk.{i}.ffn_up.weight": layer.gate_up.weight[inter:],
            f"blk.{i}.ffn_down.weight": layer.down.weight,
        }
    return tensors


@pytest.mark.parametrize("file_type", ["f32", "f16", "q8_0"])
def test_gguf_file_holds_the_source_weights_and_llama_cpp_metadata(tmp_path, file_type):
    gguf = require_module("gguf")
    config = ModelConfig.from_hf(TINY_QWEN2)
    weights = random_weights(config, seed=5)
    path = peers.write_gguf(tmp_path / "tiny.gguf", config, weights, file_type)
    reader = gguf.GGUFReader(path)

    def field(name):
        return reader.fields[name].contents()

    assert field("general.architecture") == "qwen2"
    assert field("general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7}[file_type]
    assert field("qwen2.block_count") == 2
    assert field("qwen2.embedding_length") == 64
    assert field("qwen2.feed_forward_length") == 96
    assert field("qwen2.attention.head_count") == 4
    assert field("qwen2.attention.head_count_kv") == 2
    assert field("qwen2.rope.freq_base") == 1e6
    assert field("qwen2.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert field("qwen2.vocab_size") == 256
    assert field("tokenizer.ggml.model") == "no_vocab"

    expected = expected_tensors(config, weights)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(expected)  # tied embeddings: no output.weight
    G = gguf.GGMLQuantizationType
    matrix_type = {"f32": G.F32, "f16": G.F16, "q8_0": G.Q8_0}[file_type]
    for name, source in expected.items():
        tensor = tensors[name]
        assert tuple(tensor.shape) == source.shape[::-1], name  # ggml's ne: (in, out)
        if source.ndim == 1:  # norms and biases stay float32 in every format
            assert tensor.tensor_type == G.F32
            np.testing.assert_array_equal(tensor.data, source, err_msg=name)
            continue
        assert tensor.tensor_type == matrix_type, name
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(source.shape)
        if file_type == "f32":
            np.testing.assert_array_equal(values, source, err_msg=name)
        elif file_type == "f16":
            np.testing.assert_array_equal(values, source.astype(np.float16), err_msg=name)
        else:
            # Q8_0: a block of 32 inputs has step d = max|w| / 127, stored as float16 (relative
            # error <= 2^-11); each value is off by at most d / 2 from rounding plus 127 times
            # the error of d.
            blocks = source.reshape(source.shape[0], -1, 32)
            step = np.abs(blocks).max(axis=2, keepdims=True) / 127
            bound = step * (0.5 + 127 * 2.0**-11) * (1 + 1e-6)
            error = np.abs(values.reshape(blocks.shape) - blocks)
            assert (error <= bound).all(), name
            assert error.max() > 0  # it really is quantized


def test_llama_cpp_logits_on_the_f32_file_match_mie(tmp_path):
    """llama.cpp, an implementation written by others, is an outside oracle for mie's float32
    forward pass: same weights, same prompt, every position's logits."""
    require_module("gguf")
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    from llama_cpp import GGML_TYPE_F32, Llama
    from model_runner import run_forward

    config = ModelConfig.from_hf(TINY_QWEN2)
    # Weights ten times the default scale: attention far from uniform, so that RoPE, GQA and
    # the biases all show in the logits.
    weights = random_weights(config, seed=7, scale=0.2)
    path = peers.write_gguf(tmp_path / "tiny-f32.gguf", config, weights, "f32")
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 40).tolist()
    # llama.cpp caches K and V in float16 by default: float32 here, as mie's float32 cache.
    llm = Llama(
        model_path=str(path),
        n_ctx=64,
        n_batch=64,
        n_threads=1,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        verbose=False,
    )
    llm.eval(prompt)
    theirs = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    llm.close()

    from mie.backend import select

    backend = select(None)
    model = Model(config, weights, backend.kernels)
    table = backend.BlockPool(8, throughput.bytes_per_block(config, 16)).new_table(16)
    table.append_tokens(len(prompt))
    ours = run_forward(model, [(prompt, 0, len(prompt), table)], all_positions=True)
    assert ours.shape == theirs.shape
    scale = np.abs(ours).max()
    assert scale > 1  # not a degenerate model: the logits vary
    # Both float32 throughout, summing in different orders: measured 1.2e-6 of the largest
    # logit (a RoPE base of 10,000 instead of 1,000,000 is off by the whole scale).
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=2e-5 * scale)


def test_section_measures_each_pair_and_divides_the_right_rows():
    require_module("gguf")
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    result = peers.measure(TINY_QWEN2, quick=True, seed=0, backend=None)
    pairs = [(pair["mie"], pair["llama_cpp"]) for pair in result["pairs"]]
    assert pairs == [("float32", "f32"), ("bfloat16", "f16"), ("float16", "f16"), ("int8", "q8_0")]
    for pair in result["pairs"]:
        ours, theirs = pair["mie_rates"], pair["llama_cpp_rates"]
        assert pair["decode_ratio"] == ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        assert pair["prefill_ratio"] == (
            ours["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"]
        )
        assert theirs["weight_bytes"] == result["gguf_bytes"][pair["llama_cpp"]]
    sizes = result["gguf_bytes"]
    assert sizes["f32"] > sizes["f16"] > sizes["q8_0"]
    text = peers.report(dict(result, model="tiny"))
    assert "mie bfloat16 / llama.cpp f16" in text and "llama.cpp q8_0" in text


def test_best_rates_keeps_the_fastest_figures_of_the_rounds():
    runs = [
        {"prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 9.0, "decode_step_ms": 111.1},
        {"prefill_tokens_per_s": 80.0, "decode_tokens_per_s": 10.0, "decode_step_ms": 100.0},
    ]
    assert peers.best_rates(runs) == {
        "prefill_tokens_per_s": 100.0,
        "decode_tokens_per_s": 10.0,
        "decode_step_ms": 100.0,
    }
