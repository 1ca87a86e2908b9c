"""The throughput section on a tiny Qwen2 (the real one is 0.5B-shaped and takes minutes)."""

import pytest
from conftest import require_module

from mie.bench import hf_baseline, throughput

TINY_QWEN2 = dict(
    throughput.QWEN2_05B,
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def test_measure_counts_every_requests_own_tokens_for_both_engines():
    result = throughput.measure(TINY_QWEN2, quick=True, seed=3, backend=None)
    prompts, outputs = throughput.mixed_workload(8, 3, 256, quick=True)
    workload = result["mixed_workload"]
    assert workload["useful_output_tokens"] == sum(outputs)
    assert workload["prompt_tokens"] == sum(len(p) for p in prompts)
    assert workload["mie"]["useful_tokens"] == sum(outputs)
    assert [row["batch"] for row in result["forward"]] == list(throughput.BATCHES)
    assert all(row["decode_tokens_per_s"] > 0 for row in result["forward"])
    check_modes(result["modes"])
    # The transformers baseline needs torch and transformers: without them it is None, and the
    # rest is skipped (except under CI, where they are installed and a None fails below).
    require_module("torch")
    require_module("transformers")
    hf = workload["transformers_static"]
    # one static batch of 8, padded to its longest output: everyone generates max(outputs)
    assert hf["useful_tokens"] == sum(outputs)
    assert hf["generated_tokens"] == 8 * max(outputs)
    assert "ratio mie / transformers" in throughput.report(dict(result, model="tiny"))


def test_precision_flags_choose_the_weights_and_cache_of_the_forward_passes():
    """python -m mie.bench --dtype bfloat16 --quantization int8 --kv-cache-dtype float16."""
    precision = {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "float16"}
    result = throughput.measure(TINY_QWEN2, quick=True, seed=3, backend=None, modes=(), **precision)
    # int8 from bfloat16 values: a byte per weight and a float16 scale per 32 (see check_modes)
    matrices = 256 * 32 + 2 * (64 * 32 + 32 * 32 + 128 * 32 + 32 * 64)
    assert result["weight_bytes"] == matrices * 34 // 32 + 4 * (2 * 128 + 32)
    assert (
        result["mixed_workload"]["mie"]["useful_tokens"]
        == result["mixed_workload"]["useful_output_tokens"]
    )
    text = throughput.report(dict(result, model="tiny"))
    assert "weights int8 from bfloat16 (28.75 KiB), KV cache float16" in text.splitlines()[0]
    assert "Per weight format" not in text


def check_modes(rows):
    """The per-format rows of the tiny model: every mode measured, its weight bytes counted by
    hand, ratios to the float32 row."""
    assert [row["mode"] for row in rows] == [mode[0] for mode in throughput.MODES]
    # Tiny Qwen2, tied embeddings: matrices embed 256x32, per layer qkv 64x32, o 32x32,
    # gate_up 128x32, down 32x64 (2 layers); vectors: per layer two norms of 32 and a qkv
    # bias of 64, a final norm of 32. int8: a float16 scale per 32 inputs of each row.
    matrices = 256 * 32 + 2 * (64 * 32 + 32 * 32 + 128 * 32 + 32 * 64)
    vectors = 2 * (32 + 32 + 64) + 32
    expected = {
        "float32": 4 * matrices,
        "bfloat16": 2 * matrices,
        "float16": 2 * matrices,
        "int8": matrices * 34 // 32,  # Q8_0's 34 bytes per 32 weights
        # int4: Q4_0's 18 bytes per 32 weights, the embedding int8
        "int4": (matrices - 256 * 32) * 18 // 32 + 256 * 32 * 34 // 32,
    }
    for row in rows:
        assert row["weight_bytes"] == expected[row["mode"].split(",")[0]] + 4 * vectors
        for key in ("prefill", *(f"decode_{b}" for b in throughput.BATCHES)):
            assert row[key] > 0
            assert row["ratio"][key] == row[key] / rows[0][key]
        assert 10 < row["peak_rss_mib"] < 4096
    assert all(value == 1 for value in rows[0]["ratio"].values())
    kv = [row["kv_cache_dtype"] for row in rows]
    assert kv == ["auto"] * 5 + ["bfloat16"] * 2


def test_best_of_rounds_keeps_each_modes_fastest_figures_and_largest_peak():
    def run(mode, tokens_per_s, rss):
        return {
            "mode": mode,
            "prefill": tokens_per_s,
            "decode_1": tokens_per_s / 10,
            "decode_8": tokens_per_s / 2,
            "decode_32": 7.0,
            "peak_rss_mib": rss,
        }

    first = [run("float32", 100.0, 2000.0), run("int8", 300.0, 700.0)]
    second = [run("float32", 200.0, 1900.0), run("int8", 250.0, 710.0)]
    for load, row in zip((2.5, 3.0, 7.5, 2.0), first + second, strict=True):
        row["load_average"] = load
    best = throughput.best_of([first, second])
    assert [row["mode"] for row in best] == ["float32", "int8"]
    assert [row["prefill"] for row in best] == [200.0, 300.0]
    assert [row["decode_1"] for row in best] == [20.0, 30.0]
    assert [row["peak_rss_mib"] for row in best] == [2000.0, 710.0]
    assert [row["rounds"] for row in best] == [2, 2]
    assert [row["load_averages"] for row in best] == [[2.5, 7.5], [3.0, 2.0]]
    assert "; load average 2.0-7.5 at the runs' ends" in throughput.load_note(best)


def test_targets_say_by_how_much_they_are_missed():
    ratio = {"prefill": 0.95, "decode_1": 1.5, "decode_8": 0.9, "decode_32": 0.85}
    rows = [{"mode": "float32"}, {"mode": "bfloat16", "ratio": ratio}]
    lines = throughput.target_lines(rows)
    assert "- bfloat16 batch-1 decode: 1.50x float32, target >= 1.7x: MISSED by 0.20x" in lines
    assert "- bfloat16 batch-8 decode: 0.90x float32, target >= 0.9x: met" in lines
    assert "- bfloat16 batch-32 decode: 0.85x float32, target >= 0.9x: MISSED by 0.05x" in lines
    assert "- bfloat16 prefill: 0.95x float32, target >= 0.9x: met" in lines
    assert len(lines) == 4  # no row for int8 or float16: their targets are left out


def test_mixed_workload_ranges_and_reproducibility():
    prompts, outputs = throughput.mixed_workload(200, 0, 1000, quick=False)
    assert all(32 <= len(p) <= 256 for p in prompts) and all(16 <= n <= 128 for n in outputs)
    assert (prompts, outputs) == throughput.mixed_workload(200, 0, 1000, quick=False)


def test_flops_per_token_by_hand():
    config = throughput.ModelConfig.from_hf(TINY_QWEN2)
    # Multiply-adds per token and layer: q 32x32, k and v 32x16 each, o 32x32, gate/up/down
    # 3 x 32x64 = 9216; LM head 256x32 = 8192. Attention at context 10: 4 heads of 8 dims,
    # scores + weighted sum = 2 x 4 x 8 x 10 = 640 per layer. FLOPs = 2 x multiply-adds:
    # 2 x (2 x 9216 + 8192 + 2 x 640) = 55808.
    assert throughput.flops_per_token(config, 10) == 55808
    assert throughput.flops_per_token(config, 10, lm_head=False) == 55808 - 2 * 8192
    # A 3-token prompt: attention sees 1, 2, 3 positions (mean 2); one LM head row.
    body = 3 * (2 * (2 * 9216) + 2 * 2 * (2 * 4 * 8 * 2))
    assert throughput.prefill_flops(config, 3) == body + 2 * 8192


def test_hf_baseline_is_available_in_the_test_environment():
    require_module("torch")
    require_module("transformers")
    assert hf_baseline.available()


def test_hf_baseline_prints_no_warning_into_the_report(capfd):
    """transformers' deprecation notices (``torch_dtype``) went to stderr in the middle of the
    benchmark report: the baseline uses the current spelling, so nothing is printed."""
    require_module("torch")
    require_module("transformers")
    tiny = {
        "model_type": "llama",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 64,
    }
    model = hf_baseline.build_model(tiny, seed=0)
    hf_baseline.generate_static(model, [[1, 2, 3], [4, 5]], [2, 3], batch_size=2)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_report_is_an_aligned_text_table_like_the_other_sections():
    """No Markdown (pipes, '##'): the forward-pass rows line up under their headers."""
    from test_bench import columns_align

    forward = [
        {
            "batch": b,
            "prefill_tokens_per_s": 250.0 + b,
            "prefill_gflops": 190.0,
            "decode_tokens_per_s": 10.0 * b,
            "decode_step_ms": 1000.0 / b,
            "decode_gflops": 3.0 * b,
        }
        for b in (1, 8, 32)
    ]
    workload = {
        "requests": 4,
        "prompt_tokens": 1234,
        "useful_output_tokens": 99,
        "batch_size": 2,
        "mie": {"useful_tokens_per_s": 5.0, "seconds": 19.8},
        "transformers_static": None,
    }
    modes = [
        {
            "mode": name,
            "weight_bytes": 2**30 // scale,
            "peak_rss_mib": 3000.0 / scale,
            "prefill": 250.0,
            "decode_1": 10.0 * scale,
            "decode_8": 60.0,
            "decode_32": 120.0,
        }
        for name, scale in (("float32", 1), ("bfloat16", 2), ("int8, KV bfloat16", 4))
    ]
    text = throughput.report(
        {
            "model": "tiny",
            "backend": "python",
            "gemm_gflops": {"M=1": 3.0},
            "forward": forward,
            "mixed_workload": workload,
            "peak_rss_mib_mie": 100.0,
            "dtype": "float32",
            "quantization": None,
            "kv_cache_dtype": "auto",
            "weight_bytes": 2**30,
            "modes": throughput.with_ratios(modes),
        }
    )
    assert "|" not in text and "#" not in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("batch "))
    table = lines[start : start + 5]
    assert table[0].split() == [
        "batch",
        "prefill",
        "tok/s",
        "prefill",
        "GFLOP/s",
        "decode",
        "tok/s",
        "decode",
        "step",
        "ms",
        "decode",
        "GFLOP/s",
    ]
    assert [row.split()[0] for row in table[2:]] == ["1", "8", "32"]
    assert table[4].split()[1:] == ["282.0", "190", "320.0", "31.2", "96"]
    assert columns_align(table)
    assert "1,234 prompt tokens" in text
    assert "weights float32 (1.00 GiB), KV cache float32" in lines[0]
    start = next(i for i, line in enumerate(lines) if line.startswith("weights "))
    table = lines[start : start + 5]
    assert columns_align(table)
    assert [row.split("  ")[0] for row in table[2:]] == ["float32", "bfloat16", "int8, KV bfloat16"]
    cells = [cell.strip() for cell in table[4].split("  ") if cell.strip()]
    assert cells[1:] == [
        "256.00 MiB (0.25x)",
        "750 MiB (0.25x)",
        "250.0 (1.00x)",
        "40.0 (4.00x)",
        "60.0 (1.00x)",
        "120.0 (1.00x)",
    ]
    assert "- bfloat16 batch-1 decode: 2.00x float32, target >= 1.7x: met" in lines


def test_decode_breakdown_times_every_matrix_product_of_the_model():
    from mie.backend import select

    backend = select("python")
    config = throughput.ModelConfig.from_hf(TINY_QWEN2)
    model = throughput.Model.random(config, 0, backend.kernels, dtype="bfloat16")
    result = throughput.decode_breakdown(model, backend, steps=2, rounds=3)
    products = result["products"]
    assert list(products) == ["qkv", "o", "gate_up", "down", "lm_head"]
    # bfloat16: 2 bytes a weight; 2 layers of qkv 64x32, o 32x32, gate_up 128x32, down 32x64
    assert [p["bytes"] for p in products.values()] == [
        2 * 2 * 64 * 32,
        2 * 2 * 32 * 32,
        2 * 2 * 128 * 32,
        2 * 2 * 32 * 64,
        2 * 256 * 32,
    ]
    assert result["matmul_ms"] == pytest.approx(sum(p["ms"] for p in products.values()))
    assert result["rest_ms"] == pytest.approx(result["step_ms"] - result["matmul_ms"])
    # the roofline: the weights' bytes at the read bandwidth measured in the same round
    low, high = result["read_range_gb_s"]
    assert 0 < low <= result["read_gb_s"] <= high
    low, high = result["step_over_roofline_range"]
    assert low <= result["step_over_roofline"] <= high
    low, high = result["products_of_read_range"]
    assert low <= result["products_of_read"] <= high
    assert low <= result["products_of_read_median"] <= high
    assert result["roofline_ms"] == pytest.approx(model.weights.nbytes / result["read_gb_s"] / 1e6)
    assert result["step_over_roofline"] == pytest.approx(result["step_ms"] / result["roofline_ms"])
    assert result["products_of_read"] == pytest.approx(
        sum(p["bytes"] for p in products.values()) / result["matmul_ms"] / 1e6 / result["read_gb_s"]
    )
    text = throughput.breakdown_report({"bfloat16": result})
    assert text.splitlines()[1].split()[:3] == ["weights", "step", "ms"]


def test_decode_breakdown_reports_the_round_with_the_median_step_over_roofline(monkeypatch):
    """Each round is one moment (its read, step and products); the row is the median round's,
    every figure from that round, with the ranges over all of them."""
    from mie.backend import select

    backend = select("python")
    config = throughput.ModelConfig.from_hf(TINY_QWEN2)
    model = throughput.Model.random(config, 0, backend.kernels, dtype="bfloat16")
    # rounds' (read GB/s, step ms): step / roofline is step * read / bytes, so the middle
    # one by that ratio (30, 40, 50 over the bytes) is the second round, whose step and
    # read are neither the middle step nor the middle read
    rounds = iter([(10.0, 3.0), (40.0, 1.0), (20.0, 2.5)])
    moments = []

    def read_bandwidth(backend, words, repeats):
        moments.append(next(rounds))
        return moments[-1][0]

    def decode_step_time(model, backend, batch, steps, kv_cache_dtype):
        return moments[-1][1] / 1e3

    monkeypatch.setattr(throughput, "read_bandwidth", read_bandwidth)
    monkeypatch.setattr(throughput, "decode_step_time", decode_step_time)
    monkeypatch.setattr(throughput, "probe_words", lambda: None)
    # every kind of product takes 1 ms: the products' ratio to the read is then highest in
    # the slowest read's round, and its median is the third round's (read 20)
    monkeypatch.setattr(throughput, "median_time", lambda work, repeats: 1e-3)
    result = throughput.decode_breakdown(model, backend, steps=3, rounds=3)
    nbytes = model.weights.nbytes
    product_bytes = sum(p["bytes"] for p in result["products"].values())
    assert result["matmul_ms"] == pytest.approx(5.0)
    assert result["products_of_read"] == pytest.approx(product_bytes / 5e6 / 40.0)
    assert result["products_of_read_median"] == pytest.approx(product_bytes / 5e6 / 20.0)
    assert (result["read_gb_s"], result["step_ms"]) == (40.0, 1.0)
    assert result["step_over_roofline"] == pytest.approx(40.0 / (nbytes / 1e6))
    assert result["read_range_gb_s"] == [10.0, 40.0]
    assert result["step_over_roofline_range"] == pytest.approx(
        [30.0 / (nbytes / 1e6), 50.0 / (nbytes / 1e6)]
    )
    assert result["rest_ms"] == pytest.approx(1.0 - result["matmul_ms"])


def test_breakdown_report_judges_the_issues_batch1_targets():
    """Products at >= 75% of the measured read bandwidth, the step within 1.3x its roofline:
    each verdict from the row's own figures, met or missed by how much."""
    products = {"qkv": {"ms": 1.0, "bytes": 30e6, "gb_s": 30.0}}
    row = {
        "step_ms": 14.0,
        "matmul_ms": 1.0,
        "matmul_gb_s": 30.0,
        "rest_ms": 13.0,
        "read_gb_s": 50.0,
        "read_range_gb_s": [45.0, 52.0],
        "roofline_ms": 10.0,
        "products_of_read": 0.6,
        "products_of_read_range": [0.55, 0.7],
        "products_of_read_median": 0.65,
        "step_over_roofline": 1.4,
        "step_over_roofline_range": [1.25, 1.5],
        "products": products,
    }
    good = dict(row, products_of_read_median=0.8, step_over_roofline=1.2)
    near = dict(row, products_of_read_median=0.748, step_over_roofline=1.302)
    rows = {"int8": row, "int4": good, "float16": near}
    lines = throughput.breakdown_report(rows).splitlines()
    # the products' verdict is the rounds' median, not the median-step round's own 60%
    assert (
        "- int8: products at 65% of the read bandwidth (the rounds' median; rounds 55%-70%), "
        "target >= 75%: MISSED by 10%; step 1.40x its roofline (rounds 1.25-1.50x), "
        "target <= 1.3x: MISSED by 0.10x" in lines
    )
    assert (
        "- int4: products at 80% of the read bandwidth (the rounds' median; rounds 55%-70%), "
        "target >= 75%: met; step 1.20x its roofline (rounds 1.25-1.50x), target <= 1.3x: "
        "met" in lines
    )
    # a miss that rounds to nothing is not printed as "by 0.00x"
    assert (
        "- float16: products at 75% of the read bandwidth (the rounds' median; rounds "
        "55%-70%), target >= 75%: MISSED by less than 1%; step 1.30x its roofline (rounds "
        "1.25-1.50x), target <= 1.3x: MISSED by less than 0.01x" in lines
    )
    row_text = lines[3]  # int8's
    assert "50 (45-52)" in row_text and "60%; 55%-70%" in row_text
    assert "1.40x (1.25-1.50)" in row_text


def test_a_mode_in_its_own_process_reports_one_line_of_json(capsys):
    """What ``measure_mode`` runs in the subprocess: ``--child REQUEST`` prints the row."""
    import json

    mode = ("int8, KV bfloat16", "float32", "int8", "bfloat16")
    request = {
        "hf_config": TINY_QWEN2,
        "mode": list(mode),
        "quick": True,
        "seed": 1,
        "backend": "python",
    }
    assert throughput.main(["--child", json.dumps(request)]) == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert (row["mode"], row["quantization"], row["kv_cache_dtype"]) == (
        mode[0],
        "int8",
        "bfloat16",
    )
    assert row["backend"] == "python" and row["decode_32"] > 0
