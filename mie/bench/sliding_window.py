"""Mechanism benchmark: sliding-window attention releasing KV blocks, vs full attention.

Under a sliding window of ``w`` positions (Mistral's ``sliding_window``) no query reads a
position more than ``w - 1`` before it, so the scheduler gives back every block that falls
wholly out of a sequence's window (``Scheduler(sliding_window=w)``, see
``mie.scheduler.scheduler``). A long generation then holds about ``w + block_size`` tokens of
KV instead of all of them. Two null-model simulations (``mie.bench.simulate``) of long
generations -- every request ``WINDOWS`` times as long as the window -- measure it:

* **blocks held per sequence**: one request alone, its blocks at every step (peak and mean),
  full attention vs the window;
* **sequences that fit a fixed pool**: many such requests at once over a pool far smaller
  than their full contexts (chunked prefill, the engine's default budget): how many run
  together (peak and mean), and what full attention pays in preemptions and recomputation.

The section ``mie.bench.mechanisms`` reports it under the JSON key ``sliding_window``; bytes
are blocks x ``BYTES_PER_BLOCK`` (Qwen2-0.5B's shape in 16 bits, as for every mechanism:
the ratios do not depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mie.bench.simulate import RunResult
from mie.bench.table import fmt_bytes, table
from mie.bench.workload import BLOCK_SIZE, BYTES_PER_BLOCK, EOS, WorkloadRequest, blocks_for
from mie.engine.config import DEFAULT_CHUNK_BUDGET
from mie.memory import BlockPool
from mie.scheduler import Scheduler
from mie.scheduler.scheduler import window_blocks


@dataclass(frozen=True)
class WindowConfig:
    """Sizes of the run; ``--quick`` divides the lengths and the pool by 4."""

    window: int  # tokens
    prompt_tokens: int
    output_tokens: int  # prompt + output = WINDOWS x window
    num_requests: int
    pool_blocks: int

    @classmethod
    def for_args(cls, quick: bool) -> WindowConfig:
        if quick:
            return cls(256, 128, 896, 30, 512)
        return cls(1024, 512, 3584, 30, 2048)


def _requests(seed: int, cfg: WindowConfig, n: int) -> list[WorkloadRequest]:
    """``n`` long generations (uniform random prompts, outputs of exactly ``output_tokens``)."""
    rng = np.random.default_rng([seed, 16])
    return [
        WorkloadRequest(
            tuple(int(t) for t in rng.integers(0, EOS, cfg.prompt_tokens)),
            cfg.output_tokens,
            cfg.output_tokens,
        )
        for _ in range(n)
    ]


def _scheduler(num_blocks: int, max_num_seqs: int, window: int | None) -> Scheduler:
    return Scheduler(
        BlockPool(num_blocks, 1),
        BLOCK_SIZE,
        max_num_seqs,
        DEFAULT_CHUNK_BUDGET,
        enable_chunked_prefill=True,
        sliding_window=window,
    )


def _blocks_held(r: RunResult) -> list[int]:
    """Blocks the running sequences held at each step (what the trace's reserved slots are)."""
    return [t.reserved_tokens // BLOCK_SIZE for t in r.traces]


def sliding_window_memory(seed: int, quick: bool, runs) -> tuple[dict, str]:
    """The benchmark (see the module doc); ``runs(name, scheduler, requests)`` simulates."""
    cfg = WindowConfig.for_args(quick)
    alone = _requests(seed, cfg, 1)
    crowd = _requests(seed, cfg, cfg.num_requests)
    full_blocks = blocks_for(cfg.prompt_tokens + cfg.output_tokens - 1)
    results = {}
    for name, window in (("full", None), ("windowed", cfg.window)):
        single = runs(f"{name}, alone", _scheduler(full_blocks, 1, window), alone)
        held = _blocks_held(single)
        peak = max(held)
        shared = runs(
            f"{name}, {cfg.num_requests} in {cfg.pool_blocks} blocks",
            _scheduler(cfg.pool_blocks, cfg.num_requests, window),
            crowd,
        )
        running = [t.num_running for t in shared.traces]
        results[name] = {
            "blocks_per_seq_peak": peak,
            "blocks_per_seq_mean": round(float(np.mean(held)), 2),
            "kv_bytes_per_seq_peak": peak * BYTES_PER_BLOCK,
            "seqs_fit_in_pool": cfg.pool_blocks // peak,
            "peak_running": max(running),
            "mean_running": round(float(np.mean(running)), 2),
            "steps": shared.steps,
            "preemptions": shared.total("preemptions"),
            "recomputed_tokens": shared.total("recomputed_tokens"),
            "completed": shared.completed,
        }
    full, windowed = results["full"], results["windowed"]
    memory_ratio = round(full["blocks_per_seq_peak"] / windowed["blocks_per_seq_peak"], 2)
    running_ratio = round(windowed["mean_running"] / full["mean_running"], 2)
    steps_ratio = round(full["steps"] / windowed["steps"], 2)
    columns = [
        "blocks_per_seq_peak",
        "blocks_per_seq_mean",
        "kv_bytes_per_seq_peak",
        "seqs_fit_in_pool",
        "peak_running",
        "mean_running",
        "steps",
        "preemptions",
        "recomputed_tokens",
    ]
    headers = [
        "",
        "blocks/seq peak",
        "mean",
        "KV/seq peak",
        "fit in pool",
        "running peak",
        "mean",
        "steps",
        "preemptions",
        "recomputed tok",
    ]
    rows = [
        [
            {"full": "full attention", "windowed": f"window of {cfg.window}"}[name],
            *(fmt_bytes(d[c]) if c.startswith("kv_") else d[c] for c in columns),
        ]
        for name, d in results.items()
    ]
    report = [
        f"7. Sliding window: generations of {cfg.prompt_tokens} + {cfg.output_tokens} tokens "
        f"({(cfg.prompt_tokens + cfg.output_tokens) // cfg.window}x a window of {cfg.window}), "
        f"blocks of {BLOCK_SIZE}; blocks held per sequence (one alone), and "
        f"{cfg.num_requests} such requests at once in a pool of {cfg.pool_blocks:,} blocks "
        f"({fmt_bytes(cfg.pool_blocks * BYTES_PER_BLOCK)}), chunked prefill",
        table(headers, rows),
        f"-> releasing the blocks out of the window holds {memory_ratio}x fewer blocks per "
        f"sequence (at most {window_blocks(cfg.window, BLOCK_SIZE)} blocks of the window, "
        f"plus a chunk's), so {running_ratio}x more sequences run together in the same pool, "
        f"in {steps_ratio}x fewer steps.",
    ]
    data = {
        "window": cfg.window,
        "block_size": BLOCK_SIZE,
        "prompt_tokens": cfg.prompt_tokens,
        "output_tokens": cfg.output_tokens,
        "num_requests": cfg.num_requests,
        "pool_blocks": cfg.pool_blocks,
        "window_blocks_bound": window_blocks(cfg.window, BLOCK_SIZE),
        "full_context_blocks": full_blocks,
        **results,
        "blocks_per_seq_ratio": memory_ratio,
        "mean_running_ratio": running_ratio,
        "steps_ratio": steps_ratio,
    }
    return data, "\n".join(report)
