"""The peers section (``python -m mie.bench --peers``): the GGUF writer, llama.cpp as an oracle,
the runs in fresh processes and the rule that withholds a ratio measured under load.

The ``peers`` extra (gguf, llama-cpp-python) is opt-in. ``gguf`` is a small pure-Python
package and also a test extra, so the GGUF writer is tested everywhere (``require_module``:
under CI a missing gguf fails). llama-cpp-python is not: it compiles llama.cpp from source,
which takes minutes, so the tests that run llama.cpp skip, saying so, wherever it is not
installed -- CI included; they are the one exception to "nothing but the GPU skips in CI",
and run wherever ``pip install -e ".[peers]"`` was done. What runs everywhere: the section
without the extra says how to install it, and the bench still succeeds; the withholding rule
and the best-of-clean-rounds choice (pure functions); the section's runs with a stand-in for
the worker processes (their order, their requests, and that this process never imports
llama_cpp); mie's worker in a real subprocess on a tiny model. The same for the prompt-lookup
comparison (mie's n-gram speculation beside llama.cpp's ``LlamaPromptLookupDecoding``): its
summary and report on made-up rounds, its four runs with a stand-in worker; with llama.cpp
installed, the four for real, short, on stories260K.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import LLAMA_CPP_MISSING, STORIES, require_module

from mie import linear
from mie.backend import select
from mie.bench import __main__ as bench_main
from mie.bench import child, peers, peers_worker, speculative, throughput
from mie.checkpoint import Checkpoint
from mie.engine.tokenizer import Tokenizer
from mie.model import Model, ModelConfig, load_weights, random_weights

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


@pytest.mark.parametrize("file_type", ["f32", "f16", "q8_0", "q4_0"])
def test_gguf_file_holds_the_source_weights_and_llama_cpp_metadata(tmp_path, file_type):
    gguf = require_module("gguf")
    config = ModelConfig.from_hf(TINY_QWEN2)
    weights = random_weights(config, seed=5)
    path = peers.write_gguf(tmp_path / "tiny.gguf", config, weights, file_type)
    reader = gguf.GGUFReader(path)

    def field(name):
        return reader.fields[name].contents()

    assert field("general.architecture") == "qwen2"
    assert field("general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}[file_type]
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
    matrix_type = {"f32": G.F32, "f16": G.F16, "q8_0": G.Q8_0, "q4_0": G.Q4_0}[file_type]
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
        elif file_type == "q4_0":
            # The very numbers of mie's int4 weights (llama.cpp's Q4_0, bit for bit): mie int4
            # and llama.cpp q4_0 compute with the same weights.
            ours = linear.dequantize_int4(*linear.quantize_int4(source))
            np.testing.assert_array_equal(values, ours, err_msg=name)
            assert np.abs(values - source).max() > 0  # it really is quantized
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


# A tiny Qwen2 whose matrices' input dimensions are multiples of 256, so that llama.cpp's
# quantizer can store some of them as Q4_K (super-blocks of 256 inputs).
TINY_QWEN2_256 = dict(
    TINY_QWEN2, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
)
TINY_CONTEXTS = (16, 64)
EXPECTED_PAIRS = [
    ("float32", "f32"),
    ("bfloat16", "f16"),
    ("float16", "f16"),
    ("int8", "q8_0"),
    ("int4", "q4_0"),
    ("int4", "q4_k_m"),
]


def worker_request(run: str, **fields) -> dict:
    """A request as ``peers.measure`` makes them, on a short prompt and four decode steps."""
    tokens = np.random.default_rng(3).integers(0, 256, max(TINY_CONTEXTS) + 4).tolist()
    return dict(
        run=run,
        prompt=tokens[: max(TINY_CONTEXTS)],
        decode=tokens[max(TINY_CONTEXTS) :],
        contexts=list(TINY_CONTEXTS),
        repeats=1,
        **fields,
    )


def test_mie_worker_answers_one_json_line_of_its_figures_from_a_fresh_process(tmp_path):
    config = ModelConfig.from_hf(TINY_QWEN2)
    path = peers.write_gguf(tmp_path / "q8_0.gguf", config, random_weights(config, 4), "q8_0")
    request = worker_request(
        "mie",
        path=str(path),  # the file llama.cpp's run of the pair loads
        backend=None,
        dtype="float32",
        quantization="int4",
        kv_cache_dtype="float16",  # --kv-cache-dtype float16, as llama.cpp's cache
    )
    answer = peers.run_worker(request)  # python -m mie.bench.peers_worker REQUEST
    backend = select(None)
    assert answer["engine"] == "mie" and answer["backend"] == backend.name
    # the threads a fresh process gets (this one's may have been changed by other tests)
    fresh = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mie.backend import select\n"
            "from mie.bench.peers_worker import threads_used\nprint(threads_used(select(None)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert answer["threads"] == int(fresh.stdout)
    model = Model.from_pretrained(path, backend.kernels, dtype="float32", quantization="int4")
    assert model.weights.format == "int4"  # Q8_0 requantized, as asked
    assert answer["weight_bytes"] == model.weights.nbytes
    figures = answer["tokens_per_s"]
    assert list(figures) == ["prefill", "decode@16", "decode@64"]
    assert all(np.isfinite(v) and v > 0 for v in figures.values())


def test_mie_sequence_prefills_in_chunks_as_in_one_pass(monkeypatch):
    """The long prompt is prefilled in chunks of ``PREFILL_CHUNK``: the same logits."""
    backend = select(None)
    model = Model.random(ModelConfig.from_hf(TINY_QWEN2), 2, backend.kernels)
    prompt = np.random.default_rng(0).integers(0, 256, 23).tolist()
    whole = peers_worker.MieSequence(model, backend, 40, "auto")
    whole.reset()
    expected = [whole.feed(prompt), whole.feed([7])]
    monkeypatch.setattr(peers_worker, "PREFILL_CHUNK", 5)
    chunked = peers_worker.MieSequence(model, backend, 40, "auto")
    for _ in range(2):  # and again after a reset
        chunked.reset()
        np.testing.assert_allclose(chunked.feed(prompt), expected[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(chunked.feed([7]), expected[1], rtol=1e-5, atol=1e-6)


def test_worker_module_loads_nothing_of_mie_that_llama_cpp_would_share():
    """The llama.cpp runs import this module: it must not load mie's kernels (their OpenMP
    runtime, whose wait policy mie sets, would then be llama.cpp's too)."""
    probe = (
        "import json, sys, mie.bench.peers_worker; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mie')))"
    )
    root = Path(peers.__file__).resolve().parents[2]  # this mie, not an installed one
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=root
    )
    assert json.loads(done.stdout) == ["mie", "mie.bench", "mie.bench.peers_worker"]


def test_withheld_reason_refuses_a_round_whose_load_passed_threads_plus_one():
    assert peers.withheld_reason([0.5, 2.0, 3.0, 1.0], threads=2) is None  # at the limit: counts
    assert peers.withheld_reason([0.5, 3.4, 3.0, 1.0], threads=2) == (
        "withheld: load 3.40 > 2 threads + 1"
    )
    assert peers.withheld_reason([4.9, 4.0], threads=4) is None
    assert peers.withheld_reason([5.2], threads=4) == "withheld: load 5.20 > 4 threads + 1"


def fake_run(decode: float, prefill: float, loads: tuple[float, float], weight_bytes=100) -> dict:
    return {
        "tokens_per_s": {"prefill": prefill, "decode@16": decode, "decode@64": decode / 2},
        "load_before": loads[0],
        "load_after": loads[1],
        "weight_bytes": weight_bytes,
    }


def test_summary_counts_only_clean_rounds_and_takes_their_best_figures():
    rounds = [
        # Round 1 ran under load, and mie happened to be fastest there: it must not count.
        {"mie": fake_run(50.0, 900.0, (1.0, 3.4)), "llama_cpp": fake_run(10.0, 100.0, (2, 2))},
        {"mie": fake_run(20.0, 300.0, (1.0, 2.0)), "llama_cpp": fake_run(18.0, 310.0, (2, 3))},
        {"mie": fake_run(22.0, 280.0, (2.0, 2.0)), "llama_cpp": fake_run(16.0, 330.0, (2, 2))},
    ]
    pair = peers.summarize_pair("int4", "q4_0", rounds, threads=2)
    assert pair["counted_rounds"] == [2, 3]
    assert pair["mie_rates"] == {"prefill": 300.0, "decode@16": 22.0, "decode@64": 11.0}
    assert pair["llama_cpp_rates"] == {"prefill": 330.0, "decode@16": 18.0, "decode@64": 9.0}
    assert pair["ratios"] == {"prefill": 300 / 330, "decode@16": 22 / 18, "decode@64": 11 / 9}
    assert pair["withheld"] is None
    first, second, _ = pair["rounds"]
    assert first["withheld"] == "withheld: load 3.40 > 2 threads + 1" and first["ratios"] is None
    assert second["withheld"] is None
    assert second["ratios"] == {"prefill": 300 / 310, "decode@16": 20 / 18, "decode@64": 10 / 9}
    assert first["mie"]["load_after"] == 3.4  # the JSON keeps every round's figures and loads

    text = peers.report(report_result([pair]))
    assert "withheld: load 3.40 > 2 threads + 1" in text
    assert f"{22 / 18:.2f}x" in text and f"{50 / 10:.2f}x" not in text  # no dirty ratio
    assert "2 of 3" in text


def test_with_no_clean_round_the_ratio_is_withheld():
    rounds = [
        {"mie": fake_run(50.0, 900.0, (3.5, 3.6)), "llama_cpp": fake_run(10.0, 100.0, (3, 3))},
        {"mie": fake_run(20.0, 300.0, (1.0, 2.0)), "llama_cpp": fake_run(18.0, 310.0, (3, 4.2))},
    ]
    pair = peers.summarize_pair("float32", "f32", rounds, threads=2)
    assert pair["counted_rounds"] == [] and pair["ratios"] is None
    assert pair["withheld"] == "withheld: load above 2 threads + 1 in every round (lowest 3.60)"
    assert pair["mie_rates"]["prefill"] == 900.0  # the figures: best of all rounds, flagged
    text = peers.report(report_result([pair]))
    lines = [line for line in text.splitlines() if line.startswith("mie float32 / llama.cpp f32")]
    assert len(lines) == 3  # its ratio row and its two rounds
    assert pair["withheld"] in lines[0]
    assert not any(re.search(r"\d\.\d\dx", line) for line in lines)  # no ratio printed


def test_a_pair_with_no_round_both_clean_and_complete_has_no_ratio():
    failed = {
        "failed": "llama.cpp run failed (exit -11, SIGSEGV)",
        "error": "",
        "load_before": 1,
        "load_after": 1,
    }
    rounds = [
        {"mie": fake_run(20.0, 300.0, (1.0, 2.0)), "llama_cpp": failed},
        {"mie": fake_run(50.0, 900.0, (1.0, 2.0)), "llama_cpp": fake_run(9.0, 90.0, (2, 3.5))},
    ]
    pair = peers.summarize_pair("int8", "q8_0", rounds, threads=2)
    assert pair["counted_rounds"] == [] and pair["ratios"] is None
    assert pair["withheld"] == (
        "withheld: every round failed or ran under load (llama.cpp run failed (exit -11, SIGSEGV))"
    )
    assert pair["mie_rates"]["decode@16"] == 50.0  # each side's best of the runs it finished
    assert pair["llama_cpp_rates"]["decode@16"] == 9.0


def report_result(pairs: list[dict]) -> dict:
    return {
        "model": "tiny",
        "backend": "fast",
        "threads": 2,
        "load_limit": 3,
        "kv_cache_dtype": "auto",
        "llama_cpp_python": "0.0",
        "prompt_tokens": 16,
        "contexts": list(TINY_CONTEXTS),
        "decode_tokens": 4,
        "repeats": 1,
        "rounds": len(pairs[0]["rounds"]),
        "gguf_write_s": 1.0,
        "gguf_matrix_types": {"q4_0": {"Q4_0": 14}},
        "pairs": pairs,
    }


def test_section_runs_each_engine_in_its_own_process_alternating(tmp_path, monkeypatch):
    """The section with a stand-in for the worker processes: what it asks them for, in which
    order, and that this process never imports llama_cpp (it would share one OpenMP runtime
    with mie's kernels)."""
    gguf = require_module("gguf")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # importing it here would now fail
    requests = []

    def worker(request):
        requests.append(request)
        if request["run"] == "quantize":  # a stand-in for llama.cpp's quantizer
            shutil.copy(request["source"], request["target"])
            return {}
        figures = {"prefill": 100.0, "decode@16": 10.0, "decode@64": 5.0}
        if request["run"] == "mie":
            return {"tokens_per_s": figures, "weight_bytes": 1, "threads": 2}
        return {"tokens_per_s": figures, "weight_bytes": 2, "llama_cpp_python": "x"}

    per_round = 4 * len(EXPECTED_PAIRS)  # before and after each of a pair's two runs
    loads = iter([1.0] * per_round + [3.5] * per_round + [3.0] * per_round)  # round 2: busy
    monkeypatch.setattr(peers, "run_worker", worker)
    monkeypatch.setattr(peers, "load_average", lambda: next(loads))
    monkeypatch.setattr(peers, "threads_used", lambda backend: 2)
    result = peers.measure(
        TINY_QWEN2,
        quick=False,
        seed=0,
        backend=None,
        kv_cache_dtype="float16",
        directory=tmp_path,
        contexts=TINY_CONTEXTS,
    )
    q4_0, q4_k_m, *runs = requests
    for quantize in (q4_0, q4_k_m):
        assert quantize["run"] == "quantize" and quantize["source"].endswith("f32.gguf")
    assert q4_0["ftype"] == 2 and q4_0["target"].endswith("q4_0.gguf")  # MOSTLY_Q4_0
    assert q4_k_m["ftype"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert len(runs) == 2 * len(EXPECTED_PAIRS) * peers.ROUNDS
    expected = []
    for round_index in range(peers.ROUNDS):
        for mode, file_type in EXPECTED_PAIRS:
            pair = [("mie", mode), ("llama.cpp", file_type)]
            expected += pair if round_index % 2 == 0 else pair[::-1]
    seen = [
        (r["run"], r["dtype"] if r["quantization"] is None else r["quantization"])
        if r["run"] == "mie"
        else (r["run"], r["path"].rsplit("/", 1)[1].removesuffix(".gguf"))
        for r in runs
    ]
    assert seen == expected
    for r in runs:  # the same tokens, contexts and threads on both sides
        assert r["prompt"] == runs[0]["prompt"] and r["decode"] == runs[0]["decode"]
        assert r["contexts"] == list(TINY_CONTEXTS) and len(r["prompt"]) == 64
    assert {r["threads"] for r in runs if r["run"] == "llama.cpp"} == {2}
    assert {r["kv_cache_dtype"] for r in runs if r["run"] == "mie"} == {"float16"}
    assert [(p["mie"], p["llama_cpp"]) for p in result["pairs"]] == EXPECTED_PAIRS
    for pair in result["pairs"]:
        assert pair["counted_rounds"] == [1, 3]
        assert [r["withheld"] for r in pair["rounds"]] == [
            None,
            "withheld: load 3.50 > 2 threads + 1",
            None,
        ]
    assert result["gguf_matrix_types"]["q8_0"] == {
        gguf.GGMLQuantizationType.Q8_0.name: 2 * 7 + 1  # 7 matrices a layer, the embedding
    }
    assert "q4_0" in result["gguf_bytes"]  # made by the (stand-in) quantizer, measured too
    assert sys.modules["llama_cpp"] is None


def test_a_run_that_crashes_costs_its_own_rounds_and_nothing_else(tmp_path, monkeypatch):
    """Fault injection: llama.cpp's process dies (as its AMX kernels do on some CPUs, SIGSEGV)
    for q8_0 in round 1 and for q4_0 in every round. The section still runs every other
    run, counts q8_0's other rounds, withholds q4_0's ratios saying why, and the report
    shows the failure and its stderr instead of figures."""
    require_module("gguf")
    calls = {"q8_0": 0}

    def worker(request):
        if request["run"] == "quantize":
            shutil.copy(request["source"], request["target"])
            return {}
        figures = {"prefill": 100.0, "decode@16": 10.0, "decode@64": 5.0}
        if request["run"] == "mie":
            return {"tokens_per_s": figures, "weight_bytes": 1, "threads": 2}
        file_type = Path(request["path"]).stem
        calls[file_type] = calls.get(file_type, 0) + 1
        if file_type == "q4_0" or (file_type == "q8_0" and calls["q8_0"] == 1):
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import os, signal, sys; "
                    "print('in ggml_backend_amx_mul_mat', file=sys.stderr); "
                    "os.kill(os.getpid(), signal.SIGSEGV)",
                ],
                capture_output=True,
                text=True,
            )  # a real crash's exit
            raise RuntimeError(
                f"peers: the llama.cpp run failed ({child.exit_text(done.returncode)}):\n"
                + done.stderr
            )
        figures = {"prefill": 200.0, "decode@16": 8.0, "decode@64": 4.0}
        return {"tokens_per_s": figures, "weight_bytes": 2, "llama_cpp_python": "x"}

    monkeypatch.setattr(peers, "run_worker", worker)
    monkeypatch.setattr(peers, "load_average", lambda: 1.0)
    monkeypatch.setattr(peers, "threads_used", lambda backend: 2)
    result = peers.measure(
        TINY_QWEN2, quick=False, seed=0, backend=None, directory=tmp_path, contexts=TINY_CONTEXTS
    )
    pairs = {(pair["mie"], pair["llama_cpp"]): pair for pair in result["pairs"]}
    assert list(pairs) == EXPECTED_PAIRS  # every pair ran, every round
    assert all(len(pair["rounds"]) == peers.ROUNDS for pair in result["pairs"])
    q8_0 = pairs["int8", "q8_0"]
    assert q8_0["counted_rounds"] == [2, 3]
    assert q8_0["rounds"][0]["withheld"] == "llama.cpp run failed (exit -11, SIGSEGV)"
    assert q8_0["ratios"]["decode@16"] == 10.0 / 8.0 and q8_0["withheld"] is None
    q4_0 = pairs["int4", "q4_0"]
    assert q4_0["counted_rounds"] == [] and q4_0["ratios"] is None
    assert q4_0["llama_cpp_rates"] is None and q4_0["llama_cpp_weight_bytes"] is None
    assert q4_0["mie_rates"]["decode@16"] == 10.0  # mie's own runs are still reported
    assert q4_0["withheld"] == ("failed in every round: llama.cpp run failed (exit -11, SIGSEGV)")
    assert result["llama_cpp_python"] == "x"
    text = peers.report(dict(result, model="tiny"))
    row = next(line for line in text.splitlines() if line.startswith("llama.cpp q4_0"))
    assert row.split()[2:5] == ["-", "failed", "failed"]
    assert (
        "round 1 of mie int8 / llama.cpp q8_0: llama.cpp run failed (exit -11, SIGSEGV): "
        "in ggml_backend_amx_mul_mat" in text
    )
    assert text.count("llama.cpp run failed (exit -11, SIGSEGV): in ggml") == 1 + peers.ROUNDS


def test_llama_cpp_worker_answers_its_figures_from_a_fresh_process(tmp_path):
    require_module("gguf")
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    config = ModelConfig.from_hf(TINY_QWEN2)
    path = peers.write_gguf(tmp_path / "tiny.gguf", config, random_weights(config, 0), "q4_0")
    answer = peers.run_worker(worker_request("llama.cpp", path=str(path), threads=1))
    assert answer["engine"] == "llama.cpp" and answer["threads"] == 1
    assert answer["weight_bytes"] == path.stat().st_size
    assert answer["llama_cpp_python"]
    figures = answer["tokens_per_s"]
    assert list(figures) == ["prefill", "decode@16", "decode@64"]
    assert all(np.isfinite(v) and v > 0 for v in figures.values())


def test_section_measures_each_pair_and_divides_the_right_rows(tmp_path):
    gguf = require_module("gguf")
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    result = peers.measure(
        TINY_QWEN2_256, quick=True, seed=0, backend=None, directory=tmp_path, contexts=(16, 64)
    )
    assert [(pair["mie"], pair["llama_cpp"]) for pair in result["pairs"]] == EXPECTED_PAIRS
    for pair in result["pairs"]:
        (round_,) = pair["rounds"]
        ours, theirs = round_["mie"], round_["llama_cpp"]
        assert pair["mie_rates"] == ours["tokens_per_s"]
        assert pair["llama_cpp_rates"] == theirs["tokens_per_s"]
        if pair["ratios"] is not None:  # a quiet machine
            assert pair["ratios"]["decode@64"] == (
                ours["tokens_per_s"]["decode@64"] / theirs["tokens_per_s"]["decode@64"]
            )
        assert pair["llama_cpp_weight_bytes"] == result["gguf_bytes"][pair["llama_cpp"]]
        assert all(load >= 0 for load in peers.round_loads(round_))
    sizes = result["gguf_bytes"]
    assert sizes["f32"] > sizes["f16"] > sizes["q8_0"] > sizes["q4_0"]
    # llama.cpp's quantizer wrote Q4_K where the input dimension allows it.
    assert gguf.GGMLQuantizationType.Q4_K.name in result["gguf_matrix_types"]["q4_k_m"]
    text = peers.report(dict(result, model="tiny"))
    assert "mie bfloat16 / llama.cpp f16" in text and "llama.cpp q4_k_m" in text


def test_best_rates_keeps_the_fastest_figures_of_the_rounds():
    runs = [
        {"prefill": 100.0, "decode@128": 9.0, "decode@2048": 7.0},
        {"prefill": 80.0, "decode@128": 10.0, "decode@2048": 6.0},
    ]
    assert peers.best_rates(runs) == {"prefill": 100.0, "decode@128": 10.0, "decode@2048": 7.0}


# -- prompt-lookup decoding: mie's n-gram speculation beside llama.cpp's -------------------
def test_llama_gguf_permutes_q_and_k_as_llama_cpp_s_converter_and_mie_reads_it_back(tmp_path):
    """stories260K, a Llama, as ``write_gguf`` writes it for the prompt-lookup comparison:
    llama.cpp's ``llama`` hyperparameters, q and k rows in the order its converter puts them
    (its own code, ``gguf_writer.converter_permute``), and mie loads the file back as the
    very weights it was written from."""
    gguf = require_module("gguf")
    from gguf_writer import converter_permute

    config = ModelConfig.from_pretrained(STORIES)
    weights = load_weights(Checkpoint(STORIES), config, dtype="float32")
    path = peers.write_gguf(tmp_path / "stories.gguf", config, weights, "f32")
    reader = gguf.GGUFReader(path)

    def field(name):
        return reader.fields[name].contents()

    assert field("general.architecture") == "llama"
    assert field("llama.attention.head_count") == 8
    assert field("llama.attention.head_count_kv") == 4
    assert field("llama.rope.freq_base") == 10000.0
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert field("llama.vocab_size") == 512
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd.weight
    q, kv = config.q_size, config.kv_size
    for i, layer in enumerate(weights.layers):
        qkv = layer.qkv.weight
        for name, rows, heads in (("q", qkv[:q], 8), ("k", qkv[q : q + kv], 4)):
            stored = tensors[f"blk.{i}.attn_{name}.weight"].data.reshape(rows.shape)
            np.testing.assert_array_equal(stored, converter_permute(rows, heads))
            assert not np.array_equal(stored, rows)  # really reordered
    model = Model.from_pretrained(path, select(None).kernels)
    for ours, source in zip(model.weights.layers, weights.layers, strict=True):
        np.testing.assert_array_equal(ours.qkv.weight, source.qkv.weight)
        np.testing.assert_array_equal(ours.gate_up.weight, source.gate_up.weight)
    np.testing.assert_array_equal(model.weights.embed.weight, weights.embed.weight)


def lookup_run(tokens: dict, seconds: dict, loads: tuple[float, float], steps=None) -> dict:
    """A worker's answer for one configuration (``steps``: mie counts them), with its loads."""
    workloads = {name: {"tokens": ids, "seconds": seconds[name]} for name, ids in tokens.items()}
    for name, count in (steps or {}).items():
        workloads[name]["steps"] = count
    return {"workloads": workloads, "load_before": loads[0], "load_after": loads[1]}


GROUNDED = [[5, 6, 7, 1], [8, 9]]  # mie's plain tokens: 6 of them on the grounded prompts
FREE = [[3, 4, 5]]


def lookup_rounds(first_load: float, second_load: float = 2.0) -> list[dict[str, dict]]:
    """Two rounds of the four configurations, the first ten times as fast as the second; the
    load in one run of each is ``first_load`` and ``second_load``."""
    llama_grounded = [[5, 6, 7, 1], [8, 8]]  # llama.cpp's plain text differs on prompt 2
    rounds = []
    for number, scale, high in ((1, 10.0, first_load), (2, 1.0, second_load)):
        free_lookup = FREE if number == 1 else [[3, 4, 6]]  # round 2: another text
        rounds.append(
            {
                "mie plain": lookup_run(
                    {"input-grounded": GROUNDED, "free": FREE},
                    {"input-grounded": 0.06 / scale, "free": 0.03 / scale},
                    (1.0, 1.0),
                    steps={"input-grounded": 6, "free": 3},
                ),
                "mie n-gram": lookup_run(
                    {"input-grounded": GROUNDED, "free": FREE},
                    {"input-grounded": 0.04 / scale, "free": 0.03 / scale},
                    (1.0, high),
                    steps={"input-grounded": 4, "free": 3},
                ),
                "llama.cpp plain": lookup_run(
                    {"input-grounded": llama_grounded, "free": FREE},
                    {"input-grounded": 0.01 / scale, "free": 0.005 / scale},
                    (1.0, 1.0),
                ),
                "llama.cpp prompt lookup": lookup_run(
                    {"input-grounded": llama_grounded, "free": free_lookup},
                    {"input-grounded": 0.02 / scale, "free": 0.006 / scale},
                    (1.0, 1.0),
                ),
            }
        )
    return rounds


def lookup_result(summary: dict) -> dict:
    """``measure_prompt_lookup``'s result around a summary."""
    return {
        "model": "stories260K",
        "gguf": "f32",
        "backend": "fast",
        "threads": 2,
        "load_limit": 3,
        "llama_cpp_python": "0.0",
        "max_tokens": 128,
        "stop_token_ids": [1, 2],
        "ngram": peers.NGRAM,
        "num_pred_tokens": 4,
        "rounds_run": len(summary["rounds"]),
        **summary,
    }


def test_prompt_lookup_summary_takes_clean_rounds_and_compares_each_engine_with_itself():
    summary = peers.summarize_prompt_lookup(lookup_rounds(3.4), threads=2)
    assert summary["counted_rounds"] == [2] and summary["withheld"] is None
    assert summary["rounds"][0]["withheld"] == "withheld: load 3.40 > 2 threads + 1"
    assert summary["rounds"][0]["mie n-gram"]["load_after"] == 3.4  # every round kept
    grounded, free = summary["workloads"]["input-grounded"], summary["workloads"]["free"]
    # the clean round's figures, not the ten times faster dirty one's
    assert grounded["mie plain"]["tokens_per_s"] == pytest.approx(6 / 0.06)
    assert grounded["mie n-gram"]["tokens_per_s"] == pytest.approx(6 / 0.04)
    assert grounded["llama.cpp plain"]["tokens_per_s"] == pytest.approx(6 / 0.01)
    # each engine against its own plain decoding
    assert grounded["mie n-gram"]["speedup"] == pytest.approx(0.06 / 0.04)
    assert grounded["llama.cpp prompt lookup"]["speedup"] == pytest.approx(0.01 / 0.02)
    assert grounded["mie plain"]["speedup"] == 1.0
    assert free["llama.cpp prompt lookup"]["speedup"] == pytest.approx(0.005 / 0.006)
    assert grounded["mie n-gram"]["tokens"] == 6 and free["mie plain"]["tokens"] == 3
    assert grounded["mie n-gram"]["tokens_per_step"] == 1.5  # 6 tokens in 4 steps
    assert grounded["mie plain"]["tokens_per_step"] == 1.0
    assert grounded["llama.cpp plain"]["tokens_per_step"] is None  # llama.cpp counts none
    # identical: the same ids as the engine's own plain decoding, in every round (llama.cpp's
    # plain text differing from mie's does not count against llama.cpp)
    assert all(row["identical"] for row in grounded.values())
    assert free["mie n-gram"]["identical"]
    assert not free["llama.cpp prompt lookup"]["identical"]  # round 2 changed a token
    assert summary["prompts"] == {"input-grounded": 2, "free": 1}
    assert summary["plain_tokens_agree"] == {"input-grounded": 1, "free": 1}

    text = peers.prompt_lookup_report(lookup_result(summary))
    lines = text.splitlines()
    row = next(line for line in lines if re.match(r"free\s+llama.cpp prompt lookup", line))
    assert row.split()[-2:] == [f"{0.005 / 0.006:.2f}x", "NO"]
    row = next(line for line in lines if re.match(r"input-grounded\s+mie n-gram", line))
    assert row.split()[-5:] == ["6", "1.50", "150", "1.50x", "yes"]
    assert "withheld: load 3.40 > 2 threads + 1" in text
    assert "1 of 2 input-grounded, 1 of 1 free" in text


def test_prompt_lookup_speedups_are_withheld_without_a_clean_round():
    summary = peers.summarize_prompt_lookup(lookup_rounds(3.4, 3.1), threads=2)
    assert summary["counted_rounds"] == []
    assert summary["withheld"] == (
        "withheld: load above 2 threads + 1 in every round (lowest 3.10)"
    )
    grounded = summary["workloads"]["input-grounded"]
    assert all(row["speedup"] is None for row in grounded.values())
    assert grounded["mie plain"]["tokens_per_s"] == pytest.approx(6 / 0.006)  # best of all
    text = peers.prompt_lookup_report(lookup_result(summary))
    assert "Speed-ups withheld: load above 2 threads + 1" in text
    assert not re.search(r"\d\.\d\dx", text)  # no speed-up printed


def test_prompt_lookup_runs_four_configurations_each_in_its_own_process(tmp_path, monkeypatch):
    """The comparison with a stand-in for the worker processes: the GGUF file it writes, the
    requests (the same file, prompts and stop rule; each engine plain and speculative), their
    order, and that this process never imports llama_cpp."""
    gguf = require_module("gguf")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # importing it here would now fail
    requests = []

    def worker(request):
        requests.append(request)
        reader = gguf.GGUFReader(request["path"])  # the file exists while the runs run
        assert reader.fields["general.architecture"].contents() == "llama"
        answer = {"llama_cpp_python": "x"} if request["run"] == "llama.cpp generate" else {}
        answer["workloads"] = {
            name: {"tokens": [ids[:2] for ids in prompts], "seconds": 1.0, "steps": 4}
            for name, prompts in request["workloads"].items()
        }
        return answer

    monkeypatch.setattr(peers, "run_worker", worker)
    monkeypatch.setattr(peers, "load_average", lambda: 1.0)
    monkeypatch.setattr(peers, "threads_used", lambda backend: 2)
    result = peers.measure_prompt_lookup(
        quick=True, seed=0, backend=None, directory=tmp_path, rounds=2
    )
    ran = [
        ("mie", r["speculative_config"])
        if r["run"] == "mie generate"
        else ("llama.cpp", r["num_pred_tokens"])
        for r in requests
    ]
    expected = [
        ("mie", None),
        ("mie", peers.NGRAM),
        ("llama.cpp", None),
        ("llama.cpp", 4),
    ]
    assert ran == expected + expected[::-1]  # round 2 in the reverse order
    assert peers.NGRAM["num_speculative_tokens"] == 4  # both engines propose 4 tokens
    tokenizer = Tokenizer(STORIES)
    assert requests[0]["workloads"] == {
        "input-grounded": [tokenizer.encode(t) for _, t in speculative.GROUNDED_PROMPTS[:2]],
        "free": [tokenizer.encode(t) for t in speculative.FREE_PROMPTS[:2]],
    }
    for r in requests:  # the same file, prompts, warm-up and stop rule for all four
        for key in ("path", "workloads", "warm_up", "max_tokens", "stop_token_ids"):
            assert r[key] == requests[0][key], key
    assert requests[0]["max_tokens"] == peers.LOOKUP_QUICK_MAX_TOKENS
    assert requests[0]["stop_token_ids"] == [1, 2]  # stories260K's end-of-sequence ids
    assert all(requests[0]["warm_up"] != ids for ids in requests[0]["workloads"]["free"])
    assert {r["threads"] for r in requests if r["run"] == "llama.cpp generate"} == {2}
    assert result["counted_rounds"] == [1, 2] and result["llama_cpp_python"] == "x"
    assert set(result["workloads"]) == {"input-grounded", "free"}
    assert not list(tmp_path.iterdir())  # the GGUF file's folder is removed afterwards
    assert sys.modules["llama_cpp"] is None


def test_peers_section_reports_the_prompt_lookup_comparison(monkeypatch):
    pair = peers.summarize_pair(
        "float32",
        "f32",
        [{"mie": fake_run(20, 300, (1, 1)), "llama_cpp": fake_run(18, 310, (1, 1))}],
        threads=2,
    )
    lookup = lookup_result(peers.summarize_prompt_lookup(lookup_rounds(3.4), threads=2))
    monkeypatch.setattr(peers, "missing_packages", lambda: [])
    asked = []
    monkeypatch.setattr(
        peers, "measure", lambda *args, **kwargs: asked.append(kwargs) or report_result([pair])
    )
    monkeypatch.setattr(peers, "measure_prompt_lookup", lambda *args: lookup)
    result = peers.run(argparse.Namespace(quick=True, seed=0, backend=None))
    assert asked == [{"busy": 0}]  # no --peers-busy: quiet
    assert result.data["peers"]["prompt_lookup"] is lookup  # the JSON's key
    assert "Prompt-lookup decoding: stories260K" in result.report
    assert "llama.cpp prompt lookup" in result.report


def test_prompt_lookup_against_llama_cpp_for_real(tmp_path):
    """The four configurations for real, short: llama.cpp loads the stories260K file and
    continues every prompt as mie does; mie's n-gram speculation accepts tokens on the
    input-grounded prompts and gives plain decoding's tokens."""
    require_module("gguf")
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    result = peers.measure_prompt_lookup(
        quick=True, seed=0, backend=None, directory=tmp_path, max_tokens=8, rounds=1
    )
    for name, rows in result["workloads"].items():
        assert all(row["tokens"] > 0 and row["tokens_per_s"] > 0 for row in rows.values())
        assert rows["mie n-gram"]["identical"], name
        assert rows["mie plain"]["tokens_per_step"] == 1.0
    grounded = result["workloads"]["input-grounded"]
    assert grounded["mie n-gram"]["tokens_per_step"] > 1  # it speculated, and was right
    # the same file, the same greedy tokens: llama.cpp reads write_gguf's Llama as mie does
    assert result["plain_tokens_agree"] == result["prompts"] == {"input-grounded": 2, "free": 2}
    assert "llama.cpp prompt lookup" in peers.prompt_lookup_report(result)


def test_both_generate_workers_stop_at_a_stop_token_and_keep_it(tmp_path):
    """The stop rule both engines follow (the GGUF file has no vocabulary, so llama.cpp knows
    no end-of-sequence token of its own): the output ends at the first stop token, kept."""
    require_module("gguf")
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    config = ModelConfig.from_pretrained(STORIES)
    weights = load_weights(Checkpoint(STORIES), config, dtype="float32")
    path = peers.write_gguf(tmp_path / "stories.gguf", config, weights, "f32")
    prompt = Tokenizer(STORIES).encode("Once upon a time")
    request = {
        "path": str(path),
        "workloads": {"free": [prompt]},
        "warm_up": [5, 6, 7],
        "max_tokens": 8,
        "n_ctx": 64,
        "threads": 1,
        "backend": None,
        "speculative_config": None,
        "num_pred_tokens": None,
    }
    for generate in (peers_worker.mie_generate, peers_worker.llama_cpp_generate):
        (free,) = generate(dict(request, stop_token_ids=[]))["workloads"]["free"]["tokens"]
        assert len(free) == 8
        stop = free[3]
        (stopped,) = generate(dict(request, stop_token_ids=[stop]))["workloads"]["free"]["tokens"]
        assert stopped == free[: free.index(stop) + 1], generate.__name__


# -- beside busy processes (--peers-busy) -----------------------------------------------------
def test_busy_processes_spin_while_the_block_runs_and_are_gone_after_it():
    with peers.busy_processes(2) as started:
        assert len(started) == 2 and all(p.poll() is None for p in started)
    assert all(p.returncode is not None for p in started)
    with pytest.raises(RuntimeError), peers.busy_processes(1) as started:
        raise RuntimeError("a run failed")
    assert started[0].returncode is not None  # stopped however the block ends
    with peers.busy_processes(0) as started:
        assert started == []


def test_section_runs_its_pairs_beside_busy_processes_and_allows_their_load(tmp_path, monkeypatch):
    """``busy``: the pairs' rounds (not the GGUF writing) run inside ``busy_processes``, and
    the clean-round rule allows the busy processes' load on top of the threads + 1."""
    require_module("gguf")
    inside = []

    @peers.contextmanager
    def fake_busy(count):
        inside.append(count)
        yield []
        inside.append("stopped")

    def worker(request):
        if request["run"] == "quantize":
            shutil.copy(request["source"], request["target"])
            return {}
        assert inside == [1], "a pair ran outside the busy processes"
        figures = {"prefill": 100.0, "decode@16": 10.0, "decode@64": 5.0}
        if request["run"] == "mie":
            return {"tokens_per_s": figures, "weight_bytes": 1, "threads": 2}
        return {"tokens_per_s": figures, "weight_bytes": 2, "llama_cpp_python": "x"}

    per_round = 4 * len(EXPECTED_PAIRS)
    loads = iter([3.5] * per_round + [4.5] * per_round + [4.0] * per_round)
    monkeypatch.setattr(peers, "busy_processes", fake_busy)
    monkeypatch.setattr(peers, "run_worker", worker)
    monkeypatch.setattr(peers, "load_average", lambda: next(loads))
    monkeypatch.setattr(peers, "threads_used", lambda backend: 2)
    result = peers.measure(
        TINY_QWEN2, False, 0, None, directory=tmp_path, contexts=TINY_CONTEXTS, busy=1
    )
    assert inside == [1, "stopped"]
    assert result["busy"] == 1 and result["load_limit"] == 4
    for pair in result["pairs"]:
        assert pair["counted_rounds"] == [1, 3]  # 3.5 and 4.0 count beside one busy process
        assert pair["rounds"][1]["withheld"] == "withheld: load 4.50 > 3 threads + 1"
    text = peers.report(dict(result, model="tiny"))
    assert "Beside 1 busy process (python -c 'while True: pass', one core each)" in text
    assert "at most 2 threads + 1 busy process + 1 = 4 before and after" in text


def test_peers_busy_needs_peers_and_a_count_of_zero_or_more(capsys):
    assert bench_main.parse_args(["--peers", "--peers-busy", "2"]).peers_busy == 2
    assert bench_main.parse_args(["--peers"]).peers_busy == 0
    for argv, message in [
        (["--peers-busy", "1"], "--peers-busy N needs --peers"),
        (["--peers", "--peers-busy", "-1"], "expected 0 or more, got -1"),
        (["--peers", "--peers-busy", "x"], "expected a whole number, got 'x'"),
    ]:
        with pytest.raises(SystemExit):
            bench_main.parse_args(argv)
        assert message in capsys.readouterr().err
