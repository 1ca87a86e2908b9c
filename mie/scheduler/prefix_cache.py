"""The prefix cache: full KV blocks that outlive the sequence that computed them.

A full block's KV depends on every token before it, not just its own, so a block is named
by a hash chained over the blocks before it: ``block_hash(parent's hash, own token ids)``.
A new prompt walks its blocks through the index in O(prompt blocks) and borrows every block
it finds, also when the sequence that computed them has long finished.

Three rules make a hit always right:

* **Hashes find, tokens and serials decide.** The index maps a hash to a block, and a hash
  may collide. Each entry also keeps its own token ids and the *serial* of its parent entry
  (a number handed out once per registration, never reused). A hit needs equal token ids and
  the parent serial of the block matched just before, so by induction the whole token prefix
  is equal -- also when a parent was evicted and its block reused for other tokens.
* **Cached blocks are held.** The cache is one more holder of each of its blocks (one
  refcount). A cached block nobody else holds is *evictable*: reusable by a later prompt
  until the pool actually needs the block; then the least recently used goes first, and its
  index entry goes with it.
* **Only computed blocks are registered**: the scheduler registers a block after the model
  has written its KV (``Scheduler.commit``), never at allocation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

ROOT = 0
"""Hash and serial of the empty prefix (entry serials start at 1)."""


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block. Deterministic: Python hashes ints and tuples of
    ints the same way in every process."""
    return hash((parent_hash, token_ids))


class PrefixCursor(NamedTuple):
    """How much of one sequence's prefix the cache knows: its first ``num_blocks`` blocks,
    the last of which has chained hash ``hash`` and entry ``serial``."""

    num_blocks: int = 0
    hash: int = ROOT
    serial: int = ROOT


class CachedBlock(NamedTuple):
    hash: int
    serial: int
    parent_serial: int
    token_ids: tuple[int, ...]


class PrefixCache:
    """Index of computed full blocks by chained hash, with LRU eviction of unused ones."""

    def __init__(self, pool, block_size: int) -> None:
        self._pool = pool
        self._block_size = block_size
        self._entries: dict[int, CachedBlock] = {}  # block id -> its entry
        self._by_hash: dict[int, int] = {}  # chained hash -> block id
        # Blocks held by the cache alone, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._next_serial = ROOT + 1

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def cached_blocks(self) -> tuple[int, ...]:
        return tuple(self._entries)

    @property
    def evictable_blocks(self) -> tuple[int, ...]:
        """Blocks held by the cache alone, in eviction order (first = evicted next)."""
        return tuple(self._evictable)

    # -- lookup and borrowing -------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], PrefixCursor]:
        """The cached blocks holding the longest prefix of ``token_ids`` (at most
        ``max_blocks`` full blocks), and the cursor after them. Changes nothing."""
        blocks: list[int] = []
        cursor = PrefixCursor()
        bs = self._block_size
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(cursor.hash, chunk)
            block = self._by_hash.get(h)
            if block is None:
                break
            entry = self._entries[block]
            if entry.token_ids != chunk or entry.parent_serial != cursor.serial:
                break  # a hash collision: not our prefix
            blocks.append(block)
            cursor = PrefixCursor(i + 1, h, entry.serial)
        return blocks, cursor

    def count_evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are evictable now (borrowing them takes them off the
        reusable reserve, so admission counts them as consumed)."""
        return sum(1 for block in blocks if block in self._evictable)

    def acquire(self, blocks: Iterable[int]) -> None:
        """``blocks`` were just borrowed by a table: they are in use, not evictable."""
        for block in blocks:
            self._evictable.pop(block, None)

    def release(self, blocks: Iterable[int]) -> None:
        """A holder just let go of ``blocks`` (call after the decref): the cached ones that
        only the cache holds now become evictable, as the most recently used, in the order
        given (pass a sequence's blocks last-first, so its tail is evicted before its head,
        which more prompts share)."""
        for block in blocks:
            if block in self._entries and self._pool.refcount(block) == 1:
                self._evictable[block] = None

    # -- registration and eviction --------------------------------------------------------
    def register(
        self, cursor: PrefixCursor, blocks: Sequence[int], token_ids: Sequence[int], num_full: int
    ) -> PrefixCursor | None:
        """Index a sequence's computed full blocks ``cursor.num_blocks .. num_full - 1``.

        A block whose prefix is already cached (another sequence computed the same tokens in
        the same step) is not indexed twice; the chain continues through the existing entry.
        A collision with different tokens ends the chain: returns None, and this sequence
        registers nothing more.
        """
        bs = self._block_size
        for i in range(cursor.num_blocks, num_full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(cursor.hash, chunk)
            existing = self._by_hash.get(h)
            if existing is None:
                serial = self._next_serial
                self._next_serial += 1
                self._entries[blocks[i]] = CachedBlock(h, serial, cursor.serial, chunk)
                self._by_hash[h] = blocks[i]
                self._pool.incref(blocks[i])
            else:
                entry = self._entries[existing]
                if entry.token_ids != chunk or entry.parent_serial != cursor.serial:
                    return None
                serial = entry.serial
            cursor = PrefixCursor(i + 1, h, serial)
        return cursor

    def evict(self, n: int) -> None:
        """Return the ``n`` least recently used evictable blocks to the pool's free list."""
        if n > len(self._evictable):
            raise ValueError(f"cannot evict {n} blocks, only {len(self._evictable)} evictable")
        for _ in range(n):
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)

    def clear(self) -> None:
        """Drop every entry. Blocks still in use stay with their tables."""
        self._evictable.clear()
        for block in list(self._entries):
            self._forget(block)

    def _forget(self, block: int) -> None:
        """Unindex a block and drop the cache's reference: a reused block keeps no old name."""
        entry = self._entries.pop(block)
        del self._by_hash[entry.hash]
        self._pool.decref(block)

    def check_integrity(self) -> None:
        """Index, entries and the evictable set agree with each other and with the pool."""
        if len(self._by_hash) != len(self._entries):
            raise AssertionError("prefix cache: index and entries differ in size")
        for block, entry in self._entries.items():
            if self._by_hash.get(entry.hash) != block:
                raise AssertionError(f"prefix cache: block {block} is not indexed by its hash")
            if len(entry.token_ids) != self._block_size:
                raise AssertionError(f"prefix cache: block {block} is not full")
        for block in self._evictable:
            if block not in self._entries or self._pool.refcount(block) != 1:
                raise AssertionError(f"prefix cache: evictable block {block} is in use")
        idle = sum(1 for b in self._entries if self._pool.refcount(b) == 1)
        if idle != len(self._evictable):
            raise AssertionError("prefix cache: a block held by the cache alone is not evictable")
