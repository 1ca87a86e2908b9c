"""A sequence: one request's tokens, limits and block table -- the unit the scheduler moves.

A sequence has no state field. Where it is says what it is doing: in the scheduler's
``waiting`` deque (not yet admitted, or preempted), in its ``running`` list (holding blocks),
or in neither (finished or aborted: ``finish_reason`` says which).
"""

from __future__ import annotations

from collections.abc import Iterable

from mie.scheduler.prefix_cache import PrefixCursor

FINISH_STOP = "stop"  # sampled one of its stop token ids
FINISH_LENGTH = "length"  # generated max_tokens tokens
FINISH_ABORT = "abort"  # removed by Scheduler.abort


class Sequence:
    """One request: prompt + generated token ids, stop conditions, and its ``BlockTable``.

    ``num_computed`` counts the leading tokens whose KV is in the block table. Between steps
    it is ``num_tokens - 1`` for a running sequence -- the newest token is the input of its
    next decode -- and 0 for a waiting one. Preemption drops the blocks but never a token.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        max_tokens: int,
        stop_token_ids: Iterable[int],
        table,
        reuse_prefix: bool = True,
    ) -> None:
        self.seq_id = seq_id  # unique per scheduler, increasing in submission order
        self.token_ids = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.table = table  # BlockTable of the scheduler's pool (either backend)
        # False: never borrow computed KV, compute every prompt token (their logits are
        # wanted: prompt log-probabilities). Such a sequence still lends its own blocks.
        self.reuse_prefix = reuse_prefix
        self.num_computed = 0
        self.finish_reason: str | None = None
        # Bookkeeping for the step trace: preemptions suffered, and the most tokens ever
        # computed (what a readmission after preemption recomputes is counted against it).
        self.num_preemptions = 0
        self.peak_computed = 0
        # How far this sequence's full blocks are known to the prefix cache; None once a
        # hash collision stops the chain (see PrefixCache.register).
        self.cache_cursor: PrefixCursor | None = PrefixCursor()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens this sequence will ever hold KV for: the last one sampled is never
        fed back, so prompt + max_tokens - 1."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> None:
        """Add a generated token and apply the stop conditions (stop ids first, then length).

        A stop token is kept in ``token_ids``: it was generated; hiding it is the detokenizer's
        business.
        """
        self.token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            self.finish_reason = FINISH_STOP
        elif self.num_output_tokens >= self.max_tokens:
            self.finish_reason = FINISH_LENGTH

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}/{self.max_tokens}, "
            f"computed={self.num_computed}, finish_reason={self.finish_reason!r})"
        )
