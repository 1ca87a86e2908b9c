"""``python -m mie.bench --serve``: the load generator completes every request it sends."""

import argparse
import json

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
