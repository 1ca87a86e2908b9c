"""The static-batching baseline: a batch is admitted, then drained before the next one."""

from __future__ import annotations

from mie.scheduler.batch import BatchEntry
from mie.scheduler.scheduler import Scheduler
from mie.scheduler.sequence import Sequence


class StaticBatchScheduler(Scheduler):
    """What a server without continuous batching does: nobody joins a batch once it runs.

    Same pool, same limits, same admission and preemption rules as ``Scheduler``; only the
    admission window differs. A batch forms while running is empty or no member has left yet
    (so it fills as fast as the token budget allows), and closes at the first departure --
    a finish, a preemption or an abort. The next batch forms once running is empty.

    It owns that difference by extending two of the scheduler's own steps, the ones the
    compiled mirror has too: admission (``_admit``, skipped while the batch is closed) and
    releasing a sequence that leaves ``running`` (``_free``, which closes the batch).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._batch_closed = False

    def _admit(self, scheduled: dict[int, BatchEntry], preempted: list, budget: int) -> None:
        if not self.running:
            self._batch_closed = False  # the last batch drained: the next one forms
        if not self._batch_closed:
            super()._admit(scheduled, preempted, budget)

    def _free(self, seq: Sequence) -> None:
        super()._free(seq)
        self._batch_closed = True
