"""The four mechanism benchmarks: what each mechanism buys over its naive baseline.

Step-count and memory simulations of the workload in ``mie.bench.workload`` with the null
model of ``mie.bench.simulate`` (no arithmetic, so no wall-clock time: a step is a step):

1. continuous vs static batching -- same workload, same generous pool;
2. paged vs contiguous KV -- same workload, same fixed memory budget;
3. prefix sharing -- every request behind one long system prompt: all at once (blocks with
   and without sharing), and spread out in time (running-only sharing vs the prefix cache);
4. memory pressure -- the pool swept from generous down to one block below the longest
   request: degradation through preemption, and a clear rejection below the floor.

The simulation pools hold 1 byte per block (the null model never touches KV); every byte
figure is blocks x Qwen2-0.5B's 196,608 bytes per block, or tokens x 12,288 bytes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mie.bench.section import SectionResult
from mie.bench.simulate import RunResult, simulate
from mie.bench.table import fmt_bytes, table
from mie.bench.workload import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    BYTES_PER_TOKEN,
    NUM_REQUESTS,
    NUM_REQUESTS_QUICK,
    Request,
    blocks_for,
    mixed_requests,
    spread_out,
    with_system_prompt,
)
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


def _floor(requests: list[Request]) -> int:
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

    def __call__(self, name: str, scheduler, requests: list[Request]) -> RunResult:
        self.progress.update(0, desc=f"mechanisms: {name}")
        result = simulate(scheduler, requests)
        self.results[name] = result
        self.progress.update(1)
        return result


# -- 1. continuous vs static ---------------------------------------------------------------
def continuous_vs_static(requests: list[Request], cfg: Config, runs: _Runs) -> tuple[dict, str]:
    num_blocks = cfg.max_num_seqs * _floor(requests)  # room for max_num_seqs of the longest
    data: dict = {"num_blocks": num_blocks, "pool_bytes": num_blocks * BYTES_PER_BLOCK}
    rows = []
    for name, cls in (("continuous", Scheduler), ("static", StaticBatchScheduler)):
        sched = cls(_pool(num_blocks), BLOCK_SIZE, cfg.max_num_seqs, MAX_NUM_BATCHED_TOKENS)
        r = runs(name, sched, requests)
        tokens = r.total("num_prefill_tokens") + r.total("num_decode_tokens")
        data[name] = {
            "steps": r.steps,
            "tokens_per_step": round(tokens / r.steps, 2),
            "output_tokens_per_step": round(r.output_tokens / r.steps, 2),
            "mean_running": round(r.mean("num_running"), 2),
            **_percentiles(r.latencies, "latency"),
            **_percentiles(r.queueing, "queueing"),
            "preemptions": r.total("preemptions"),
        }
        d = data[name]
        rows.append([name, d["steps"], d["tokens_per_step"], d["output_tokens_per_step"],
                     d["latency_mean"], d["latency_p50"], d["latency_p99"],
                     d["queueing_mean"], d["queueing_p50"], d["queueing_p99"]])  # fmt: skip
    data["static_to_continuous_steps"] = round(
        data["static"]["steps"] / data["continuous"]["steps"], 2
    )
    report = "\n".join([
        f"1. Continuous vs static batching: {len(requests)} requests at once, max "
        f"{cfg.max_num_seqs} sequences, "
        f"pool {num_blocks:,} blocks ({fmt_bytes(data['pool_bytes'])}); "
        "latency and queueing in steps",
        table(["", "steps", "tok/step", "out tok/step", "lat mean", "lat p50", "lat p99",
               "queue mean", "queue p50", "queue p99"], rows),  # fmt: skip
        f"-> static batching needs {data['static_to_continuous_steps']}x the steps to drain.",
    ])  # fmt: skip
    return data, report


# -- 2. paged vs contiguous ----------------------------------------------------------------
def paged_vs_contiguous(requests: list[Request], cfg: Config, runs: _Runs) -> tuple[dict, str]:
    max_num_seqs = len(requests)
    num_blocks = cfg.budget_bytes // BYTES_PER_BLOCK
    capacity = cfg.budget_bytes // BYTES_PER_TOKEN
    schedulers = {
        "paged": Scheduler(_pool(num_blocks), BLOCK_SIZE, max_num_seqs, MAX_NUM_BATCHED_TOKENS,
                           prefix_sharing=False),
        "contiguous": ContiguousScheduler(
            _pool(ContiguousScheduler.min_pool_blocks(capacity, BLOCK_SIZE, max_num_seqs)),
            BLOCK_SIZE, max_num_seqs, MAX_NUM_BATCHED_TOKENS, capacity_tokens=capacity),
    }  # fmt: skip
    data: dict = {"budget_bytes": cfg.budget_bytes}
    rows = []
    for name, sched in schedulers.items():
        r = runs(name, sched, requests)
        reserved, used = r.total("reserved_tokens"), r.total("kv_tokens")
        data[name] = {
            "reserved_bytes": round(reserved / r.steps * BYTES_PER_TOKEN),
            "used_bytes": round(used / r.steps * BYTES_PER_TOKEN),
            "waste_pct": round(100 * (1 - used / reserved), 2),
            "max_concurrent": r.peak("num_running"),
            "mean_concurrent": round(r.mean("num_running"), 2),
            "steps": r.steps,
            "preemptions": r.total("preemptions"),
        }
        d = data[name]
        rows.append([name, fmt_bytes(d["reserved_bytes"]), fmt_bytes(d["used_bytes"]),
                     d["waste_pct"], d["max_concurrent"], d["mean_concurrent"], d["steps"],
                     d["preemptions"]])  # fmt: skip
    ratio = data["paged"]["max_concurrent"] / data["contiguous"]["max_concurrent"]
    data["concurrency_ratio"] = round(ratio, 2)
    report = "\n".join([
        f"2. Paged vs contiguous KV: {fmt_bytes(cfg.budget_bytes)} of KV ({num_blocks:,} blocks, "
        f"{capacity:,} tokens); reserved and used are means over the steps",
        table(["", "reserved", "used", "waste %", "max conc", "mean conc", "steps",
               "preemptions"], rows),  # fmt: skip
        f"-> paging fits {data['concurrency_ratio']}x the sequences at once in the same memory.",
    ])  # fmt: skip
    return data, report


# -- 3. prefix sharing ---------------------------------------------------------------------
def prefix_sharing(
    requests: list[Request], seed: int, cfg: Config, runs: _Runs
) -> tuple[dict, str]:
    shared = with_system_prompt(requests, seed, SYSTEM_PROMPT_TOKENS)
    prompt_tokens = sum(len(r.prompt) for r in shared)
    num_blocks = cfg.max_num_seqs * _floor(shared)

    def scheduler(**kwargs) -> Scheduler:
        return Scheduler(_pool(num_blocks), BLOCK_SIZE, cfg.max_num_seqs,
                         MAX_NUM_BATCHED_TOKENS, **kwargs)  # fmt: skip

    modes = {
        "no sharing": {"prefix_sharing": False},
        "running-only sharing": {},
        "prefix cache": {"prefix_caching": True},
    }
    concurrent = {name: runs(f"{name}, at once", scheduler(**kw), shared)
                  for name, kw in modes.items()}  # fmt: skip
    mean_gap = SPREAD_GAP_FACTOR * float(np.mean([r.output_len for r in shared]))
    spread_requests = spread_out(shared, seed, mean_gap)
    spread = {name: runs(f"{name}, spread", scheduler(**modes[name]), spread_requests)
              for name in ("running-only sharing", "prefix cache")}  # fmt: skip

    def peak_blocks(r: RunResult) -> int:
        return r.peak("reserved_tokens") // BLOCK_SIZE

    def saved(r: RunResult) -> float:
        return round(r.total("prefix_hit_tokens") / prompt_tokens, 4)

    without = peak_blocks(concurrent["no sharing"])
    with_ = peak_blocks(concurrent["running-only sharing"])
    data = {
        "system_prompt_tokens": SYSTEM_PROMPT_TOKENS,
        "num_blocks": num_blocks,
        "concurrent": {
            "blocks_without": without,
            "blocks_with": with_,
            "saved_fraction": round(1 - with_ / without, 4),
            "blocks_prefix_cache": peak_blocks(concurrent["prefix cache"]),
            "prefill_saved_fraction": {n: saved(r) for n, r in concurrent.items()},
        },
        "spread": {
            "mean_gap_steps": round(mean_gap, 2),
            "mean_running": round(spread["running-only sharing"].mean("num_running"), 2),
            "running_only_saved_fraction": saved(spread["running-only sharing"]),
            "prefix_cache_saved_fraction": saved(spread["prefix cache"]),
        },
    }
    rows = [[name, peak_blocks(r), round(r.mean("reserved_tokens") / BLOCK_SIZE), saved(r),
             r.steps] for name, r in concurrent.items()]  # fmt: skip
    spread_rows = [[name, saved(r), round(r.mean("num_running"), 2), r.steps]
                   for name, r in spread.items()]  # fmt: skip
    report = "\n".join([
        f"3. Prefix sharing: every request starts with the same {SYSTEM_PROMPT_TOKENS}-token "
        f"system prompt; pool {num_blocks:,} blocks",
        "   all at once:",
        table(["", "peak blocks", "mean blocks", "prefill saved", "steps"], rows),
        f"-> sharing saves {data['concurrent']['saved_fraction']:.0%} of the peak blocks.",
        f"   spread out (exponential gaps, mean {mean_gap:.0f} steps):",
        table(["", "prefill saved", "mean running", "steps"], spread_rows),
        "-> when requests rarely overlap, only the prefix cache still finds the system prompt.",
    ])  # fmt: skip
    return data, report


# -- 4. memory pressure --------------------------------------------------------------------
def pressure_sizes(floor: int, max_num_seqs: int) -> list[int]:
    """Pool sizes from room for ``max_num_seqs`` longest requests, halving, to the floor and
    one block below it."""
    sizes, n = [], max_num_seqs * floor
    while n > floor:
        sizes.append(n)
        n //= 2
    return [*sizes, floor, floor - 1]


def memory_pressure(requests: list[Request], cfg: Config, runs: _Runs) -> tuple[list, str]:
    floor = _floor(requests)
    points, rows, rejection = [], [], ""
    for num_blocks in pressure_sizes(floor, cfg.max_num_seqs):
        sched = Scheduler(_pool(num_blocks), BLOCK_SIZE, cfg.max_num_seqs, MAX_NUM_BATCHED_TOKENS)
        r = runs(f"pool of {num_blocks} blocks", sched, requests)
        point = {
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
        points.append(point)
        rows.append([num_blocks, fmt_bytes(point["pool_bytes"]), r.completed, r.rejected,
                     point["preemptions"], point["recomputed_tokens"], r.steps,
                     point["mean_running"], point["latency_p99"]])  # fmt: skip
        rejection = rejection or (r.rejections[0] if r.rejections else "")
    report = "\n".join([
        f"4. Memory pressure: the pool from generous down to the floor ({floor} blocks, the "
        f"longest request) and one block below; max {cfg.max_num_seqs} sequences",
        table(["blocks", "pool", "completed", "rejected", "preemptions", "recomputed",
               "steps", "mean running", "lat p99"], rows),  # fmt: skip
        f"-> below the floor, at submission: {rejection}",
    ])  # fmt: skip
    return points, report


# -- the section ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> SectionResult:
    cfg = Config.for_args(args.quick)
    requests = mixed_requests(args.seed, cfg.num_requests)
    num_runs = 2 + 2 + 5 + len(pressure_sizes(_floor(requests), cfg.max_num_seqs))
    with ProgressBar(num_runs, "mechanisms") as progress:
        runs = _Runs(progress)
        cvs, cvs_report = continuous_vs_static(requests, cfg, runs)
        pvc, pvc_report = paged_vs_contiguous(requests, cfg, runs)
        sharing, sharing_report = prefix_sharing(requests, args.seed, cfg, runs)
        pressure, pressure_report = memory_pressure(requests, cfg, runs)
        progress.update(0, desc="mechanisms")
    data = {
        "workload": _describe(requests, cfg),
        "continuous_vs_static": cvs,
        "paged_vs_contiguous": pvc,
        "prefix_sharing": sharing,
        "memory_pressure": pressure,
    }
    w = data["workload"]
    header = (
        f"Mechanisms (seed {args.seed}): {cfg.num_requests} requests, prompts mean "
        f"{w['prompt_tokens_mean']:.0f} / max {w['prompt_tokens_max']} tokens, outputs mean "
        f"{w['output_tokens_mean']:.0f} / max {w['output_tokens_max']}; Qwen2-0.5B KV "
        f"({BYTES_PER_TOKEN:,} B/token), blocks of {BLOCK_SIZE}"
    )
    report = "\n\n".join([header, cvs_report, pvc_report, sharing_report, pressure_report])

    def plot(folder: Path) -> list[Path]:
        from mie.bench.plots import plot_mechanisms

        return plot_mechanisms(runs.results, pressure, folder)

    return SectionResult(data, report, plot)


def _describe(requests: list[Request], cfg: Config) -> dict:
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
