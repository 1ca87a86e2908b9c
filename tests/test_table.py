"""Unit tests for BlockTable (each backend): append, copy-on-write, prefix borrowing, release."""

import gc

import numpy as np
import pytest

from mie import AllocatorError


def pool_state(pool):
    return [pool.refcount(b) for b in range(pool.num_blocks)], pool.free_ids


def test_append_allocates_only_at_block_boundaries(backend):
    pool = backend.BlockPool(8, 4)
    t = backend.BlockTable(pool, 4)
    assert t.append_tokens(1) and t.blocks == (0,)
    assert t.append_tokens(3) and t.blocks == (0,)
    assert t.append_tokens(1) and t.blocks == (0, 1)
    assert t.append_tokens(0) and t.num_tokens == 5
    assert t.append_tokens(8) and t.blocks == (0, 1, 2, 3)
    assert t.num_blocks == 4 and t.num_tokens == 13
    assert t.internal_fragmentation == 3


def test_append_out_of_memory_changes_nothing(backend):
    pool = backend.BlockPool(3, 4)
    t = backend.BlockTable(pool, 4)
    assert t.append_tokens(6)
    before_pool, before_table = pool_state(pool), (t.blocks, t.num_tokens)
    assert t.append_tokens(7) is False  # needs 2 more blocks, only 1 free
    assert pool_state(pool) == before_pool and (t.blocks, t.num_tokens) == before_table
    assert t.append_tokens(6)  # exactly fills the last free block


def test_append_rejects_negative(backend):
    t = backend.BlockTable(backend.BlockPool(2, 4), 4)
    with pytest.raises(ValueError):
        t.append_tokens(-1)


def test_writable_block_unshared_is_in_place(backend):
    pool = backend.BlockPool(4, 8)
    t = backend.BlockTable(pool, 4)
    t.append_tokens(5)
    view = t.writable_block(4)
    view[:] = 9
    assert t.blocks == (0, 1) and np.all(pool.block_data(1) == 9)


def test_writable_block_out_of_range(backend):
    t = backend.BlockTable(backend.BlockPool(4, 8), 4)
    t.append_tokens(3)
    for pos in (-1, 3, 10):
        with pytest.raises(IndexError):
            t.writable_block(pos)


def test_borrow_shares_blocks_including_partial_last_block(backend):
    pool = backend.BlockPool(8, 4)
    src = backend.BlockTable(pool, 4)
    src.append_tokens(10)  # blocks 0,1,2 ; block 2 holds 2 tokens
    dst = backend.BlockTable(pool, 4)
    dst.borrow_prefix(src, 9)
    assert dst.blocks == (0, 1, 2) and dst.num_tokens == 9
    assert [pool.refcount(b) for b in (0, 1, 2)] == [2, 2, 2]
    dst2 = backend.BlockTable(pool, 4)
    dst2.borrow_prefix(src, 8)  # exactly two full blocks
    assert dst2.blocks == (0, 1)


def test_copy_on_write_copies_then_decrefs_then_swaps(backend):
    pool = backend.BlockPool(4, 4)
    src = backend.BlockTable(pool, 4)
    src.append_tokens(3)
    src.writable_block(0)[:] = [1, 2, 3, 4]
    dst = backend.BlockTable(pool, 4)
    dst.borrow_prefix(src, 3)
    view = dst.writable_block(2)
    assert dst.blocks == (1,) and src.blocks == (0,)
    assert pool.refcount(0) == 1 and pool.refcount(1) == 1
    assert list(view) == [1, 2, 3, 4]  # the copy carries the shared bytes
    view[2] = 99
    assert list(pool.block_data(0)) == [1, 2, 3, 4]  # source unchanged


def test_copy_on_write_with_empty_pool_returns_none_and_changes_nothing(backend):
    pool = backend.BlockPool(1, 4)
    src = backend.BlockTable(pool, 4)
    src.append_tokens(2)
    dst = backend.BlockTable(pool, 4)
    dst.borrow_prefix(src, 2)
    before = pool_state(pool), dst.blocks, src.blocks
    assert dst.writable_block(1) is None
    assert (pool_state(pool), dst.blocks, src.blocks) == before


def test_last_holder_writes_without_copy(backend):
    pool = backend.BlockPool(4, 4)
    src = backend.BlockTable(pool, 4)
    src.append_tokens(2)
    dst = backend.BlockTable(pool, 4)
    dst.borrow_prefix(src, 2)
    src.release()
    dst.writable_block(0)
    assert dst.blocks == (0,) and pool.num_free == 3


def test_borrow_misuse(backend):
    pool = backend.BlockPool(8, 4)
    src = backend.BlockTable(pool, 4)
    src.append_tokens(5)
    nonempty = backend.BlockTable(pool, 4)
    nonempty.append_tokens(1)
    with pytest.raises(AllocatorError):
        nonempty.borrow_prefix(src, 2)
    with pytest.raises(ValueError):
        backend.BlockTable(pool, 4).borrow_prefix(src, 6)
    with pytest.raises(AllocatorError):
        backend.BlockTable(backend.BlockPool(8, 4), 4).borrow_prefix(src, 2)
    with pytest.raises(AllocatorError):
        backend.BlockTable(pool, 2).borrow_prefix(src, 2)
    assert [pool.refcount(b) for b in range(3)] == [1, 1, 1]


def test_release_is_idempotent_and_context_manager_releases(backend):
    pool = backend.BlockPool(4, 4)
    with backend.BlockTable(pool, 4) as t:
        t.append_tokens(9)
        assert pool.num_free == 1
    assert pool.num_free == 4 and t.num_tokens == 0 and t.blocks == ()
    t.release()
    assert pool.num_free == 4


def test_garbage_collected_table_returns_its_blocks(backend):
    pool = backend.BlockPool(4, 4)
    t = backend.BlockTable(pool, 4)
    t.append_tokens(16)
    assert pool.num_free == 0
    del t
    gc.collect()
    assert pool.num_free == 4


def test_internal_fragmentation(backend):
    t = backend.BlockTable(backend.BlockPool(4, 16), 16)
    assert t.internal_fragmentation == 0
    t.append_tokens(1)
    assert t.internal_fragmentation == 15
    t.append_tokens(15)
    assert t.internal_fragmentation == 0
