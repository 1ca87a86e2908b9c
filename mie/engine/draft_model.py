"""Draft-model proposals for speculative decoding: a small model guesses, the target checks.

``speculative_config={"model": <directory>, "num_speculative_tokens": k}`` loads a second,
smaller checkpoint with the target's vocabulary. Each step, for every sequence that proposes,
the draft model runs ``k`` greedy steps over its own paged KV cache -- a ``BlockPool`` of its
own, one ``BlockTable`` per target sequence -- and its ``k`` argmax tokens are the proposal,
which the target then verifies like any other (``mie.engine.speculative``).

The draft's cache follows the target's tokens, not the other way round. Before proposing, a
draft keeps the longest prefix its cached tokens share with the sequence's tokens now and
cuts the rest off its table (``BlockTable.truncate``: its own proposals the target rejected),
then computes the sequence's tokens after that prefix in one chunk. So a rejection is rolled back
exactly as the target's is, and a sequence that leaves the target's running batch (finished,
aborted, preempted) has its draft blocks given back at the next step.

Memory: the draft's pool has as many blocks as the target's (its KV per token is smaller, so
it holds at least as many tokens in less memory). A sequence whose draft cannot get a block
proposes nothing that step; it is never a reason to preempt anything.
"""

from __future__ import annotations

import numpy as np

from mie.model import Model
from mie.model.kv_cache import bytes_per_block, kv_view
from mie.scheduler.batch import BatchEntry
from mie.scheduler.sequence import Sequence


class DraftModel:
    """The draft model, its KV pool and one draft per target sequence (see the module)."""

    def __init__(self, model: Model, backend, block_size: int, num_blocks: int) -> None:
        self.model = model
        self.prepare_inputs = backend.prepare_inputs  # the target's: the fast one, if built
        self.block_size = block_size
        block_bytes = bytes_per_block(model.config, block_size, "auto")
        self.pool = backend.BlockPool(num_blocks, block_bytes)
        self.kv_cache = kv_view(self.pool, model.config, block_size, "auto")
        # Target seq_id -> its draft: a ``Sequence`` of the draft's pool (what
        # ``prepare_inputs`` reads) whose table holds the KV of exactly its tokens.
        self._drafts: dict[int, Sequence] = {}

    @property
    def num_drafts(self) -> int:
        return len(self._drafts)

    def forget_all_but(self, seq_ids: set[int]) -> None:
        """Give back the blocks of every draft whose target sequence is not in ``seq_ids``
        (the target's running batch): it finished, was aborted or preempted."""
        for seq_id in [s for s in self._drafts if s not in seq_ids]:
            self._drafts.pop(seq_id).table.release()

    def propose(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """``requests``: target seq_id -> (its token ids, how many tokens to propose). Returns
        seq_id -> the draft's greedy continuation (none for a sequence whose draft found no
        memory). The first forward pass catches every draft up with its sequence (its newest
        token included, whose logits give the first proposal); each further one feeds every
        draft the token it just proposed. If anything raises (a forward pass), the drafts of
        ``requests`` are dropped, their blocks given back: their tables may count positions
        whose KV was never written, and the next proposal computes them again from scratch."""
        try:
            return self._propose(requests)
        except BaseException:
            for seq_id in requests:
                draft = self._drafts.pop(seq_id, None)
                if draft is not None:
                    draft.table.release()
            raise

    def _propose(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """``propose`` without its clean-up on failure."""
        for seq_id, (token_ids, _) in requests.items():
            self._catch_up(seq_id, token_ids)
        proposals: dict[int, list[int]] = {seq_id: [] for seq_id in requests}
        active = list(requests)
        while active:
            batch = []
            for seq_id in active:
                draft = self._drafts[seq_id]
                start = draft.table.num_tokens
                if not draft.table.append_tokens(draft.num_tokens - start):  # the pool is full
                    self._drafts.pop(seq_id).table.release()
                    del proposals[seq_id]
                    continue
                batch.append((seq_id, BatchEntry(draft, start, draft.num_tokens - start, True)))
            if not batch:
                break
            logits = self.model.forward(self.prepare_inputs([e for _, e in batch]), self.kv_cache)
            active = []
            for (seq_id, entry), row in zip(batch, logits, strict=True):
                token = int(np.argmax(row))
                proposals[seq_id].append(token)
                if len(proposals[seq_id]) < requests[seq_id][1]:
                    entry.seq.token_ids.append(token)  # its KV: the next round's input
                    active.append(seq_id)
        return {seq_id: tokens for seq_id, tokens in proposals.items() if tokens}

    def _catch_up(self, seq_id: int, token_ids: list[int]) -> None:
        """Make the draft of ``seq_id`` hold ``token_ids``, its cache cut back to the longest
        prefix of tokens it shares with them -- never all of them: the newest is computed
        again, for the logits that propose what follows."""
        draft = self._drafts.get(seq_id)
        if draft is None:
            table = self.pool.new_table(self.block_size)
            draft = self._drafts[seq_id] = Sequence(seq_id, token_ids, 1, (), table)
        limit = min(draft.table.num_tokens, len(token_ids) - 1)
        common = 0
        while common < limit and draft.token_ids[common] == token_ids[common]:
            common += 1
        draft.table.truncate(common)
        draft.token_ids[:] = token_ids
