"""The mechanism benchmarks: what each mechanism buys over its naive baseline.

Step-count and memory simulations of the workload in ``mie.bench.workload`` with the null
model of ``mie.bench.simulate`` (no arithmetic, so no wall-clock time: a step is a step):

1. continuous vs static batching -- same workload, same generous pool;
2. paged vs contiguous KV -- same workload, same fixed memory budget;
3. prefix sharing -- every request behind one long system prompt: all at once (blocks with
   and without sharing), and spread out in time (running-only sharing vs the prefix cache);
4. memory pressure -- the pool swept from generous down to one block below the longest
   request: degradation through preemption, and a clear rejection below the floor;
5. chunked vs whole prefill -- streams decoding while long prompts (1,000-4,000 tokens) keep
   arriving: how long a running stream waits between two tokens, counted in the tokens the
   engine computes meanwhile (``mie.bench.simulate``), and what chunking costs in steps.
6. sharing among one request's sequences -- parallel sampling (n samples forked from the
   prompt) and beam search (mie's ``BeamSearch`` over a null model of random log-probabilities):
   blocks held with fork + copy-on-write vs the same sequences each in its own blocks.
7. sliding window -- long generations under a window: blocks held per sequence and how many
   sequences run together in a fixed pool, full attention vs blocks released out of the
   window (``mie.bench.sliding_window``).

The simulation pools hold 1 byte per block (the null model never touches KV); every byte
figure is blocks x Qwen2-0.5B's 196,608 bytes per block, or tokens x 12,288 bytes: K and V in
16 bits, as mie's engine stores them with ``kv_cache_dtype="bfloat16"`` or ``"float16"``
(its default, float32, takes twice that: 24,576 bytes per token, so a pool holds half as many
tokens per byte); the ratios between mechanisms do not depend on the size.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mie.bench.section import SectionResult
from mie.bench.simulate import RunResult, simulate
from mie.bench.sliding_window import sliding_window_memory
from mie.bench.table import fmt_bytes, percent, table
from mie.bench.workload import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    BYTES_PER_TOKEN,
    EOS,
    NUM_REQUESTS,
    NUM_REQUESTS_QUICK,
    WorkloadRequest,
    blocks_for,
    mixed_requests,
    spread_out,
    with_system_prompt,
)
from mie.engine.beam_search import BeamSearch, BeamSearchParams
from mie.engine.config import DEFAULT_CHUNK_BUDGET as CHUNK_BUDGET
from mie.engine.outputs import Logprob
from mie.memory import BlockPool
from mie.progress import ProgressBar
from mie.scheduler import ContiguousScheduler, Scheduler, StaticBatchScheduler

MAX_NUM_BATCHED_TOKENS = 4096  # covers the longest request: prompt + max_tokens - 1
SYSTEM_PROMPT_TOKENS = 768
SPREAD_GAP_FACTOR = 4  # spread arrivals: mean gap = 4 x the mean output length


@dataclass(frozen=True)
class Config:
    """Sizes of one run; ``--quick`` scales the requests, batch and budget down by 8."""

    num_requests: int
    max_num_seqs: int  # benchmarks 1, 3 and 4: the workload drains in about 4 batches
    budget_bytes: int  # benchmark 2 (no max_num_seqs cap there): memory is the limit

    @classmethod
    def for_args(cls, quick: bool) -> Config:
        if quick:
            return cls(NUM_REQUESTS_QUICK, 8, 2**27)
        return cls(NUM_REQUESTS, 64, 2**30)


def _pool(num_blocks: int) -> BlockPool:
    return BlockPool(num_blocks, 1)


def _floor(requests: list[WorkloadRequest]) -> int:
    """Blocks the longest request needs: no smaller pool can ever run it."""
    return max(blocks_for(r.max_kv_tokens) for r in requests)


def _percentiles(values: list[int], prefix: str) -> dict:
    v = np.asarray(values, dtype=float)
    return {
        f"{prefix}_mean": round(float(v.mean()), 2),
        f"{prefix}_p50": round(float(np.percentile(v, 50)), 2),
        f"{prefix}_p99": round(float(np.percentile(v, 99)), 2),
    }


class _Runs:
    """Runs simulations, ticking the progress bar, and keeps results for the plots."""

    def __init__(self, progress: ProgressBar) -> None:
        self.progress = progress
        self.results: dict[str, RunResult] = {}

    def __call__(
        self, name: str, scheduler, requests: list[WorkloadRequest], record_tokens: bool = False
    ) -> RunResult:
        self.progress.update(0, desc=f"mechanisms: {name}")
        result = simulate(scheduler, requests, record_tokens=record_tokens)
        self.results[name] = result
        self.progress.update(1)
        return result


def _rows(results: dict[str, dict], columns: list[str], formats: dict | None = None) -> list:
    """One table row per named result: its name, then ``columns`` (formatted if asked)."""
    formats = formats or {}
    return [
        [name, *(formats.get(c, lambda v: v)(d[c]) for c in columns)] for name, d in results.items()
    ]


# -- 1. continuous vs static ---------------------------------------------------------------
def continuous_vs_static(
    requests: list[WorkloadRequest], cfg: Config, runs: _Runs
) -> tuple[dict, str]:
    num_blocks = cfg.max_num_seqs * _floor(requests)  # room for max_num_seqs of the longest
    results = {}
    for name, cls in (("continuous", Scheduler), ("static", StaticBatchScheduler)):
        sched = cls(_pool(num_blocks), BLOCK_SIZE, cfg.max_num_seqs, MAX_NUM_BATCHED_TOKENS)
        r = runs(name, sched, requests)
        tokens = r.total("num_prefill_tokens") + r.total("num_decode_tokens")
        results[name] = {
            "steps": r.steps,
            "tokens_per_step": round(tokens / r.steps, 2),
            "output_tokens_per_step": round(r.output_tokens / r.steps, 2),
            "mean_running": round(r.mean("num_running"), 2),
            **_percentiles(r.latencies, "latency"),
            **_percentiles(r.queueing, "queueing"),
            "preemptions": r.total("preemptions"),
        }
    ratio = round(results["static"]["steps"] / results["continuous"]["steps"], 2)
    columns = (
        "steps tokens_per_step output_tokens_per_step latency_mean "
        "latency_p50 latency_p99 queueing_mean queueing_p50 queueing_p99"
    ).split()
    headers = [
        "",
        "steps",
        "tok/step",
        "out tok/step",
        "lat mean",
        "lat p50",
        "lat p99",
        "queue mean",
        "queue p50",
        "queue p99",
    ]
    report = [
        f"1. Continuous vs static batching: {len(requests)} requests at once, max "
        f"{cfg.max_num_seqs} sequences, pool {num_blocks:,} blocks "
        f"({fmt_bytes(num_blocks * BYTES_PER_BLOCK)}); latency and queueing in steps",
        table(headers, _rows(results, columns)),
        f"-> static batching needs {ratio}x the steps to drain.",
    ]
    data = {"num_blocks": num_blocks, "pool_bytes": num_blocks * BYTES_PER_BLOCK, **results}
    data["static_to_continuous_steps"] = ratio
    return data, "\n".join(report)


# -- 2. paged vs contiguous ----------------------------------------------------------------
def paged_vs_contiguous(
    requests: list[WorkloadRequest], cfg: Config, runs: _Runs
) -> tuple[dict, str]:
    max_num_seqs = len(requests)  # no cap: memory is the limit
    num_blocks = cfg.budget_bytes // BYTES_PER_BLOCK
    capacity = cfg.budget_bytes // BYTES_PER_TOKEN
    shadow_pool = _pool(ContiguousScheduler.min_pool_blocks(capacity, BLOCK_SIZE, max_num_seqs))
    schedulers = {
        "paged": Scheduler(
            _pool(num_blocks),
            BLOCK_SIZE,
            max_num_seqs,
            MAX_NUM_BATCHED_TOKENS,
            prefix_sharing=False,
        ),
        "contiguous": ContiguousScheduler(
            shadow_pool,
            BLOCK_SIZE,
            max_num_seqs,
            MAX_NUM_BATCHED_TOKENS,
            capacity_tokens=capacity,
        ),
    }
    results = {}
    for name, sched in schedulers.items():
        r = runs(name, sched, requests)
        reserved, used = r.total("reserved_tokens"), r.total("kv_tokens")
        results[name] = {
            "reserved_bytes": round(reserved / r.steps * BYTES_PER_TOKEN),
            "used_bytes": round(used / r.steps * BYTES_PER_TOKEN),
            "waste_pct": round(100 * (1 - used / reserved), 2),
            "max_concurrent": r.peak("num_running"),
            "mean_concurrent": round(r.mean("num_running"), 2),
            "steps": r.steps,
            "preemptions": r.total("preemptions"),
        }
    ratio = round(results["paged"]["max_concurrent"] / results["contiguous"]["max_concurrent"], 2)
    columns = (
        "reserved_bytes used_bytes waste_pct max_concurrent mean_concurrent steps preemptions"
    ).split()
    headers = ["", "reserved", "used", "waste %", "max conc", "mean conc", "steps", "preempted"]
    as_bytes = {"reserved_bytes": fmt_bytes, "used_bytes": fmt_bytes}
    report = [
        f"2. Paged vs contiguous KV: {fmt_bytes(cfg.budget_bytes)} of KV ({num_blocks:,} "
        f"blocks, {capacity:,} tokens); reserved and used are means over the steps",
        table(headers, _rows(results, columns, as_bytes)),
        f"-> paging fits {ratio}x the sequences at once in the same memory.",
    ]
    data = {"budget_bytes": cfg.budget_bytes, **results, "concurrency_ratio": ratio}
    return data, "\n".join(report)


# -- 3. prefix sharing ---------------------------------------------------------------------
SHARING_MODES = {
    "no sharing": {"prefix_sharing": False},
    "running-only sharing": {},
    "prefix cache": {"prefix_caching": True},
}


def prefix_sharing(
    requests: list[WorkloadRequest], seed: int, cfg: Config, runs: _Runs
) -> tuple[dict, str]:
    shared = with_system_prompt(requests, seed, SYSTEM_PROMPT_TOKENS)
    prompt_tokens = sum(len(r.prompt) for r in shared)
    num_blocks = cfg.max_num_seqs * _floor(shared)
    mean_gap = SPREAD_GAP_FACTOR * float(np.mean([r.output_len for r in shared]))
    spread_requests = spread_out(shared, seed, mean_gap)

    def run(name: str, when: str, workload: list[WorkloadRequest]) -> dict:
        sched = Scheduler(
            _pool(num_blocks),
            BLOCK_SIZE,
            cfg.max_num_seqs,
            MAX_NUM_BATCHED_TOKENS,
            **SHARING_MODES[name],
        )
        r = runs(f"{name}, {when}", sched, workload)
        return {
            "peak_blocks": r.peak("reserved_tokens") // BLOCK_SIZE,
            "mean_blocks": round(r.mean("reserved_tokens") / BLOCK_SIZE, 2),
            "prefill_saved": round(r.total("prefix_hit_tokens") / prompt_tokens, 4),
            "mean_running": round(r.mean("num_running"), 2),
            "steps": r.steps,
        }

    at_once = {name: run(name, "at once", shared) for name in SHARING_MODES}
    spread = {name: run(name, "spread", spread_requests) for name in list(SHARING_MODES)[1:]}
    without = at_once["no sharing"]["peak_blocks"]
    with_ = at_once["running-only sharing"]["peak_blocks"]
    data = {
        "system_prompt_tokens": SYSTEM_PROMPT_TOKENS,
        "num_blocks": num_blocks,
        "concurrent": {
            "blocks_without": without,
            "blocks_with": with_,
            "saved_fraction": round(1 - with_ / without, 4),
            "blocks_prefix_cache": at_once["prefix cache"]["peak_blocks"],
            "runs": at_once,
        },
        "spread": {
            "mean_gap_steps": round(mean_gap, 2),
            "running_only_saved_fraction": spread["running-only sharing"]["prefill_saved"],
            "prefix_cache_saved_fraction": spread["prefix cache"]["prefill_saved"],
            "runs": spread,
        },
    }
    as_percent = {"prefill_saved": percent}  # a fraction in the JSON, a percentage in print
    report = [
        f"3. Prefix sharing: every request starts with the same {SYSTEM_PROMPT_TOKENS}-token "
        f"system prompt; pool {num_blocks:,} blocks",
        "   all at once:",
        table(
            ["", "peak blocks", "mean blocks", "prefill saved", "steps"],
            _rows(at_once, ["peak_blocks", "mean_blocks", "prefill_saved", "steps"], as_percent),
        ),
        f"-> sharing saves {percent(data['concurrent']['saved_fraction'])} of the peak blocks.",
        f"   spread out (exponential gaps, mean {mean_gap:.0f} steps):",
        table(
            ["", "prefill saved", "mean running", "steps"],
            _rows(spread, ["prefill_saved", "mean_running", "steps"], as_percent),
        ),
        "-> when requests rarely overlap, only the prefix cache still finds the system prompt.",
    ]
    return data, "\n".join(report)


# -- 4. memory pressure --------------------------------------------------------------------
def pressure_sizes(floor: int, max_num_seqs: int) -> list[int]:
    """Pool sizes from room for ``max_num_seqs`` longest requests, halving, to the floor and
    one block below it."""
    sizes, n = [], max_num_seqs * floor
    while n > floor:
        sizes.append(n)
        n //= 2
    return [*sizes, floor, floor - 1]


def memory_pressure(requests: list[WorkloadRequest], cfg: Config, runs: _Runs) -> tuple[list, str]:
    floor = _floor(requests)
    points, rejection = {}, ""
    for num_blocks in pressure_sizes(floor, cfg.max_num_seqs):
        sched = Scheduler(_pool(num_blocks), BLOCK_SIZE, cfg.max_num_seqs, MAX_NUM_BATCHED_TOKENS)
        r = runs(f"pool of {num_blocks} blocks", sched, requests)
        points[f"{num_blocks:,}"] = {
            "num_blocks": num_blocks,
            "pool_bytes": num_blocks * BYTES_PER_BLOCK,
            "completed": r.completed,
            "rejected": r.rejected,
            "preemptions": r.total("preemptions"),
            "recomputed_tokens": r.total("recomputed_tokens"),
            "steps": r.steps,
            "mean_running": round(r.mean("num_running"), 2),
            "latency_p99": _percentiles(r.latencies, "latency")["latency_p99"],
        }
        rejection = rejection or (r.rejections[0] if r.rejections else "")
    columns = (
        "pool_bytes completed rejected preemptions recomputed_tokens steps mean_running latency_p99"
    ).split()
    headers = [
        "blocks",
        "pool",
        "completed",
        "rejected",
        "preempted",
        "recomputed",
        "steps",
        "mean running",
        "lat p99",
    ]
    report = [
        f"4. Memory pressure: the pool from generous down to the floor ({floor} blocks, the "
        f"longest request) and one block below; max {cfg.max_num_seqs} sequences",
        table(headers, _rows(points, columns, {"pool_bytes": fmt_bytes})),
        f"-> below the floor, at submission: {rejection}",
    ]
    return list(points.values()), "\n".join(report)


# -- 5. chunked vs whole prefill -------------------------------------------------------------
LONG_PROMPT_TOKENS = (1000, 4000)  # uniform; each long prompt asks for 16-64 tokens
LONG_OUTPUT_TOKENS = (16, 64)
LONG_GAP_STEPS = 32  # a long prompt arrives every 32 steps, from step 16 on
STREAM_PROMPT_TOKENS = (32, 256)


@dataclass(frozen=True)
class ChunkedConfig:
    """Benchmark 5's sizes: ``num_streams`` long-running decodes arriving at step 0 (outputs
    long enough to outlast every arrival) and ``num_long`` long prompts arriving one by one."""

    num_streams: int
    stream_output_tokens: tuple[int, int]
    num_long: int

    @classmethod
    def for_args(cls, quick: bool) -> ChunkedConfig:
        if quick:
            return cls(8, (192, 256), 6)
        return cls(32, (768, 1024), 24)


def long_prompt_requests(seed: int, cfg: ChunkedConfig) -> list[WorkloadRequest]:
    """Streams at step 0 (short prompts, long outputs), then long prompts every
    ``LONG_GAP_STEPS`` steps (1,000-4,000 prompt tokens, 16-64 output tokens); every length
    uniform, from one ``numpy.random.default_rng([seed, 5])``."""
    rng = np.random.default_rng([seed, 5])

    def request(prompt_range, output_range, arrival: int) -> WorkloadRequest:
        prompt_len = int(rng.integers(*prompt_range, endpoint=True))
        output_len = int(rng.integers(*output_range, endpoint=True))
        prompt = tuple(int(t) for t in rng.integers(0, EOS, prompt_len))
        return WorkloadRequest(prompt, output_len, output_range[1], arrival)

    streams = [
        request(STREAM_PROMPT_TOKENS, cfg.stream_output_tokens, 0) for _ in range(cfg.num_streams)
    ]
    longs = [
        request(LONG_PROMPT_TOKENS, LONG_OUTPUT_TOKENS, LONG_GAP_STEPS // 2 + k * LONG_GAP_STEPS)
        for k in range(cfg.num_long)
    ]
    return streams + longs


def _percentile(values: list[int], q: float) -> float:
    return round(float(np.percentile(values, q)), 2)


def chunked_vs_whole(seed: int, quick: bool, runs: _Runs) -> tuple[dict, str]:
    """Benchmark 5: the same workload with prompts computed whole and in chunks.

    Whole prefill gets the smallest budget that admits every request (its longest prompt +
    max_tokens - 1; a preempted sequence is recomputed in one step): the smallest stall whole
    prefill can have on this workload. Chunked prefill gets the engine's default budget.
    The pool holds every request at once, so no preemption muddles the comparison.
    """
    cfg = ChunkedConfig.for_args(quick)
    requests = long_prompt_requests(seed, cfg)
    whole_budget = max(r.max_kv_tokens for r in requests)
    num_blocks = sum(blocks_for(r.max_kv_tokens) for r in requests)
    max_num_seqs = len(requests)
    results = {}
    for name, budget, chunked in (
        ("whole", whole_budget, False),
        ("chunked", CHUNK_BUDGET, True),
    ):
        sched = Scheduler(
            _pool(num_blocks), BLOCK_SIZE, max_num_seqs, budget, enable_chunked_prefill=chunked
        )
        r = runs(f"{name} prefill", sched, requests, record_tokens=True)
        stalls, step_tokens = r.stalls(), r.step_tokens()
        ttft_steps, ttft_tokens = r.ttft_steps(), r.ttft_tokens()
        longs = [i for i, req in r.requests.items() if len(req.prompt) >= LONG_PROMPT_TOKENS[0]]
        long_ttft_tokens = r.ttft_tokens(longs)
        results[name] = {
            "max_num_batched_tokens": budget,
            "steps": r.steps,
            "max_step_tokens": max(step_tokens),
            "computed_tokens": sum(step_tokens),
            "output_tokens": r.output_tokens,
            "completed": r.completed,
            "stall_mean": round(float(np.mean(stalls)), 2),
            "stall_p50": _percentile(stalls, 50),
            "stall_p99": _percentile(stalls, 99),
            "stall_max": max(stalls),
            "ttft_steps_p50": _percentile(ttft_steps, 50),
            "ttft_steps_p99": _percentile(ttft_steps, 99),
            "ttft_tokens_p50": _percentile(ttft_tokens, 50),
            "ttft_tokens_p99": _percentile(ttft_tokens, 99),
            "long_ttft_steps_p50": _percentile(r.ttft_steps(longs), 50),
            "long_ttft_tokens_p50": _percentile(long_ttft_tokens, 50),
            "long_ttft_tokens_p99": _percentile(long_ttft_tokens, 99),
            "preemptions": r.total("preemptions"),
        }
    whole, chunked = results["whole"], results["chunked"]
    stall_ratio = round(whole["stall_p99"] / chunked["stall_p99"], 2)
    steps_ratio = round(chunked["steps"] / whole["steps"], 4)
    columns = (
        "max_num_batched_tokens steps max_step_tokens stall_p50 stall_p99 stall_max "
        "ttft_steps_p50 ttft_steps_p99 ttft_tokens_p50 ttft_tokens_p99 long_ttft_tokens_p50"
    ).split()
    headers = [
        "",
        "budget",
        "steps",
        "max step tok",
        "stall p50",
        "stall p99",
        "stall max",
        "TTFT steps p50",
        "p99",
        "TTFT tok p50",
        "p99",
        "long TTFT tok p50",
    ]
    report = [
        f"5. Chunked vs whole prefill: {cfg.num_streams} streams decode "
        f"{cfg.stream_output_tokens[0]}-{cfg.stream_output_tokens[1]} tokens while "
        f"{cfg.num_long} prompts of {LONG_PROMPT_TOKENS[0]:,}-{LONG_PROMPT_TOKENS[1]:,} tokens "
        f"arrive, one every {LONG_GAP_STEPS} steps; whole prefill with the smallest budget "
        f"that admits every request, chunked with the engine's default. Stall = tokens "
        f"computed between two output tokens of a request; TTFT from arrival, all requests "
        f"(long: the long prompts alone)",
        table(headers, _rows(results, columns)),
        f"-> chunking cuts the p99 stall {stall_ratio}x (p99 {whole['stall_p99']:g} -> "
        f"{chunked['stall_p99']:g} tokens) in {steps_ratio:.2f}x the steps.",
    ]
    data = {
        "num_streams": cfg.num_streams,
        "num_long_prompts": cfg.num_long,
        "long_gap_steps": LONG_GAP_STEPS,
        "num_blocks": num_blocks,
        **results,
        "stall_p99_ratio": stall_ratio,
        "steps_ratio": steps_ratio,
    }
    return data, "\n".join(report)


# -- 6. sharing among one request's sequences: parallel sampling and beam search -------------
SAMPLE_COUNTS = (4, 8)  # parallel sampling's n
BEAM_WIDTHS = (4, 8)
NULL_LOGIT_SCALE = 2.0  # the beam null model's next-token logits: N(0, 2**2)
PAPER_SAVED = {"parallel_sampling": (0.06, 0.10), "beam_search": (0.37, 0.55)}  # vLLM paper


class _Family:
    """The KV blocks of one request's sequences in a shared pool, driven by the block table
    itself: ``fork`` borrows every block of a parent (its partly filled last block included),
    ``grow`` writes one token (splitting a shared last block: copy-on-write), ``drop``
    releases. A block shared by several sequences is held once."""

    def __init__(self, pool: BlockPool, prompt_len: int) -> None:
        self.pool = pool
        self.prompt = pool.new_table(BLOCK_SIZE)
        assert self.prompt.append_tokens(prompt_len), "the pool is sized to hold everything"

    def fork(self, parent) -> object:
        child = self.pool.new_table(BLOCK_SIZE)
        child.borrow_prefix(parent, parent.num_tokens)
        return child

    @staticmethod
    def grow(table) -> None:
        assert table.append_tokens(1), "the pool is sized to hold everything"
        assert table.writable_block(table.num_tokens - 1) is not None

    @staticmethod
    def drop(tables) -> None:
        for kv in tables:
            kv.release()


def _parallel_sampling(family: _Family, lengths: list[int]) -> Iterator[list[tuple]]:
    """Yield the live sequences, (sample index, table) pairs, after each step of
    ``len(lengths)`` samples forked from the prompt, sample i generating ``lengths[i]``
    tokens."""
    tables = [family.prompt] + [family.fork(family.prompt) for _ in lengths[1:]]
    live = dict(enumerate(tables))
    for step in range(1, max(lengths) + 1):
        for kv in live.values():
            family.grow(kv)
        yield list(live.items())
        family.drop(live.pop(i) for i in list(live) if lengths[i] == step)


def _beam_search(
    family: _Family, request: WorkloadRequest, width: int, rng: np.random.Generator
) -> Iterator[list[tuple]]:
    """Yield the live beams, (generated tokens, table) pairs, after each step of mie's beam search
    (``BeamSearch``, EOS ignored, ``output_len`` tokens) over the null model: each beam's
    ``width`` candidate tokens get the log-softmax of ``width + 1`` logits drawn from
    N(0, NULL_LOGIT_SCALE**2) (the last one stands for the rest of the vocabulary). A beam's
    first child continues in its parent's table, the others fork it (before the first child
    writes); a beam without children releases it."""
    params = BeamSearchParams(width, request.output_len, ignore_eos=True)
    search = BeamSearch(request.prompt, params, eos_token_ids=())
    tables = [family.prompt]  # the running beams' tables, in search.running's order
    while not search.done:
        rows = []
        for _ in search.running:
            logits = NULL_LOGIT_SCALE * rng.standard_normal(width + 1)
            logprobs = logits - np.logaddexp.reduce(logits)
            rows.append({token: Logprob(float(lp)) for token, lp in enumerate(logprobs[:width])})
        search.advance(rows)
        children, taken = [], set()
        for parent in search.parents:
            children.append(tables[parent] if parent not in taken else family.fork(tables[parent]))
            taken.add(parent)  # the first child takes its parent's table over
        family.drop(kv for i, kv in enumerate(tables) if i not in taken)  # no children
        for kv in children:
            family.grow(kv)
        tables = children
        if tables:
            yield [(beam.generated, kv) for beam, kv in zip(search.running, tables, strict=True)]


def _held_vs_independent(pool: BlockPool, runs: list[Iterator[list[tuple]]]) -> dict:
    """Step all requests' runs together (every request arrives at step 0, one token per
    sequence per step); per step, the blocks the pool holds vs the blocks the same sequences
    would hold each on its own."""
    held, independent = [], []
    while runs:
        live = [(run, next(run, None)) for run in runs]
        runs = [run for run, tables in live if tables is not None]
        kv_tokens = [kv.num_tokens for _, pairs in live if pairs for _, kv in pairs]
        if kv_tokens:
            held.append(pool.num_blocks - pool.num_free)
            independent.append(sum(blocks_for(n) for n in kv_tokens))
    assert pool.num_free == pool.num_blocks, "every sequence released its blocks"
    peak_held, peak_alone = max(held), max(independent)
    mean_held, mean_alone = float(np.mean(held)), float(np.mean(independent))
    return {
        "peak_blocks_shared": peak_held,
        "peak_blocks_independent": peak_alone,
        "peak_saved_fraction": round(1 - peak_held / peak_alone, 4),
        "mean_blocks_shared": round(mean_held, 2),
        "mean_blocks_independent": round(mean_alone, 2),
        "mean_saved_fraction": round(1 - mean_held / mean_alone, 4),
        "steps": len(held),
    }


def sampling_sharing(
    requests: list[WorkloadRequest], seed: int, progress: ProgressBar
) -> tuple[dict, str]:
    """Benchmark 6: the blocks one request's sequences share. Parallel sampling: ``n``
    samples fork from the computed prompt; sample 0 generates the request's ``output_len``
    tokens, the others lengths drawn from the workload's own output lengths (capped at the
    request's ``max_tokens``). Beam search: ``width`` beams for ``output_len`` tokens over
    the null model of ``_beam_search``. All requests at once; the pool holds everything."""
    rng = np.random.default_rng([seed, 6])
    outputs = [r.output_len for r in requests]

    def pool_for(width: int) -> BlockPool:
        return _pool(sum(width * (blocks_for(r.max_kv_tokens + 1) + 1) for r in requests))

    results: dict[str, dict] = {}
    for n in SAMPLE_COUNTS:
        progress.update(0, desc=f"mechanisms: parallel sampling, n={n}")
        pool = pool_for(n)
        runs = []
        for r in requests:
            others = [min(int(x), r.max_tokens) for x in rng.choice(outputs, n - 1)]
            runs.append(_parallel_sampling(_Family(pool, len(r.prompt)), [r.output_len, *others]))
        results[f"parallel sampling, n={n}"] = _held_vs_independent(pool, runs)
        progress.update(1)
    for width in BEAM_WIDTHS:
        progress.update(0, desc=f"mechanisms: beam search, width={width}")
        pool = pool_for(width)
        beam_rng = np.random.default_rng([seed, 6, width])
        runs = [_beam_search(_Family(pool, len(r.prompt)), r, width, beam_rng) for r in requests]
        results[f"beam search, width={width}"] = _held_vs_independent(pool, runs)
        progress.update(1)
    data = {
        "null_logit_scale": NULL_LOGIT_SCALE,
        "paper_saved_fraction": {k: list(v) for k, v in PAPER_SAVED.items()},
        **results,
    }
    columns = (
        "peak_blocks_shared peak_blocks_independent peak_saved_fraction "
        "mean_blocks_shared mean_blocks_independent mean_saved_fraction"
    ).split()
    headers = [
        "",
        "peak shared",
        "peak alone",
        "peak saved",
        "mean shared",
        "mean alone",
        "mean saved",
    ]
    as_percent = {"peak_saved_fraction": percent, "mean_saved_fraction": percent}
    low_p, high_p = PAPER_SAVED["parallel_sampling"]
    low_b, high_b = PAPER_SAVED["beam_search"]
    report = [
        f"6. Sharing among a request's sequences: {len(requests)} requests at once, each as "
        f"n samples forked from its prompt or as a beam search (null model); blocks held with "
        f"sharing (fork + copy-on-write) vs the same sequences each in its own blocks",
        table(headers, _rows(results, columns, as_percent)),
        f"-> the PagedAttention paper measures {percent(low_p)}-{percent(high_p)} saved for "
        f"parallel sampling and {percent(low_b)}-{percent(high_b)} for beam search.",
    ]
    return data, "\n".join(report)


# -- the section ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> SectionResult:
    cfg = Config.for_args(args.quick)
    requests = mixed_requests(args.seed, cfg.num_requests)
    num_runs = 2 + 2 + 5 + len(pressure_sizes(_floor(requests), cfg.max_num_seqs)) + 2
    num_runs += len(SAMPLE_COUNTS) + len(BEAM_WIDTHS)
    num_runs += 4  # sliding window: full and windowed, alone and in a fixed pool
    with ProgressBar(num_runs, "mechanisms") as progress:
        runs = _Runs(progress)
        batching, batching_report = continuous_vs_static(requests, cfg, runs)
        paging, paging_report = paged_vs_contiguous(requests, cfg, runs)
        sharing, sharing_report = prefix_sharing(requests, args.seed, cfg, runs)
        pressure, pressure_report = memory_pressure(requests, cfg, runs)
        chunking, chunking_report = chunked_vs_whole(args.seed, args.quick, runs)
        forks, forks_report = sampling_sharing(requests, args.seed, progress)
        window, window_report = sliding_window_memory(args.seed, args.quick, runs)
        progress.update(0, desc="mechanisms")
    data = {
        "workload": _describe(requests, cfg),
        "continuous_vs_static": batching,
        "paged_vs_contiguous": paging,
        "prefix_sharing": sharing,
        "memory_pressure": pressure,
        "chunked_prefill": chunking,
        "sampling_sharing": forks,
        "sliding_window": window,
    }
    w = data["workload"]
    header = (
        f"Mechanisms (seed {args.seed}): {cfg.num_requests} requests, prompts mean "
        f"{w['prompt_tokens_mean']:.0f} / max {w['prompt_tokens_max']} tokens, outputs mean "
        f"{w['output_tokens_mean']:.0f} / max {w['output_tokens_max']}; Qwen2-0.5B KV in 16 "
        f"bits ({BYTES_PER_TOKEN:,} B/token, kv_cache_dtype bfloat16; float32 is twice that), "
        f"blocks of {BLOCK_SIZE}"
    )
    report = "\n\n".join(
        [
            header,
            batching_report,
            paging_report,
            sharing_report,
            pressure_report,
            chunking_report,
            forks_report,
            window_report,
        ]
    )

    def plot(folder: Path) -> list[Path]:
        from mie.bench.plots import plot_mechanisms

        return plot_mechanisms(runs.results, pressure, folder)

    return SectionResult(data, report, plot)


def _describe(requests: list[WorkloadRequest], cfg: Config) -> dict:
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "bytes_per_token": BYTES_PER_TOKEN,
        "block_size": BLOCK_SIZE,
        "bytes_per_block": BYTES_PER_BLOCK,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "prompt_tokens_mean": round(float(np.mean(prompts)), 2),
        "prompt_tokens_max": max(prompts),
        "output_tokens_mean": round(float(np.mean(outputs)), 2),
        "output_tokens_max": max(outputs),
        "floor_blocks": _floor(requests),
    }
