"""Prepare once: a scheduled batch becomes the flat arrays one forward pass computes from.

The scheduler hands the engine a batch of entries, each "compute tokens ``start .. start +
num_tokens - 1`` of this sequence" (``mie.scheduler.BatchEntry``: ``token_ids`` -- the
sequence's, then any proposed ones to verify --, ``seq.table``, ``start``, ``num_tokens``).
``prepare_inputs`` turns them, once per step, into what the model needs -- in the spirit of
nano-vllm's ``prepare_prefill`` / ``prepare_decode``::

    token_ids      (T,)   every new token of every entry, entry after entry
    positions      (T,)   each token's position in its sequence
    slot_mapping   (T,)   each token's KV slot in the arena: block * block_size + offset
    decode_rows           the rows of single-token entries (decodes), and for them
    decode_block_tables   their block tables, padded with -1 (and -1 too where a windowed
                          model's scheduler released blocks before the window), and
    decode_context_lens   how many positions each attends to
    prefills              each longer entry's rows, block table and first position
    logits_rows           the rows whose logits are wanted: each entry's last token, or
                          all of an entry's rows where asked (prompt log-probabilities)

The model then starts at the embedding and only computes (``Model.forward``).

Memory is the scheduler's business, not the runner's: every block a token is written to must
already be private (refcount 1) -- the scheduler split shared blocks (copy-on-write) while it
could still preempt on a failed allocation. ``prepare_inputs`` checks that guarantee instead of
repairing it, so the forward pass never calls the allocator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mie.checks import is_int


class ScheduledEntry(Protocol):
    """What ``prepare_inputs`` reads of a ``mie.scheduler.BatchEntry`` (either backend's)."""

    seq: object  # has token_ids (list of ints) and table (a BlockTable)
    start: int
    num_tokens: int
    spec_token_ids: tuple[int, ...]  # proposed tokens after the sequence's (speculation)
    token_ids: list[int]  # the entry's tokens: the sequence's, then any proposed ones


@dataclass(frozen=True)
class PrefillSegment:
    """One entry of more than one token: causal attention over its rows and its cache."""

    rows: slice  # its rows in the flat arrays
    block_ids: np.ndarray  # its block table
    start: int  # position of its first row; positions before it are already cached


@dataclass(frozen=True)
class ForwardInputs:
    """Everything a forward pass reads besides the weights and the KV cache."""

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    decode_rows: np.ndarray
    decode_block_tables: np.ndarray
    decode_context_lens: np.ndarray
    prefills: tuple[PrefillSegment, ...]
    logits_rows: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def prepare_inputs(
    entries: Sequence[ScheduledEntry], *, all_positions: bool | Sequence[bool] = False
) -> ForwardInputs:
    """The flat inputs of one forward pass over ``entries`` (see the module docstring).

    ``all_positions`` asks for the logits of every computed token instead of each entry's
    last: for all entries (True; the transformers comparisons use it), or per entry (one
    bool each: the engine, for requests that want their prompt's log-probabilities). Raises
    ``ValueError`` for an entry that cannot be computed -- before anything is written -- and
    ``RuntimeError`` if a block about to be written is shared: the scheduler's contract was
    broken.
    """
    if not entries:
        raise ValueError("a forward pass needs at least one entry")
    if isinstance(all_positions, bool):
        all_positions = [all_positions] * len(entries)
    if len(all_positions) != len(entries):
        raise ValueError(f"all_positions has {len(all_positions)} flags for {len(entries)} entries")
    first = entries[0].seq.table
    _check_table(first)
    pool, block_size = first.pool, first.block_size
    token_ids, positions, slots, logits_rows = [], [], [], []
    decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
    row = 0
    for entry, entry_all_positions in zip(entries, all_positions, strict=True):
        start, n, seq = entry.start, entry.num_tokens, entry.seq
        table = seq.table
        num_token_ids = len(seq.token_ids) + len(entry.spec_token_ids)
        _check_entry(start, n, num_token_ids, table, pool, block_size)
        blocks = np.asarray(table.blocks, dtype=np.int64)
        bs = table.block_size
        entry_positions = np.arange(start, start + n)
        entry_slots = blocks[entry_positions // bs] * bs + entry_positions % bs
        _check_private(pool, blocks[start // bs : (start + n - 1) // bs + 1])
        ids = np.asarray(entry.token_ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be ints, got {ids.dtype}")
        token_ids.append(ids.astype(np.int64, copy=False))
        positions.append(entry_positions)
        slots.append(entry_slots)
        logits_rows.extend(range(row, row + n) if entry_all_positions else (row + n - 1,))
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(blocks[: start // bs + 1])
            decode_lens.append(start + 1)
        else:
            prefills.append(PrefillSegment(slice(row, row + n), blocks, start))
        row += n
    return ForwardInputs(
        token_ids=np.concatenate(token_ids),
        positions=np.concatenate(positions),
        slot_mapping=np.concatenate(slots),
        decode_rows=np.array(decode_rows, dtype=np.int64),
        decode_block_tables=_padded(decode_tables),
        decode_context_lens=np.array(decode_lens, dtype=np.int64),
        prefills=tuple(prefills),
        logits_rows=np.array(logits_rows, dtype=np.int64),
    )


def _check_entry(
    start: object, n: object, num_token_ids: int, table, pool, block_size: int
) -> None:
    """Refuse an entry that cannot be computed, before anything is written."""
    for name, value in (("start", start), ("num_tokens", n)):
        if not is_int(value):
            raise TypeError(f"entry {name} must be an integer, got {value!r}")
    if start < 0 or n < 1:
        raise ValueError(f"entry start {start} must be >= 0 and num_tokens {n} >= 1")
    if start + n > num_token_ids:
        raise ValueError(f"entry wants tokens up to {start + n}, has {num_token_ids}")
    _check_table(table)
    if table.pool is not pool or table.block_size != block_size:
        raise ValueError("all entries of a forward pass must share one pool and block size")
    if start + n > table.num_tokens:
        raise ValueError(
            f"entry wants slots up to {start + n}, its block table holds {table.num_tokens}"
        )


def _check_table(table: object) -> None:
    if not all(hasattr(table, name) for name in ("blocks", "pool", "block_size", "num_tokens")):
        raise TypeError(f"an entry's seq.table must be a BlockTable, got {type(table).__name__}")


def _check_private(pool, written_blocks: np.ndarray) -> None:
    for block in written_blocks.tolist():
        if pool.refcount(block) != 1:
            raise RuntimeError(
                f"block {block} is shared (refcount {pool.refcount(block)}) but about to be "
                "written: the scheduler must split shared blocks (copy-on-write) before the "
                "forward pass"
            )


def _padded(tables: list[np.ndarray]) -> np.ndarray:
    """Block tables of unequal length as one int64 array (the kernels' index type: no
    conversion per layer), padded with -1."""
    out = np.full((len(tables), max((len(t) for t in tables), default=0)), -1, dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out
