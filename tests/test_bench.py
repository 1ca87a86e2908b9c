"""``python -m mie.bench``: reproducible JSON, the mechanisms' claims, the CLI, the progress bar."""

import io
import json
import re
import sys
import time

import numpy as np
import pytest
from conftest import require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import progress
from mie.backend import select
from mie.bench import __main__ as bench
from mie.bench import mechanisms
from mie.bench.simulate import simulate
from mie.bench.workload import EOS, MAX_TOKENS_CAPS, WorkloadRequest, mixed_requests, spread_out
from mie.extension import BackendUnavailableError
from mie.memory import BlockPool
from mie.progress import ProgressBar
from mie.scheduler import Scheduler


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
    """The quick mechanisms run, twice with seed 0 and once with seed 1 (raw JSON text)."""
    folder = tmp_path_factory.mktemp("bench")
    texts = []
    for i, seed in enumerate((0, 0, 1)):
        path = folder / f"run{i}.json"
        argv = ["--quick", "--only", "mechanisms", "--seed", str(seed), "--json", str(path)]
        assert bench.main(argv) == 0
        texts.append(path.read_text())
    return texts


def test_same_seed_same_json(quick_json):
    first, again, other_seed = quick_json
    assert first == again
    assert first != other_seed


def test_json_has_the_promised_fields_and_the_mechanisms_show(quick_json):
    data = json.loads(quick_json[0])
    cvs = data["continuous_vs_static"]
    for name in ("continuous", "static"):
        assert {"steps", "tokens_per_step", "latency_p50", "latency_p99"} <= set(cvs[name])
    assert cvs["continuous"]["steps"] < cvs["static"]["steps"]
    assert cvs["continuous"]["latency_p50"] < cvs["static"]["latency_p50"]

    pvc = data["paged_vs_contiguous"]
    for name in ("paged", "contiguous"):
        assert {"reserved_bytes", "used_bytes", "waste_pct", "max_concurrent"} <= set(pvc[name])
        assert pvc[name]["used_bytes"] <= pvc[name]["reserved_bytes"] <= pvc["budget_bytes"]
    assert pvc["paged"]["waste_pct"] < pvc["contiguous"]["waste_pct"]
    assert pvc["paged"]["max_concurrent"] > pvc["contiguous"]["max_concurrent"]

    concurrent = data["prefix_sharing"]["concurrent"]
    assert concurrent["blocks_with"] < concurrent["blocks_without"]
    assert concurrent["saved_fraction"] == round(
        1 - concurrent["blocks_with"] / concurrent["blocks_without"], 4
    )
    spread = data["prefix_sharing"]["spread"]
    assert spread["running_only_saved_fraction"] < spread["prefix_cache_saved_fraction"]

    sweep = data["memory_pressure"]
    num_requests = data["workload"]["num_requests"]
    for point in sweep:
        assert {
            "num_blocks",
            "completed",
            "rejected",
            "preemptions",
            "recomputed_tokens",
            "steps",
        } <= set(point)
        assert point["completed"] + point["rejected"] == num_requests  # no crash, no loss
    assert [p["num_blocks"] for p in sweep] == sorted(
        (p["num_blocks"] for p in sweep), reverse=True
    )
    assert sweep[0]["preemptions"] == 0 and max(p["preemptions"] for p in sweep) > 0
    assert all(p["rejected"] == 0 for p in sweep[:-1])  # down to the floor, all run ...
    assert sweep[-1]["rejected"] >= 1  # ... and one block below it, the longest is refused
    assert (
        sweep[-2]["num_blocks"] == data["workload"]["floor_blocks"] == sweep[-1]["num_blocks"] + 1
    )


def test_chunked_prefill_mechanism_bounds_the_step_and_loses_no_token(quick_json):
    data = json.loads(quick_json[0])["chunked_prefill"]
    requests = mechanisms.long_prompt_requests(0, mechanisms.ChunkedConfig.for_args(True))
    longest = max(len(r.prompt) for r in requests)
    assert 1000 <= min(len(r.prompt) for r in requests[-data["num_long_prompts"] :])
    whole, chunked = data["whole"], data["chunked"]
    for run in (whole, chunked):
        assert {
            "steps",
            "max_step_tokens",
            "stall_p50",
            "stall_p99",
            "stall_max",
            "ttft_tokens_p50",
            "ttft_tokens_p99",
            "ttft_steps_p50",
            "ttft_steps_p99",
        } <= set(run)
        assert run["completed"] == len(requests)  # every request ran to its end ...
        assert run["output_tokens"] == sum(r.output_len for r in requests)  # ... and no further
        assert run["stall_p50"] <= run["stall_p99"] <= run["stall_max"] <= run["max_step_tokens"]
        assert run["preemptions"] == 0
    assert chunked["max_num_batched_tokens"] == 512
    assert chunked["max_step_tokens"] <= 512 and chunked["stall_max"] <= 512
    assert whole["max_step_tokens"] >= longest  # a long prompt computed in one step
    assert whole["stall_max"] >= longest  # ... and a running stream waited through all of it
    assert data["stall_p99_ratio"] == round(whole["stall_p99"] / chunked["stall_p99"], 2)
    assert data["stall_p99_ratio"] >= 4  # the target, even on the quick workload
    assert abs(chunked["steps"] / whole["steps"] - 1) <= 0.1


def test_report_is_printed(capsys):
    assert bench.main(["--only", "mechanisms", "--quick"]) == 0
    out = capsys.readouterr()
    for title in (
        "Continuous vs static",
        "Paged vs contiguous",
        "Prefix sharing",
        "Memory pressure",
        "request too long",
    ):
        assert title in out.out
    assert "mechanisms:" in out.err  # the progress bar's line


def test_first_line_names_the_backend_and_the_cpu(capsys, monkeypatch):
    monkeypatch.delenv("MIE_BACKEND", raising=False)
    assert bench.main(["--only", "mechanisms", "--quick"]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    name = select().name
    assert first.startswith(f"mie.bench: backend {name} (") and "the best built" in first
    assert bench.cpu_description() in first and f"NumPy {np.__version__}" in first
    if name == "fast":
        assert "Cython" in first and second == ""
    else:  # the reason the fast backend is missing, on the next line
        assert second.startswith("note: the fast backend is unavailable: ")


def test_asking_for_the_python_backend_names_it_and_how(capsys):
    assert bench.main(["--only", "mechanisms", "--quick", "--backend", "python"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("mie.bench: backend python (pure-Python reference; --backend) on ")


def test_fast_backend_unavailable_is_one_error_line_with_the_reason(capsys, monkeypatch):
    def unavailable(name=None):
        raise BackendUnavailableError("the fast backend was asked for, but REASON")

    monkeypatch.setattr(bench, "select", unavailable)
    assert bench.main(["--only", "mechanisms", "--quick", "--backend", "fast"]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing ran
    assert out.err == "python -m mie.bench: error: the fast backend was asked for, but REASON\n"


def test_unknown_backend_in_the_environment_is_an_error_line(capsys, monkeypatch):
    monkeypatch.setenv("MIE_BACKEND", "gpu")
    assert bench.main(["--only", "mechanisms", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m mie.bench: error: ") and "MIE_BACKEND" in err


X86_AVX2 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma

processor\t: 1
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu sse sse2 avx avx2 avx512f
"""
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes crc32\n"


@pytest.mark.parametrize(
    "cpuinfo, model, simd",
    [
        (X86_AVX2, "Intel(R) Xeon(R) CPU @ 2.20GHz", "AVX2"),  # the first processor's flags
        (X86_AVX2.replace("avx2 fma", "fma").replace(" avx ", " "), None, "SSE4.2"),
        ("model name: AMD EPYC\nflags: sse2 avx avx2 avx512f avx512bw\n", "AMD EPYC", "AVX-512"),
        (ARM, None, "NEON"),
        ("Features: fp asimd sve\n", None, "SVE"),
        ("", None, "SIMD level unknown"),
        ("garbage without colons\n\x00\n", None, "SIMD level unknown"),
    ],
)
def test_cpu_description_reads_the_model_and_the_widest_simd_level(cpuinfo, model, simd):
    text = bench.cpu_description(cpuinfo)
    name, cores, level = text.rsplit(", ", 2)
    assert level == simd and cores.endswith(" cores") and int(cores.split()[0]) >= 1
    if model:
        assert name == model
    else:
        assert name  # from platform, never empty


def test_plot_without_matplotlib_is_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.main(["--quick", "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "matplotlib" in err and "mie[plot]" in err


def test_plot_writes_pngs(tmp_path):
    require_module("matplotlib")
    assert bench.main(["--only", "mechanisms", "--quick", "--plot", str(tmp_path)]) == 0
    for name in (
        "utilization.png",
        "preemptions.png",
        "memory_pressure.png",
        "chunked_prefill.png",
    ):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--only", "nonsense"])
    assert exc.value.code == 2


# -- the workload and the simulation ---------------------------------------------------------
def test_workload_follows_its_documented_distributions():
    requests = mixed_requests(3, 400)
    assert requests == mixed_requests(3, 400)
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.output_len for r in requests]
    assert 8 <= min(prompts) and max(prompts) <= 1536
    assert 4 <= min(outputs) and max(outputs) <= 768
    assert 0.2 < sum(p > 512 for p in prompts) / len(prompts) < 0.4  # ~30 % long
    for r in requests:
        assert r.max_tokens in MAX_TOKENS_CAPS and r.output_len <= r.max_tokens
        assert EOS not in r.prompt


def test_null_model_runs_each_request_to_its_length_and_latencies_count_steps():
    requests = [
        WorkloadRequest((1, 2, 3), 4, 8),
        WorkloadRequest((4, 5), 1, 8),
        WorkloadRequest((6,), 3, 8, arrival=50),
    ]
    sched = Scheduler(BlockPool(16, 1), 4, 2, 16)
    result = simulate(sched, requests, record_tokens=True)
    assert result.completed == 3 and result.output_tokens == 4 + 1 + 3
    # 4 steps for the first two together, then the clock jumps to step 50 for the third
    assert result.steps == 4 + 3
    assert sorted(result.latencies) == [1, 3, 4] and result.queueing == [0, 0, 0]


def _hand_run(chunked: bool):
    """A: 2-token prompt, 3 tokens out, at step 0; B: 6-token prompt, 1 token out, at step 1;
    two sequences, blocks of 4."""
    requests = [WorkloadRequest((1, 2), 3, 3), WorkloadRequest((3, 4, 5, 6, 7, 8), 1, 1, arrival=1)]
    budget = 4 if chunked else 8
    sched = Scheduler(BlockPool(16, 1), 4, 2, budget, enable_chunked_prefill=chunked)
    return simulate(sched, requests, record_tokens=True)


def test_chunked_null_model_answers_only_sampling_entries_and_counts_stalls_in_tokens():
    result = _hand_run(chunked=True)
    # step 0: A's prompt (2), A samples. step 1: A decodes (1), B's first chunk (3): only A
    # samples. step 2: A decodes (1), B's last 3 prompt tokens: both sample, both finish.
    assert result.step_tokens() == [2, 4, 4]
    assert result.completed == 2 and result.output_tokens == 3 + 1
    assert result.token_steps == {0: [0, 1, 2], 1: [2]}
    assert result.stalls() == [4, 4]  # A waits one step of 4 tokens, twice
    assert result.ttft_steps() == [1, 2] and result.ttft_tokens() == [2, 8]


def test_whole_null_model_stalls_the_running_request_for_the_whole_prompt():
    result = _hand_run(chunked=False)
    # step 0: A's prompt (2). step 1: A decodes (1) and B's whole prompt (6). step 2: A (1).
    assert result.step_tokens() == [2, 7, 1]
    assert result.output_tokens == 3 + 1 and result.token_steps == {0: [0, 1, 2], 1: [1]}
    assert result.stalls() == [7, 1]
    assert result.ttft_steps() == [1, 1] and result.ttft_tokens() == [2, 7]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 8), st.integers(0, 12)),
        min_size=1,
        max_size=6,
    ),
    max_num_seqs=st.integers(1, 4),
    extra_budget=st.integers(0, 50),
    chunked=st.booleans(),
)
def test_null_model_runs_every_request_to_its_length_in_either_mode(
    lengths, max_num_seqs, extra_budget, chunked
):
    requests = [
        WorkloadRequest(tuple(range(1 + i, 1 + i + p)), out, out, arrival)
        for i, (p, out, arrival) in enumerate(lengths)
    ]
    longest = max(r.max_kv_tokens for r in requests)
    budget = max_num_seqs + extra_budget if chunked else max(longest, max_num_seqs) + extra_budget
    sched = Scheduler(
        BlockPool(64, 1),
        4,
        max_num_seqs,
        budget,
        prefix_sharing=False,
        enable_chunked_prefill=chunked,
    )
    result = simulate(sched, requests, record_tokens=True)
    assert result.completed == len(requests) and not result.rejections
    assert result.output_tokens == sum(r.output_len for r in requests)
    assert max(result.step_tokens()) <= budget
    assert sum(result.step_tokens()) >= sum(len(r.prompt) + r.output_len - 1 for r in requests)
    for seq_id, steps in result.token_steps.items():
        assert len(steps) == result.requests[seq_id].output_len
        assert steps == sorted(set(steps))  # one token per step at most
    assert len(result.stalls()) == sum(r.output_len - 1 for r in requests)
    assert all(s >= 1 for s in result.stalls())
    for seq_id, ttft in zip(result.token_steps, result.ttft_tokens(), strict=True):
        assert ttft >= len(result.requests[seq_id].prompt)  # its prompt came first


def test_spread_arrivals_are_increasing_and_seeded():
    requests = mixed_requests(0, 20)
    spread = spread_out(requests, 0, 100.0)
    arrivals = [r.arrival for r in spread]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert spread == spread_out(requests, 0, 100.0)


# -- the progress bar ------------------------------------------------------------------------
def test_progress_bar_off_a_terminal_shows_progress_as_it_goes(monkeypatch):
    """A file or a pipe gets a line at the start, one per interval as work completes (not per
    update), and the last one at the end: long work shows it is alive wherever output goes."""
    monkeypatch.setattr(progress, "OFF_TERMINAL_INTERVAL_S", 0.2)
    out = io.StringIO()
    with ProgressBar(40, "work", file=out) as bar:
        assert "work:   0%" in out.getvalue()  # before any work completes
        for _ in range(4):
            time.sleep(0.25)  # more than the interval: each completion is shown
            bar.update(10)
        shown = out.getvalue()
        for n in (10, 20, 30):
            assert f"| {n}/40 " in shown
    assert out.getvalue().endswith("\n") and "| 40/40 " in out.getvalue()
    quiet = io.StringIO()
    with ProgressBar(1000, "fast", file=quiet) as bar:
        for _ in range(1000):
            bar.update()
    assert quiet.getvalue().count("\r") <= 3  # the start, perhaps one interval, the end


def test_progress_bar_on_a_terminal_redraws_in_place():
    out = io.StringIO()
    with ProgressBar(2, "a long description", file=out, live=True) as bar:
        bar.update(1, desc="x")
    text = out.getvalue()
    assert "\n" not in text[:-1] and text.endswith("\n")  # one line, redrawn with \r
    assert text.startswith("\ra long description:   0%") and "\rx:  50%" in text


def test_progress_bar_rejects_bad_totals():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            ProgressBar(bad, file=io.StringIO())


# -- what a newcomer reads --------------------------------------------------------------------


def columns_align(lines: list[str]) -> bool:
    """An aligned text table: under a header, a rule of dash groups, and every cell of every
    row ends where its rule group ends (the first column starts at the left edge instead)."""
    rule = next(line for line in lines if line and set(line) <= {"-", " "})
    ends = [m.end() for m in re.finditer(r"-+", rule)][1:]
    rows = [line for line in lines if line and line != rule]
    return all(
        len(row) <= len(rule)
        and all(k == len(row) or row[k] == " " for k in ends[:-1])
        and all(row[k - 1] != " " for k in ends if k <= len(row))
        for row in rows
    )


def test_prefill_saved_is_a_percentage_in_print_as_in_the_takeaways(capsys, tmp_path):
    path = tmp_path / "m.json"
    assert bench.main(["--only", "mechanisms", "--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    sharing = json.loads(path.read_text())["prefix_sharing"]
    for k, when in enumerate(("concurrent", "spread")):  # the all-at-once table comes first
        for name, run in sharing[when]["runs"].items():
            rows = [line for line in out.splitlines() if line.startswith(name + "  ")]
            row = rows[k if name != "no sharing" else 0]
            assert f" {100 * run['prefill_saved']:.1f}%" in row, (row, run)
    saved = sharing["concurrent"]["saved_fraction"]
    assert f"-> sharing saves {100 * saved:.1f}% of the peak blocks." in out
    assert not re.search(r"prefill saved.*\n.*\n\S.*\s0\.\d\d\s", out)  # no bare fractions


def test_results_are_said_to_be_printed_only_without_json(capsys, tmp_path):
    assert bench.main(["--only", "mechanisms", "--quick"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "(results printed only: --json PATH also writes them to a file)"
    )
    path = tmp_path / "out.json"
    assert bench.main(["--only", "mechanisms", "--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"wrote {path}" and "printed only" not in out


def test_help_is_plain_text_and_says_json_is_needed_to_keep_results(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out
    assert not re.search(r"``|\*\*|:\w+:`|^\.\. ", text, re.MULTILINE)  # no reST markup
    assert "Results are printed only; --json PATH also writes them to a file." in text
    assert "workload seed (default: 0)" in text


# -- 6. sharing among a request's sequences ------------------------------------------------------


def test_sampling_sharing_figures_are_consistent_and_sharing_saves(quick_json):
    data = json.loads(quick_json[0])["sampling_sharing"]
    runs = {name: run for name, run in data.items() if isinstance(run, dict) and "steps" in run}
    assert set(runs) == {
        "parallel sampling, n=4",
        "parallel sampling, n=8",
        "beam search, width=4",
        "beam search, width=8",
    }
    for run in runs.values():
        for kind in ("peak", "mean"):
            shared, alone = run[f"{kind}_blocks_shared"], run[f"{kind}_blocks_independent"]
            assert 0 < shared < alone
            assert run[f"{kind}_saved_fraction"] == round(1 - shared / alone, 4)
    assert data["paper_saved_fraction"] == {
        "parallel_sampling": [0.06, 0.1],
        "beam_search": [0.37, 0.55],
    }


def held_blocks(pool):
    return pool.num_blocks - pool.num_free


@settings(max_examples=60, deadline=None)
@given(
    prompt_len=st.integers(1, 70),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
)
def test_parallel_samples_hold_the_prompt_once_and_their_own_blocks_after_it(prompt_len, lengths):
    """n samples forked from a prompt of p tokens hold, after step s, the prompt's p // 16 full
    blocks once, and each live sample the blocks from there to its p + s tokens: the partly
    filled prompt block is split by copy-on-write at each sample's first token."""
    pool = BlockPool(len(lengths) * 8 + 8, 1)
    family = mechanisms._Family(pool, prompt_len)
    full = prompt_len // 16
    for step, pairs in enumerate(mechanisms._parallel_sampling(family, lengths), start=1):
        live = dict(pairs)
        assert sorted(live) == [i for i, n in enumerate(lengths) if n >= step]
        assert all(kv.num_tokens == prompt_len + step for kv in live.values())
        own = -(-(prompt_len + step) // 16) - full
        assert held_blocks(pool) == full + len(live) * own
    assert held_blocks(pool) == 0


@settings(max_examples=40, deadline=None)
@given(
    prompt_len=st.integers(1, 40),
    output_len=st.integers(1, 40),
    width=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_beams_hold_each_distinct_full_block_once_and_their_own_last_block(
    prompt_len, output_len, width, seed
):
    """After every step of a beam search, the pool holds one block per distinct token prefix
    ending a full block that no beam writes any more (beams with the same prefix share it),
    plus each beam's own last block (written this step)."""
    rng = np.random.default_rng(seed)
    prompt = tuple(int(t) for t in rng.integers(100, 200, prompt_len))
    request = WorkloadRequest(prompt, output_len, output_len)
    pool = BlockPool(width * (-(-(prompt_len + output_len) // 16) + 1) + 1, 1)
    family = mechanisms._Family(pool, prompt_len)
    steps = 0
    for steps, live in enumerate(mechanisms._beam_search(family, request, width, rng), start=1):
        tokens = [prompt + tuple(generated) for generated, _ in live]
        assert len(set(tokens)) == len(live) <= width  # distinct beams
        assert all(len(t) == prompt_len + steps for t in tokens)
        assert [kv.num_tokens for _, kv in live] == [len(t) for t in tokens]
        full = {t[: (j + 1) * 16] for t in tokens for j in range((len(t) - 1) // 16)}
        assert held_blocks(pool) == len(full) + len(live)
    assert steps == output_len - 1  # the last step finishes every beam: none is left running
    assert held_blocks(pool) == 0


def test_sliding_window_mechanism_holds_one_window_per_sequence(quick_json):
    """Benchmark 7 against formulas: full attention peaks at the whole context's blocks, the
    window at the blocks ``window`` positions can span (``window_blocks``); the fixed pool
    fits ``pool // peak`` of each, and every request of the crowd completes."""
    from mie.scheduler.scheduler import window_blocks

    data = json.loads(quick_json[0])["sliding_window"]
    window, bs = data["window"], data["block_size"]
    full, windowed = data["full"], data["windowed"]
    context = data["prompt_tokens"] + data["output_tokens"] - 1
    assert context >= 3 * window  # long generations: the window is crossed several times
    assert full["blocks_per_seq_peak"] == data["full_context_blocks"] == -(-context // bs)
    assert windowed["blocks_per_seq_peak"] == data["window_blocks_bound"]
    assert data["window_blocks_bound"] == window_blocks(window, bs) == -(-(window - 1) // bs) + 1
    for run in (full, windowed):
        assert run["seqs_fit_in_pool"] == data["pool_blocks"] // run["blocks_per_seq_peak"]
        assert run["completed"] == data["num_requests"]
        assert run["kv_bytes_per_seq_peak"] == run["blocks_per_seq_peak"] * 196_608
    assert windowed["seqs_fit_in_pool"] >= data["num_requests"] > full["seqs_fit_in_pool"]
    assert windowed["preemptions"] == 0 < full["preemptions"]
    assert windowed["mean_running"] > 2 * full["mean_running"]
    assert data["blocks_per_seq_ratio"] == round(
        full["blocks_per_seq_peak"] / windowed["blocks_per_seq_peak"], 2
    )
