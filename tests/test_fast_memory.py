"""The Cython allocator against the reference, side by side.

One state machine drives a reference pool and a fast pool (and pairs of tables over them)
with the same random operations, legal and illegal. Every operation must give the same
answer on both sides -- the same return value, or the same exception type and message -- and
after every operation all observable state must agree: refcounts, the free list, occupancy,
arena bytes (so copy-on-write copies the same bytes), and every table's blocks and counts.
"""

import weakref

import numpy as np
import pytest
from conftest import needs_fast, require_fast
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mie import INVALID_BLOCK, memory
from mie.backend import select

REF, FAST = 0, 1
MISUSED_IDS = [True, 1.5, None, "0", 2**70, -(2**70)]


def outcome(call):
    """What a call did, comparable across backends: its value or its exception."""
    try:
        return "returned", call()
    except Exception as exc:
        return "raised", type(exc), str(exc)


def where(view, pool):
    """A block view as (offset into the arena, bytes), or None."""
    if view is None:
        return None
    offset = view.__array_interface__["data"][0] - pool.arena.__array_interface__["data"][0]
    return offset, view.tobytes()


class SideBySide(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 10),
        bytes_per_block=st.integers(1, 6),
        block_size=st.integers(1, 4),
    )
    def make_pools(self, num_blocks, bytes_per_block, block_size):
        self.backends = (select("python"), select("fast"))
        self.pools = tuple(b.BlockPool(num_blocks, bytes_per_block) for b in self.backends)
        self.block_size = block_size
        self.tables = []  # pairs (reference table, fast table) over the two pools
        self.raw = []  # block ids this test holds itself, through allocate() or incref()

    def same(self, operation):
        """Run ``operation(side)`` on both sides; they must agree. Returns the outcome."""
        ref, fast = outcome(lambda: operation(REF)), outcome(lambda: operation(FAST))
        assert ref == fast
        return ref

    def block_ids(self):
        return st.one_of(
            st.integers(-2, self.pools[REF].num_blocks + 1),
            st.sampled_from(MISUSED_IDS),
            st.builds(np.int64, st.integers(0, self.pools[REF].num_blocks - 1)),
        )

    def pick_table(self, data):
        return data.draw(st.integers(0, len(self.tables) - 1), label="table")

    # -- the pool ------------------------------------------------------------------------
    @rule()
    def allocate(self):
        block = self.same(lambda side: self.pools[side].allocate())[1]
        if block != INVALID_BLOCK:
            self.raw.append(block)

    @precondition(lambda self: self.raw)
    @rule(data=st.data())
    def decref_held(self, data):
        block = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1)))
        self.same(lambda side: self.pools[side].decref(block))

    @rule(data=st.data(), operation=st.sampled_from(["incref", "decref", "refcount", "block_data"]))
    def any_id(self, data, operation):
        """Any operation on any id: legal ones change state alike, illegal ones raise alike."""
        block = data.draw(self.block_ids(), label="block")
        refcount = outcome(lambda: self.pools[REF].refcount(block))
        if operation == "decref" and refcount[0] == "returned" and refcount[1] > 0:
            return  # a legal decref would steal a table's reference; decref_held covers it
        result = self.same(
            lambda side: (
                where(self.pools[side].block_data(block), self.pools[side])
                if operation == "block_data"
                else getattr(self.pools[side], operation)(block)
            )
        )
        if operation == "incref" and result[0] == "returned":
            self.raw.append(int(block))

    # -- tables --------------------------------------------------------------------------
    @rule(other_block_size=st.booleans())
    def new_table(self, other_block_size):
        block_size = self.block_size + other_block_size
        self.tables.append(tuple(b.BlockTable(p, block_size) for b, p in self.both_pools()))

    def both_pools(self):
        return zip(self.backends, self.pools, strict=True)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.one_of(st.integers(0, 12), st.sampled_from([-1, True, 1.5])))
    def append(self, data, n):
        pair = self.tables[self.pick_table(data)]
        self.same(lambda side: pair[side].append_tokens(n))
        self.same(lambda side: pair[side].blocks_needed(3))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def write(self, data):
        pair = self.tables[self.pick_table(data)]
        pos = data.draw(
            st.one_of(st.integers(-1, pair[REF].num_tokens), st.sampled_from([True, 0.0])),
            label="pos",
        )
        result = self.same(lambda side: where(pair[side].writable_block(pos), self.pools[side]))
        if result[0] == "returned" and result[1] is not None:
            size = len(result[1][1])
            payload = data.draw(st.binary(min_size=size, max_size=size), label="bytes")
            for side in (REF, FAST):
                pair[side].writable_block(pos)[:] = np.frombuffer(payload, dtype=np.uint8)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), into_existing=st.booleans())
    def borrow(self, data, into_existing):
        source = self.tables[self.pick_table(data)]
        n = data.draw(st.integers(-1, source[REF].num_tokens + 1), label="n")
        if into_existing:  # usually not empty: AllocatorError on both sides
            target = self.tables[self.pick_table(data)]
        else:
            target = tuple(b.BlockTable(p, self.block_size) for b, p in self.both_pools())
            self.tables.append(target)
        self.same(lambda side: target[side].borrow_prefix(source[side], n))

    @rule(data=st.data(), into_existing=st.booleans())
    def borrow_blocks(self, data, into_existing):
        """The prefix cache's way in: held blocks (sometimes free or bogus ids, sometimes a
        token count that does not fit them) shared into a table."""
        ref_pool = self.pools[REF]
        held = [b for b in range(ref_pool.num_blocks) if ref_pool.refcount(b)]
        some_id = st.one_of(st.integers(-1, ref_pool.num_blocks), st.sampled_from(MISUSED_IDS))
        blocks = data.draw(
            st.lists(st.sampled_from(held) | some_id if held else some_id, max_size=4),
            label="blocks",
        )
        fitting = st.integers(
            (len(blocks) - 1) * self.block_size + 1, len(blocks) * self.block_size
        )
        n = data.draw((fitting if blocks else st.just(0)) | st.integers(-1, 20), label="n")
        if into_existing and self.tables:  # usually not empty: AllocatorError on both sides
            target = self.tables[self.pick_table(data)]
        else:
            target = tuple(b.BlockTable(p, self.block_size) for b, p in self.both_pools())
            self.tables.append(target)
        self.same(lambda side: target[side].borrow_blocks(blocks, n))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release_before(self, data):
        """A sliding window moving on (bad positions included: IndexError on both sides)."""
        pair = self.tables[self.pick_table(data)]
        pos = data.draw(
            st.one_of(st.integers(-1, pair[REF].num_tokens + 1), st.sampled_from([True, 1.0])),
            label="pos",
        )
        self.same(lambda side: pair[side].release_before(pos))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        pair = self.tables[self.pick_table(data)]
        self.same(lambda side: pair[side].release())

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def drop(self, data):
        """Forget a pair of tables without release(): garbage collection returns the blocks."""
        dropped = [weakref.ref(table) for table in self.tables.pop(self.pick_table(data))]
        assert [table() for table in dropped] == [None, None]  # freed at once, no cycle

    # -- after every step ----------------------------------------------------------------
    @invariant()
    def everything_observable_agrees(self):
        ref, fast = self.pools
        assert ref.free_ids == fast.free_ids
        assert ref.num_free == fast.num_free and ref.utilization == fast.utilization
        assert [ref.refcount(b) for b in range(ref.num_blocks)] == [
            fast.refcount(b) for b in range(fast.num_blocks)
        ]
        assert np.array_equal(ref.arena, fast.arena)
        assert repr(ref) == repr(fast)
        for ref_table, fast_table in self.tables:
            assert ref_table.blocks == fast_table.blocks
            assert ref_table.num_tokens == fast_table.num_tokens
            assert ref_table.num_blocks == fast_table.num_blocks
            assert ref_table.num_released == fast_table.num_released
            assert ref_table.internal_fragmentation == fast_table.internal_fragmentation
            assert repr(ref_table) == repr(fast_table)

    def teardown(self):
        if not hasattr(self, "pools"):
            return
        for pair in self.tables:
            self.same(lambda side, pair=pair: pair[side].release())
        for block in self.raw:
            self.same(lambda side, block=block: self.pools[side].decref(block))
        self.everything_observable_agrees()
        assert self.pools[FAST].num_free == self.pools[FAST].num_blocks


TestSideBySide = needs_fast(SideBySide.TestCase)
TestSideBySide.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)


def test_a_fast_table_needs_a_fast_pool():
    require_fast()
    with pytest.raises(TypeError):
        select("fast").BlockTable(memory.BlockPool(2, 4), 4)
