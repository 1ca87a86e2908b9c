"""The block table: one sequence's map from logical token positions to physical blocks.

Token ``pos`` of a sequence lives in physical block ``blocks[pos // block_size]`` at slot
``pos % block_size``. Blocks are allocated only when a block boundary is crossed, so at most
``block_size - 1`` slots per sequence are ever reserved but unused (internal fragmentation);
there is no external fragmentation, because any free block can serve any sequence.

Blocks may be shared between tables (a common prompt prefix is computed once and borrowed).
A shared block is read-only: ``writable_block`` splits it first (copy-on-write).

Under sliding-window attention the leading blocks fall out of every later query's window for
good, and ``release_before(pos)`` gives them back to the pool while the sequence runs on.
A released block stays in ``blocks`` as ``INVALID_BLOCK`` (-1), a placeholder: token ``pos``
still lives in ``blocks[pos // block_size]``, so no position arithmetic anywhere changes, and
the attention kernels, which never read before the window, accept -1 there. Released blocks
are always a prefix of the table (``num_released`` of them); they cannot be lent
(``borrow_prefix``) or written (``writable_block``).

Speculative decoding reserves slots for proposed tokens before the model has judged them;
``truncate(n)`` gives back the blocks past the first ``n`` slots once it has rejected some.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mie.checks import as_int, check_capacity, check_token_count, is_int, positive_int
from mie.memory.block_ids import INVALID_BLOCK, AllocatorError

if TYPE_CHECKING:  # a table is built over a pool; the pool module makes tables (new_table)
    from mie.memory.pool import BlockPool


def _decref_all(pool: BlockPool, blocks: list[int]) -> None:
    """Drop one reference to each held block (not the released placeholders) and empty the
    list, last first (shared by release and GC)."""
    while blocks:
        block = blocks.pop()
        if block != INVALID_BLOCK:
            pool.decref(block)


class BlockTable:
    """Logical -> physical block map of one sequence, over a shared ``BlockPool``."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        num_blocks = getattr(pool, "num_blocks", None)
        if not is_int(num_blocks):
            raise TypeError(f"a BlockTable needs a BlockPool, got {pool!r}")
        block_size = positive_int(block_size, "block_size", limit=None)
        check_capacity(num_blocks, block_size)
        self._pool = pool
        self._block_size = block_size
        self._blocks: list[int] = []  # INVALID_BLOCK for the released leading blocks
        self._num_tokens = 0
        self._num_released = 0
        # A table dropped without release() still returns its blocks. The finalizer holds
        # the pool and this very list object (never rebound), not the table itself.
        self._finalizer = weakref.finalize(self, _decref_all, pool, self._blocks)
        self._finalizer.atexit = False

    @property
    def pool(self) -> BlockPool:
        return self._pool

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_tokens(self) -> int:
        """Token slots reserved so far (written or not)."""
        return self._num_tokens

    @property
    def blocks(self) -> tuple[int, ...]:
        """Physical block ids, in logical order (``INVALID_BLOCK`` for released ones)."""
        return tuple(self._blocks)

    @property
    def num_blocks(self) -> int:
        """Logical blocks, released ones included (``num_tokens`` spans them all)."""
        return len(self._blocks)

    @property
    def num_released(self) -> int:
        """Leading blocks given back by ``release_before``; the table holds the rest."""
        return self._num_released

    @property
    def internal_fragmentation(self) -> int:
        """Reserved-but-unused token slots in the last block."""
        return len(self._blocks) * self._block_size - self._num_tokens

    def blocks_needed(self, n: int) -> int:
        """How many new blocks ``append_tokens(n)`` would allocate."""
        n = check_token_count(n, "blocks_needed")
        return -(-(self._num_tokens + n) // self._block_size) - len(self._blocks)

    def append_tokens(self, n: int) -> bool:
        """Reserve slots for ``n`` more tokens.

        Returns False, with the table and the pool untouched, if the pool cannot supply the
        blocks; the caller decides what to do (the scheduler preempts someone).
        """
        n = check_token_count(n, "append_tokens")
        needed = self.blocks_needed(n)
        if needed > self._pool.num_free:
            return False
        for _ in range(needed):
            block = self._pool.allocate()
            assert block != INVALID_BLOCK  # guaranteed by the num_free check above
            self._blocks.append(block)
        self._num_tokens += n
        return True

    def writable_block(self, pos: int) -> np.ndarray | None:
        """The bytes of the block holding token ``pos``, safe to write.

        If the block is shared, it is split first: allocate a new block, copy the bytes,
        decref the old one, put the new id in the table -- in that order. Copying first
        means nobody ever sees a half-made block; decref before swap means that if this was
        the last other holder the old block simply returns to the pool. Returns None with
        nothing changed if the pool has no block for the copy.
        """
        if not is_int(pos) or not 0 <= pos < self._num_tokens:
            raise IndexError(
                f"token position {pos!r} outside this table's {self._num_tokens} tokens"
            )
        index = pos // self._block_size
        if index < self._num_released:
            raise IndexError(f"token position {pos} is in a released block")
        old = self._blocks[index]
        if self._pool.refcount(old) > 1:
            new = self._pool.allocate()
            if new == INVALID_BLOCK:
                return None
            self._pool.block_data(new)[:] = self._pool.block_data(old)  # 1. copy
            self._pool.decref(old)  # 2. decref
            self._blocks[index] = new  # 3. swap
        return self._pool.block_data(self._blocks[index])

    def borrow_prefix(self, source: BlockTable, num_tokens: int) -> None:
        """Share the blocks holding ``source``'s first ``num_tokens`` tokens (refcount bump).

        A partly used last block is shared too; copy-on-write splits it at the first write.
        """
        if self._blocks or self._num_tokens:
            raise AllocatorError("borrow_prefix needs an empty table")
        if not isinstance(source, BlockTable):
            raise TypeError(f"borrow_prefix needs a BlockTable to borrow from, got {source!r}")
        if source._pool is not self._pool or source._block_size != self._block_size:
            raise AllocatorError("borrow_prefix across different pools or block sizes")
        tokens = as_int(num_tokens)
        if tokens is None or not 0 <= tokens <= source._num_tokens:
            raise ValueError(
                f"cannot borrow {num_tokens!r} tokens from a table of {source._num_tokens}"
            )
        num_tokens = tokens
        shared = source._blocks[: -(-num_tokens // self._block_size)]
        if source._num_released and shared:
            raise AllocatorError(
                f"borrow_prefix of {num_tokens} tokens from a table whose first "
                f"{source._num_released} blocks are released"
            )
        for block in shared:
            self._pool.incref(block)
        self._blocks.extend(shared)
        self._num_tokens = num_tokens

    def borrow_blocks(self, blocks: Sequence[int], num_tokens: int) -> None:
        """Share ``blocks`` (refcount bump) as the ones holding this table's first ``num_tokens``.

        The prefix cache's way in: its blocks outlive the table that computed them, so there
        is no source table to ``borrow_prefix`` from. ``num_tokens`` must fall in the last
        block. Every block is checked before any refcount changes.
        """
        if self._blocks or self._num_tokens:
            raise AllocatorError("borrow_blocks needs an empty table")
        blocks = list(blocks)
        tokens = as_int(num_tokens)
        if tokens is None or -(-tokens // self._block_size) != len(blocks):
            raise ValueError(
                f"{num_tokens!r} tokens do not fill {len(blocks)} blocks of {self._block_size}"
            )
        num_tokens = tokens
        for block in blocks:
            if self._pool.refcount(block) == 0:
                raise AllocatorError(f"borrow_blocks of block {block}, which is free")
        for block in blocks:
            self._pool.incref(block)
        self._blocks.extend(blocks)
        self._num_tokens = num_tokens

    def release_before(self, pos: int) -> list[int]:
        """Release the blocks wholly before token position ``pos`` (their tokens fell out of
        every later query's sliding window): decref each still held, first to last, leave
        ``INVALID_BLOCK`` in its place, and return the ids dropped, in logical order.

        ``pos`` may be anything from 0 to ``num_tokens``; blocks already released are skipped,
        so calling it again with the same or a smaller position changes nothing.
        """
        if not is_int(pos) or not 0 <= pos <= self._num_tokens:
            raise IndexError(
                f"release_before({pos!r}) outside this table's {self._num_tokens} tokens"
            )
        dropped = []
        while self._num_released < pos // self._block_size:
            block = self._blocks[self._num_released]
            self._pool.decref(block)
            self._blocks[self._num_released] = INVALID_BLOCK
            self._num_released += 1
            dropped.append(block)
        return dropped

    def truncate(self, num_tokens: int) -> list[int]:
        """Shrink the table to its first ``num_tokens`` token slots: decref every block that no
        longer holds one, last first, and return the ids dropped, in logical order.

        Speculative decoding's rollback: a step reserves slots for proposed tokens, and the
        ones the model rejected are cut off again. Slots kept in the last block are untouched
        (a rejected token's slot there is simply written again by a later step). ``num_tokens``
        may be anything from the released blocks' end to ``num_tokens``; the released
        placeholders are never touched.
        """
        if not is_int(num_tokens) or not 0 <= num_tokens <= self._num_tokens:
            raise IndexError(
                f"truncate({num_tokens!r}) outside this table's {self._num_tokens} tokens"
            )
        keep = -(-num_tokens // self._block_size)
        if keep < self._num_released:
            raise IndexError(
                f"truncate({num_tokens}) would cut into the {self._num_released} released blocks"
            )
        dropped = self._blocks[keep:]
        for block in reversed(dropped):
            self._pool.decref(block)
        del self._blocks[keep:]
        self._num_tokens = num_tokens
        return dropped

    def release(self) -> None:
        """Drop every block (decref). Idempotent; the table is empty and reusable after."""
        _decref_all(self._pool, self._blocks)
        self._num_tokens = 0
        self._num_released = 0

    def __enter__(self) -> BlockTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"BlockTable(num_tokens={self._num_tokens}, blocks={self._blocks})"
