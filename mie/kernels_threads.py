"""How many threads the kernels run on: all of them, unless another process holds a core.

A batch-1 decode step opens about a hundred parallel regions (every matrix product, every
attention call), and the threads of each wait for one another at its end. When another
process keeps a core busy, the OS runs one of mie's threads late and at every region's end the
others wait for it: on the 2-core bench VM beside one busy process, a Qwen2-0.5B-shaped int4
step ran at 20-31 tok/s on two threads and at 38-45 on one (44-62 on two, quiet). So the
kernels run on fewer threads while the machine is crowded.

The signal is the process's involuntary context switches (``getrusage``'s ``ru_nivcsw``: the OS
took a core from one of its threads to run another task) per second of forward passes and
thread. A thread of mie's that waits spins, then sleeps -- a voluntary switch -- so with a core
free for each thread there are few: 10-20 a second per thread measured on the bench VM, quiet,
and as few on one thread beside a busy process; two threads beside it brought about 900 a
second per thread. ``ThreadPolicy`` counts them over windows of at least ``WINDOW_SECONDS`` of
forward passes: above ``CROWDED_PER_THREAD_SECOND`` it drops a thread (down to one). Running on
fewer than its ceiling, it tries one more after ``FIRST_PROBE_WINDOWS`` quiet windows, keeps it
if that window stays quiet, and otherwise waits twice as long before the next try (at most
``MAX_PROBE_WINDOWS``), so that a crowded machine costs the tries little and a freed core is
taken back within seconds. Only forward passes are timed: an idle engine's waits count for
nothing.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

WINDOW_SECONDS = 0.1
CROWDED_PER_THREAD_SECOND = 150.0
FIRST_PROBE_WINDOWS = 4
MAX_PROBE_WINDOWS = 64


def involuntary_switches() -> int:
    """The process's involuntary context switches so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


class ThreadPolicy:
    """The kernels' thread count, step by step (see the module docstring).

    ``ceiling``: the threads the kernels were given (``Kernels.threads``); ``set_threads``:
    the kernels' setter, which sets the threads of the calling thread's next kernel calls
    (``step`` sets it around each pass it runs on fewer and restores the ceiling after), so
    the policy must run in the thread that steps (``None``: nothing to set -- the reference
    kernels -- and the policy does nothing); ``switches`` and ``clock``: where the counts and
    the seconds come from (tests give their own)."""

    def __init__(
        self,
        ceiling: int,
        set_threads: Callable[[int], None] | None,
        switches: Callable[[], int] = involuntary_switches,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.ceiling = max(1, ceiling)
        self.threads = self.ceiling
        self.set_threads = set_threads if self.ceiling > 1 else None
        self.switches = switches
        self.clock = clock
        self.window_seconds = 0.0  # forward passes timed in the current window
        self.window_switches = 0
        self.probe_windows = FIRST_PROBE_WINDOWS  # windows to wait before trying one more
        self.quiet_windows = 0  # windows since the last change, all quiet
        self.probing = False  # the current window runs on a thread more, on trial

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one forward pass: runs it on the threads decided so far, then gives the
        kernels back all of them (so that nothing else in the process inherits the count),
        counts the pass's switches and seconds, and at a window's end decides the threads of
        the next passes. A pass that raises is not counted."""
        if self.set_threads is None:
            yield
            return
        reduced = self.threads != self.ceiling
        if reduced:
            self.set_threads(self.threads)
        switches, start = self.switches(), self.clock()
        try:
            yield
        finally:
            if reduced:
                self.set_threads(self.ceiling)
        self.window_seconds += self.clock() - start
        self.window_switches += self.switches() - switches
        if self.window_seconds >= WINDOW_SECONDS:
            limit = CROWDED_PER_THREAD_SECOND * self.threads * self.window_seconds
            crowded = self.window_switches > limit
            self.window_seconds, self.window_switches = 0.0, 0
            self._decide(crowded)

    def _decide(self, crowded: bool) -> None:
        if crowded:
            if self.probing:  # the thread tried was one too many: wait longer next time
                self.probe_windows = min(2 * self.probe_windows, MAX_PROBE_WINDOWS)
            self.probing = False
            self.quiet_windows = 0
            self.threads = max(self.threads - 1, 1)  # set at the next pass
            return
        if self.probing:  # the thread tried kept quiet: keep it
            self.probing = False
            self.probe_windows = FIRST_PROBE_WINDOWS
        self.quiet_windows += 1
        if self.threads < self.ceiling and self.quiet_windows >= self.probe_windows:
            self.probing = True
            self.quiet_windows = 0
            self.threads += 1
