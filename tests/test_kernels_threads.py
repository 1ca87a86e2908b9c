"""ThreadPolicy: the kernels' threads follow how crowded the machine is (mie.kernels_threads).

Driven by a fake clock and a fake switch counter: each step is (its seconds, the involuntary
context switches during it). The rule is written out a second time in ``reference_threads``,
from the module docstring, and hypothesis drives both with any sequence of steps."""

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mie.kernels_threads import (
    CROWDED_PER_THREAD_SECOND,
    FIRST_PROBE_WINDOWS,
    MAX_PROBE_WINDOWS,
    WINDOW_SECONDS,
    ThreadPolicy,
)
from tests.conftest import require_fast


class FakeMachine:
    """A clock and a switch counter that passes advance, and the kernels' thread setting:
    ``current`` is what the kernels would run on now (the ceiling until the policy says)."""

    def __init__(self, ceiling: int) -> None:
        self.now = 0.0
        self.count = 0
        self.ceiling = ceiling
        self.current = ceiling
        self.calls = 0

    def set_threads(self, n: int) -> None:
        self.current = n
        self.calls += 1

    def policy(self) -> ThreadPolicy:
        return ThreadPolicy(self.ceiling, self.set_threads, lambda: self.count, lambda: self.now)

    def step(self, policy: ThreadPolicy, seconds: float, switches: int) -> int:
        """One forward pass; returns the threads the kernels ran it on, and checks that
        they are all given back after it."""
        with policy.step():
            threads = self.current
            self.now += seconds
            self.count += switches
        assert self.current == self.ceiling
        return threads


WINDOW = WINDOW_SECONDS * 1.01  # a step that completes a window (in spite of float rounding)
RATE = CROWDED_PER_THREAD_SECOND
CROWDED = (WINDOW, int(2 * RATE * 6 * WINDOW))  # twice the rate, for up to 6 threads
QUIET = (WINDOW, 0)


def test_a_quiet_machine_keeps_every_thread():
    machine = FakeMachine(4)
    policy = machine.policy()
    assert all(machine.step(policy, *QUIET) == 4 for _ in range(100))
    assert machine.calls == 0  # all of them: nothing to set


def test_crowded_windows_drop_a_thread_each_down_to_one():
    machine = FakeMachine(3)
    policy = machine.policy()
    ran = [machine.step(policy, *CROWDED) for _ in range(4)]
    assert ran == [3, 2, 1, 1]


def test_a_window_is_counted_over_steps_until_it_lasts_long_enough():
    """Short steps add up: 0.3 windows' worth of crowding in 10 short steps is one window."""
    machine = FakeMachine(2)
    policy = machine.policy()
    per_step = WINDOW_SECONDS / 10
    switches = int(2 * RATE * 2 * per_step) + 1
    ran = [machine.step(policy, per_step * 1.0001, switches) for _ in range(11)]
    assert ran == [2] * 10 + [1]


def test_switches_below_the_rate_are_quiet():
    machine = FakeMachine(2)
    policy = machine.policy()
    few = int(RATE * 2 * WINDOW)  # at most the rate, per thread: not above it
    assert all(machine.step(policy, WINDOW, few) == 2 for _ in range(20))
    machine.step(policy, WINDOW, int(RATE * 2 * WINDOW) + 2)  # just above it
    assert policy.threads == 1
    few = int(RATE * 1 * WINDOW)  # one thread: half as many
    assert all(machine.step(policy, WINDOW, few) == 1 for _ in range(FIRST_PROBE_WINDOWS))


def test_while_crowded_the_tries_of_one_more_thread_back_off():
    """A machine with one busy process and two cores: crowded on 2 threads, quiet on 1 (each
    process has its core). After FIRST_PROBE_WINDOWS quiet windows the policy tries 2
    threads; crowded again, it goes back to 1 and waits twice as long before the next try,
    up to MAX_PROBE_WINDOWS."""
    machine = FakeMachine(2)
    policy = machine.policy()
    tries = []  # the windows run on 2 threads, after the first
    for window in range(2000):
        ran = machine.step(policy, *(CROWDED if policy.threads == 2 else QUIET))
        if ran == 2 and window:
            tries.append(window)
    assert tries[0] == 1 + FIRST_PROBE_WINDOWS
    gaps = [later - earlier - 1 for earlier, later in zip(tries, tries[1:], strict=False)]
    assert gaps == [
        min(FIRST_PROBE_WINDOWS * 2 ** (i + 1), MAX_PROBE_WINDOWS) for i in range(len(gaps))
    ]
    assert gaps[-1] == MAX_PROBE_WINDOWS  # a try every MAX_PROBE_WINDOWS: ~1/64 of the time


def test_a_freed_core_is_taken_back_within_the_first_try():
    machine = FakeMachine(2)
    policy = machine.policy()
    machine.step(policy, *CROWDED)
    ran = [machine.step(policy, *QUIET) for _ in range(FIRST_PROBE_WINDOWS + 3)]
    assert ran == [1] * FIRST_PROBE_WINDOWS + [2, 2, 2]


def reference_threads(ceiling: int, windows: list[bool]) -> list[int]:
    """The threads each window runs on, as the module docstring's rule says, given whether
    each window is crowded."""
    threads, probe, quiet, probing, ran = ceiling, FIRST_PROBE_WINDOWS, 0, False, []
    for crowded in windows:
        ran.append(threads)
        if crowded:
            if probing:
                probe = min(2 * probe, MAX_PROBE_WINDOWS)
            probing, quiet, threads = False, 0, max(threads - 1, 1)
            continue
        if probing:
            probing, probe = False, FIRST_PROBE_WINDOWS
        quiet += 1
        if threads < ceiling and quiet >= probe:
            probing, quiet, threads = True, 0, threads + 1
    return ran


@settings(max_examples=300, deadline=None)
@given(ceiling=st.integers(1, 6), windows=st.lists(st.booleans(), max_size=300))
def test_the_policy_decides_as_its_rule_says(ceiling, windows):
    machine = FakeMachine(ceiling)
    policy = machine.policy()
    ran = [machine.step(policy, *(CROWDED if crowded else QUIET)) for crowded in windows]
    assert ran == reference_threads(ceiling, windows)
    assert all(1 <= t <= ceiling for t in ran)
    assert machine.calls == 2 * sum(t != ceiling for t in ran)  # set, then given back


def test_kernels_without_a_setter_or_with_one_thread_leave_everything_alone():
    for machine, policy in [
        (m := FakeMachine(4), ThreadPolicy(4, None, lambda: m.count, lambda: m.now)),
        (m1 := FakeMachine(1), m1.policy()),
    ]:
        assert all(machine.step(policy, *CROWDED) == machine.ceiling for _ in range(10))
        assert machine.calls == 0


def test_a_pass_that_raises_gives_the_threads_back_and_is_not_counted():
    machine = FakeMachine(2)
    policy = machine.policy()
    machine.step(policy, *CROWDED)  # now on 1
    for _ in range(3):
        with pytest.raises(RuntimeError), policy.step():
            assert machine.current == 1
            machine.now += 10 * WINDOW
            raise RuntimeError("the model failed")
        assert machine.current == 2
    assert policy.window_seconds == 0  # the failed passes' seconds did not count
    assert policy.threads == 1


THREADS_PROGRAM = """
from mie._fast import ops
from mie.kernels import select_kernels
kernels = select_kernels("fast")
before = ops.max_threads()
kernels.set_threads(1)
after = ops.max_threads()
print(kernels.threads, before, after)
"""


def test_the_compiled_kernels_threads_can_be_set():
    """``Kernels.threads`` is what OMP_NUM_THREADS gave; ``set_threads`` changes what the
    next kernel calls run on (OpenMP's limit for the calling thread)."""
    require_fast()
    import mie._fast.ops as ops

    if not ops.OPENMP:
        pytest.skip("built without OpenMP: one thread, nothing to set")
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    done = subprocess.run(
        [sys.executable, "-c", THREADS_PROGRAM], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "3", "1"]


def test_the_engine_runs_its_forward_passes_under_its_policy():
    """LLMEngine.step runs the model inside its ThreadPolicy: once a window is crowded the
    next passes run on one thread fewer, and outside them the kernels have all of theirs."""
    require_fast()
    import mie._fast.ops as ops

    from mie.engine.sampling import SamplingParams
    from tests.conftest import STORIES, engine_of

    if not ops.OPENMP:
        pytest.skip("built without OpenMP: one thread, nothing to set")
    ceiling = max(2, ops.THREADS)  # at least one to drop, even on a one-core machine
    engine = engine_of(str(STORIES), "fast")
    ticks = iter(range(10**6))
    engine.thread_policy = ThreadPolicy(
        ceiling,
        ops.set_threads,
        switches=lambda: next(ticks) * 10**6,  # every pass crowded
        clock=lambda: next(ticks) * WINDOW,  # every pass a window long
    )
    ran = []
    forward = engine.model.forward

    def recording_forward(*args, **kwargs):
        ran.append(ops.max_threads())
        return forward(*args, **kwargs)

    engine.model.forward = recording_forward
    engine.add_request("Once upon a time", SamplingParams(max_tokens=4, temperature=0.0))
    try:
        ops.set_threads(ceiling)
        while engine.has_unfinished_requests():
            engine.step()
            assert ops.max_threads() == ceiling
    finally:
        ops.set_threads(ops.THREADS)
    assert ran[:ceiling] == list(range(ceiling, 0, -1))
    assert all(t == 1 for t in ran[ceiling:])
