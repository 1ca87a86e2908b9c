"""``python -m mie.bench --serve``: the load generator completes every request it sends."""

import argparse
import json

import numpy as np
import pytest
from conftest import require_module

import mie.bench.__main__ as bench_main
from mie.bench import serve
from mie.bench.section import SectionResult


def test_quick_serving_run_completes_every_request_and_reports_both_sides():
    require_module("httpx")  # the load generator's client
    require_module("mie.serve")  # the server it runs (starlette, uvicorn)
    args = argparse.Namespace(quick=True, seed=0, backend="python")
    result = serve.run(args)
    data = result.data["serve"]
    assert data["all_complete"], "every streamed request produced exactly its max_tokens"
    assert data["requests"] == serve.NUM_REQUESTS_QUICK
    assert data["output_tokens"] == sum(
        n for _, n in serve.mixed_requests(0, serve.NUM_REQUESTS_QUICK, 512, True)
    )
    for side in ("served", "offline"):
        assert data[side]["output_tokens_per_s"] > 0
    assert set(data["served"]["ttft_ms"]) == {"p50", "p90", "p99"}
    longest = max(n for _, n in serve.mixed_requests(0, serve.NUM_REQUESTS_QUICK, 512, True))
    assert data["served"]["engine_steps"] >= longest
    assert "time to first token" in result.report

    long_prompts = result.data["serve_long_prompts"]  # the long-prompt scenario ran too
    setup = serve.LONG_SETUP_QUICK
    for mode in ("whole", "chunked"):
        run = long_prompts[mode]
        assert run["complete"], "every request, streams and long prompts, got its max_tokens"
        assert run["num_gaps"] == setup.streams * setup.stream_requests * (setup.stream_tokens - 1)
        assert 0 <= run["itl_ms"]["p50"] <= run["itl_ms"]["p99"] <= run["itl_ms"]["max"]
        assert run["output_tokens_per_s"] > 0 and run["long_ttft_ms"]["max"] > 0
    assert "Long prompts while streams decode" in result.report


def test_serve_is_opt_in_and_runs_alone_with_its_flag(tmp_path, monkeypatch):
    assert "serve" not in bench_main.SECTIONS
    ran = []
    fake = lambda args: ran.append(args) or SectionResult({"serve": {"ok": 1}}, "report")  # noqa: E731
    monkeypatch.setitem(bench_main.OPT_IN, "serve", fake)
    assert bench_main.main(["--serve", "--json", str(tmp_path / "out.json")]) == 0
    assert len(ran) == 1
    assert json.loads((tmp_path / "out.json").read_text())["serve"] == {"ok": 1}


def test_same_seed_same_workload_and_rounds_share_only_lengths():
    a, b = serve.mixed_requests(3, 20, 512, False), serve.mixed_requests(3, 20, 512, False)
    assert a == b
    other_round = serve.mixed_requests(3, 20, 512, False, round_=1)
    assert [(len(p), n) for p, n in a] == [(len(p), n) for p, n in other_round]
    assert [p for p, _ in a] != [p for p, _ in other_round]


def test_random_checkpoint_loads_and_every_token_is_visible_text(tmp_path):
    require_module("tokenizers")
    from mie.engine.tokenizer import Tokenizer
    from mie.model import Model

    shape = serve.LONG_SETUP_QUICK.model
    directory = serve.write_random_checkpoint(tmp_path / "m", shape, seed=3)
    model = Model.from_pretrained(directory)
    assert model.config.hidden_size == shape["hidden_size"]
    assert model.config.num_layers == shape["num_hidden_layers"]
    assert model.config.max_position_embeddings == shape["max_position_embeddings"]
    layer = model.weights.layers[0]
    assert np.all(layer.input_norm == 1.0)
    values = layer.qkv.weight
    assert 0.015 < float(values.std()) < 0.025 and float(abs(values).max()) <= 0.02 * 3**0.5
    tokenizer = Tokenizer(directory)
    assert tokenizer.vocab_size == shape["vocab_size"]
    for token in (0, 7, shape["vocab_size"] - 1):
        assert tokenizer.decode([token]) == f"t{token}"
    assert serve._num_params(shape) == sum(
        a.size for a in (model.weights.embed.weight, model.weights.final_norm)
    ) + sum(
        w.size
        for layer in model.weights.layers
        for w in (
            layer.input_norm,
            layer.post_norm,
            layer.qkv.weight,
            layer.o.weight,
            layer.gate_up.weight,
            layer.down.weight,
        )
    )


def test_long_prompt_workload_has_the_promised_sizes_and_fresh_tokens_per_round():
    setup = serve.LONG_SETUP
    streams, longs = serve.long_prompt_workload(setup, 0, 0)
    assert len(streams) == setup.streams
    assert all(len(requests) == setup.stream_requests for requests in streams)
    assert all(n == setup.stream_tokens for requests in streams for _, n in requests)
    assert [(len(p), n) for p, n in longs] == [(2000, setup.long_output_tokens)] * 6
    assert serve.long_prompt_workload(setup, 0, 0) == (streams, longs)
    _, other_round = serve.long_prompt_workload(setup, 0, 1)
    assert [p for p, _ in other_round] != [p for p, _ in longs]


def test_long_prompt_summary_counts_every_gap_of_the_streams():
    streams = [
        {"sent": 0.0, "times": [1.0, 1.1, 1.2, 3.2], "tokens": 4, "max_tokens": 4},
        {"sent": 0.5, "times": [1.0, 1.1], "tokens": 2, "max_tokens": 2},
    ]
    longs = [{"sent": 1.5, "times": [3.2, 3.3], "tokens": 2, "max_tokens": 2}]
    summary = serve.summarize_long_prompts(
        {"seconds": 4.0, "streams": streams, "longs": longs}, prompt_tokens=92
    )
    assert summary["num_gaps"] == 4  # 3 + 1; the long prompt's own gap is not a stream's
    assert summary["itl_ms"]["max"] == pytest.approx(2000.0)  # the stall
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)
    assert summary["long_ttft_ms"] == pytest.approx({"p50": 1700.0, "max": 1700.0})
    assert summary["output_tokens_per_s"] == pytest.approx(8 / 4.0)
    assert summary["tokens_per_s"] == pytest.approx(100 / 4.0)
    assert summary["complete"]
    streams[1]["tokens"] = 1
    incomplete = serve.summarize_long_prompts(
        {"seconds": 4.0, "streams": streams, "longs": longs}, prompt_tokens=92
    )
    assert not incomplete["complete"]
