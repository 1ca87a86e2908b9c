"""The prefix cache, and the traps other engines fell into, one test each."""

import pytest
from conftest import backend_named
from scheduler_model import KVModel, drain, expected_output, kv_pool, scheduler_and_model

from mie import AllocatorError
from mie.backend import PYTHON
from mie.scheduler import PrefixCache, Scheduler, prefix_cache


def make(backend, num_blocks=16, block_size=4, max_num_seqs=4, budget=64, caching=True):
    return scheduler_and_model(
        backend, num_blocks, block_size, max_num_seqs, budget, prefix_caching=caching
    )


def run(sched, model, prompt, max_tokens=3):
    """Submit one request and drain; returns (its sequence, its prefill entry, the traces)."""
    seq = sched.submit(prompt, max_tokens)
    prefill, traces = None, []
    while sched.has_unfinished():
        batch = sched.step()
        traces.append(batch.trace)
        prefill = prefill or next((e for e in batch.entries if e.seq is seq), None)
        sched.commit(batch, model(batch))
        sched.check_integrity()
    assert seq.output_token_ids == expected_output(prompt, max_tokens)
    return seq, prefill, traces


def pool_state(sched):
    pool = sched.pool
    return (
        [pool.refcount(b) for b in range(pool.num_blocks)],
        pool.free_ids,
        sched.prefix_cache.evictable_blocks,
        sched.prefix_cache.cached_blocks,
    )


def test_cache_outlives_the_sequence_that_computed_it(backend):
    sched, model = make(backend)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    run(sched, model, prompt)
    assert sched.pool.num_free < sched.pool.num_blocks  # idle cached blocks kept ...
    assert sched.prefix_cache.num_evictable == sched.prefix_cache.num_cached == 3
    # (the prompt's 2 blocks, and the one its generated tokens filled)
    _, prefill, traces = run(sched, model, [*prompt[:8], 42, 43])
    assert (prefill.start, prefill.num_tokens) == (8, 2)  # ... and borrowed, finished or not
    assert traces[0].prefix_hit_tokens == 8
    without, model = make(backend, caching=False)
    run(without, model, prompt)
    _, prefill, _ = run(without, model, [*prompt[:8], 42, 43])
    assert prefill.start == 0  # running-only sharing: nobody left to share with


@pytest.mark.parametrize("caching", [True, False])
def test_a_sequence_that_reuses_no_prefix_computes_its_whole_prompt(backend, caching):
    """Prompt log-probabilities need the logits of every prompt position: such a sequence
    borrows nothing, from the cache or from a running sequence, but still lends."""
    sched, model = make(backend, caching=caching)
    prompt = list(range(1, 11))
    first = sched.submit(prompt, 8)  # runs while the others come: a lender either way
    batch = sched.step()
    sched.commit(batch, model(batch))
    whole = sched.submit(prompt, 3, reuse_prefix=False)
    borrower = sched.submit(prompt, 3)
    batch = sched.step()
    entries = {e.seq.seq_id: e for e in batch.entries}
    assert (entries[whole.seq_id].start, entries[whole.seq_id].num_tokens) == (0, 10)
    assert entries[borrower.seq_id].start == 9  # the others still borrow (up to the last)
    assert batch.trace.prefix_hit_tokens == entries[borrower.seq_id].start
    sched.commit(batch, model(batch))
    sched.check_integrity()
    drain(sched, model)
    assert first.output_token_ids == expected_output(prompt, 8)
    assert whole.output_token_ids == borrower.output_token_ids == expected_output(prompt, 3)
    with pytest.raises(ValueError, match="reuse_prefix"):
        sched.submit(prompt, 3, reuse_prefix=1)


def test_cached_blocks_and_a_running_partly_filled_block_are_borrowed_together(backend):
    """A forked sample's prompt: its full blocks are cached, and the sequence that computed
    them still runs, so the partly filled block after them is borrowed too and split by
    copy-on-write at the first write (only the last prompt token is recomputed)."""
    sched, model = make(backend)
    prompt = list(range(1, 11))  # 2 full blocks of 4 + 2 tokens
    first = sched.submit(prompt, 8)
    batch = sched.step()
    sched.commit(batch, model(batch))
    fork = sched.submit(prompt, 3)
    batch = sched.step()
    (entry,) = [e for e in batch.entries if e.seq is fork]
    assert (entry.start, entry.num_tokens) == (9, 1)
    assert batch.trace.prefix_hit_tokens == 9
    assert fork.table.blocks[:2] == first.table.blocks[:2]  # shared, refcount 3 with the cache
    assert fork.table.blocks[2] != first.table.blocks[2]  # the partly filled one: split
    assert [sched.pool.refcount(b) for b in first.table.blocks] == [3, 3, 1]
    sched.commit(batch, model(batch))
    sched.check_integrity()
    drain(sched, model)
    assert fork.output_token_ids == expected_output(prompt, 3)
    assert first.output_token_ids == expected_output(prompt, 8)


@pytest.mark.parametrize("length", [8, 10])
def test_trap_a_fully_cached_prompt_still_computes_its_last_token(backend, length):
    sched, model = make(backend)
    prompt = list(range(1, length + 1))
    run(sched, model, prompt)
    _, prefill, _ = run(sched, model, prompt)
    # hits cover whole blocks within the first length - 1 tokens; the last token's block is
    # computed afresh (its logits are needed, and a cached block is never written)
    assert prefill.start == (length - 1) // 4 * 4
    assert prefill.start + prefill.num_tokens == length


def test_trap_an_evicted_block_loses_its_old_entry(backend):
    sched, model = make(backend, num_blocks=6, block_size=4)
    old = list(range(1, 9))  # 2 full blocks
    run(sched, model, old, max_tokens=1)
    cached = set(sched.prefix_cache.cached_blocks)
    assert len(cached) == 2
    run(sched, model, list(range(20, 44)), max_tokens=1)  # 6 blocks: evicts both, reuses them
    assert cached <= set(sched.prefix_cache.cached_blocks)  # the same ids, now other tokens
    blocks, _ = sched.prefix_cache.lookup(old, 2)
    assert blocks == []  # the old prompt must not find them
    _, prefill, _ = run(sched, model, old, max_tokens=1)
    assert prefill.start == 0


def test_lru_eviction_takes_the_least_recently_used_tail_first(backend):
    sched, model = make(backend, num_blocks=8, block_size=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    seq_a, *_ = run(sched, model, a, max_tokens=1)
    run(sched, model, b, max_tokens=1)
    cache = sched.prefix_cache
    blocks_a, _ = cache.lookup(a, 2)
    blocks_b, _ = cache.lookup(b, 2)
    # released last-first, a before b: a's tail, a's head, b's tail, b's head
    assert cache.evictable_blocks == (blocks_a[1], blocks_a[0], blocks_b[1], blocks_b[0])
    run(sched, model, [*a, 9], max_tokens=1)  # a's blocks used again: now the most recent
    assert cache.evictable_blocks[:2] == (blocks_b[1], blocks_b[0])
    assert cache.evictable_blocks[2:4] == (blocks_a[1], blocks_a[0])


def test_trap_a_failed_admission_leaves_every_refcount_as_it_was(backend):
    sched, model = make(backend, num_blocks=6, block_size=2, max_num_seqs=2)
    shared = [1, 2, 3, 4]
    run(sched, model, shared, max_tokens=1)  # caches 2 blocks
    blocker = sched.submit([9, 9, 9], 4)  # holds 2 blocks then 3
    sched.commit(batch := sched.step(), model(batch))
    sched.commit(batch := sched.step(), model(batch))
    # the next request would revive both cached blocks and need 3 fresh ones: 5 blocks,
    # with 4 free or idle, 1 of them set aside for the blocker's next token
    sched.submit([*shared, 5, 6, 7, 8, 9], 1)
    before = pool_state(sched)
    batch = sched.step()
    assert [e.seq for e in batch.entries] == [blocker]  # not admitted ...
    sched.commit(batch, model(batch))
    after = pool_state(sched)
    # ... and the blocks it would have borrowed are as they were: same refcounts, same LRU
    # order, still cached (only the blocker's own decode may have moved)
    assert after[2] == before[2] and after[3] == before[3]
    for block in sched.prefix_cache.cached_blocks:
        assert after[0][block] == before[0][block]
    drain(sched, model)


def test_trap_a_preempted_sequence_readmitted_through_the_cache(backend):
    sched, model = make(backend, num_blocks=5, block_size=2, max_num_seqs=2)
    x = sched.submit([7, 8], 6)
    a = sched.submit([1, 2, 3, 4], 5)  # admitted last: the victim when x needs a block
    readmissions = []
    while sched.has_unfinished():
        batch = sched.step()
        readmissions += [
            (e.start, e.num_tokens, e.seq.num_tokens, e.seq.peak_computed, batch.trace)
            for e in batch.entries
            if e.is_prefill and e.seq.num_preemptions
        ]
        sched.commit(batch, model(batch))
        sched.check_integrity()
    assert a.num_preemptions == 1 and x.num_preemptions == 0
    (start, num_tokens, num_tokens_then, peak, trace) = readmissions[0]
    # its head block survived in the cache (LRU evicts a sequence's tail first): borrowed,
    # and only the rest is computed -- of which all but the newest token is recomputation
    assert (start, num_tokens_then, peak) == (2, 7, 6)
    assert start + num_tokens == num_tokens_then
    assert trace.prefix_hit_tokens == start and trace.recomputed_tokens == peak - start
    assert a.output_token_ids == expected_output([1, 2, 3, 4], 5)
    assert x.output_token_ids == expected_output([7, 8], 6)


def test_trap_hash_collisions_never_give_a_wrong_hit(monkeypatch):
    def collide(parent_hash, token_ids):
        return 7  # every block has the same hash

    def unchained(parent_hash, token_ids):
        return hash(token_ids)  # blocks with equal tokens collide whatever precedes them

    for bad_hash in (collide, unchained):  # (the fast mirror's collisions: test_fast_scheduler)
        monkeypatch.setattr(prefix_cache, "block_hash", bad_hash)
        sched, model = make(PYTHON, num_blocks=32, block_size=2)
        # [3, 4] and [7, 8] follow different blocks in different prompts; the last two
        # prompts match a cached first block, then find a cached [3, 4] / [7, 8] whose
        # parent is another block
        prompts = [[1, 2, 3, 4, 5], [5, 6, 7, 8, 9], [5, 6, 3, 4, 9], [1, 2, 7, 8, 5]]
        seqs = [sched.submit(p, 4) for p in prompts[:2]]
        drain(sched, model)
        seqs += [sched.submit(p, 4) for p in prompts * 2]
        drain(sched, model)
        for s in seqs:
            assert s.output_token_ids == expected_output(s.prompt_token_ids, 4)


def test_duplicate_blocks_computed_in_one_step_are_indexed_once(backend):
    sched, model = make(backend, num_blocks=16, block_size=2)
    twins = [sched.submit([1, 2, 3, 4, 5], 2) for _ in range(2)]  # same step, no hit
    drain(sched, model)
    assert twins[0].table.num_blocks == 0
    # 3 full blocks computed twice ([1,2], [3,4], [5, first output]): one entry each
    assert sched.prefix_cache.num_cached == 3
    _, prefill, _ = run(sched, model, [1, 2, 3, 4, 9])
    assert prefill.start == 4


def test_no_leak_pool_full_after_clearing_the_cache(backend):
    sched, model = make(backend, num_blocks=12, block_size=2)
    for i in range(6):
        sched.submit([1, 2, 3, i + 4, i + 5], 3)
    drain(sched, model)
    cache = sched.prefix_cache
    assert sched.pool.num_free + cache.num_evictable == sched.pool.num_blocks
    sched.clear_prefix_cache()
    assert sched.pool.num_free == sched.pool.num_blocks and cache.num_cached == 0
    sched.check_integrity()


def test_prefix_cache_with_the_fast_backend():
    fast = backend_named("fast")
    pool = kv_pool(12, 2, backend_pool=fast.BlockPool)
    sched = Scheduler(pool, 2, 3, 32, prefix_caching=True)
    seqs = [sched.submit([1, 2, 3, 4, i + 5], 4) for i in range(5)]
    drain(sched, KVModel(pool, 2))
    for s in seqs:
        assert s.output_token_ids == expected_output(s.prompt_token_ids, 4)


def test_evict_more_than_evictable_is_an_error():
    pool = kv_pool(4, 2)
    with pytest.raises(ValueError, match="only 0 evictable"):
        PrefixCache(pool, 2).evict(1)


def test_borrow_blocks_checks_everything_before_any_incref(backend):
    pool = backend.BlockPool(6, 4)
    source = backend.BlockTable(pool, 4)
    source.append_tokens(9)  # blocks 0, 1, 2
    table = backend.BlockTable(pool, 4)
    table.borrow_blocks([0, 1], 8)
    assert table.blocks == (0, 1) and table.num_tokens == 8
    assert [pool.refcount(b) for b in range(3)] == [2, 2, 1]
    before = [pool.refcount(b) for b in range(6)], pool.free_ids
    for blocks, n, error in [
        ([0, 5], 8, AllocatorError),  # block 5 is free
        ([0, 9], 8, AllocatorError),  # out of range
        ([0], 8, ValueError),  # 8 tokens need 2 blocks
        ([0, 1], 4, ValueError),
        ([0, 1], True, ValueError),
    ]:
        with pytest.raises(error):
            backend.BlockTable(pool, 4).borrow_blocks(blocks, n)
    with pytest.raises(AllocatorError, match="empty table"):
        table.borrow_blocks([2], 1)
    assert ([pool.refcount(b) for b in range(6)], pool.free_ids) == before


# -- a cached prefix longer than the sliding window ------------------------------------------
def windowed(backend, num_blocks, block_size, window, budget, chunked):
    """A prefix-caching scheduler with a sliding window, and the model that reads only it."""
    return scheduler_and_model(
        backend,
        num_blocks,
        block_size,
        1,
        budget,
        prefix_caching=True,
        enable_chunked_prefill=chunked,
        sliding_window=window,
    )


def test_trap_a_cached_prefix_longer_than_the_window_is_borrowed_from_a_full_pool(backend):
    """The window livelock, at the scheduler: the engine's case scaled down (blocks of 4, a
    window of 8, a pool of 4 blocks, chunks of 16). The first request fills the pool and
    leaves it all cached and idle; the second starts with it. Borrowing its 4 blocks gives
    the 2 wholly before the window straight back, so 2 of them stay evictable for its own
    chunks. Counting all 4 as taken would leave 0 blocks: nothing admitted, nothing
    running -- every step empty, forever."""
    sched, model = windowed(backend, num_blocks=4, block_size=4, window=8, budget=16, chunked=True)
    first = list(range(1, 17))
    sched.submit(first, 1)
    drain(sched, model)
    assert (sched.pool.num_free, sched.prefix_cache.num_evictable) == (0, 4)
    prompt = [*first, *range(30, 38)]
    seq = sched.submit(prompt, 3)
    batch = sched.step()  # the livelocked version returned an empty batch here
    assert [(e.seq, e.start, e.num_tokens) for e in batch.entries] == [(seq, 16, 8)]
    assert batch.trace.prefix_hit_tokens == 16
    sched.commit(batch, model(batch))
    sched.check_integrity()
    drain(sched, model, max_steps=20)
    assert seq.output_token_ids == expected_output(prompt, 3, window=8)
    assert sched.pool.num_free + sched.prefix_cache.num_evictable == sched.pool.num_blocks


def test_computing_prompts_whole_a_borrowed_prefix_counts_only_the_blocks_it_keeps(backend):
    """The same accounting when prompts are computed whole: a request borrowing 4 cached
    blocks of which the window keeps 2, plus 1 fresh block, needs 3 blocks, not 5. Four are
    left (1 free, 3 idle cached: the rest of the pool is held by a table outside the
    scheduler), and it is admitted; it used to wait for 5 that nothing would ever free."""
    sched, model = windowed(backend, num_blocks=8, block_size=4, window=8, budget=64, chunked=False)
    first = list(range(1, 17))
    sched.submit(first, 1)
    drain(sched, model)
    hog = backend.BlockTable(sched.pool, 4)
    assert hog.append_tokens(16)  # the 4 free blocks
    assert (sched.pool.num_free, sched.prefix_cache.num_evictable) == (0, 4)
    prompt = [*first, *range(30, 34)]
    seq = sched.submit(prompt, 2)
    batch = sched.step()
    assert [(e.seq, e.start, e.num_tokens) for e in batch.entries] == [(seq, 16, 4)]
    sched.commit(batch, model(batch))
    hog.release()
    sched.check_integrity()
    drain(sched, model, max_steps=20)
    assert seq.output_token_ids == expected_output(prompt, 2, window=8)
