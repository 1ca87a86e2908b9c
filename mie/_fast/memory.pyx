# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython mirror of ``mie.memory``: ``BlockPool`` and ``BlockTable`` over C arrays.

What mirrors what (same names, same behaviour; checks from ``mie.checks``)::

    here                                        reference
    BlockPool: allocate, incref, decref,        mie/memory/pool.py  BlockPool, same methods
      refcount, new_table, block_data,
      free_ids, num_free, utilization
    BlockTable: append_tokens, blocks_needed,   mie/memory/table.py BlockTable, same methods
      writable_block, borrow_prefix,
      borrow_blocks, release_before, truncate,
      release, blocks, num_released

The pure-Python classes in ``mie/memory`` are the specification. These have the same public
API and the same observable behaviour -- the same ids handed out in the same order, the same
refcounts, return values, views and exceptions (``AllocatorError`` is the very same class) --
and differ only in storage: refcounts, the free list and block ids live in C arrays, and
copy-on-write is one ``memcpy``. Read the reference for the *why* of every rule; comments
here only explain what is specific to the C representation.

One restriction: a fast ``BlockTable`` needs a fast ``BlockPool`` (it reads the pool's C
arrays directly); mixing backends raises ``TypeError``.
"""

cimport cython
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.string cimport memcpy

import numpy as np

from mie.memory.block_ids import AllocatorError
from mie.checks import (
    MAX_TOKEN_COUNT,
    as_int,
    check_capacity,
    check_token_count,
    is_int,
    positive_int,
)


cdef class BlockPool:
    """Fixed-size blocks in one preallocated arena, with refcounts and a LIFO free list."""

    def __cinit__(self, num_blocks, bytes_per_block):
        # Same checks, messages and order as the reference; __cinit__ rather than __init__ so
        # the C arrays exist exactly once per object.
        num_blocks = positive_int(num_blocks, "num_blocks", limit=None)
        bytes_per_block = positive_int(bytes_per_block, "bytes_per_block", limit=None)
        self.arena = np.zeros(num_blocks * bytes_per_block, dtype=np.uint8)
        cdef unsigned char[::1] arena_bytes = self.arena
        self._data = &arena_bytes[0]
        self._num_blocks = num_blocks
        self._bytes_per_block = bytes_per_block
        self._refcounts = <Py_ssize_t *>PyMem_Malloc(num_blocks * sizeof(Py_ssize_t))
        self._free = <Py_ssize_t *>PyMem_Malloc(num_blocks * sizeof(Py_ssize_t))
        if self._refcounts == NULL or self._free == NULL:
            raise MemoryError()
        cdef Py_ssize_t i
        for i in range(num_blocks):
            self._refcounts[i] = 0
            self._free[i] = num_blocks - 1 - i  # top of the stack is 0: hands out 0, 1, 2, ...
        self._num_free = num_blocks

    def __dealloc__(self):
        PyMem_Free(self._refcounts)
        PyMem_Free(self._free)

    # -- size and occupancy -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self._bytes_per_block

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def utilization(self) -> float:
        """Fraction of blocks currently held by someone."""
        return (self._num_blocks - self._num_free) / <double>self._num_blocks

    @property
    def free_ids(self) -> tuple:
        """The free list, bottom to top (the last id is the next one ``allocate`` returns)."""
        return tuple([self._free[i] for i in range(self._num_free)])

    # -- allocation and refcounting -----------------------------------------------------
    def allocate(self) -> int:
        """Take a free block (refcount 1), or return ``INVALID_BLOCK`` if none is free."""
        return self._allocate()

    def incref(self, block) -> None:
        """One more holder of an allocated block."""
        self._refcounts[self._check_held(block, "incref")] += 1

    def decref(self, block) -> None:
        """One holder fewer; the last one returns the block to the free list."""
        self._release_one(self._check_held(block, "decref"))

    def refcount(self, block) -> int:
        return self._refcounts[self._check_range(block)]

    def new_table(self, block_size) -> BlockTable:
        """An empty fast ``BlockTable`` over this pool (mirrors ``BlockPool.new_table``)."""
        return BlockTable(self, block_size)

    def block_data(self, block):
        """A writable view (no copy) of an allocated block's bytes."""
        return self._view(self._check_held(block, "block_data"))

    # -- C-level operations (no checks: callers pass ids they know are valid) -----------
    cdef Py_ssize_t _allocate(self) noexcept:
        if self._num_free == 0:
            return NO_BLOCK
        self._num_free -= 1
        cdef Py_ssize_t block = self._free[self._num_free]
        self._refcounts[block] = 1
        return block

    cdef void _release_one(self, Py_ssize_t block) noexcept:
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._free[self._num_free] = block
            self._num_free += 1

    cdef object _view(self, Py_ssize_t block):
        start = block * self._bytes_per_block
        return self.arena[start : start + self._bytes_per_block]

    # -- misuse checks: raise before touching any state; return the id as a C integer ----
    cdef Py_ssize_t _check_range(self, object block) except -1:
        cdef int overflow = 0
        cdef long long index
        if type(block) is int:  # the common case, without a Python comparison
            index = PyLong_AsLongLongAndOverflow(block, &overflow)
            if not overflow and 0 <= index < self._num_blocks:
                return index
        elif isinstance(block, bool) or not isinstance(block, (int, np.integer)):
            raise AllocatorError(f"block id must be an int, got {block!r}")
        elif 0 <= block < self._num_blocks:
            return block
        raise AllocatorError(
            f"block {block} is out of range for a pool of {self._num_blocks} blocks"
        )

    cdef Py_ssize_t _check_held(self, object block, str operation) except -1:
        cdef Py_ssize_t index = self._check_range(block)
        if self._refcounts[index] == 0:
            raise AllocatorError(f"{operation} of block {block}, which is free")
        return index

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, bytes_per_block={self._bytes_per_block},"
            f" num_free={self._num_free})"
        )


# no_gc_clear: a table dropped inside a reference cycle must still reach its pool in
# __dealloc__ to return its blocks (the reference does this with weakref.finalize).
@cython.no_gc_clear
cdef class BlockTable:
    """Logical -> physical block map of one sequence, over a shared (fast) ``BlockPool``."""

    def __cinit__(self, pool, block_size):
        # The reference's checks in its order: the pool, the block size, the pool's capacity
        # (which keeps every token count this table computes inside C arithmetic).
        if not isinstance(pool, BlockPool):
            raise TypeError(f"a fast BlockTable needs a fast BlockPool (mie._fast), got {pool!r}")
        block_size = positive_int(block_size, "block_size", limit=None)
        check_capacity((<BlockPool>pool)._num_blocks, block_size)
        self.pool = pool
        self.block_size = block_size
        self._reserve(4)

    def __dealloc__(self):
        # Garbage collection returns the blocks, last first like release(); a block someone
        # else already freed by misuse is skipped rather than double-freed.
        cdef Py_ssize_t block
        if self.pool is not None:
            while self._num_blocks:
                self._num_blocks -= 1
                block = self._blocks[self._num_blocks]
                if block != NO_BLOCK and self.pool._refcounts[block] > 0:
                    self.pool._release_one(block)
        PyMem_Free(self._blocks)

    @property
    def blocks(self) -> tuple:
        """Physical block ids, in logical order (``INVALID_BLOCK`` for released ones)."""
        return tuple([self._blocks[i] for i in range(self._num_blocks)])

    @property
    def num_blocks(self) -> int:
        """Logical blocks, released ones included (``num_tokens`` spans them all)."""
        return self._num_blocks

    @property
    def num_released(self) -> int:
        """Leading blocks given back by ``release_before``; the table holds the rest."""
        return self._num_released

    @property
    def internal_fragmentation(self) -> int:
        """Reserved-but-unused token slots in the last block."""
        return self._num_blocks * self.block_size - self.num_tokens

    def blocks_needed(self, n) -> int:
        """How many new blocks ``append_tokens(n)`` would allocate."""
        n = check_token_count(n, "blocks_needed")
        return -(-(self.num_tokens + n) // self.block_size) - self._num_blocks

    def append_tokens(self, n) -> bool:
        """Reserve slots for ``n`` more tokens; False, with nothing changed, if out of memory."""
        n = check_token_count(n, "append_tokens")
        if n > MAX_TOKEN_COUNT:
            # More than the pool can ever hold (its capacity is at most MAX_TOKEN_COUNT), so
            # the reference answers False too; below it, the C sum of the table's tokens, n
            # and the block size stays under 2**63.
            return False
        return self._append(n)

    def writable_block(self, pos):
        """The bytes of the block holding token ``pos``, split first if shared (copy-on-write).

        Copy (``memcpy``), decref the old block, swap the id in -- the reference's order.
        Returns None with nothing changed if the pool has no block for the copy.
        """
        if not is_int(pos) or not 0 <= pos < self.num_tokens:
            raise IndexError(
                f"token position {pos!r} outside this table's {self.num_tokens} tokens"
            )
        cdef BlockPool pool = self.pool
        cdef Py_ssize_t index = <Py_ssize_t>pos // self.block_size
        if index < self._num_released:
            raise IndexError(f"token position {pos} is in a released block")
        cdef Py_ssize_t old = self._blocks[index]
        cdef Py_ssize_t new
        if pool._refcounts[old] > 1:
            new = pool._allocate()
            if new == NO_BLOCK:
                return None
            memcpy(
                pool._data + new * pool._bytes_per_block,
                pool._data + old * pool._bytes_per_block,
                pool._bytes_per_block,
            )  # 1. copy
            pool._release_one(old)  # 2. decref
            self._blocks[index] = new  # 3. swap
        return pool.block_data(self._blocks[index])

    def borrow_prefix(self, source, num_tokens) -> None:
        """Share the blocks holding ``source``'s first ``num_tokens`` tokens (refcount bump)."""
        cdef BlockTable src
        cdef Py_ssize_t i, count
        if self._num_blocks or self.num_tokens:
            raise AllocatorError("borrow_prefix needs an empty table")
        if not isinstance(source, BlockTable):  # None too: a typed variable would accept it
            raise TypeError(f"borrow_prefix needs a BlockTable to borrow from, got {source!r}")
        src = source
        if src.pool is not self.pool or src.block_size != self.block_size:
            raise AllocatorError("borrow_prefix across different pools or block sizes")
        tokens = as_int(num_tokens)
        if tokens is None or not 0 <= tokens <= src.num_tokens:
            raise ValueError(
                f"cannot borrow {num_tokens!r} tokens from a table of {src.num_tokens}"
            )
        num_tokens = tokens
        count = -(-<Py_ssize_t>num_tokens // self.block_size)
        if src._num_released and count:
            raise AllocatorError(
                f"borrow_prefix of {num_tokens} tokens from a table whose first "
                f"{src._num_released} blocks are released"
            )
        self._reserve(count)
        for i in range(count):  # checked one by one, like the reference's pool.incref calls
            self.pool.incref(src._blocks[i])
        memcpy(self._blocks, src._blocks, count * sizeof(Py_ssize_t))
        self._num_blocks = count
        self.num_tokens = num_tokens

    def borrow_blocks(self, blocks, num_tokens) -> None:
        """Share ``blocks`` (refcount bump) as the ones holding this table's first ``num_tokens``.

        The prefix cache's way in (see the reference). Every block is checked before any
        refcount changes.
        """
        cdef Py_ssize_t i, count
        if self._num_blocks or self.num_tokens:
            raise AllocatorError("borrow_blocks needs an empty table")
        blocks = list(blocks)
        count = len(blocks)
        tokens = as_int(num_tokens)
        if tokens is None or -(-tokens // self.block_size) != count:
            raise ValueError(
                f"{num_tokens!r} tokens do not fill {count} blocks of {self.block_size}"
            )
        num_tokens = tokens
        for block in blocks:
            if self.pool.refcount(block) == 0:
                raise AllocatorError(f"borrow_blocks of block {block}, which is free")
        self._reserve(count)
        for i in range(count):
            self._blocks[i] = self.pool._check_range(blocks[i])
            self.pool._refcounts[self._blocks[i]] += 1
        self._num_blocks = count
        self.num_tokens = num_tokens

    def release_before(self, pos) -> list:
        """Release the blocks wholly before token position ``pos``, first to last: decref,
        ``INVALID_BLOCK`` in their place; return the ids dropped (mirrors the reference)."""
        if not is_int(pos) or not 0 <= pos <= self.num_tokens:
            raise IndexError(
                f"release_before({pos!r}) outside this table's {self.num_tokens} tokens"
            )
        cdef Py_ssize_t end = <Py_ssize_t>pos // self.block_size
        dropped = []
        while self._num_released < end:
            block = self._blocks[self._num_released]
            self.pool.decref(block)
            self._blocks[self._num_released] = NO_BLOCK
            self._num_released += 1
            dropped.append(block)
        return dropped

    def truncate(self, num_tokens) -> list:
        """Shrink to the first ``num_tokens`` slots: decref the blocks past them, last first;
        return the ids dropped, in logical order (mirrors the reference)."""
        if not is_int(num_tokens) or not 0 <= num_tokens <= self.num_tokens:
            raise IndexError(
                f"truncate({num_tokens!r}) outside this table's {self.num_tokens} tokens"
            )
        cdef Py_ssize_t keep = (<Py_ssize_t>num_tokens + self.block_size - 1) // self.block_size
        if keep < self._num_released:
            raise IndexError(
                f"truncate({num_tokens}) would cut into the {self._num_released} released blocks"
            )
        dropped = [self._blocks[i] for i in range(keep, self._num_blocks)]
        while self._num_blocks > keep:
            self._num_blocks -= 1
            self.pool.decref(self._blocks[self._num_blocks])
        self.num_tokens = num_tokens
        return dropped

    def release(self) -> None:
        """Drop every block (decref), last first. Idempotent; the table is reusable after."""
        while self._num_blocks:
            self._num_blocks -= 1
            if self._blocks[self._num_blocks] != NO_BLOCK:
                self.pool.decref(self._blocks[self._num_blocks])
        self.num_tokens = 0
        self._num_released = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"BlockTable(num_tokens={self.num_tokens}, blocks={list(self.blocks)})"

    # -- C-level operations ---------------------------------------------------------------
    cdef Py_ssize_t _blocks_needed(self, Py_ssize_t n) noexcept:
        return (self.num_tokens + n + self.block_size - 1) // self.block_size - self._num_blocks

    cdef int _reserve(self, Py_ssize_t capacity) except -1:
        """Grow the id array to hold at least ``capacity`` ids (doubling, never shrinking)."""
        if capacity <= self._capacity:
            return 0
        capacity = max(capacity, 2 * self._capacity)
        cdef Py_ssize_t *grown = <Py_ssize_t *>PyMem_Realloc(
            self._blocks, capacity * sizeof(Py_ssize_t)
        )
        if grown == NULL:
            raise MemoryError()
        self._blocks = grown
        self._capacity = capacity
        return 0

    cdef bint _append(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t i, needed = self._blocks_needed(n)
        if needed > self.pool._num_free:
            return False
        self._reserve(self._num_blocks + needed)
        for i in range(needed):
            self._blocks[self._num_blocks] = self.pool._allocate()
            self._num_blocks += 1
        self.num_tokens += n
        return True
