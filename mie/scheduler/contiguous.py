"""The contiguous-KV baseline: each sequence reserves its maximum context up front.

A server without paging must give each sequence one contiguous KV region, sized for the
longest the sequence may become (prompt + max_tokens - 1 tokens), because a region cannot
grow in place once neighbours sit beside it. ``ContiguousAllocator`` does that, first fit,
so both of its wastes show: the reserved-but-unused tail of every region, and holes between
regions too small for the next request (external fragmentation).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from mie.checks import positive_int, token_ids
from mie.scheduler.batch import BatchEntry
from mie.scheduler.scheduler import RequestTooLongError, Scheduler, check_request_fits
from mie.scheduler.sequence import Sequence
from mie.scheduler.trace import StepTrace


class ContiguousAllocator:
    """First-fit allocation of token ranges in one arena of ``capacity`` token slots."""

    def __init__(self, capacity: int) -> None:
        capacity = positive_int(capacity, "capacity", limit=None)
        self.capacity = capacity
        self._holes: list[tuple[int, int]] = [(0, capacity)]  # (start, size), by start
        self._regions: dict[int, int] = {}  # start -> size of each reservation
        self.num_reserved = 0

    @property
    def largest_hole(self) -> int:
        return max((size for _, size in self._holes), default=0)

    def reserve(self, size: int) -> int | None:
        """Start of a new region of ``size`` slots in the first hole that fits, or None."""
        for i, (start, hole) in enumerate(self._holes):
            if hole >= size:
                if hole == size:
                    del self._holes[i]
                else:
                    self._holes[i] = (start + size, hole - size)
                self._regions[start] = size
                self.num_reserved += size
                return start
        return None

    def release(self, start: int) -> None:
        """Give a region back, merging it with the holes on either side."""
        size = self._regions.pop(start)
        self.num_reserved -= size
        i = 0
        while i < len(self._holes) and self._holes[i][0] < start:
            i += 1
        if i < len(self._holes) and start + size == self._holes[i][0]:
            size += self._holes.pop(i)[1]
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == start:
            start, size = self._holes[i - 1][0], self._holes[i - 1][1] + size
            i -= 1
            del self._holes[i]
        self._holes.insert(i, (start, size))

    def check_integrity(self) -> None:
        """Holes and regions tile the arena exactly, and no two holes touch."""
        pieces = sorted([*self._holes, *self._regions.items()])
        end = 0
        for start, size in pieces:
            if start != end or size < 1:
                raise AssertionError(f"contiguous arena: gap or overlap at {start}")
            end = start + size
        if end != self.capacity or self.num_reserved != sum(self._regions.values()):
            raise AssertionError("contiguous arena: regions and holes do not add up")
        for (a, size), (b, _) in zip(self._holes, self._holes[1:], strict=False):
            if a + size >= b:
                raise AssertionError(f"contiguous arena: holes at {a} and {b} not merged")


class ContiguousScheduler(Scheduler):
    """Continuous batching gated, and measured, as a non-paged server would be.

    Admission additionally needs a contiguous region of ``seq.max_kv_tokens`` slots in an
    arena of ``capacity_tokens``; the trace's reserved/capacity figures are the arena's. The
    KV itself still goes through ``pool`` (so any runner works unchanged); the pool must be
    big enough never to be the limit: ``min_pool_blocks`` blocks. No prefix sharing.

    It owns its difference by extending ``submit`` and the scheduler's own steps around
    ``super()`` (``_admit``, ``_free``, ``_trace``: the compiled mirror has them too).
    """

    def __init__(
        self,
        pool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        capacity_tokens: int,
    ) -> None:
        self.allocator = ContiguousAllocator(capacity_tokens)
        needed = self.min_pool_blocks(capacity_tokens, block_size, max_num_seqs)
        if pool.num_blocks < needed:
            raise ValueError(
                f"the pool behind a contiguous arena of {capacity_tokens} tokens needs "
                f"{needed} blocks, it has {pool.num_blocks}"
            )
        super().__init__(
            pool, block_size, max_num_seqs, max_num_batched_tokens, prefix_sharing=False
        )
        self._region_of: dict[int, int] = {}  # seq_id -> start of its region

    @staticmethod
    def min_pool_blocks(capacity_tokens: int, block_size: int, max_num_seqs: int) -> int:
        """Blocks that hold any set of sequences whose regions fit the arena (each region
        of r slots needs at most r // block_size + 1 blocks)."""
        return capacity_tokens // block_size + max_num_seqs

    def submit(
        self,
        prompt_token_ids: Iterable[int],
        max_tokens: int,
        stop_token_ids: Iterable[int] = (),
        *,
        reuse_prefix: bool = True,
    ) -> Sequence:
        """``Scheduler.submit``; a request whose region could never fit the arena is refused
        too (``RequestTooLongError``), after the paged scheduler's own rules."""
        prompt = token_ids(prompt_token_ids, "prompt_token_ids")  # it may be an iterator: read once
        if prompt:  # an empty one is Scheduler.submit's to refuse
            positive_int(max_tokens, "max_tokens", limit=None)
            check_request_fits(self, len(prompt), max_tokens)
            kv_tokens = len(prompt) + max_tokens - 1
            if kv_tokens > self.allocator.capacity:
                raise RequestTooLongError(
                    f"request too long: prompt {len(prompt)} + max_tokens {max_tokens} - 1 = "
                    f"{kv_tokens} tokens exceed the contiguous arena's {self.allocator.capacity}"
                )
        return super().submit(prompt, max_tokens, stop_token_ids, reuse_prefix=reuse_prefix)

    def _admit(self, scheduled: dict[int, BatchEntry], preempted: list, budget: int) -> None:
        """The paged scheduler's admission, over only as much of the front of ``waiting`` as
        the arena holds: each sequence's region is reserved, first fit and in queue order,
        before admission looks at it, and given back if it was not admitted after all."""
        queue = self.waiting
        candidates: deque[Sequence] = deque()
        for seq in queue:
            if len(self.running) + len(candidates) == self.max_num_seqs:
                break
            start = self.allocator.reserve(seq.max_kv_tokens)
            if start is None:
                break  # FCFS: nobody behind a request without a region is admitted
            self._region_of[seq.seq_id] = start
            candidates.append(seq)
        num_candidates = len(candidates)
        self.waiting = candidates  # admission pops the ones it admits from the front
        try:
            super()._admit(scheduled, preempted, budget)
        finally:
            self.waiting = queue
            for _ in range(num_candidates - len(candidates)):
                queue.popleft()  # admitted: now in running, with its region
            for seq in reversed(candidates):  # not admitted: its region goes back
                self.allocator.release(self._region_of.pop(seq.seq_id))

    def _free(self, seq: Sequence) -> None:
        super()._free(seq)
        self.allocator.release(self._region_of.pop(seq.seq_id))

    def _trace(self, entries: tuple[BatchEntry, ...]) -> StepTrace:
        """The scheduler's trace, with the arena's reserved and capacity figures."""
        reserved, capacity = self.allocator.num_reserved, self.allocator.capacity
        trace = super()._trace(entries)
        return replace(
            trace,
            utilization=reserved / capacity,
            reserved_tokens=reserved,
            capacity_tokens=capacity,
        )

    def check_integrity(self) -> None:
        super().check_integrity()
        self.allocator.check_integrity()
        if set(self._region_of) != {s.seq_id for s in self.running}:
            raise AssertionError("contiguous: regions are not exactly the running sequences'")
