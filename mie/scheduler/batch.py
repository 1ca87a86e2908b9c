"""What one scheduler step hands to the model runner."""

from __future__ import annotations

from dataclasses import dataclass

from mie.scheduler.sequence import Sequence
from mie.scheduler.trace import StepTrace


@dataclass(frozen=True)
class BatchEntry:
    """Compute tokens ``start .. start + num_tokens - 1`` of ``seq`` and answer one next token.

    Their slots are already in ``seq.table`` and every block they fall in is writable
    (refcount 1): the runner writes K/V there without allocating anything. Attention reads
    positions ``0 .. start + num_tokens - 1``; the first ``start`` are already in the cache.
    ``mie.model.inputs.prepare_inputs`` turns a batch's entries into the model's arrays (the
    slot mapping among them).
    """

    seq: Sequence
    start: int
    num_tokens: int
    is_prefill: bool  # False: a decode step (of one token, plus any proposed tokens)
    # Speculative decoding: tokens proposed to follow the sequence's newest one, computed in
    # this entry after it (its last ``len(spec_token_ids)`` tokens) for the model to verify.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        end = self.start + self.num_tokens - len(self.spec_token_ids)
        return self.seq.token_ids[self.start : end] + list(self.spec_token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)

    @property
    def context_len(self) -> int:
        """Tokens attention sees after this entry: the cached ones and the new ones."""
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether the runner samples a next token for this entry: its tokens reach the end
        of the sequence. A prompt chunk that ends earlier (chunked prefill) only computes
        K/V: the next token of a position inside the prompt is already known."""
        return self.start + self.num_tokens - len(self.spec_token_ids) == len(self.seq.token_ids)


@dataclass(frozen=True)
class Batch:
    """One step's work, in ``running`` order. Answer it with ``Scheduler.commit``."""

    step: int
    entries: tuple[BatchEntry, ...]
    preempted: tuple[Sequence, ...]  # sequences sent back to ``waiting`` by this step
    trace: StepTrace

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_sampling(self) -> int:
        """Entries that sample a next token: what ``Scheduler.commit`` takes one token for."""
        return sum(e.samples for e in self.entries)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if e.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if not e.is_prefill)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens the entries carry for verification (speculative decoding)."""
        return sum(len(e.spec_token_ids) for e in self.entries)
