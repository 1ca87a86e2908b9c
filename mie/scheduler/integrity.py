"""The scheduler's invariants, as one function over its public state (either backend's)."""

from __future__ import annotations


def check_integrity(scheduler) -> None:
    """Raise AssertionError unless every invariant of ``scheduler`` holds.

    The tests call it after every step, on both backends: it reads only public state
    (``running``, ``waiting``, ``pool``, ``block_size``, ``max_num_seqs``, ``prefix_cache``,
    ``pending_batch``), so the Cython mirror is checked by the very same code.

    * ``running + waiting`` is in arrival order, each sequence once (FCFS, LIFO victims);
    * waiting sequences hold nothing; each running table holds exactly its computed tokens
      (plus, while a batch is out, the slots the batch writes, all in refcount-1 blocks);
    * every block's refcount equals its holders (tables, the prefix cache);
    * with a sliding window, each running table has released exactly the blocks wholly before
      its window (``num_computed - sliding_window + 1``), no more, no fewer; without one,
      none;
    * free + cached-but-idle + in-use (held by a table) = all blocks.
    """
    pool, n, bs = scheduler.pool, scheduler.pool.num_blocks, scheduler.block_size
    ids = [s.seq_id for s in scheduler.running] + [s.seq_id for s in scheduler.waiting]
    if ids != sorted(set(ids)):
        raise AssertionError(f"running + waiting out of arrival order: {ids}")
    if len(scheduler.running) > scheduler.max_num_seqs:
        raise AssertionError(f"{len(scheduler.running)} running > max_num_seqs")
    batch = scheduler.pending_batch
    pending = {e.seq.seq_id: e for e in batch.entries} if batch is not None else {}
    for seq in scheduler.waiting:
        if seq.table.num_blocks or seq.table.num_tokens or seq.num_computed or seq.finished:
            raise AssertionError(f"waiting {seq} holds blocks or is finished")
    holders = [0] * n
    for seq in scheduler.running:
        entry = pending.get(seq.seq_id)
        expected = entry.context_len if entry else seq.num_computed
        if seq.finished or seq.table.num_tokens != expected:
            raise AssertionError(f"running {seq}: table has {seq.table.num_tokens} tokens")
        if seq.num_computed >= seq.num_tokens:
            raise AssertionError(f"running {seq} has no token left to compute")
        blocks = seq.table.blocks
        released = seq.table.num_released
        window = scheduler.sliding_window
        expected_released = max(0, seq.num_computed - window + 1) // bs if window else 0
        if released != expected_released:
            raise AssertionError(
                f"running {seq}: {released} blocks released, the window says {expected_released}"
            )
        for block in blocks[released:]:
            holders[block] += 1
        if entry:
            for pos in entry.positions:
                if pool.refcount(blocks[pos // scheduler.block_size]) != 1:
                    raise AssertionError(f"{seq}: position {pos} is in a shared block")
    in_use = n - holders.count(0)
    cached = scheduler.prefix_cache.cached_blocks if scheduler.prefix_cache is not None else ()
    for block in cached:
        holders[block] += 1
    for block in range(n):
        if pool.refcount(block) != holders[block]:
            raise AssertionError(
                f"block {block}: refcount {pool.refcount(block)}, {holders[block]} holders"
            )
    free = pool.free_ids
    if len(set(free)) != len(free) or len(free) != holders.count(0):
        raise AssertionError("the free list is not exactly the blocks nobody holds")
    idle_cached = scheduler.prefix_cache.num_evictable if scheduler.prefix_cache is not None else 0
    if pool.num_free + idle_cached + in_use != n:
        raise AssertionError("free + cached-but-idle + in-use blocks != all blocks")
    if scheduler.prefix_cache is not None:
        scheduler.prefix_cache.check_integrity()
