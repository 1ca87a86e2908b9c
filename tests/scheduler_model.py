"""A deterministic model that really reads its KV cache, and its scheduler-free oracle.

Like a transformer's, the "KV" of a token depends on the token and on everything before it:
``kv[p] = crc32(kv[p - 1], token[p])``, written into the token's slot of the pool's arena (one
int32 per slot), where ``kv[p - 1]`` is *read back from the cache* through the block table.
The next token is a hash of every KV value of the context, read back the same way. So a wrong
block table, a shared block overwritten, a stale or wrongly chained cache hit, or a
preemption that loses a token changes the output, and ``expected_output`` -- computed from
the token ids alone, with no scheduler and no cache -- no longer matches.

With a sliding window ``w`` (the scheduler's ``sliding_window``) it reads only what a windowed
transformer reads: ``kv[p]`` chains over a hash of ``kv[p - w + 1 .. p - 1]`` (the positions
query ``p`` attends to), and the next token hashes the last ``w`` KV values. A read of a
released block (-1 in the table) is a test failure, so blocks released too early show, and
an output computed from anything outside the window would not match the oracle.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from mie import BlockPool

VOCAB = 50
STOP = 0  # the stop token id the tests use (prompts avoid it)


def kv_pool(num_blocks: int, block_size: int, backend_pool=BlockPool) -> BlockPool:
    """A pool whose blocks hold one int32 per token slot."""
    return backend_pool(num_blocks, block_size * 4)


def kv_value(previous: int, token: int) -> int:
    return zlib.crc32(struct.pack("<ii", previous, token)) & 0x7FFFFFFF


def next_token(kv_values) -> int:
    return zlib.crc32(np.asarray(kv_values, dtype=np.int32).tobytes()) % VOCAB


def previous_kv(seen, window: int | None) -> int:
    """What a new token's KV chains on, from the KV values ``seen`` before it that its query
    attends to: the last one without a window, a hash of them all under one (0: none)."""
    if not len(seen):
        return 0
    if window is None:
        return int(seen[-1])
    return zlib.crc32(np.asarray(seen, dtype=np.int32).tobytes()) & 0x7FFFFFFF


def attended(p: int, window: int | None) -> int:
    """The first position before ``p`` that ``p``'s KV chains on."""
    return max(0, p - 1) if window is None else max(0, p - window + 1)


def expected_output(prompt, max_tokens: int, stop_token_ids=(), window=None) -> list[int]:
    """What any correct scheduler must produce for this request."""
    kv, out = [], []
    for token in prompt:
        kv.append(kv_value(previous_kv(kv[attended(len(kv), window) :], window), token))
    while len(out) < max_tokens:
        t = next_token(kv if window is None else kv[-window:])
        out.append(t)
        if t in stop_token_ids:
            break
        kv.append(kv_value(previous_kv(kv[attended(len(kv), window) :], window), t))
    return out


class KVModel:
    """Runs a batch: checks the batch contract, writes each new token's KV into its slot,
    reads the whole context back through the block table, answers one token per sampling
    entry (``entry.samples``; a chunk that ends inside its prompt gets none)."""

    def __init__(self, pool, block_size: int, window: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.slots = pool.arena.view(np.int32).reshape(pool.num_blocks, block_size)

    def read(self, blocks, first: int, end: int) -> list[int]:
        """KV values of positions ``first .. end - 1``, through the block table."""
        bs = self.block_size
        values = []
        for pos in range(first, end):
            block = blocks[pos // bs]
            assert block >= 0, f"position {pos} read from a released block"
            values.append(int(self.slots[block, pos % bs]))
        return values

    def write(self, entry) -> tuple[int, ...]:
        """Check the entry's slots and write its tokens' KV; return its table's blocks."""
        bs = self.block_size
        table = entry.seq.table
        blocks = table.blocks
        assert table.num_tokens == entry.context_len, "slots reserved for exactly the batch"
        for pos, token in zip(entry.positions, entry.token_ids, strict=True):
            block = blocks[pos // bs]
            assert self.pool.refcount(block) == 1, f"position {pos} is in a shared block"
            seen = self.read(blocks, attended(pos, self.window), pos)
            previous = previous_kv(seen, self.window)
            self.slots[block, pos % bs] = kv_value(previous, token)
        return blocks

    def token_after(self, blocks, end: int) -> int:
        """The token the KV of positions before ``end`` (its window's) says comes next."""
        first = 0 if self.window is None else max(0, end - self.window)
        return next_token(self.read(blocks, first, end))

    def __call__(self, batch) -> list[int]:
        answers = []
        for entry in batch.entries:
            blocks = self.write(entry)
            if entry.samples:  # (a prompt chunk ending inside the prompt gets no token)
                answers.append(self.token_after(blocks, entry.context_len))
        return answers


def scheduler_and_model(backend, num_blocks, block_size, max_num_seqs, budget, **flags):
    """The backend's scheduler (reference or Cython mirror) over a pool of that backend, and
    the ``KVModel`` that answers its batches (reading only the window, given one)."""
    pool = kv_pool(num_blocks, block_size, backend.BlockPool)
    scheduler = backend.Scheduler(pool, block_size, max_num_seqs, budget, **flags)
    return scheduler, KVModel(pool, block_size, flags.get("sliding_window"))


def checked_step(scheduler, model):
    """One step answered by ``model`` and committed, every invariant checked after it;
    returns (the batch, the sequences that finished)."""
    batch = scheduler.step()
    finished = scheduler.commit(batch, model(batch))
    scheduler.check_integrity()
    return batch, finished


def drain(scheduler, model, check=True, max_steps=100_000):
    """Step until nothing is left; returns the finished sequences in finishing order."""
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        batch = scheduler.step()
        finished += scheduler.commit(batch, model(batch))
        if check:
            scheduler.check_integrity()
    raise AssertionError(f"not drained after {max_steps} steps")
