"""``/metrics`` for many replicas: each replica's exposition, labelled, plus totals.

Each engine replica renders its own ``ServerMetrics`` (the single-process server's metrics,
unchanged; its ``engine`` label is the replica's index). The ingress parses them all with
``prometheus_client``'s parser and writes one exposition with ``generate_latest``: every
sample of replica ``i`` gains the label ``replica="i"``. mie's families (``mie_*``) also get a
sample labelled ``replica="total"`` that adds the replicas up -- counters, gauges and
histogram buckets are summed; the two ratios are recomputed from the summed parts
(``mie_prefix_cache_hit_rate``: hit tokens over hit plus computed prompt tokens;
``mie_kv_cache_usage_ratio``: weighted by each pool's size), never averaged. Summing a mie
family over every label would count each replica twice: select ``replica!="total"`` or
``replica="total"``. vLLM's families (``vllm:*``) get no total, as in vLLM with several
engines: one series per ``engine``, which vLLM's dashboards sum themselves; their
``model_name`` is the ingress's served name.

Then the ingress's own families: which replicas are up, requests routed to each, requests
that failed because their replica died, and requests refused because every replica was full.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

TOTAL = "total"
VLLM_PREFIX = "vllm:"


def parse(text: str) -> dict[str, Metric]:
    """The families of a Prometheus text exposition, by name, in order."""
    try:
        return {family.name: family for family in text_string_to_metric_families(text)}
    except ValueError as exc:
        raise ValueError(f"not a Prometheus sample: {exc}") from exc


def merge(per_replica: Mapping[int, str], model_name: str | None = None) -> dict[str, Metric]:
    """The replicas' expositions as one: samples labelled by replica, plus mie's totals.

    ``model_name``, if given, replaces the ``model_name`` label of vLLM's families."""
    merged: dict[str, Metric] = {}
    totals: dict[str, dict[tuple[str, tuple], float]] = {}
    parsed = {r: parse(text) for r, text in sorted(per_replica.items())}
    for replica, families in parsed.items():
        for name, family in families.items():
            out = merged.get(name)
            if out is None:
                out = merged[name] = Metric(name, family.documentation, family.type)
            vllm = name.startswith(VLLM_PREFIX)
            summed = not vllm and not name.endswith("_created")  # a time, not an amount
            sums = totals.setdefault(name, {})
            for sample in family.samples:
                labels = dict(sample.labels)
                if vllm and model_name is not None and "model_name" in labels:
                    labels["model_name"] = model_name
                out.add_sample(sample.name, {"replica": str(replica), **labels}, sample.value)
                if summed:
                    key = (sample.name, tuple(labels.items()))
                    sums[key] = sums.get(key, 0.0) + sample.value
    for name, sums in totals.items():
        for (sample, labels), value in sums.items():
            merged[name].add_sample(sample, {"replica": TOTAL, **dict(labels)}, value)
    _recompute_ratios(merged, parsed)
    return merged


def _recompute_ratios(merged: dict[str, Metric], parsed: Mapping[int, dict[str, Metric]]) -> None:
    """Replace the summed ratios of the ``total`` row by ratios of the summed parts."""

    def total_of(sample: str) -> float:
        return sum(_value(families, sample) for families in parsed.values())

    hits = total_of("mie_prefix_cache_hit_tokens_total")
    seen = total_of("mie_prompt_tokens_total") + hits
    blocks = total_of("mie_kv_cache_blocks_total")
    in_use = sum(
        _value(f, "mie_kv_cache_usage_ratio") * _value(f, "mie_kv_cache_blocks_total")
        for f in parsed.values()
    )
    ratios = {
        "mie_prefix_cache_hit_rate": hits / seen if seen else 0.0,
        "mie_kv_cache_usage_ratio": in_use / blocks if blocks else 0.0,
    }
    for name, value in ratios.items():
        if name in merged:
            family = merged[name]
            family.samples = [
                s._replace(value=value) if s.labels == {"replica": TOTAL} else s
                for s in family.samples
            ]


def _value(families: Mapping[str, Metric], sample: str) -> float:
    """The unlabelled sample named ``sample`` (0 if absent)."""
    return sum(
        s.value
        for family in families.values()
        for s in family.samples
        if s.name == sample and not s.labels
    )


class _Families:
    """A collector that yields families already built (``render``)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self):
        return iter(self.families)


def render(families: Mapping[str, Metric]) -> str:
    """The exposition text of ``families``, written by ``prometheus_client``."""
    registry = CollectorRegistry()
    registry.register(_Families(families.values()))
    return generate_latest(registry).decode()


@dataclass
class IngressCounts:
    """What the ingress itself counts, per replica."""

    up: dict[int, bool]
    routed: dict[int, int]  # requests handed to the replica (and accepted by it)
    failed: dict[int, int]  # requests that failed because the replica died under them
    rejected: int = 0  # requests refused with a 503: every live replica was full
    fallbacks: int = 0  # prefix routing: requests sent past their much busier owner


def ingress_families(counts: IngressCounts) -> dict[str, Metric]:
    """The ingress's own families (see the module doc)."""

    def per_replica(kind, name: str, help_: str, values: Mapping[int, float]) -> Metric:
        family = kind(name, help_, labels=["replica"])
        for r, v in sorted(values.items()):
            family.add_metric([str(r)], float(v))
        return family

    families = [
        GaugeMetricFamily(
            "mie_replicas_up",
            "Engine replicas answering (of mie_replicas).",
            value=sum(counts.up.values()),
        ),
        GaugeMetricFamily("mie_replicas", "Engine replicas deployed.", value=len(counts.up)),
        per_replica(
            GaugeMetricFamily, "mie_replica_up", "1 if the replica answers, else 0.", counts.up
        ),
        per_replica(
            CounterMetricFamily,
            "mie_router_requests_total",
            "Requests the ingress routed to each replica (and it accepted).",
            counts.routed,
        ),
        per_replica(
            CounterMetricFamily,
            "mie_replica_failed_requests_total",
            "Requests that failed because their replica died while running them.",
            counts.failed,
        ),
        CounterMetricFamily(
            "mie_router_fallbacks_total",
            "Prefix routing: requests sent to the least-loaded replica because "
            "the one owning their prefix was much busier (docs/distributed.md).",
            value=counts.fallbacks,
        ),
        CounterMetricFamily(
            "mie_cluster_rejected_total",
            "Requests refused with a 503 because every live replica's queue was full.",
            value=counts.rejected,
        ),
    ]
    return {f.name: f for f in families}
