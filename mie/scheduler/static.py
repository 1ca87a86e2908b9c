"""The static-batching baseline: a batch is admitted, then drained before the next one."""

from __future__ import annotations

from mie.scheduler.scheduler import Scheduler
from mie.scheduler.sequence import Sequence


class StaticBatchScheduler(Scheduler):
    """What a server without continuous batching does: nobody joins a batch once it runs.

    Same pool, same limits, same admission and preemption rules as ``Scheduler``; only the
    admission window differs. A batch forms while running is empty or no member has left yet
    (so it fills as fast as the token budget allows), and closes at the first departure --
    a finish, a preemption or an abort. The next batch forms once running is empty.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._batch_closed = False

    def _admission_open(self) -> bool:
        if not self.running:
            self._batch_closed = False
        return not self._batch_closed

    def _on_release(self, seq: Sequence) -> None:
        self._batch_closed = True
