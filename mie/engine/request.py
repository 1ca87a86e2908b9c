"""The engine's record of a request: its samples, what they generated, and its output.

The scheduler knows a request's samples only as ``Sequence``s (tokens and blocks). Everything
else a sample accumulates lives here: its random generator, detokenized text, penalty state
and log-probabilities (``Sample``), and per request its prompt log-probabilities, how many
samples have finished and whether the others have been forked from the first (``Request``).

A step changes this state before the scheduler commits the step's tokens, so it must be
undone exactly if the step fails: ``checkpoint()`` saves what a step can change and returns
the function that puts it back. ``Request.output()`` turns the record into the
``RequestOutput`` callers see (with ``best_of > n``, once finished, the ``n`` most likely).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from mie.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from mie.engine.sampling import LogitsState, SamplingParams, logits_state, request_rng
from mie.engine.speculative import NgramLookup, ProposalPolicy
from mie.engine.stop_strings import StopMatcher
from mie.engine.structured import GrammarCompiler, GrammarMatcher
from mie.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from mie.scheduler.sequence import Sequence

T = TypeVar("T")


@dataclass
class Sample:
    """One sequence of a request (``n`` / ``best_of`` make several): its tokens in the
    scheduler's ``Sequence``, its own generator, text, penalties and log-probabilities."""

    request: Request
    index: int
    rng: np.random.Generator
    detokenizer: IncrementalDetokenizer | None
    # What min_tokens, logit_bias and the penalties read of the history; None: none asked.
    penalty_state: LogitsState | None
    seq: Sequence | None = None  # None until submitted (the samples after the first wait)
    text: str = ""
    cumulative_logprob: float | None = None  # 0.0 from the start where it is computed
    logprobs: list[PositionLogprobs] | None = None
    # "stop" once a stop string or the caller finished it (``LLMEngine.finish_sample``): the
    # scheduler only knows that its sequence was aborted.
    finish_reason: str | None = None
    # Its stop strings read over its text (``SamplingParams.stop``); None: none asked.
    stops: StopMatcher | None = None
    # Where the sample is in its grammar (``structured_outputs``); None: unconstrained.
    matcher: GrammarMatcher | None = None
    # Speculative decoding, made on its first decode step: how many tokens it proposes (fewer
    # after failures), and its prompt lookup's index.
    proposal_policy: ProposalPolicy | None = None
    ngram_lookup: NgramLookup | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or (self.seq is not None and self.seq.finished)

    @property
    def stopped_by_string(self) -> bool:
        """Whether its text has reached one of its stop strings (it ends at that token)."""
        return self.stops is not None and self.stops.stop_at is not None

    def checkpoint(self) -> Callable[[], None]:
        """Save what a step changes before its commit; the returned function restores it."""
        rng_state = None if self.request.params.greedy else self.rng.bit_generator.state
        text, cumulative = self.text, self.cumulative_logprob
        num_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        detokenizer_state = self.detokenizer.checkpoint() if self.detokenizer else None
        num_consumed = self.matcher.num_consumed if self.matcher is not None else 0
        penalties = self.penalty_state
        num_observed = penalties.num_generated if penalties is not None else 0
        stops_state = self.stops.checkpoint() if self.stops is not None else None

        def restore() -> None:
            if self.finish_reason is not None:  # finished by the caller while the step ran:
                return  # it never runs again, and its text stays as the caller cut it
            if rng_state is not None:
                self.rng.bit_generator.state = rng_state
            self.text, self.cumulative_logprob = text, cumulative
            if self.logprobs is not None:
                del self.logprobs[num_logprobs:]
            if detokenizer_state is not None:
                self.detokenizer.restore(detokenizer_state)
            if self.matcher is not None:
                self.matcher.rollback_to(num_consumed)
            if penalties is not None:
                penalties.rollback_to(num_observed)
            if stops_state is not None:
                self.stops.restore(stops_state)

        return restore

    def completion(self) -> CompletionOutput:
        seq = self.seq
        if seq is None:
            return CompletionOutput(
                self.index,
                "",
                [],
                self.finish_reason,
                self.cumulative_logprob,
                [] if self.logprobs is not None else None,
            )
        text, tokens = self.text, seq.output_token_ids
        finish_reason = self.finish_reason or seq.finish_reason
        stop_reason = None
        if self.stops is not None:
            text = text[: self.stops.visible(finished=finish_reason is not None)]
            stop_reason = self.stops.stop_string
        if finish_reason == "stop" and stop_reason is None and tokens:
            if tokens[-1] in self.request.params.stop_token_ids:
                stop_reason = tokens[-1]
        return CompletionOutput(
            self.index,
            text,
            tokens,
            finish_reason,
            self.cumulative_logprob,
            list(self.logprobs) if self.logprobs is not None else None,
            stop_reason,
        )


def most_likely(samples: list[T], n: int, cumulative_logprob: Callable[[T], float]) -> list[T]:
    """``best_of``'s rule (vLLM's): of the samples, the ``n`` with the highest cumulative
    log-probability, best first (ties: the lower index first). The server ranks the choices
    it collected with it too (``mie.serve.answers``)."""
    return sorted(samples, key=lambda s: -cumulative_logprob(s))[:n]


@dataclass
class Request:
    """The engine's bookkeeping for one request: its samples, beside the scheduler's
    ``Sequence``s. The first sample computes the prompt; the others are submitted once it
    has (``LLMEngine._fork``), to borrow its KV."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: list[int]
    metrics: RequestMetrics
    samples: list[Sample] = field(default_factory=list)
    forked: bool = False  # the samples after the first are submitted
    num_finished: int = 0  # samples finished
    # [None, then one dict per prompt token computed so far] when prompt_logprobs is asked
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # The prompt read up to its last recorded position, for its log-probabilities' texts in
    # context (``Logprob.decoded_token``); None without prompt_logprobs or a tokenizer.
    prompt_detokenizer: IncrementalDetokenizer | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_token_ids: list[int],
        *,
        engine_seed: int,
        arrival: int,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        arrival_time: float,
        grammar: GrammarCompiler | None = None,
        bad_words_ids: list[tuple[int, ...]] | None = None,
    ) -> Request:
        """A request with every sample's generator, detokenizer, penalty state and grammar
        matcher built now, before it reaches the scheduler: nothing about it can fail once it
        is queued. ``arrival`` (the engine's count of accepted requests) seeds an unseeded
        request; ``grammar`` compiles its ``structured_outputs`` (raising
        ``StructuredOutputsError`` when it cannot); ``bad_words_ids`` are its ``bad_words``'
        token sequences."""
        constraint = params.structured_outputs
        request = cls(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            stop_token_ids,
            RequestMetrics(arrival_time=arrival_time),
            forked=params.best_of == 1,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if params.prompt_logprobs is not None and tokenizer:
            # From the first token, which has no log-probabilities (nothing precedes it).
            skip = params.skip_special_tokens
            request.prompt_detokenizer = IncrementalDetokenizer(tokenizer, [], skip)
            request.prompt_detokenizer.add(prompt_token_ids[0])
        scored = params.logprobs is not None or params.best_of > params.n
        stops = StopMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        for index in range(params.best_of):
            request.samples.append(
                Sample(
                    request,
                    index,
                    request_rng(params, engine_seed, arrival, index),
                    IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                    if tokenizer
                    else None,
                    logits_state(
                        params, prompt_token_ids, stop_token_ids, vocab_size, bad_words_ids or ()
                    ),
                    cumulative_logprob=0.0 if scored else None,
                    logprobs=[] if params.logprobs is not None else None,
                    matcher=grammar.matcher(constraint) if constraint else None,
                    stops=stops.fresh() if stops is not None else None,
                )
            )
        return request

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)

    def wants_all_positions(self, entry) -> bool:
        """Whether ``entry`` (a ``BatchEntry`` of the first sample, either backend's) computes
        prompt positions whose log-probabilities are still missing: then the model returns
        all its rows."""
        done = self.prompt_logprobs
        return (
            done is not None
            and len(done) < len(self.prompt_token_ids)
            and (entry.start < len(self.prompt_token_ids) - 1)
        )

    def checkpoint(self) -> Callable[[], None]:
        """Save the prompt log-probabilities' length (and how far their detokenizer read);
        the returned function restores it."""
        done, detokenizer = self.prompt_logprobs, self.prompt_detokenizer
        num = len(done) if done is not None else 0
        detokenizer_state = detokenizer.checkpoint() if detokenizer is not None else None

        def restore() -> None:
            if done is not None:
                del done[num:]
            if detokenizer_state is not None:
                detokenizer.restore(detokenizer_state)

        return restore

    def output(self) -> RequestOutput:
        samples, params, finished = self.samples, self.params, self.finished
        if finished and params.best_of > params.n:
            samples = most_likely(samples, params.n, lambda s: s.cumulative_logprob)
        prompt_logprobs = list(self.prompt_logprobs) if self.prompt_logprobs else None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [s.completion() for s in samples],
            finished,
            self.metrics,
            prompt_logprobs,
        )
