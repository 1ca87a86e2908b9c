"""What the engine hands back: vLLM's ``RequestOutput`` shape, so callers feel at home.

Log-probabilities are vLLM's shapes too: a position's alternatives are a dict token id ->
``Logprob``, holding the token actually there (sampled, or the prompt's) and the top-k of the
raw distribution (``mie.engine.logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``)."""

    logprob: float  # log-softmax of the model's raw logits
    rank: int | None = None  # 1 + how many tokens are strictly more likely (ties share)
    # The token's text in context: what it adds to the text after the tokens before it,
    # leading space included (None: no tokenizer). See ``IncrementalDetokenizer.peek``.
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # token id -> its Logprob, at one position


@dataclass
class CompletionOutput:
    """The generated part of one sample of a request (``index``: which sample)."""

    index: int
    # Everything generated so far, detokenized: up to a stop string, without a stop token's
    # text (unless ``include_stop_str_in_output``); while running, without a tail that may
    # still become a stop string.
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    # Sum of the sampled tokens' log-probabilities; None where none were computed (neither
    # logprobs nor best_of > n asked for them).
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per generated token (``logprobs``)
    # What ended it with "stop": the stop string, or the ``stop_token_ids`` token; None for
    # EOS, for any other finish reason, and while running (vLLM's ``stop_reason``).
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of one request's life, and what
    speculative decoding did for it (all its samples together)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    spec_draft_tokens: int = 0  # proposed tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's state after a step: its prompt, what it generated, whether it is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False)
    # ``prompt_logprobs``: None for the first prompt token (nothing precedes it), then one
    # dict per prompt token: the token itself and the top-k alternatives.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
