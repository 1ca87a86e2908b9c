"""Unit tests for BlockPool (each backend): allocation order, refcounting, views, misuse."""

import numpy as np
import pytest

from mie import INVALID_BLOCK, AllocatorError


def snapshot(pool):
    return ([pool.refcount(b) for b in range(pool.num_blocks)], pool.free_ids, pool.arena.copy())


def test_fresh_pool_hands_out_ids_in_order_then_invalid(backend):
    pool = backend.BlockPool(4, 8)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.num_free == 0
    assert pool.allocate() == INVALID_BLOCK == -1
    assert pool.utilization == 1.0


def test_free_list_is_lifo(backend):
    pool = backend.BlockPool(5, 8)
    ids = [pool.allocate() for _ in range(5)]
    pool.decref(ids[1])
    pool.decref(ids[3])
    assert pool.allocate() == ids[3]
    assert pool.allocate() == ids[1]


def test_refcounts_and_free_on_zero(backend):
    pool = backend.BlockPool(2, 8)
    b = pool.allocate()
    assert pool.refcount(b) == 1
    pool.incref(b)
    assert pool.refcount(b) == 2
    pool.decref(b)
    assert pool.num_free == 1
    pool.decref(b)
    assert pool.refcount(b) == 0 and pool.num_free == 2
    assert pool.utilization == 0.0


def test_block_data_is_a_view_of_the_arena(backend):
    pool = backend.BlockPool(3, 16)
    arena_ptr = pool.arena.ctypes.data
    pool.allocate()
    b = pool.allocate()
    view = pool.block_data(b)
    assert view.shape == (16,) and view.dtype == np.uint8
    view[:] = 7
    assert np.all(pool.arena[16:32] == 7)
    assert np.all(pool.arena[:16] == 0) and np.all(pool.arena[32:] == 0)
    assert np.shares_memory(view, pool.arena)
    assert pool.arena.ctypes.data == arena_ptr  # no reallocation


def test_properties(backend):
    pool = backend.BlockPool(10, 32)
    assert pool.num_blocks == 10 and pool.bytes_per_block == 32
    assert pool.arena.nbytes == 320
    pool.allocate()
    assert pool.utilization == pytest.approx(0.1)


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, "0", None, True])
@pytest.mark.parametrize("op", ["incref", "decref", "refcount", "block_data"])
def test_misuse_out_of_range_raises_and_changes_nothing(backend, op, bad):
    pool = backend.BlockPool(4, 8)
    pool.allocate()
    before = snapshot(pool)
    with pytest.raises(AllocatorError) as err:
        getattr(pool, op)(bad)
    assert str(bad) in str(err.value)
    after = snapshot(pool)
    assert before[0] == after[0] and before[1] == after[1]


@pytest.mark.parametrize("op", ["incref", "decref", "block_data"])
def test_misuse_of_a_free_block_raises_and_changes_nothing(backend, op):
    pool = backend.BlockPool(4, 8)
    b = pool.allocate()
    pool.decref(b)
    before = snapshot(pool)
    with pytest.raises(AllocatorError, match=f"block {b}.*free"):
        getattr(pool, op)(b)
    after = snapshot(pool)
    assert before[0] == after[0] and before[1] == after[1]


def test_allocator_error_is_a_value_error():
    assert issubclass(AllocatorError, ValueError)


@pytest.mark.parametrize("args", [(0, 8), (-1, 8), (4, 0), (4, -2), (2.5, 8), (4, "8")])
def test_bad_constructor_arguments(backend, args):
    with pytest.raises(ValueError):
        backend.BlockPool(*args)
