"""``/metrics`` for many replicas: each replica's Prometheus text, labelled, plus totals.

Each engine replica renders its own ``ServerMetrics`` (the single-process server's metrics,
unchanged). The ingress reads them all and writes one exposition: every sample of replica
``i`` gains the label ``replica="i"``, and a sample labelled ``replica="total"`` adds the
replicas up -- counters, gauges and histogram buckets are summed; the two ratios are
recomputed from the summed parts (``mie_prefix_cache_hit_rate``: hit tokens over hit plus
computed prompt tokens; ``mie_kv_cache_usage_ratio``: weighted by each pool's size), never
averaged. Summing a family over every label would count each replica twice: select
``replica!="total"`` or ``replica="total"``.

Then the ingress's own families: which replicas are up, requests routed to each, requests
that failed because their replica died, and requests refused because every replica was full.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

TOTAL = "total"
_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$"
)


@dataclass
class Family:
    """One metric family: its HELP and TYPE, and samples as (name, labels, value)."""

    name: str
    kind: str = "untyped"
    help: str = ""
    samples: list[tuple[str, str, float]] = field(default_factory=list)


def parse(text: str) -> dict[str, Family]:
    """The families of a Prometheus text exposition, in order (the subset mie writes)."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[len("# HELP ") :].partition(" ")
            current = families.setdefault(name, Family(name))
            current.help = help_
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            current = families.setdefault(name, Family(name))
            current.kind = kind
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            if match is None:
                raise ValueError(f"not a Prometheus sample: {line!r}")
            name = match["name"]
            if current is None or not name.startswith(current.name):
                current = families.setdefault(name, Family(name))
            current.samples.append((name, match["labels"] or "", float(match["value"])))
    return families


def merge(per_replica: Mapping[int, str]) -> dict[str, Family]:
    """The replicas' expositions as one: samples labelled by replica, plus the totals."""
    merged: dict[str, Family] = {}
    totals: dict[str, dict[tuple[str, str], float]] = {}
    parsed = {r: parse(text) for r, text in sorted(per_replica.items())}
    for replica, families in parsed.items():
        for name, family in families.items():
            out = merged.setdefault(name, Family(name, family.kind, family.help))
            sums = totals.setdefault(name, {})
            for sample, labels, value in family.samples:
                out.samples.append((sample, _with_replica(labels, str(replica)), value))
                sums[(sample, labels)] = sums.get((sample, labels), 0.0) + value
    for name, sums in totals.items():
        merged[name].samples += [
            (sample, _with_replica(labels, TOTAL), value)
            for (sample, labels), value in sums.items()
        ]
    _recompute_ratios(merged, parsed)
    return merged


def _recompute_ratios(merged: dict[str, Family], parsed: Mapping[int, dict[str, Family]]) -> None:
    """Replace the summed ratios of the ``total`` row by ratios of the summed parts."""

    def total_of(name: str) -> float:
        return sum(_value(families, name) for families in parsed.values())

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
    total_label = _with_replica("", TOTAL)
    for name, value in ratios.items():
        if name in merged:
            family = merged[name]
            family.samples = [
                (s, labels, value if labels == total_label else v)
                for s, labels, v in family.samples
            ]


def _value(families: Mapping[str, Family], name: str) -> float:
    family = families.get(name)
    return sum(v for _, labels, v in family.samples if not labels) if family else 0.0


def _with_replica(labels: str, replica: str) -> str:
    return f'replica="{replica}"' + (f",{labels}" if labels else "")


def render(families: Mapping[str, Family]) -> str:
    """The exposition text of ``families``."""
    lines = []
    for family in families.values():
        lines += [f"# HELP {family.name} {family.help}", f"# TYPE {family.name} {family.kind}"]
        for sample, labels, value in family.samples:
            shown = int(value) if value.is_integer() and family.kind != "gauge" else value
            lines.append(f"{sample}{{{labels}}} {shown}" if labels else f"{sample} {shown}")
    return "\n".join(lines) + "\n"


@dataclass
class IngressCounts:
    """What the ingress itself counts, per replica."""

    up: dict[int, bool]
    routed: dict[int, int]  # requests handed to the replica (and accepted by it)
    failed: dict[int, int]  # requests that failed because the replica died under them
    rejected: int = 0  # requests refused with a 503: every live replica was full
    fallbacks: int = 0  # prefix routing: requests sent past their much busier owner


def ingress_families(counts: IngressCounts) -> dict[str, Family]:
    """The ingress's own families (see the module doc)."""
    families = [
        Family("mie_replicas_up", "gauge", "Engine replicas answering (of mie_replicas).",
               [("mie_replicas_up", "", float(sum(counts.up.values())))]),
        Family("mie_replicas", "gauge", "Engine replicas deployed.",
               [("mie_replicas", "", float(len(counts.up)))]),
        Family("mie_replica_up", "gauge", "1 if the replica answers, else 0.",
               [("mie_replica_up", _with_replica("", str(r)), float(u))
                for r, u in sorted(counts.up.items())]),
        Family("mie_router_requests_total", "counter",
               "Requests the ingress routed to each replica (and it accepted).",
               [("mie_router_requests_total", _with_replica("", str(r)), float(n))
                for r, n in sorted(counts.routed.items())]),
        Family("mie_replica_failed_requests_total", "counter",
               "Requests that failed because their replica died while running them.",
               [("mie_replica_failed_requests_total", _with_replica("", str(r)), float(n))
                for r, n in sorted(counts.failed.items())]),
        Family("mie_router_fallbacks_total", "counter",
               "Prefix routing: requests sent to the least-loaded replica because the one "
               "owning their prefix was much busier (docs/distributed.md).",
               [("mie_router_fallbacks_total", "", float(counts.fallbacks))]),
        Family("mie_cluster_rejected_total", "counter",
               "Requests refused with a 503 because every live replica's queue was full.",
               [("mie_cluster_rejected_total", "", float(counts.rejected))]),
    ]  # fmt: skip
    return {f.name: f for f in families}
