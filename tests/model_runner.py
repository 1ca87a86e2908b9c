"""Run ``Model.forward`` the way the engine does, from plain (token_ids, start, n, table) tuples.

The engine hands the model ``prepare_inputs(batch.entries)`` and the pool's KV view; tests that
drive the model without a scheduler build the same entries from tuples here.
"""

from __future__ import annotations

from mie.model import kv_view, prepare_inputs
from mie.scheduler import BatchEntry, Sequence


def run_forward(model, chunks, all_positions: bool = False):
    """``model.forward`` over ``chunks``: each computes ``token_ids[start : start + n]``."""
    entries = [
        BatchEntry(Sequence(i, list(token_ids), 1, (), table), start, n, is_prefill=n > 1)
        for i, (token_ids, start, n, table) in enumerate(chunks)
    ]
    inputs = prepare_inputs(entries, all_positions=all_positions)
    table = chunks[0][3]
    return model.forward(inputs, kv_view(table.pool, model.config, table.block_size))
