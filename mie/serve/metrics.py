"""``GET /metrics``: the server's state and totals, written by ``prometheus_client``.

Two sets of names, side by side:

* **vLLM's** (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``...), with
  vLLM's labels (``model_name``, ``engine``) and histogram buckets, as vLLM v1 defines them
  in ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``), so that a dashboard built
  for vLLM (Grafana's vLLM dashboard) shows mie unchanged.
* **mie's own** (``mie_*``, unlabelled): what vLLM has no name for (the pool in blocks and
  bytes, recomputed tokens, refusals, failed steps), and mie's finer latency buckets.

Each server has its own ``CollectorRegistry`` (never the process-wide default), so several
servers in one process do not collide. The engine thread writes: a snapshot of the engine
after every step, latencies and finished requests as tokens go out. HTTP handlers read:
``render`` runs ``generate_latest`` under the same lock the writers take, so one scrape sees
one consistent state. Gauges and totals come from the snapshot through a collector
(``_Families``); histograms are ``prometheus_client`` histograms, observed as tokens go out.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

METRICS_MEDIA_TYPE = CONTENT_TYPE_LATEST  # Prometheus' text format, as prometheus_client writes it

# mie's buckets, in seconds. TTFT includes the wait for admission, so its buckets reach
# further than ITL's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# vLLM's labels and buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
VLLM_LABELS = ("model_name", "engine")
VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

FINISH_REASONS = ("stop", "length", "abort", "error")  # error: its engine step failed


@dataclass
class EngineSnapshot:
    """The engine's numbers after a step, copied by the engine thread."""

    running: int = 0
    waiting: int = 0
    unfinished: int = 0  # requests, each once (running and waiting count sequences)
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0  # held by the prefix cache (some may also be in use)
    blocks_cache_only: int = 0  # held by the prefix cache alone: reusable at once
    prefix_caching: bool = False  # whether the engine looks prompts up in a prefix cache
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefix_hit_tokens: int = 0
    spec_drafts: int = 0  # speculative decoding: verifications, proposed and accepted tokens
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    weight_bytes: int = 0  # the model's weights as stored (bfloat16: half of float32)
    kv_cache_bytes: int = 0  # the whole KV pool, used or not

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool held by requests (blocks only the prefix cache holds are
        reusable, so not counted: vLLM counts them free too)."""
        in_use = self.blocks_total - self.blocks_free - self.blocks_cache_only
        return in_use / self.blocks_total if self.blocks_total else 0.0


class ServerMetrics:
    """One server's (or one Ray replica's) metrics; ``render`` writes the exposition.

    ``model_name`` and ``engine_index`` are the values of vLLM's ``model_name`` and
    ``engine`` labels: the served model's name, and the replica's index (0 alone)."""

    def __init__(self, model_name: str = "mie", engine_index: int = 0) -> None:
        self.engine = EngineSnapshot()
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected = 0  # refused by the engine loop: invalid for the engine, or queue full
        self.step_failures = 0  # engine steps that raised (rolled back; their requests ended)
        self.requests_prompt_tokens = 0  # whole prompts, counted at each request's first token
        self.lock = threading.Lock()
        self.labels = (model_name, str(engine_index))
        self.registry = CollectorRegistry()
        self.registry.register(_Families(self))

        def histogram(name: str, help_: str, buckets: tuple[float, ...], vllm: bool = True):
            if not vllm:
                return Histogram(name, help_, buckets=buckets, registry=self.registry)
            family = Histogram(name, help_, VLLM_LABELS, buckets=buckets, registry=self.registry)
            return family.labels(*self.labels)

        ttft = (
            "From the request's hand-off to the engine loop (parsed, tokenized) to its first token."
        )
        itl = "Time between two consecutive tokens of one request."
        self.ttft = [
            histogram("mie_time_to_first_token_seconds", ttft, TTFT_BUCKETS, vllm=False),
            histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                VLLM_TTFT_BUCKETS,
            ),
        ]
        self.itl = [
            histogram("mie_inter_token_latency_seconds", itl, ITL_BUCKETS, vllm=False),
            histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                VLLM_ITL_BUCKETS,
            ),
            # vLLM's older name for the same observations
            histogram(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                VLLM_ITL_BUCKETS,
            ),
        ]
        e2e = "Histogram of e2e request latency in seconds."
        self.e2e = histogram("vllm:e2e_request_latency_seconds", e2e, VLLM_REQUEST_LATENCY_BUCKETS)

    # -- the engine thread's side ----------------------------------------------------------------
    def update_engine(self, engine) -> None:
        """Copy the engine's state; called by the engine thread, the engine's only user."""
        cache = engine.scheduler.prefix_cache
        stats = engine.stats
        snapshot = EngineSnapshot(
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            unfinished=engine.num_unfinished_requests,
            blocks_total=engine.pool.num_blocks,
            blocks_free=engine.pool.num_free,
            blocks_cached=cache.num_cached if cache else 0,
            blocks_cache_only=cache.num_evictable if cache else 0,
            prefix_caching=cache is not None,
            steps=stats.steps,
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens,
            preemptions=stats.preemptions,
            recomputed_tokens=stats.recomputed_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            spec_drafts=stats.spec_drafts,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
            weight_bytes=engine.weight_bytes,
            kv_cache_bytes=engine.pool.num_blocks * engine.pool.bytes_per_block,
        )
        with self.lock:
            self.engine = snapshot

    def observe_token(self, ttft: float | None, itl: float | None, prompt_tokens: int = 0) -> None:
        """A request's new token: ``ttft`` for its first (then ``prompt_tokens`` is its
        prompt's length), ``itl`` for the others."""
        with self.lock:
            if ttft is not None:
                for h in self.ttft:
                    h.observe(ttft)
                self.requests_prompt_tokens += prompt_tokens
            if itl is not None:
                for h in self.itl:
                    h.observe(itl)

    def count_finished(self, reason: str, e2e: float | None = None) -> None:
        """A request ended with ``reason``; ``e2e``: seconds from its hand-off to its end."""
        with self.lock:
            self.finished[reason] += 1
            if e2e is not None:
                self.e2e.observe(e2e)

    def count_rejected(self) -> None:
        with self.lock:
            self.rejected += 1

    def count_step_failure(self) -> None:
        with self.lock:
            self.step_failures += 1

    # -- the handlers' side --------------------------------------------------------------------
    def render(self) -> str:
        """The exposition text (``METRICS_MEDIA_TYPE``), one consistent state."""
        with self.lock:
            return generate_latest(self.registry).decode()


class _Families:
    """The gauges and totals, read from ``ServerMetrics`` (``render`` holds its lock)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m, e = self.metrics, self.metrics.engine
        seen = e.prompt_tokens + e.prefix_hit_tokens  # every admission looks its tokens up
        yield from _vllm_families(m, e, seen)
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield gauge("mie_num_requests_running", "Requests in the running batch.", e.running)
        yield gauge("mie_num_requests_waiting", "Requests waiting to be admitted.", e.waiting)
        yield gauge(
            "mie_num_requests_unfinished",
            "Requests the engine holds, each counted once whatever its samples (the running "
            "and waiting gauges count sequences: a request's forked samples too).",
            e.unfinished,
        )
        yield gauge(
            "mie_model_weight_bytes", "Bytes of the model's weights as stored.", e.weight_bytes
        )
        yield gauge("mie_kv_cache_bytes", "Bytes of the KV pool.", e.kv_cache_bytes)
        yield gauge("mie_kv_cache_blocks_total", "Blocks in the KV pool.", e.blocks_total)
        yield gauge("mie_kv_cache_blocks_free", "Blocks on the free list.", e.blocks_free)
        yield gauge(
            "mie_prefix_cache_blocks", "Blocks indexed by the prefix cache.", e.blocks_cached
        )
        yield gauge(
            "mie_kv_cache_usage_ratio",
            "Fraction of the pool held by requests (blocks only the prefix cache holds are "
            "reusable, so not counted).",
            e.kv_cache_usage,
        )
        yield gauge(
            "mie_prefix_cache_hit_rate",
            "Prompt tokens borrowed from the prefix cache / prompt tokens borrowed or computed.",
            e.prefix_hit_tokens / seen if seen else 0.0,
        )
        yield counter("mie_engine_steps_total", "Engine steps run.", e.steps)
        yield counter(
            "mie_prompt_tokens_total",
            "Prompt tokens computed (recomputation after preemption included).",
            e.prompt_tokens,
        )
        yield counter(
            "mie_prefix_cache_hit_tokens_total",
            "Prompt tokens borrowed from cached blocks.",
            e.prefix_hit_tokens,
        )
        yield counter("mie_generation_tokens_total", "Tokens generated.", e.generated_tokens)
        yield counter("mie_num_preemptions_total", "Sequences preempted.", e.preemptions)
        yield counter(
            "mie_recomputed_tokens_total",
            "Prompt tokens recomputed after preemption.",
            e.recomputed_tokens,
        )
        yield counter(
            "mie_request_rejected_total",
            "Requests the engine loop refused (invalid for the engine, or queue full).",
            m.rejected,
        )
        yield counter(
            "mie_engine_step_failures_total",
            "Engine steps that raised; rolled back, their requests ended with an error.",
            m.step_failures,
        )
        drafted = e.spec_draft_tokens
        yield gauge(
            "mie_spec_decode_acceptance_rate",
            "Speculative decoding: proposed tokens accepted / proposed tokens verified.",
            e.spec_accepted_tokens / drafted if drafted else 0.0,
        )
        yield gauge(
            "mie_spec_decode_mean_acceptance_length",
            "Speculative decoding: tokens a verification yields on average (1 + accepted "
            "proposals per verification).",
            1 + e.spec_accepted_tokens / e.spec_drafts if e.spec_drafts else 0.0,
        )
        finished = counter(
            "mie_request_finished_total",
            "Requests finished, by reason (abort: the client went away or the server stopped; "
            "error: the engine step running it failed).",
            labels=["finish_reason"],
        )
        for reason, n in m.finished.items():
            finished.add_metric([reason], n)
        yield finished


def _vllm_families(m: ServerMetrics, e: EngineSnapshot, seen: int):
    """vLLM's gauges and counters: its names, help texts and labels."""

    def labelled(kind, name: str, help_: str, value: float):
        family = kind(name, help_, labels=VLLM_LABELS)
        family.add_metric(m.labels, value)
        return family

    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    running = "Number of requests in model execution batches."
    yield labelled(gauge, "vllm:num_requests_running", running, e.running)
    waiting = "Number of requests waiting to be processed."
    yield labelled(gauge, "vllm:num_requests_waiting", waiting, e.waiting)
    usage = "KV-cache usage. 1 means 100 percent usage."
    yield labelled(gauge, "vllm:kv_cache_usage_perc", usage, e.kv_cache_usage)
    usage = f"GPU {usage} (vLLM's older name for vllm:kv_cache_usage_perc; any device here)"
    yield labelled(gauge, "vllm:gpu_cache_usage_perc", usage, e.kv_cache_usage)
    prompt = "Number of prefill tokens processed (whole prompts, cached tokens included)."
    yield labelled(counter, "vllm:prompt_tokens", prompt, m.requests_prompt_tokens)
    generation = "Number of generation tokens processed."
    yield labelled(counter, "vllm:generation_tokens", generation, e.generated_tokens)
    preemptions = "Cumulative number of preemption from the engine."
    yield labelled(counter, "vllm:num_preemptions", preemptions, e.preemptions)
    queries = "Prefix cache queries, in terms of number of queried tokens."
    queried = seen if e.prefix_caching else 0
    yield labelled(counter, "vllm:prefix_cache_queries", queries, queried)
    hits = "Prefix cache hits, in terms of number of cached tokens."
    yield labelled(counter, "vllm:prefix_cache_hits", hits, e.prefix_hit_tokens)
    drafts = "Number of spec decoding drafts."
    yield labelled(counter, "vllm:spec_decode_num_drafts", drafts, e.spec_drafts)
    draft_tokens = "Number of draft tokens."
    yield labelled(counter, "vllm:spec_decode_num_draft_tokens", draft_tokens, e.spec_draft_tokens)
    accepted = "Number of accepted tokens."
    yield labelled(
        counter, "vllm:spec_decode_num_accepted_tokens", accepted, e.spec_accepted_tokens
    )
    success = counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=[*VLLM_LABELS, "finished_reason"],
    )
    for reason, n in m.finished.items():
        success.add_metric([*m.labels, reason], n)
    yield success
