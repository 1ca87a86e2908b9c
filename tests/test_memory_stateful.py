"""Stateful property test of the memory layer.

Random interleavings of allocate / append / borrow / write / release / release_before (the
leading blocks a sliding window no longer reads) across many tables.
Each table writes its own distinct byte pattern into the token slots it owns; the model
remembers what every table should read at every written position. After every step:

* every block's refcount equals the number of tables holding it;
* free + used = all blocks, no id twice on the free list, free <=> refcount 0;
* every table reads back exactly what the model says (copy-on-write never leaks a write);
* an out-of-memory answer changes nothing; releasing everything refills the pool;
* released leading blocks are INVALID_BLOCK placeholders (positions keep their blocks' index),
  can be neither written nor lent, and refuse either with nothing changed.
"""

from collections import Counter

import pytest
from conftest import needs_fast
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from mie import INVALID_BLOCK
from mie.backend import select
from mie.memory import AllocatorError

TOKEN_BYTES = 2


class MemoryMachine(RuleBasedStateMachine):
    backend_name = "python"
    tables = Bundle("tables")

    @rule(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
    @precondition(lambda self: not hasattr(self, "pool"))
    def make_pool(self, num_blocks, block_size):
        self.BlockTable = select(self.backend_name).BlockTable
        self.pool = select(self.backend_name).BlockPool(num_blocks, block_size * TOKEN_BYTES)
        self.block_size = block_size
        self.expected = {}  # table -> list of expected 2-byte values per position (or None)
        self.raw = []  # blocks held directly through allocate()
        self.stamp = 0

    def ready(self):
        return hasattr(self, "pool")

    def snapshot(self):
        return (
            [self.pool.refcount(b) for b in range(self.pool.num_blocks)],
            self.pool.free_ids,
            {id(t): (t.blocks, t.num_tokens) for t in self.expected},
            self.pool.arena.tobytes(),
        )

    @precondition(ready)
    @rule(target=tables)
    def new_table(self):
        table = self.BlockTable(self.pool, self.block_size)
        self.expected[table] = []
        return table

    @precondition(ready)
    @rule()
    def allocate_raw(self):
        before = self.snapshot()
        block = self.pool.allocate()
        if block == INVALID_BLOCK:
            assert self.snapshot() == before
        else:
            self.raw.append(block)

    @precondition(lambda self: self.ready() and self.raw)
    @rule(data=st.data())
    def free_raw(self, data):
        block = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1)))
        self.pool.decref(block)

    @precondition(ready)
    @rule(table=tables, n=st.integers(0, 9))
    def append(self, table, n):
        if table not in self.expected:
            return
        before = self.snapshot()
        if table.append_tokens(n):
            self.expected[table].extend([None] * n)
        else:
            assert self.snapshot() == before

    @precondition(ready)
    @rule(table=tables, data=st.data())
    def write(self, table, data):
        if table not in self.expected or table.num_tokens == 0:
            return
        pos = data.draw(st.integers(0, table.num_tokens - 1))
        before = self.snapshot()
        if pos // self.block_size < table.num_released:
            with pytest.raises(IndexError, match="released"):
                table.writable_block(pos)
            assert self.snapshot() == before
            return
        view = table.writable_block(pos)
        if view is None:
            assert self.snapshot() == before
            return
        self.stamp = (self.stamp + 1) % 65536
        slot = (pos % self.block_size) * TOKEN_BYTES
        view[slot : slot + TOKEN_BYTES] = [self.stamp & 0xFF, self.stamp >> 8]
        self.expected[table][pos] = self.stamp

    @precondition(ready)
    @rule(source=tables, data=st.data(), target=tables)
    def borrow(self, source, data):
        table = self.BlockTable(self.pool, self.block_size)
        if source in self.expected:
            n = data.draw(st.integers(0, source.num_tokens))
            if source.num_released and n:
                before = self.snapshot()
                with pytest.raises(AllocatorError, match="released"):
                    table.borrow_prefix(source, n)
                assert self.snapshot() == before and table.num_tokens == 0
                self.expected[table] = []
                return table
            table.borrow_prefix(source, n)
            self.expected[table] = list(self.expected[source][:n])
        else:
            self.expected[table] = []
        return table

    @precondition(ready)
    @rule(table=tables, data=st.data())
    def release_before(self, table, data):
        """A sliding window moved past ``pos``: exactly the blocks wholly before it that were
        still held are dropped, first to last."""
        if table not in self.expected:
            return
        pos = data.draw(st.integers(0, table.num_tokens))
        blocks, released = table.blocks, table.num_released
        end = max(released, pos // self.block_size)
        dropped = table.release_before(pos)
        assert dropped == list(blocks[released:end])
        assert table.num_released == end
        assert table.blocks == (INVALID_BLOCK,) * end + blocks[end:]
        assert table.num_tokens == len(self.expected[table])

    @precondition(ready)
    @rule(table=tables, data=st.data())
    def truncate(self, table, data):
        """Speculative decoding's rollback: exactly the blocks past the kept slots go back,
        last first, the kept ones are untouched (their bytes too: the read-back invariant),
        and a cut into released blocks is refused with nothing changed."""
        if table not in self.expected:
            return
        n = data.draw(st.integers(0, table.num_tokens))
        blocks, released = table.blocks, table.num_released
        keep = -(-n // self.block_size)
        if keep < released:
            before = self.snapshot()
            with pytest.raises(IndexError, match="released"):
                table.truncate(n)
            assert self.snapshot() == before
            return
        refcounts = [self.pool.refcount(b) for b in blocks[keep:]]
        assert table.truncate(n) == list(blocks[keep:])
        assert table.blocks == blocks[:keep] and table.num_tokens == n
        for block, count in zip(blocks[keep:], refcounts, strict=True):
            assert self.pool.refcount(block) == count - 1
        del self.expected[table][n:]

    @precondition(ready)
    @rule(table=consumes(tables))
    def release(self, table):
        if table in self.expected:
            table.release()
            table.release()  # idempotent
            del self.expected[table]

    @invariant()
    def refcounts_equal_holders(self):
        if not self.ready():
            return
        holders = Counter(self.raw)
        for table in self.expected:
            held = table.blocks[table.num_released :]
            assert table.blocks[: table.num_released] == (INVALID_BLOCK,) * table.num_released
            assert INVALID_BLOCK not in held and len(set(held)) == len(held)
            holders.update(held)
        for block in range(self.pool.num_blocks):
            assert self.pool.refcount(block) == holders[block], block

    @invariant()
    def free_list_is_consistent(self):
        if not self.ready():
            return
        free = self.pool.free_ids
        assert len(set(free)) == len(free) == self.pool.num_free
        assert set(free) == {b for b in range(self.pool.num_blocks) if self.pool.refcount(b) == 0}

    @invariant()
    def every_table_reads_what_it_wrote(self):
        if not self.ready():
            return
        for table, values in self.expected.items():
            assert table.num_tokens == len(values)
            assert table.num_blocks == -(-table.num_tokens // self.block_size)
            for pos, value in enumerate(values):
                if value is None or pos // self.block_size < table.num_released:
                    continue
                data = self.pool.block_data(table.blocks[pos // self.block_size])
                slot = (pos % self.block_size) * TOKEN_BYTES
                assert int(data[slot]) | (int(data[slot + 1]) << 8) == value

    def teardown(self):
        if not self.ready():
            return
        for table in list(self.expected):
            table.release()
        for block in self.raw:
            self.pool.decref(block)
        assert self.pool.num_free == self.pool.num_blocks


class FastMemoryMachine(MemoryMachine):
    backend_name = "fast"


TestMemoryMachine = MemoryMachine.TestCase
TestMemoryMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestFastMemoryMachine = needs_fast(FastMemoryMachine.TestCase)
TestFastMemoryMachine.settings = TestMemoryMachine.settings
