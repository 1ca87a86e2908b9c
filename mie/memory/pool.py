"""The block pool: every byte of KV memory the engine will ever use, allocated once.

The KV cache is carved into fixed-size blocks living in one contiguous arena. A block is
named by its integer id (its index in the arena), never by a host pointer, which is what
lets the same ids mean the same thing to NumPy, Cython and a GPU kernel alike.

Three preallocated structures, nothing else:

* ``arena``      -- ``num_blocks * bytes_per_block`` bytes (uint8), block ``b`` at
                    ``arena[b * bytes_per_block : (b + 1) * bytes_per_block]``;
* ``refcounts``  -- one plain int per block: how many holders (block tables, the prefix
                    cache) currently reference it; 0 means free;
* ``free list``  -- a LIFO stack of free ids. A fresh pool hands out 0, 1, 2, ...; after
                    that the most recently freed block is handed out next (it is the one
                    most likely to still be in a CPU cache).

Running out of memory is a normal event for a serving engine (it triggers preemption), so
``allocate`` answers with the sentinel ``INVALID_BLOCK`` instead of raising. Misuse -- an id
out of range, touching a free block -- is a bug in the caller and raises ``AllocatorError``
before anything is changed.
"""

from __future__ import annotations

import numpy as np

from mie.checks import is_int, positive_int
from mie.memory.block_ids import INVALID_BLOCK, AllocatorError
from mie.memory.table import BlockTable


class BlockPool:
    """Fixed-size blocks in one preallocated arena, with refcounts and a LIFO free list."""

    def __init__(self, num_blocks: int, bytes_per_block: int) -> None:
        num_blocks = positive_int(num_blocks, "num_blocks", limit=None)
        bytes_per_block = positive_int(bytes_per_block, "bytes_per_block", limit=None)
        self._num_blocks = num_blocks
        self._bytes_per_block = bytes_per_block
        self.arena = np.zeros(num_blocks * bytes_per_block, dtype=np.uint8)
        self._refcounts = [0] * num_blocks
        # Reversed so that pop() (the top of the stack) hands out 0, 1, 2, ... first.
        self._free = list(range(num_blocks - 1, -1, -1))

    # -- size and occupancy -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self._bytes_per_block

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def utilization(self) -> float:
        """Fraction of blocks currently held by someone."""
        return (self._num_blocks - len(self._free)) / self._num_blocks

    @property
    def free_ids(self) -> tuple[int, ...]:
        """The free list, bottom to top (the last id is the next one ``allocate`` returns)."""
        return tuple(self._free)

    # -- allocation and refcounting -----------------------------------------------------
    def allocate(self) -> int:
        """Take a free block (refcount 1), or return ``INVALID_BLOCK`` if none is free."""
        if not self._free:
            return INVALID_BLOCK
        block = self._free.pop()
        self._refcounts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more holder of an allocated block."""
        self._check_held(block, "incref")
        self._refcounts[block] += 1

    def decref(self, block: int) -> None:
        """One holder fewer; the last one returns the block to the free list."""
        self._check_held(block, "decref")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        self._check_range(block)
        return self._refcounts[block]

    def new_table(self, block_size: int) -> BlockTable:
        """An empty ``BlockTable`` over this pool: each backend's pool makes its own kind, so
        a scheduler never needs to know which backend it runs on."""
        return BlockTable(self, block_size)

    def block_data(self, block: int) -> np.ndarray:
        """A writable view (no copy) of an allocated block's bytes."""
        self._check_held(block, "block_data")
        start = block * self._bytes_per_block
        return self.arena[start : start + self._bytes_per_block]

    # -- misuse checks: raise before touching any state ----------------------------------
    def _check_range(self, block: int) -> None:
        if not is_int(block):
            raise AllocatorError(f"block id must be an int, got {block!r}")
        if not 0 <= block < self._num_blocks:
            raise AllocatorError(
                f"block {block} is out of range for a pool of {self._num_blocks} blocks"
            )

    def _check_held(self, block: int, operation: str) -> None:
        self._check_range(block)
        if self._refcounts[block] == 0:
            raise AllocatorError(f"{operation} of block {block}, which is free")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, bytes_per_block={self._bytes_per_block},"
            f" num_free={self.num_free})"
        )
