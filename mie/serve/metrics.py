"""``GET /metrics``: the server's state and totals in Prometheus' text exposition format.

The engine thread writes (a snapshot after every step, latencies as tokens go out); HTTP
handlers read. One lock keeps each read consistent. The format is simple enough to write by
hand, which keeps ``prometheus_client`` out of the dependencies.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass, field

# Seconds. TTFT includes the wait for admission, so its buckets reach further than ITL's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: its engine step failed


class Histogram:
    """Cumulative-bucket histogram, as Prometheus wants it."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        return [*out, f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


@dataclass
class EngineSnapshot:
    """The engine's numbers after a step, copied by the engine thread."""

    running: int = 0
    waiting: int = 0
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0  # held by the prefix cache (some may also be in use)
    blocks_cache_only: int = 0  # held by the prefix cache alone: reusable at once
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefix_hit_tokens: int = 0
    weight_bytes: int = 0  # the model's weights as stored (bfloat16: half of float32)
    kv_cache_bytes: int = 0  # the whole KV pool, used or not


@dataclass
class ServerMetrics:
    engine: EngineSnapshot = field(default_factory=EngineSnapshot)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    rejected: int = 0  # refused by the engine loop: invalid for the engine, or queue full
    step_failures: int = 0  # engine steps that raised (rolled back; their requests ended)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def update_engine(self, engine) -> None:
        """Copy the engine's state; called by the engine thread, the engine's only user."""
        cache = engine.scheduler.prefix_cache
        stats = engine.stats
        snapshot = EngineSnapshot(
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            blocks_total=engine.pool.num_blocks,
            blocks_free=engine.pool.num_free,
            blocks_cached=cache.num_cached if cache else 0,
            blocks_cache_only=cache.num_evictable if cache else 0,
            steps=stats.steps,
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens,
            preemptions=stats.preemptions,
            recomputed_tokens=stats.recomputed_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            weight_bytes=engine.weight_bytes,
            kv_cache_bytes=engine.pool.num_blocks * engine.pool.bytes_per_block,
        )
        with self.lock:
            self.engine = snapshot

    def observe_token(self, ttft: float | None, itl: float | None) -> None:
        with self.lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def count_finished(self, reason: str) -> None:
        with self.lock:
            self.finished[reason] += 1

    def count_rejected(self) -> None:
        with self.lock:
            self.rejected += 1

    def count_step_failure(self) -> None:
        with self.lock:
            self.step_failures += 1

    def render(self) -> str:
        """The exposition text (``text/plain; version=0.0.4``)."""
        with self.lock:
            e = self.engine
            in_use = e.blocks_total - e.blocks_free - e.blocks_cache_only
            seen = e.prompt_tokens + e.prefix_hit_tokens
            finished = [(f'{{finish_reason="{r}"}}', n) for r, n in self.finished.items()]
            families = [
                ("mie_num_requests_running", "gauge", "Requests in the running batch.",
                 e.running),
                ("mie_num_requests_waiting", "gauge", "Requests waiting to be admitted.",
                 e.waiting),
                ("mie_model_weight_bytes", "gauge", "Bytes of the model's weights as stored.",
                 e.weight_bytes),
                ("mie_kv_cache_bytes", "gauge", "Bytes of the KV pool.", e.kv_cache_bytes),
                ("mie_kv_cache_blocks_total", "gauge", "Blocks in the KV pool.", e.blocks_total),
                ("mie_kv_cache_blocks_free", "gauge", "Blocks on the free list.", e.blocks_free),
                ("mie_prefix_cache_blocks", "gauge", "Blocks indexed by the prefix cache.",
                 e.blocks_cached),
                ("mie_kv_cache_usage_ratio", "gauge",
                 "Fraction of the pool held by requests (blocks only the prefix cache holds "
                 "are reusable, so not counted).",
                 in_use / e.blocks_total if e.blocks_total else 0.0),
                ("mie_prefix_cache_hit_rate", "gauge",
                 "Prompt tokens borrowed from the prefix cache / prompt tokens borrowed or "
                 "computed.",
                 e.prefix_hit_tokens / seen if seen else 0.0),
                ("mie_engine_steps_total", "counter", "Engine steps run.", e.steps),
                ("mie_prompt_tokens_total", "counter",
                 "Prompt tokens computed (recomputation after preemption included).",
                 e.prompt_tokens),
                ("mie_prefix_cache_hit_tokens_total", "counter",
                 "Prompt tokens borrowed from cached blocks.", e.prefix_hit_tokens),
                ("mie_generation_tokens_total", "counter", "Tokens generated.",
                 e.generated_tokens),
                ("mie_num_preemptions_total", "counter", "Sequences preempted.", e.preemptions),
                ("mie_recomputed_tokens_total", "counter",
                 "Prompt tokens recomputed after preemption.", e.recomputed_tokens),
                ("mie_request_finished_total", "counter",
                 "Requests finished, by reason (abort: the client went away or the server "
                 "stopped; error: the engine step running it failed).",
                 finished),
                ("mie_request_rejected_total", "counter",
                 "Requests the engine loop refused (invalid for the engine, or queue full).",
                 self.rejected),
                ("mie_engine_step_failures_total", "counter",
                 "Engine steps that raised; rolled back, their requests ended with an error.",
                 self.step_failures),
                ("mie_time_to_first_token_seconds", "histogram",
                 "From the request's hand-off to the engine loop (parsed and tokenized) to its "
                 "first token.", self.ttft),
                ("mie_inter_token_latency_seconds", "histogram",
                 "Time between two consecutive tokens of one request.", self.itl),
            ]  # fmt: skip
            lines = []
            for name, kind, help_, value in families:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if isinstance(value, Histogram):
                    lines += value.lines(name)
                elif isinstance(value, list):  # labelled samples
                    lines += [f"{name}{labels} {n}" for labels, n in value]
                else:
                    lines.append(f"{name} {value}")
        return "\n".join(lines) + "\n"
