"""Scheduling: continuous batching over the paged pool, its baselines, and the step trace."""

from mie.scheduler.batch import Batch, BatchEntry
from mie.scheduler.contiguous import ContiguousAllocator, ContiguousScheduler
from mie.scheduler.prefix_cache import PrefixCache
from mie.scheduler.scheduler import RequestTooLongError, Scheduler, SchedulerStallError
from mie.scheduler.sequence import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Sequence
from mie.scheduler.static import StaticBatchScheduler
from mie.scheduler.trace import StepTrace, to_jsonl

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Batch",
    "BatchEntry",
    "ContiguousAllocator",
    "ContiguousScheduler",
    "PrefixCache",
    "RequestTooLongError",
    "Scheduler",
    "SchedulerStallError",
    "Sequence",
    "StaticBatchScheduler",
    "StepTrace",
    "to_jsonl",
]
