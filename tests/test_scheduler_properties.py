"""Hypothesis properties of the scheduler over random workloads, pools and interleavings.

The oracle is ``expected_output``: each request's tokens fed to the model alone, with no
scheduler, no block table and no cache. The model reads every token back through the block
tables, so batching, sharing, caching, preemption and abort can only pass by keeping every
sequence's KV exactly right. Under a sliding window the model reads only the window (and
fails on a released block), the oracle computes only from the window, and every sequence must
hold no more than one window's blocks between steps.
"""

import pytest
from conftest import backend_named, needs_fast
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from scheduler_model import STOP, VOCAB, KVModel, expected_output, kv_pool, scheduler_and_model

from mie.backend import PYTHON, select
from mie.extension import BACKENDS
from mie.scheduler import (
    ContiguousScheduler,
    RequestTooLongError,
    Scheduler,
    StaticBatchScheduler,
)
from mie.scheduler.scheduler import window_blocks

# A few shared "system prompts" so that sharing and caching really happen.
PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12], [20] * 9, [5, 6, 7]]
tokens = st.integers(1, VOCAB - 1)
prompts = st.builds(
    lambda prefix, tail: PREFIXES[prefix] + tail,
    st.integers(0, len(PREFIXES) - 1),
    st.lists(tokens, min_size=1, max_size=6),
)
requests = st.tuples(prompts, st.integers(1, 12))

MODES = {
    "continuous, no sharing": (Scheduler, {"prefix_sharing": False}),
    "continuous, running sharing": (Scheduler, {}),
    "continuous, prefix cache": (Scheduler, {"prefix_caching": True}),
    "chunked, no sharing": (Scheduler, {"prefix_sharing": False, "enable_chunked_prefill": True}),
    "chunked, running sharing": (Scheduler, {"enable_chunked_prefill": True}),
    "chunked, prefix cache": (Scheduler, {"prefix_caching": True, "enable_chunked_prefill": True}),
    "static, running sharing": (StaticBatchScheduler, {}),
    "static, prefix cache": (StaticBatchScheduler, {"prefix_caching": True}),
    "contiguous": (ContiguousScheduler, None),
}


def build(mode, num_blocks, block_size, max_num_seqs, budget, backend=PYTHON, window=None):
    """The mode's scheduler over a pool of ``backend``: the backend's own ``Scheduler`` (the
    Cython mirror on the fast backend) or a reference baseline, which takes either pool;
    ``window``: its sliding window (the contiguous baseline has none)."""
    cls, kwargs = MODES[mode]
    if kwargs is not None and window is not None:
        kwargs = {**kwargs, "sliding_window": window}
    cls = backend.Scheduler if cls is Scheduler else cls
    if kwargs is None:  # the contiguous arena is the memory limit; its pool never is
        capacity = num_blocks * block_size
        blocks = cls.min_pool_blocks(capacity, block_size, max_num_seqs)
        pool = kv_pool(blocks, block_size, backend.BlockPool)
        sched = cls(pool, block_size, max_num_seqs, budget, capacity_tokens=capacity)
    else:
        pool = kv_pool(num_blocks, block_size, backend.BlockPool)
        sched = cls(pool, block_size, max_num_seqs, budget, **kwargs)
    return sched, KVModel(pool, block_size, window if kwargs is not None else None)


def chunked(mode) -> bool:
    return mode.startswith("chunked")


def fits(prompt, max_tokens, num_blocks, block_size, budget, chunked=False, window=None):
    """Whether a request can ever run: with chunked prefill the budget limits nothing, and a
    sliding window then needs only one window's blocks."""
    kv_tokens = len(prompt) + max_tokens - 1
    blocks = -(-kv_tokens // block_size)
    if chunked and window is not None:
        blocks = min(blocks, window_blocks(window, block_size))
    return (chunked or kv_tokens <= budget) and blocks <= num_blocks


def note_events(batch, block_size):
    """Label what a step exercised (``pytest --hypothesis-show-statistics`` shows how often)."""
    if batch.preempted:
        event("preemption")
    hits = [e for e in batch.entries if e.is_prefill and e.start]
    if hits:
        event("prefix reused")
    if any(e.start % block_size for e in hits):
        event("partly shared block copied on write")
    if any(e.seq.num_preemptions for e in hits):
        event("readmission reusing KV")
    if any(e.is_prefill and not e.samples for e in batch.entries):
        event("prompt chunk ending inside the prompt")
    if any(e.context_len % block_size for e in batch.entries if not e.samples):
        event("chunk ending mid-block")


def assert_progress(batch, waiting, idle, mode=None):
    """No step may be one that every later step would repeat (a livelock): with
    requests ``waiting`` and nothing running before it (``idle``), nothing can change unless
    the step admits the head of the queue -- so its batch must not be empty. (The scheduler
    raises ``SchedulerStallError`` rather than return such a batch; this says what is
    required whatever it raises.)"""
    if waiting and idle:
        assert batch.entries, ("an idle scheduler admitted nothing", mode, waiting[0])
        assert batch.entries[0].seq is waiting[0], mode  # the head of the queue, first


@st.composite
def scenarios(draw):
    """A workload and limits that fit its largest request, often with little to spare; and
    a token budget for chunked prefill, from 1 (max_num_seqs 1) up, mostly tiny."""
    workload = draw(st.lists(requests, min_size=1, max_size=10))
    block_size = draw(st.integers(1, 4))
    max_num_seqs = draw(st.integers(1, 3))
    largest = max(len(p) + m - 1 for p, m in workload)
    num_blocks = -(-largest // block_size) + draw(st.integers(0, 8))
    budget = max(largest, max_num_seqs) + draw(st.integers(0, 8))
    chunk_budget = max_num_seqs + draw(st.sampled_from([0, 0, 1, 2, 4, 6, 12, 30]))
    return workload, num_blocks, block_size, max_num_seqs, budget, chunk_budget


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_every_mode_gives_every_request_its_own_output(backend_name):
    """Continuous or static, with or without sharing or caching, paged or contiguous, over
    either allocator backend: every request finishes with exactly the tokens it would get
    alone, and nothing leaks."""
    every_mode_gives_every_request_its_own_output(backend_named(backend_name))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def every_mode_gives_every_request_its_own_output(backend, scenario):
    workload, num_blocks, block_size, max_num_seqs, budget, chunk_budget = scenario
    for mode in MODES:
        limit = chunk_budget if chunked(mode) else budget
        sched, model = build(mode, num_blocks, block_size, max_num_seqs, limit, backend)
        seqs = [sched.submit(prompt, max_tokens, [STOP]) for prompt, max_tokens in workload]
        while sched.has_unfinished():
            waiting, idle = list(sched.waiting), not sched.running
            batch = sched.step()
            note_events(batch, block_size)
            assert_progress(batch, waiting, idle, mode)
            assert sum(e.num_tokens for e in batch.entries) <= limit, mode
            admitted = [e.seq for e in batch.entries if e.seq in waiting]
            assert admitted == waiting[: len(admitted)], mode  # strict FCFS
            sched.commit(batch, model(batch))
            sched.check_integrity()
        for seq, (prompt, max_tokens) in zip(seqs, workload, strict=True):
            assert seq.output_token_ids == expected_output(prompt, max_tokens, [STOP]), mode
        pool = sched.pool
        idle_cached = sched.prefix_cache.num_evictable if sched.prefix_cache else 0
        assert pool.num_free + idle_cached == pool.num_blocks, mode
        sched.clear_prefix_cache()
        assert pool.num_free == pool.num_blocks, mode


windows = st.integers(1, 9)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_windowed_modes_give_every_request_its_windowed_output(backend_name):
    """A sliding window shorter than most requests, every paged mode, either backend: outputs
    equal the windowed oracle's (no read of a released block), integrity after every step, at
    most one window's blocks per sequence between steps, nothing leaked."""
    windowed_modes_give_every_request_its_windowed_output(backend_named(backend_name))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), window=windows, long_tail=st.integers(0, 24))
def windowed_modes_give_every_request_its_windowed_output(backend, scenario, window, long_tail):
    workload, num_blocks, block_size, max_num_seqs, budget, chunk_budget = scenario
    # long generations, crossing the window several times
    workload = [(p, m + long_tail) for p, m in workload]
    largest = max(len(p) + m - 1 for p, m in workload)
    bound = window_blocks(window, block_size)
    for mode in MODES:
        if MODES[mode][1] is None:
            continue  # the contiguous baseline has no window
        limit = chunk_budget if chunked(mode) else max(budget, largest)
        # computing prompts whole: room for the largest request; chunked: as little as one
        # window's blocks (what check_request_fits asks), up to the largest request's
        blocks = max(num_blocks, -(-largest // block_size))
        if chunked(mode):
            blocks = max(min(bound, blocks), min(num_blocks, blocks))
        sched, model = build(mode, blocks, block_size, max_num_seqs, limit, backend, window)
        seqs = [sched.submit(prompt, max_tokens, [STOP]) for prompt, max_tokens in workload]
        while sched.has_unfinished():
            waiting, idle = list(sched.waiting), not sched.running
            batch = sched.step()
            note_events(batch, block_size)
            assert_progress(batch, waiting, idle, mode)
            sched.commit(batch, model(batch))
            sched.check_integrity()
            for seq in sched.running:
                held = seq.table.num_blocks - seq.table.num_released
                assert held <= bound, (mode, seq, held, bound)
            if any(s.table.num_released for s in sched.running):
                event("blocks released")
        for seq, (prompt, max_tokens) in zip(seqs, workload, strict=True):
            expected = expected_output(prompt, max_tokens, [STOP], window)
            assert seq.output_token_ids == expected, mode
        pool = sched.pool
        idle_cached = sched.prefix_cache.num_evictable if sched.prefix_cache else 0
        assert pool.num_free + idle_cached == pool.num_blocks, mode
        sched.clear_prefix_cache()
        assert pool.num_free == pool.num_blocks, mode


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_cached_prefix_longer_than_the_window_is_borrowed_in_a_full_pool(backend_name):
    """The window livelock, in general: one request fills a small pool and is cached, then a
    longer one that starts with it arrives. The blocks it borrows are idle cached ones, and
    often nothing is free; those wholly before its window go straight back. Every step of an
    idle scheduler admits, and it gets its windowed output."""
    cached_prefix_longer_than_the_window_is_borrowed_in_a_full_pool(backend_named(backend_name))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 4),
    window=windows,
    chunked=st.booleans(),
    first=st.lists(tokens, min_size=1, max_size=24),
    tail=st.lists(tokens, min_size=1, max_size=12),
    max_tokens=st.integers(1, 6),
    extra_blocks=st.integers(0, 2),
    chunk_budget=st.integers(1, 16),
)
def cached_prefix_longer_than_the_window_is_borrowed_in_a_full_pool(
    backend, block_size, window, chunked, first, tail, max_tokens, extra_blocks, chunk_budget
):
    second = first + tail
    # the fewest blocks both requests fit in (check_request_fits' rule), and a little more
    kv_tokens = len(second) + max_tokens - 1
    need = -(-kv_tokens // block_size)
    if chunked:
        need = min(need, window_blocks(window, block_size))
    num_blocks = max(need, -(-len(first) // block_size)) + extra_blocks
    budget = chunk_budget if chunked else kv_tokens
    sched, model = scheduler_and_model(
        backend,
        num_blocks,
        block_size,
        1,
        budget,
        prefix_caching=True,
        enable_chunked_prefill=chunked,
        sliding_window=window,
    )
    seqs = [sched.submit(first, 1, [STOP])]
    for prompt in (None, second):
        if prompt is not None:
            seqs.append(sched.submit(prompt, max_tokens, [STOP]))
        for _ in range(1000):
            if not sched.has_unfinished():
                break
            waiting, idle = list(sched.waiting), not sched.running
            batch = sched.step()
            assert_progress(batch, waiting, idle)
            sched.commit(batch, model(batch))
            sched.check_integrity()
        if sched.pool.num_free == 0 and prompt is None:
            event("the first request left no block free")
    assert not sched.has_unfinished()
    assert seqs[0].output_token_ids == expected_output(first, 1, [STOP], window)
    assert seqs[1].output_token_ids == expected_output(second, max_tokens, [STOP], window)


class SchedulerMachine(RuleBasedStateMachine):
    """Random submit / step / abort interleavings; every invariant after every step."""

    backend_name = "python"

    @initialize(
        mode=st.sampled_from(sorted(MODES)),
        capacity=st.integers(6, 32),  # token slots; some requests will not fit
        block_size=st.integers(1, 4),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(4, 24),
        first=st.lists(requests, min_size=1, max_size=6),
        window=st.one_of(st.none(), windows),
    )
    def setup(self, mode, capacity, block_size, max_num_seqs, budget, first, window):
        num_blocks = -(-capacity // block_size)
        if chunked(mode):  # tiny budgets too: down to one token per running sequence
            budget = max(max_num_seqs, budget - 12)
        if MODES[mode][1] is None:
            window = None  # the contiguous baseline has no window
        self.window = window
        self.limits = (num_blocks, block_size, budget, chunked(mode), window)
        self.sched, self.model = build(
            mode, num_blocks, block_size, max_num_seqs, budget, select(self.backend_name), window
        )
        self.expected = {}  # seq -> its oracle output
        self.aborted = set()
        self.submit(first)

    @rule(batch=st.lists(requests, min_size=1, max_size=3))
    def submit(self, batch):
        for prompt, max_tokens in batch:
            if fits(prompt, max_tokens, *self.limits):
                seq = self.sched.submit(prompt, max_tokens, [STOP])
                self.expected[seq] = expected_output(prompt, max_tokens, [STOP], self.window)
                continue
            waiting = list(self.sched.waiting)
            try:
                self.sched.submit(prompt, max_tokens, [STOP])
            except RequestTooLongError:
                assert list(self.sched.waiting) == waiting
                continue
            raise AssertionError("accepted a request that cannot fit")

    @rule(abort_one=st.booleans(), data=st.data())
    def step(self, abort_one, data):
        sched = self.sched
        running, waiting = list(sched.running), list(sched.waiting)
        tokens = {s: list(s.token_ids) for s in running + waiting}
        batch = sched.step()
        note_events(batch, self.limits[1])
        assert_progress(batch, waiting, not running)
        sched.check_integrity()
        assert sum(e.num_tokens for e in batch.entries) <= self.limits[2], "over the budget"
        # FCFS: the newly admitted are the front of waiting, in order
        admitted = [s for s in sched.running if s not in running]
        assert admitted == waiting[: len(admitted)]
        # LIFO: victims were taken from the back, newest first, and lost no token
        victims = list(batch.preempted)
        assert [s.seq_id for s in victims] == sorted((s.seq_id for s in victims), reverse=True)
        assert all(v.seq_id > s.seq_id for v in victims for s in sched.running)
        for seq in victims:
            assert seq.token_ids == tokens[seq] and seq in sched.waiting
        answers = self.model(batch)
        if abort_one and batch.entries:  # an abort between step() and commit()
            entry = data.draw(st.sampled_from(batch.entries))
            sched.abort(entry.seq.seq_id)
            self.aborted.add(entry.seq)
        for seq in sched.commit(batch, answers):
            assert seq.output_token_ids == self.expected[seq]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(sorted(self.expected, key=lambda s: s.seq_id)))
        was_live = seq in self.sched.running or seq in self.sched.waiting
        assert self.sched.abort(seq.seq_id) == was_live
        assert seq.table.num_blocks == 0
        self.aborted.add(seq)

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        while self.sched.has_unfinished():
            self.step(abort_one=False, data=None)
        for seq, output in self.expected.items():
            if seq not in self.aborted:
                assert seq.output_token_ids == output
        self.sched.clear_prefix_cache()
        assert self.sched.pool.num_free == self.sched.pool.num_blocks


class FastSchedulerMachine(SchedulerMachine):
    backend_name = "fast"


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestFastSchedulerMachine = needs_fast(FastSchedulerMachine.TestCase)
TestFastSchedulerMachine.settings = TestSchedulerMachine.settings
