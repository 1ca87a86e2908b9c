"""Unit tests of the scheduler: the batch contract, admission, preemption, abort, validation.

Outputs are checked against ``expected_output`` (the request's tokens fed to the model with no
scheduler and no cache); the model reads its tokens back through the block tables, so any
bookkeeping error shows up as a wrong token.
"""

import json

import pytest
from scheduler_model import (
    STOP,
    KVModel,
    checked_step,
    drain,
    expected_output,
    kv_pool,
    scheduler_and_model,
)

from mie.memory import BlockPool
from mie.model import prepare_inputs
from mie.scheduler import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    BatchEntry,
    ContiguousAllocator,
    ContiguousScheduler,
    RequestTooLongError,
    Scheduler,
    SchedulerStallError,
    StaticBatchScheduler,
    to_jsonl,
)


def make(backend, num_blocks=16, block_size=4, max_num_seqs=4, budget=64, **kwargs):
    return scheduler_and_model(backend, num_blocks, block_size, max_num_seqs, budget, **kwargs)


# -- validation -----------------------------------------------------------------------------
def test_constructor_rejects_inconsistent_limits(backend):
    pool, Scheduler = kv_pool(4, 4, backend.BlockPool), backend.Scheduler
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(pool, 4, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="prefix_sharing"):
        Scheduler(pool, 4, 2, 8, prefix_sharing=False, prefix_caching=True)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError):
            Scheduler(pool, bad, 2, 8)
    with pytest.raises(TypeError):
        Scheduler(object(), 4, 2, 8)


@pytest.mark.parametrize(
    "prompt, max_tokens",
    [([], 4), ([1, -2], 4), ([1, True], 4), ([1, 2.5], 4), ([1], 0), ([1], True), ([1], None)],
)
def test_submit_rejects_bad_requests_and_changes_nothing(backend, prompt, max_tokens):
    sched, _ = make(backend)
    with pytest.raises(ValueError):
        sched.submit(prompt, max_tokens)
    assert not sched.waiting
    assert sched.submit([1], 1).seq_id == 0  # no id was used up


def test_request_too_long_names_both_numbers(backend):
    sched, _ = make(backend, num_blocks=4, block_size=4, budget=32)  # pool: 16 slots
    with pytest.raises(RequestTooLongError, match=r"= 17 tokens need 5 blocks .* has 4"):
        sched.submit([1] * 10, 8)
    with pytest.raises(RequestTooLongError, match=r"= 33 tokens exceed max_num_batched_tokens 32"):
        sched.submit([1] * 30, 4)
    assert not sched.waiting
    assert sched.submit([1] * 10, 7) is sched.waiting[0]  # exactly 16 KV tokens fit


def test_commit_misuse(backend):
    sched, model = make(backend)
    sched.submit([1, 2, 3], 3)
    batch = sched.step()
    with pytest.raises(RuntimeError, match="before commit"):
        sched.step()
    with pytest.raises(ValueError, match="one next token per sampling entry"):
        sched.commit(batch, [])
    with pytest.raises(ValueError, match="non-negative"):
        sched.commit(batch, [-1])
    sched.check_integrity()  # still pending, nothing changed
    sched.commit(batch, model(batch))
    with pytest.raises(ValueError, match="exactly once"):
        sched.commit(batch, model(batch))


# -- the batch contract ---------------------------------------------------------------------
def test_prefill_then_decode_entries_and_slots(backend):
    sched, model = make(backend, block_size=4)
    seq = sched.submit([5, 6, 7, 8, 9], 3)
    batch = sched.step()
    (entry,) = batch.entries
    assert (entry.seq, entry.start, entry.num_tokens, entry.is_prefill) == (seq, 0, 5, True)
    assert entry.token_ids == [5, 6, 7, 8, 9]
    b0, b1 = seq.table.blocks
    slots = prepare_inputs([entry]).slot_mapping.tolist()
    assert slots == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4]
    sched.commit(batch, model(batch))
    batch, _ = checked_step(sched, model)
    (entry,) = batch.entries
    assert (entry.start, entry.num_tokens, entry.is_prefill) == (5, 1, False)
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 0


def test_stop_conditions_and_reaping(backend):
    sched, model = make(backend)
    prompt = [3, 1, 4]
    expected = expected_output(prompt, 20)
    stop = expected[2]  # the third generated token
    by_stop = sched.submit(prompt, 20, [stop])
    by_length = sched.submit(prompt, 2)
    finished = drain(sched, model)
    assert by_stop.output_token_ids == expected[: expected.index(stop) + 1]
    assert by_stop.finish_reason == FINISH_STOP and by_length.finish_reason == FINISH_LENGTH
    assert by_length.output_token_ids == expected[:2]
    assert set(finished) == {by_stop, by_length}
    assert sched.pool.num_free == sched.pool.num_blocks  # reaped at commit: nothing held


# -- admission ------------------------------------------------------------------------------
class SkipAheadScheduler(Scheduler):
    """A scheduler that is *not* FCFS, kept as a negative control: where the head of the queue
    does not fit, it admits later requests that do (the reference loop with its ``return`` on a
    misfit turned into ``continue``). The FCFS check below must reject it."""

    def _admit(self, scheduled, preempted, budget):
        if preempted:
            return
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                return
            plan = self._plan(seq)
            num_new = seq.num_tokens - plan.num_cached
            if num_new > budget or plan.num_blocks > self._num_available():
                continue  # skip the misfit: this is what FCFS forbids
            self.waiting.remove(seq)
            self._borrow(seq, plan)
            assert self._grow(seq, num_new)
            self.running.append(seq)
            scheduled[seq.seq_id] = BatchEntry(seq, plan.num_cached, num_new, is_prefill=True)
            budget -= num_new


def check_admission_stops_at_the_first_misfit(Scheduler, BlockPool, misfit: str) -> None:
    """The head of the queue, c, does not fit (the token budget or the free blocks) while d,
    behind it, would: a strict FCFS scheduler leaves both waiting until c fits."""
    if misfit == "budget":
        # budget 16: a and b take 12 tokens, leaving 4: c (7) does not fit, d (1) would
        pool = kv_pool(64, 4, BlockPool)
        sched = Scheduler(pool, 4, 4, 16)
        first = [sched.submit([1] * 6, 2), sched.submit([2] * 6, 2)]
        c = sched.submit([3] * 7, 2)
    else:
        # 4 blocks of 4: a's prompt takes 2, leaving 2: c (3 blocks) does not fit, d (1) would
        pool = kv_pool(4, 4, BlockPool)
        sched = Scheduler(pool, 4, 4, 64)
        first = [sched.submit([1] * 8, 1)]  # done at its prefill: its blocks free at commit
        c = sched.submit([3] * 9, 2)
    d = sched.submit([4], 2)
    model = KVModel(pool, 4)
    batch = sched.step()  # checked before check_integrity, which would catch it as well
    assert [e.seq for e in batch.entries] == first, "admitted a request behind a misfit"
    assert list(sched.waiting) == [c, d]
    sched.commit(batch, model(batch))
    sched.check_integrity()
    batch, _ = checked_step(sched, model)  # now c fits, and d behind it
    assert [e.seq for e in batch.entries if e.is_prefill] == [c, d]
    drain(sched, model)
    assert d.output_token_ids == expected_output([4], 2)


@pytest.mark.parametrize("misfit", ["budget", "memory"])
def test_admission_is_strict_fcfs_and_stops_at_the_first_misfit(backend, misfit):
    check_admission_stops_at_the_first_misfit(backend.Scheduler, backend.BlockPool, misfit)


@pytest.mark.parametrize("misfit", ["budget", "memory"])
def test_the_fcfs_check_rejects_a_skip_ahead_scheduler(misfit):
    with pytest.raises(AssertionError, match="admitted a request behind a misfit"):
        check_admission_stops_at_the_first_misfit(SkipAheadScheduler, BlockPool, misfit)


def test_admission_respects_max_num_seqs_and_memory(backend):
    sched, model = make(backend, num_blocks=5, block_size=4, max_num_seqs=2, budget=64)
    seqs = [sched.submit([i + 1] * 4, 3) for i in range(3)]
    batch, _ = checked_step(sched, model)
    assert [e.seq for e in batch.entries] == seqs[:2]
    # 4 blocks used (one per prompt, one per first decode); a third prompt waits on max_num_seqs
    assert list(sched.waiting) == seqs[2:]


def test_admission_leaves_the_blocks_running_sequences_decode_into(backend):
    sched, model = make(backend, num_blocks=3, block_size=4, max_num_seqs=4, budget=64)
    a = sched.submit([1] * 4, 5)  # block 0 full after prefill: its decode needs a new block
    checked_step(sched, model)
    b = sched.submit([2] * 5, 1)  # needs 2 blocks; only 2 free and 1 is a's
    batch, _ = checked_step(sched, model)
    assert [e.seq for e in batch.entries] == [a] and not batch.preempted
    assert list(sched.waiting) == [b]


# -- preemption -----------------------------------------------------------------------------
def test_preemption_is_lifo_keeps_tokens_and_recomputes(backend):
    sched, model = make(backend, num_blocks=6, block_size=2, max_num_seqs=3, budget=64)
    seqs = [sched.submit([i + 1, i + 1], 6) for i in range(3)]  # 2 tokens = 1 full block each
    for _ in range(3):  # admit all three, then two decodes each: 2 blocks each, pool full
        batch, _ = checked_step(sched, model)
        assert not batch.preempted
    tokens_before = [list(s.token_ids) for s in seqs]
    batch, _ = checked_step(sched, model)  # each needs a third block; none free: victims LIFO
    assert batch.preempted == (seqs[2],)  # the newest, not the requester seqs[0]
    assert [e.seq for e in batch.entries] == seqs[:2]
    assert list(sched.waiting) == [seqs[2]] and sched.running == seqs[:2]
    assert seqs[2].token_ids == tokens_before[2] and seqs[2].num_computed == 0
    assert batch.trace.preemptions == 1
    drain(sched, model)
    for s in seqs:
        assert s.output_token_ids == expected_output(s.prompt_token_ids, 6)
    assert seqs[2].num_preemptions >= 1


def test_victims_go_back_to_the_front_of_waiting_in_admission_order(backend):
    sched, model = make(backend, num_blocks=4, block_size=2, max_num_seqs=4, budget=64)
    seqs = [sched.submit([i + 1, i + 1], 3) for i in range(4)]  # one full block each
    late = sched.submit([9], 1)
    batch, _ = checked_step(sched, model)  # four admitted, pool full; late waits
    assert list(sched.waiting) == [late]
    batch, _ = checked_step(sched, model)  # seqs[0] needs a block: seqs[3] goes; seqs[1] needs
    # one: seqs[2] goes; seqs[1] takes the last freed block
    assert batch.preempted == (seqs[3], seqs[2])
    assert list(sched.waiting) == [seqs[2], seqs[3], late]
    drain(sched, model)
    for s in seqs:
        assert s.output_token_ids == expected_output(s.prompt_token_ids, 3)


def test_requester_preempts_itself_when_no_victim_is_left(backend):
    sched, model = make(backend, num_blocks=3, block_size=2, max_num_seqs=2, budget=64)
    a = sched.submit([1, 2], 3)  # a full block; decodes fill a second one
    b = sched.submit([3], 4)  # half a block
    checked_step(sched, model)  # both admitted: 2 blocks
    checked_step(sched, model)  # a takes the last block; b writes in place
    batch, _ = checked_step(sched, model)  # a in place; b needs a block: nobody after it
    assert batch.preempted == (b,) and [e.seq for e in batch.entries] == [a]
    assert a.finished and list(sched.waiting) == [b]
    drain(sched, model)
    assert a.output_token_ids == expected_output([1, 2], 3)
    assert b.output_token_ids == expected_output([3], 4)


def test_readmission_counts_recomputed_tokens_in_the_trace(backend):
    sched, model = make(backend, num_blocks=2, block_size=2, max_num_seqs=2, budget=64)
    sched.submit([1, 2], 3)
    b = sched.submit([3, 4], 3)
    checked_step(sched, model)
    checked_step(sched, model)  # b preempted after computing its 2 prompt tokens
    traces = []
    while sched.has_unfinished():
        batch, _ = checked_step(sched, model)
        traces.append(batch.trace)
        if any(e.seq is b for e in batch.entries if e.is_prefill):
            break
    assert traces[-1].recomputed_tokens == 2  # b's prompt; its generated token is new work
    assert [e.num_tokens for e in batch.entries if e.seq is b] == [3]


# -- abort ----------------------------------------------------------------------------------
def test_abort_waiting_running_and_unknown(backend):
    sched, model = make(backend)
    a = sched.submit([1, 2, 3], 5)
    b = sched.submit([4, 5], 5)
    checked_step(sched, model)
    c = sched.submit([6], 5)
    assert sched.abort(a.seq_id) is True and a.finish_reason == FINISH_ABORT
    assert a not in sched.running and a.table.num_blocks == 0  # freed at once
    assert sched.abort(c.seq_id) is True and not sched.waiting
    assert sched.abort(a.seq_id) is False
    with pytest.raises(KeyError):
        sched.abort(99)
    with pytest.raises(KeyError):
        sched.abort("0")
    sched.check_integrity()
    drain(sched, model)
    assert b.output_token_ids == expected_output([4, 5], 5)
    assert sched.pool.num_free == sched.pool.num_blocks


def test_abort_between_step_and_commit(backend):
    sched, model = make(backend)
    a = sched.submit([1, 2, 3], 5)
    b = sched.submit([4, 5], 5)
    batch = sched.step()
    answers = model(batch)
    assert sched.abort(a.seq_id)
    sched.check_integrity()
    assert sched.commit(batch, answers) == []
    assert a.num_output_tokens == 0 and b.num_output_tokens == 1
    drain(sched, model)
    assert b.output_token_ids == expected_output([4, 5], 5)


# -- sharing with running sequences -----------------------------------------------------------
def test_running_sharing_borrows_and_splits_a_partial_block(backend):
    sched, model = make(backend, num_blocks=16, block_size=4)
    system = [7, 8, 9, 7, 8, 9]  # a block and a half
    a = sched.submit([*system, 1], 8)
    checked_step(sched, model)
    b = sched.submit([*system, 2, 2], 8)
    batch, _ = checked_step(sched, model)
    (entry,) = [e for e in batch.entries if e.seq is b]
    assert entry.start == 6 and batch.trace.prefix_hit_tokens == 6
    assert b.table.blocks[0] == a.table.blocks[0]  # full block shared ...
    assert b.table.blocks[1] != a.table.blocks[1]  # ... partial one copied on write
    assert sched.pool.refcount(a.table.blocks[0]) == 2
    drain(sched, model)
    assert b.output_token_ids == expected_output([*system, 2, 2], 8)
    assert a.output_token_ids == expected_output([*system, 1], 8)


def test_no_sharing_when_switched_off(backend):
    sched, model = make(backend, prefix_sharing=False)
    sched.submit([7, 8, 9, 7, 8], 8)
    checked_step(sched, model)
    sched.submit([7, 8, 9, 7, 8], 8)
    batch, _ = checked_step(sched, model)
    assert batch.trace.prefix_hit_tokens == 0 and batch.trace.sharing_saved_fraction == 0


# -- static batching ------------------------------------------------------------------------
def test_static_batching_admits_nobody_until_the_batch_drains(backend):
    pool = kv_pool(32, 4)
    sched, model = StaticBatchScheduler(pool, 4, 2, 64), KVModel(pool, 4)
    short = sched.submit([1], 1)
    long = sched.submit([2], 6)
    late = sched.submit([3], 1)
    admitted_at = {}
    step = 0
    while sched.has_unfinished():
        batch, _ = checked_step(sched, model)
        for e in batch.entries:
            admitted_at.setdefault(e.seq, step)
        step += 1
    assert admitted_at[short] == admitted_at[long] == 0
    assert admitted_at[late] == 6  # after long's 6 steps, though short left after one
    continuous, model = make(backend, num_blocks=32, max_num_seqs=2)
    seqs = [continuous.submit(*r) for r in [([1], 1), ([2], 6), ([3], 1)]]
    batch, _ = checked_step(continuous, model)
    batch, _ = checked_step(continuous, model)
    assert seqs[2] in [e.seq for e in batch.entries]  # continuous: joins at once
    assert late.output_token_ids == expected_output([3], 1)


# -- trace ----------------------------------------------------------------------------------
def test_trace_rows_and_jsonl(backend):
    sched, model = make(backend, num_blocks=10, block_size=4)
    sched.submit([1, 2, 3, 4, 5], 4)
    sched.submit([6], 4)
    traces = []
    while sched.has_unfinished():
        traces.append(checked_step(sched, model)[0].trace)
    first = traces[0]
    assert (first.step, first.num_running, first.num_waiting) == (0, 2, 0)
    assert (first.num_prefill_tokens, first.num_decode_tokens) == (6, 0)
    assert first.reserved_tokens == 3 * 4 and first.kv_tokens == 6
    assert first.internal_fragmentation == 6 and first.capacity_tokens == 40
    assert first.utilization == pytest.approx(12 / 40)
    assert traces[1].num_decode_tokens == 2
    rows = [json.loads(line) for line in to_jsonl(traces).splitlines()]
    assert [r["step"] for r in rows] == list(range(len(traces)))
    assert rows[0] == first.to_dict()


def test_stop_token_in_prompt_does_not_stop(backend):
    sched, model = make(backend)
    seq = sched.submit([STOP + 1, STOP, STOP + 2], 3, [STOP])
    drain(sched, model)
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 3, [STOP])


# -- the contiguous baseline ----------------------------------------------------------------
def test_contiguous_allocator_first_fit_merges_and_fragments():
    arena = ContiguousAllocator(10)
    a, b, c = arena.reserve(3), arena.reserve(3), arena.reserve(3)
    assert (a, b, c) == (0, 3, 6) and arena.reserve(2) is None and arena.largest_hole == 1
    arena.release(a)
    arena.release(c)
    assert arena.num_reserved == 3 and arena.largest_hole == 4
    assert arena.reserve(5) is None  # 7 slots free, but in two holes: external fragmentation
    assert arena.reserve(2) == 0  # first fit
    arena.release(b)
    arena.release(0)
    assert arena.largest_hole == 10 and arena.num_reserved == 0
    arena.check_integrity()


def test_contiguous_scheduler_reserves_the_maximum_context():
    capacity, bs = 20, 4
    pool = kv_pool(ContiguousScheduler.min_pool_blocks(capacity, bs, 4), bs)
    sched, model = ContiguousScheduler(pool, bs, 4, 32, capacity_tokens=capacity), KVModel(pool, bs)
    with pytest.raises(RequestTooLongError, match="contiguous arena's 20"):
        sched.submit([1] * 5, 17)
    a = sched.submit([1, 2], 10)  # reserves 11 slots up front
    b = sched.submit([3, 4], 10)  # 11 more: does not fit the 9 left
    batch, _ = checked_step(sched, model)
    assert [e.seq for e in batch.entries] == [a] and list(sched.waiting) == [b]
    assert batch.trace.reserved_tokens == 11 and batch.trace.kv_tokens == 2
    drain(sched, model)
    assert b.output_token_ids == expected_output([3, 4], 10)
    with pytest.raises(ValueError, match="needs 9 blocks"):
        ContiguousScheduler(kv_pool(8, bs), bs, 4, 32, capacity_tokens=capacity)


STALL = (
    "scheduler stalled: nothing is running and the request at the head of the queue (seq_id 0: "
    "5 tokens, 2 blocks of 4) cannot be admitted with 0 free and 0 evictable blocks of 4; no "
    "later step would differ (a scheduler defect: abort that request to go on)"
)


@pytest.mark.parametrize("caching", [False, True])
def test_a_step_that_can_never_progress_raises_and_changes_nothing(backend, caching):
    """Requests waiting, nothing running, nothing admitted: every later step would
    be the same empty one, and the engine would spin forever. Both backends raise
    ``SchedulerStallError`` instead (the same message), naming the request at the head and
    the memory there was, before any batch is handed out: the scheduler is unchanged and
    usable. A table outside the scheduler holding the whole pool forces the stall here (the
    scheduler's own arithmetic, fixed, can no longer produce one)."""
    sched, model = make(backend, num_blocks=4, block_size=4, prefix_caching=caching)
    hog = backend.BlockTable(sched.pool, 4)
    assert hog.append_tokens(16)
    seq = sched.submit([1, 2, 3, 4, 5], 2)
    for _ in range(2):  # and again: nothing changed in between
        with pytest.raises(SchedulerStallError) as info:
            sched.step()
        assert str(info.value) == STALL and isinstance(info.value, RuntimeError)
        stall = info.value
        assert (stall.seq_id, stall.num_tokens, stall.num_free, stall.num_evictable) == (
            seq.seq_id,
            5,
            0,
            0,
        )
        assert sched.pending_batch is None and sched.num_steps == 0
        assert list(sched.waiting) == [seq] and not sched.running
        assert seq.table.num_blocks == 0 and seq.num_computed == 0
    hog.release()
    sched.check_integrity()
    drain(sched, model)  # usable: the next step carries on
    assert seq.output_token_ids == expected_output([1, 2, 3, 4, 5], 2)


def test_a_stalled_request_aborted_lets_the_queue_move_on(backend):
    """What the engine does with a stall: abort the request at the head; the next step goes on
    with the others (here one that fits what the stalled one could not get)."""
    sched, model = make(backend, num_blocks=4, block_size=4)
    hog = backend.BlockTable(sched.pool, 4)
    assert hog.append_tokens(12)  # 1 block left
    big, small = sched.submit([1, 2, 3, 4, 5], 2), sched.submit([6, 7], 2)
    with pytest.raises(SchedulerStallError, match="seq_id 0: 5 tokens, 2 blocks of 4"):
        sched.step()
    assert sched.abort(big.seq_id) and big.finish_reason == FINISH_ABORT
    drain(sched, model, check=False)  # the hog's blocks are no table's of the scheduler
    assert small.output_token_ids == expected_output([6, 7], 2)
    hog.release()
    sched.check_integrity()
