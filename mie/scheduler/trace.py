"""The step trace: one row of numbers per scheduler step, exportable as JSON lines."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepTrace:
    """What one ``Scheduler.step`` did and how memory stood after it.

    Memory is counted in token slots: ``reserved_tokens`` is what the sequences hold (whole
    blocks for the paged scheduler, whole maximum contexts for the contiguous baseline) and
    ``kv_tokens`` what they use (each sequence's token count, shared prefixes counted once
    per sequence). Under a sliding window, leading blocks a sequence has released (and their
    tokens) are in neither ``kv_tokens`` nor the blocks the tables list.
    """

    step: int
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    utilization: float  # reserved_tokens / capacity_tokens
    reserved_tokens: int
    capacity_tokens: int
    kv_tokens: int
    internal_fragmentation: int  # reserved-but-unused slots in the sequences' last blocks
    sharing_saved_fraction: float  # 1 - physical blocks / blocks the tables list
    cached_blocks: int  # blocks the prefix cache alone holds (reusable, evictable)
    preemptions: int
    recomputed_tokens: int  # prefill tokens whose KV had been computed before a preemption
    prefix_hit_tokens: int  # prompt tokens whose KV was borrowed instead of computed
    # Speculative decoding: proposed tokens this step verifies, and how many the model
    # accepted (the engine fills that in once it has verified them).
    spec_tokens: int = 0
    accepted_spec_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def to_jsonl(traces: Iterable[StepTrace]) -> str:
    """One JSON object per line, one line per step."""
    return "".join(json.dumps(t.to_dict()) + "\n" for t in traces)
