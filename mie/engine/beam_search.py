"""Beam search on the engine: transformers' algorithm, vLLM's API, the KV shared in blocks.

``LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens, ...))`` returns, for each
prompt, ``beam_width`` finished sequences, best first (vLLM's ``BeamSearchOutput``).

**The algorithm** is transformers' ``generate(num_beams=k, do_sample=False, early_stopping=...,
length_penalty=...)`` (its vectorised ``_beam_search``), one prompt at a time:

* A *running* beam has a cumulative log-probability, the sum of its generated tokens'. The
  search starts from one beam, the prompt, with 0.
* Each step, every (running beam, next token) pair is a candidate scored by the beam's sum +
  the token's log-probability (the log-softmax of the model's raw logits). The best
  ``K = max(2, 1 + #EOS) * k`` candidates are ranked, best first.
* A candidate *hits a stop* if its token is an EOS (unless ``ignore_eos``) or it reaches
  ``max_tokens``. Among the first ``k`` of the ranking, those that hit a stop become
  *finished* hypotheses, scored ``sum / generated_length ** length_penalty`` (the generated
  length counts the EOS token, not the prompt); the ``k`` best finished hypotheses are kept.
* The next running beams are the ``k`` best candidates that hit no stop (there always are
  ``k`` among the ``K``: the EOS tokens take at most ``#EOS * k`` places).
* The search stops when every candidate hits a stop (``max_tokens``), or ``k`` hypotheses are
  finished and either ``early_stopping=True``, or the best running beam can no longer beat the
  worst finished one by transformers' estimate: its sum divided by its length **now** (or, for
  ``early_stopping="never"`` with a positive ``length_penalty``, by ``max_tokens``) ``**
  length_penalty`` -- a heuristic that transformers keeps for compatibility.

Only the first ``k + #EOS`` tokens of each beam can matter: the first ``k`` candidates of the
ranking are among every beam's own best ``k``, and the ``k`` best that hit no stop are among
each beam's best ``k`` non-EOS tokens. So each beam asks the engine for exactly that many
log-probabilities (``SamplingParams(logprobs=k + #EOS)``), at most ``MAX_LOGPROBS``.

**Where this differs from vLLM's ``beam_search``** (which has no early stopping, divides by
the whole sequence's length, prompt included and EOS excluded, and ranks running beams by
their sum over ``2 * k`` candidates): the results here are transformers', the oracle of the
tests. ``early_stopping`` is a field vLLM's ``BeamSearchParams`` lacks (transformers' values:
``False``, ``True``, ``"never"``). ``temperature`` is accepted for vLLM's signature and, as in
vLLM, changes nothing: beams are ranked by raw log-probabilities (transformers' greedy beam
search applies no temperature either). ``beam_width=1`` runs this search with one beam, where
transformers' ``generate(num_beams=1)`` switches to greedy search: the two agree except with
``early_stopping="never"`` and a positive ``length_penalty``, where the one beam is judged at
``max_tokens`` and may go on past an EOS that greedy search stops at (tests pin both).

**On the engine** (vLLM v1's design, no scheduler change): each step, every running beam is a
one-token request whose prompt is the beam's tokens. With the prefix cache (the engine's
default) the request borrows every full block of its beam from the cache -- the prompt's and
the common ancestors' blocks are shared by all the beams descending from them, one reference
each -- and computes only the tokens of its partly filled last block; when the request ends,
its references are dropped. So beams *fork* by borrowing their parent's blocks and *die* by
releasing them: blocks no beam holds any more become idle cached blocks, reused on demand.
What this costs: the partly filled last block of each beam is recomputed each step (at most
``block_size`` tokens per beam) instead of split by copy-on-write; the memory held at a step
is the same, every full block once and one last block per beam.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mie.checks import as_float, as_int, is_int
from mie.engine.prompts import Prompt, check_fits_context, prompt_list, prompt_token_ids
from mie.engine.sampling import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from mie.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from mie.progress import ProgressBar

if TYPE_CHECKING:
    from mie.engine.llm_engine import LLMEngine
    from mie.engine.outputs import Logprob, RequestOutput

EARLY_STOPPING = (False, True, "never")  # transformers' values


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (``beam_width``, ``max_tokens``, ``ignore_eos``,
    ``temperature``, ``length_penalty``), plus transformers' ``early_stopping``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def fail(field: str, message: str) -> None:
            raise InvalidRequestError(f"BeamSearchParams: {field} {message}", field=field)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS:
            fail("beam_width", f"must be an int in [1, {MAX_LOGPROBS}], got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            fail("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.length_penalty):
            fail("length_penalty", f"must be a finite number, got {self.length_penalty!r}")
        if not any(self.early_stopping is v for v in EARLY_STOPPING):
            fail("early_stopping", f"must be False, True or 'never', got {self.early_stopping!r}")
        for name in ("beam_width", "max_tokens"):  # NumPy integers: as the Python int
            object.__setattr__(self, name, as_int(getattr(self, name)))
        for name in ("temperature", "length_penalty"):
            object.__setattr__(self, name, as_float(getattr(self, name)))


def _is_finite(x: object) -> bool:
    """A finite real number (``as_float``: 10**400 is not, and raises no OverflowError)."""
    number = as_float(x)
    return number is not None and math.isfinite(number)


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's names). ``tokens``: prompt + generated (a final EOS included);
    ``logprobs[i]``: the engine's log-probabilities for generated token i (the token and the
    best alternatives); ``cum_logprob``: the generated tokens' sum; ``score``: what ranks
    finished beams, ``cum_logprob / len(generated) ** length_penalty`` (transformers'
    ``sequences_scores``; a mie addition); ``text``: the text the generated tokens add to the
    prompt's, as every completion's text is read (``beam_text``), the EOS not shown;
    ``finish_reason``: "stop" (EOS) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """One prompt's result: ``beam_width`` finished sequences, best score first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    generated: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0


class BeamSearch:
    """One prompt's search, driven from outside: ask ``running`` which beams need the next
    token's log-probabilities, hand them to ``advance``, until ``done``; then ``output()``.

    Kept free of the engine so the algorithm reads (and is tested) on its own.
    """

    def __init__(
        self, prompt: Sequence[int], params: BeamSearchParams, eos_token_ids: Sequence[int]
    ) -> None:
        self.prompt = list(prompt)
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.running: list[_Beam] = [_Beam()]
        # running[i] continues the previous step's running[parents[i]] (where its KV forks from)
        self.parents: list[int] = []
        # (length_score(...), beam), best first, at most k
        self.finished: list[tuple[tuple[float, ...], _Beam]] = []
        self.num_generated = 0
        self.done = False
        self._improvable = True  # transformers' is_early_stop_heuristic_unsatisfied

    @property
    def num_logprobs(self) -> int:
        """Log-probabilities each beam needs: its best ``k + #EOS`` tokens (module doc)."""
        return self.params.beam_width + len(self.eos)

    def beam_prompts(self) -> list[list[int]]:
        """The running beams' tokens: each is the prompt of this step's request."""
        return [self.prompt + beam.generated for beam in self.running]

    def advance(self, next_logprobs: Sequence[Mapping[int, Logprob]]) -> None:
        """One step: ``next_logprobs[i]`` holds (at least) the best ``num_logprobs`` next
        tokens of running beam i, token id -> ``Logprob``."""
        if self.done:
            raise RuntimeError("advance() after the search is done")
        if len(next_logprobs) != len(self.running):
            raise ValueError(f"{len(next_logprobs)} rows for {len(self.running)} beams")
        k, params = self.params.beam_width, self.params
        length = self.num_generated + 1  # generated tokens once this step's is appended
        at_max = length >= params.max_tokens
        # Every candidate, best first (equal sums: by beam, then token id; torch.topk, which
        # transformers uses, leaves ties unordered).
        candidates = sorted(
            (
                (beam.cum_logprob + lp.logprob, i, token)
                for i, (beam, row) in enumerate(zip(self.running, next_logprobs, strict=True))
                for token, lp in row.items()
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: max(2, 1 + len(self.eos)) * k]

        def extend(i: int, token: int, total: float) -> _Beam:
            parent = self.running[i]
            row = next_logprobs[i]  # shared by the siblings, never changed
            return _Beam([*parent.generated, token], [*parent.logprobs, row], total)

        # Among the first k candidates, those that stop become finished hypotheses.
        new_finished = [
            (length_score(total, length, params.length_penalty), extend(i, token, total))
            for total, i, token in candidates[:k]
            if at_max or token in self.eos
        ]
        ranked = sorted([*self.finished, *new_finished], key=lambda f: f[0], reverse=True)
        self.finished = ranked[:k]  # (reverse=True keeps equal ranks in their order)
        # The k best candidates that do not stop run on.
        continuing = [
            (i, token, total) for total, i, token in candidates if not (at_max or token in self.eos)
        ]
        self.parents = [i for i, _, _ in continuing[:k]]
        self.running = [extend(i, token, total) for i, token, total in continuing[:k]]
        self.num_generated = length
        self.done = at_max or self._should_stop()

    def _should_stop(self) -> bool:
        """transformers' stopping rule, once k hypotheses are finished (module doc)."""
        params = self.params
        if len(self.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        if params.early_stopping == "never" and params.length_penalty > 0:
            best_length = params.max_tokens
        else:
            best_length = self.num_generated
        best_possible = length_score(
            self.running[0].cum_logprob, best_length, params.length_penalty
        )
        worst_finished = self.finished[-1][0]
        self._improvable = self._improvable and best_possible > worst_finished
        return not self._improvable

    def output(
        self, decode: Callable[[list[int], list[int]], str] | None = None
    ) -> BeamSearchOutput:
        """The finished hypotheses, best first, as vLLM's ``BeamSearchOutput``; ``decode``
        (prompt, generated tokens) -> their text (``beam_text``; None: no text)."""
        sequences = []
        for (score, *_), beam in self.finished:
            stopped = bool(beam.generated) and beam.generated[-1] in self.eos
            shown = beam.generated[:-1] if stopped else beam.generated
            sequences.append(
                BeamSearchSequence(
                    tokens=self.prompt + beam.generated,
                    logprobs=beam.logprobs,
                    cum_logprob=beam.cum_logprob,
                    text=decode(self.prompt, shown) if decode is not None else None,
                    finish_reason="stop" if stopped else "length",
                    score=score,
                )
            )
        return BeamSearchOutput(sequences)


def length_score(total: float, length: int, length_penalty: float) -> tuple[float, ...]:
    """A hypothesis' rank, compared as a tuple (higher is better): transformers' score
    ``total / length ** length_penalty`` first, then, where that score rounds to 0 or to
    -inf, what orders such hypotheses exactly.

    The direct formula raises for an extreme finite ``length_penalty`` (2 ** 2000 is an
    ``OverflowError``; 2 ** -2000 is 0, a ``ZeroDivisionError``). Here the power saturates to
    inf or 0 instead, and the score to -0.0 or -inf, as the exact value rounds. Many
    hypotheses may then share that score, so the rest ranks them by ``-ln(-score)`` =
    ``length_penalty * ln(length) - ln(-total)``; where that too is infinite (the product
    beyond float's range), the product dominates any difference of ``ln(-total)``, so
    ``ln(length)`` signed as ``length_penalty`` decides, then ``-ln(-total)``. Where the score
    is finite and not 0 the rest is 0: the ranking is transformers' own.
    """
    if total == -math.inf:  # a hypothesis with an impossible token: the worst there is
        return -math.inf, -math.inf, -math.inf, -math.inf
    if total == 0:  # a certain hypothesis: the best there is
        return 0.0, math.inf, math.inf, math.inf
    log_length, log_magnitude = math.log(length), math.log(-total)
    try:
        power = length**length_penalty
    except OverflowError:
        power = math.inf
    if sys.float_info.min <= power < math.inf:  # transformers' formula, as it computes it
        score = total / power
    else:  # the power is beyond float's normal range, the score may not be: from its log
        try:
            score = -math.exp(log_magnitude - length_penalty * log_length)
        except OverflowError:
            score = -math.inf
    if math.isfinite(score) and score != 0:
        return score, 0.0, 0.0, 0.0
    return (
        score,
        length_penalty * log_length - log_magnitude,
        math.copysign(log_length, length_penalty),
        -log_magnitude,
    )


def beam_text(tokenizer: Tokenizer, prompt: list[int], generated: list[int]) -> str:
    """The text ``generated`` adds after ``prompt``, read as the engine reads every sample's
    (``IncrementalDetokenizer``): in context, so that prompt + text is the whole text -- a
    SentencePiece token's leading space kept, which decoding the generated tokens alone drops."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    return "".join(detokenizer.add(token) for token in generated)


def start_search(
    token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int], max_model_len: int
) -> BeamSearch:
    """A search of ``token_ids`` (a prompt of the vocabulary), or the ``InvalidRequestError``
    that refuses it before anything runs: the prompt and ``max_tokens`` must fit the context,
    and the log-probabilities a beam needs (``BeamSearch.num_logprobs``) ``MAX_LOGPROBS``."""
    check_fits_context(len(token_ids), params.max_tokens, max_model_len)
    search = BeamSearch(token_ids, params, eos_token_ids)
    if search.num_logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(
            f"beam_width {params.beam_width} + the model's {len(search.eos)} EOS tokens "
            f"need {search.num_logprobs} log-probabilities per beam, more than "
            f"MAX_LOGPROBS = {MAX_LOGPROBS}: lower beam_width",
            field="beam_width",
        )
    return search


def step_params(search: BeamSearch, vocab_size: int) -> SamplingParams:
    """The engine's parameters for one step of ``search``: each running beam is a request
    of one greedy token whose log-probabilities (the beam's best ``num_logprobs`` next
    tokens) are what the search reads."""
    logprobs = min(search.num_logprobs, vocab_size)
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def beam_search(
    engine: LLMEngine,
    generate: Callable[..., list[RequestOutput]],
    prompts: Prompt | Sequence[Prompt],
    params: BeamSearchParams,
    use_tqdm: bool = True,
) -> list[BeamSearchOutput]:
    """Run one ``BeamSearch`` per prompt, all of them together: each step, every running beam
    of every prompt is one request of one token (``generate``, i.e. ``LLM.generate``), whose
    log-probabilities advance its search. Every prompt is validated before anything runs."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError(
            f"expected BeamSearchParams, got {type(params).__name__}", field="params"
        )
    eos, vocab = engine.model.config.eos_token_ids, engine.model.config.vocab_size
    searches = []
    for prompt in prompt_list(prompts):
        _, token_ids = prompt_token_ids(prompt, engine.tokenizer, engine.max_model_len, vocab)
        searches.append(start_search(token_ids, params, eos, engine.max_model_len))
    step = step_params(searches[0], vocab) if searches else None
    decode = functools.partial(beam_text, engine.tokenizer) if engine.tokenizer else None
    with ProgressBar(params.max_tokens, "beam search") if use_tqdm else nullcontext() as bar:
        while live := [s for s in searches if not s.done]:
            requests = [{"prompt_token_ids": t} for s in live for t in s.beam_prompts()]
            outputs = iter(generate(requests, step, use_tqdm=False))
            for search in live:
                search.advance([next(outputs).outputs[0].logprobs[0] for _ in search.running])
            if bar:
                bar.update(1)
    return [search.output(decode) for search in searches]
