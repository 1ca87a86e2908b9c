"""Sampling parameters and the sampler: from one row of logits to one token.

The order of application is vLLM's (its v1 ``Sampler``), starting from the model's raw logits:

1. log-probabilities, when asked for (``logprobs``): the log-softmax of the *raw* logits,
   before anything below (vLLM's default ``raw_logprobs``; see ``mie.engine.logprobs``);
1a. ``structured_outputs``: every token the request's grammar cannot accept next gets -inf
   (``mie.engine.structured``), before anything else shapes the distribution, as vLLM's
   grammar bitmask is applied before its logits processors;
1b. ``allowed_token_ids``: every other token gets -inf; ``bad_words``: a word's last token
   gets -inf where the tokens before it end the sequence so far (a one-token word: always),
   each word as it begins a text and as it follows a space (vLLM's rule,
   ``bad_words_token_ids``; transformers' ``NoBadWordsLogitsProcessor`` on those sequences);
2. ``min_tokens``: the sequence's stop tokens (EOS unless ``ignore_eos``, and
   ``stop_token_ids``) get -inf until ``min_tokens`` tokens are generated;
3. ``logit_bias``: a bias added to the chosen token ids' logits;
4. the penalties: ``repetition_penalty`` (over prompt and generated tokens: a positive logit
   divided by it, a negative one multiplied, as transformers' ``RepetitionPenaltyLogitsProcessor``),
   then ``frequency_penalty`` and ``presence_penalty`` (over the generated tokens, OpenAI's
   formula: ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``);
5. greedy (temperature below ``GREEDY_TEMPERATURE``) takes the argmax here; otherwise
6. temperature, 7. ``min_p`` (drop tokens whose probability is below ``min_p`` times the top
   token's, transformers' ``MinPLogitsWarper``), 8. top-k, then top-p, 9. one draw.

Steps 1b-4 change which token greedy picks, so they come before it; 6-8 do not change the
argmax. Steps 1b-4 need the sequence's history: ``LogitsState`` keeps what they read (token
counts, the tokens seen, how many were generated, the last few) up to date one token at a
time, so a step costs O(vocabulary + bad words' tokens) for a request that uses them,
whatever its length, and nothing at all for one that does not (``logits_state`` returns
None).

A temperature below ``GREEDY_TEMPERATURE`` (1e-5, vLLM's ``_SAMPLING_EPS``) means greedy
(argmax), which needs no randomness at all; dividing logits by a smaller one (down to
5e-324) would overflow.

Ties: top-k keeps every token tied with the k-th largest logit (as Hugging Face's warper
does). Top-p ranks tokens by their scaled logit, highest first, and among exactly equal logits
the *higher* token id first -- the order of Hugging Face's and vLLM's ascending stable sort,
read from the top -- then keeps the smallest prefix of that ranking whose mass reaches top_p.
Ranking by logit rather than by probability matters when two distinct logits round to the same
probability (e.g. 0.0 and 1e-45): the larger logit wins, as in Hugging Face.

Reproducibility: every sequence owns its random generator, seeded from the request's own
``seed`` (or, when it has none, from the engine seed and the request's arrival index) and,
for the samples of ``n`` / ``best_of`` after the first, its sample index; it draws exactly
one uniform number per sampled token. What a request samples therefore never depends on
which other requests happen to share its batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from mie.checks import as_float, as_int, is_int
from mie.checks import short_repr as _short
from mie.engine.errors import InvalidRequestError
from mie.engine.stop_strings import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from mie.engine.structured import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
SEED_RANGE = (-(2**63), 2**64 - 1)  # torch.manual_seed's range; negative seeds wrap (+2**64),
# except -1, which is None (vLLM's "no seed")
MAX_LOGPROBS = 20  # most alternatives per token for logprobs / prompt_logprobs (OpenAI's cap)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty (OpenAI's range)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_BAD_WORDS = 128  # words of bad_words (vLLM's cap), ...
MAX_BAD_WORDS_TOKENS = 1024  # ... and their tokens in all, both spellings (vLLM's)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""``repetition_penalty``'s bounds. transformers and vLLM only ask for a positive number, but
a subnormal one (5e-324) divides a positive logit to inf, and two infs make the softmax NaN.
Within these bounds every penalized float32 logit stays finite in float64 with a wide margin;
beyond them the penalty is already total (a factor of 100 on every seen token's logit)."""
INT_FIELDS = (
    "n",
    "best_of",
    "top_k",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)
"""The fields read as ``as_int`` / ``as_float`` before any check (``logit_bias``'s keys and
values, and ``stop_token_ids``, are read the same way)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's names and defaults).

    ``n`` samples are returned per prompt; ``best_of`` (default ``n``) are generated and the
    ``n`` with the highest cumulative log-probability kept. ``logprobs`` / ``prompt_logprobs``
    ask for the log-probability of each generated / prompt token and of the top-k
    alternatives (k <= ``MAX_LOGPROBS``; 0: the token's own only). A sample stops at EOS
    (unless ``ignore_eos``), at a token of ``stop_token_ids``, or once its text contains one
    of the ``stop`` strings (``mie.engine.stop_strings``); the text then ends before the stop
    string and leaves a stop token's text out, unless ``include_stop_str_in_output``. Special
    tokens add no text unless ``skip_special_tokens`` is False.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        def fail(field: str, message: str) -> None:
            raise InvalidRequestError(f"SamplingParams: {message}", field=field)

        # Every number is read once, as a Python int or float (``as_int`` / ``as_float``: NumPy
        # scalars included, bools not, 10**400 as inf), and stored so: the checks below then
        # compare plain numbers, which never overflow, and a NumPy seed or count behaves
        # exactly as the same Python number does.
        for name in INT_FIELDS:
            value = getattr(self, name)
            if value is not None and as_int(value) is not None:
                object.__setattr__(self, name, as_int(value))
        for name in FLOAT_FIELDS:
            value = as_float(getattr(self, name))
            if value is None or not math.isfinite(value):
                fail(name, f"{name} must be a finite number, got {_short(getattr(self, name))}")
            object.__setattr__(self, name, value)
        if self.temperature < 0:
            fail("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not is_int(self.top_k) or self.top_k < -1:  # -1 or 0: every token (vLLM, HF)
            fail("top_k", f"top_k must be -1 or 0 (disabled) or >= 1, got {_short(self.top_k)}")
        if not 0 < self.top_p <= 1:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail(
                "max_tokens",
                f"max_tokens must be None (the context's room) or an int >= 1, "
                f"got {_short(self.max_tokens)}",
            )
        most = self.max_tokens if self.max_tokens is not None else math.inf
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= most:
            fail(
                "min_tokens",
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {_short(self.min_tokens)}",
            )
        if self.seed == -1 and is_int(self.seed):  # vLLM's "no seed"
            object.__setattr__(self, "seed", None)
        low, high = SEED_RANGE
        if self.seed is not None and not (is_int(self.seed) and low <= self.seed <= high):
            fail(
                "seed",
                f"seed must be None or an int in [-2**63, 2**64 - 1], got {_short(self.seed)}",
            )
        stops = self.stop_token_ids
        if stops is None:
            stops = ()
        if not isinstance(stops, (list, tuple)) or not all(is_int(t) and t >= 0 for t in stops):
            fail(
                "stop_token_ids",
                f"stop_token_ids must be a list of non-negative ints, got {_short(stops)}",
            )
        object.__setattr__(self, "stop_token_ids", tuple(as_int(t) for t in stops))
        object.__setattr__(self, "stop", _checked_stop_strings(self.stop, fail))
        cut = self.truncate_prompt_tokens
        if cut is not None and not (is_int(cut) and (cut >= 1 or cut == -1)):
            fail(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens must be None, -1 (the context length) or an int >= 1 "
                f"(the prompt's last tokens kept), got {_short(cut)}",
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                fail(name, f"{name} must be in [-2, 2], got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            fail(
                "repetition_penalty",
                f"repetition_penalty must be in [{low:g}, {high:g}] "
                f"(REPETITION_PENALTY_RANGE), got {self.repetition_penalty!r}",
            )
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias, fail))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, (list, tuple))
                or not allowed
                or not all(is_int(t) and t >= 0 for t in allowed)
            ):
                fail(
                    "allowed_token_ids",
                    "allowed_token_ids must be None or a non-empty list of non-negative ints, "
                    f"got {_short(allowed)}",
                )
            object.__setattr__(self, "allowed_token_ids", tuple(as_int(t) for t in allowed))
        words = () if self.bad_words is None else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
            fail("bad_words", f"bad_words must be a list of non-empty strings, got {_short(words)}")
        if len(words) > MAX_BAD_WORDS:
            fail("bad_words", f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS}")
        for i, word in enumerate(words):  # the tokenizer encodes them: UTF-8 text only
            try:
                word.encode("utf-8")
            except UnicodeEncodeError as exc:
                fail("bad_words", f"bad_words[{i}] is not valid Unicode: {exc.reason}")
        object.__setattr__(self, "bad_words", tuple(words))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and 0 <= value <= MAX_LOGPROBS):
                fail(
                    name,
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {_short(value)}",
                )
        if not is_int(self.n) or self.n < 1:
            fail("n", f"n must be an int >= 1, got {_short(self.n)}")
        if self.best_of is None:
            object.__setattr__(self, "best_of", self.n)
        elif not is_int(self.best_of) or self.best_of < self.n:
            fail("best_of", f"best_of must be an int >= n ({self.n}), got {_short(self.best_of)}")
        self._check_structured_outputs(fail)
        if self.greedy and self.best_of > 1:  # vLLM: the samples would all be the same
            fail(
                "n" if self.n > 1 else "best_of",
                f"best_of (and n) must be 1 when sampling greedily (temperature "
                f"{self.temperature}), got best_of={self.best_of}",
            )

    def _check_structured_outputs(self, fail) -> None:
        """A constraint's grammar decides when the output ends, by allowing the end-of-sequence
        token exactly when it accepts: so it needs that token to end on (not ``ignore_eos``).
        It also decides which tokens may come next, so ``min_tokens`` (which forbids the
        end), ``allowed_token_ids`` and ``bad_words`` (which forbid others) could leave a step
        nothing to draw: the request would fail halfway instead of being refused now."""
        constraint = self.structured_outputs
        if constraint is None:
            return
        if not isinstance(constraint, StructuredOutputsParams):
            fail(
                "structured_outputs",
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(constraint).__name__}",
            )
        for name, conflicting in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens)):
            if conflicting:
                fail(
                    name,
                    f"{name} cannot be combined with structured_outputs: the grammar ends the "
                    "output by allowing the end-of-sequence token exactly when it accepts",
                )
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name):
                fail(
                    name,
                    f"{name} cannot be combined with structured_outputs: the grammar decides "
                    "which tokens may come next, and where it allows only tokens this forbids "
                    "nothing would be left to draw",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads more than the logits: steps 1b-4 of the module docstring."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )


def _checked_stop_strings(stop: object, fail) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string: a tuple of one), within
    ``MAX_STOP_STRINGS`` and ``MAX_STOP_LENGTH`` (``mie.engine.stop_strings``)."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        fail("stop", f"stop must be a non-empty string or a list of them, got {_short(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        fail("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stops:
        if len(s) > MAX_STOP_LENGTH:
            fail(
                "stop",
                f"a stop string has {len(s)} characters; at most {MAX_STOP_LENGTH} are allowed",
            )
    return tuple(stops)


def _checked_logit_bias(bias: object, fail) -> dict[int, float] | None:
    """A copy of ``logit_bias`` with int keys and float values (ids are checked against the
    vocabulary by the engine, which knows it)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        fail(
            "logit_bias",
            f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}",
        )
    low, high = LOGIT_BIAS_RANGE
    out = {}
    for token, value in bias.items():
        if not is_int(token) or token < 0:
            fail(
                "logit_bias",
                f"logit_bias keys must be non-negative int token ids, got {_short(token)}",
            )
        number = as_float(value)
        if number is None or not low <= number <= high:
            fail(
                "logit_bias",
                f"logit_bias values must be in [-100, 100], got {_short(value)} for token {token}",
            )
        out[as_int(token)] = number
    return out or None


def request_rng(
    params: SamplingParams, engine_seed: int, request_index: int, sample_index: int = 0
) -> np.random.Generator:
    """A sequence's own generator: the request's seed if given, else (engine seed, arrival
    index); the samples after the first (``n`` / ``best_of``) also mix in their index. The
    two kinds of seed lists never collide: a seeded sample's ends in 0, an unseeded one's in
    its index >= 1."""
    if params.seed is not None:
        seed = params.seed % 2**64  # -1 -> 2**64 - 1, as in torch
        return np.random.default_rng(seed if sample_index == 0 else [seed, sample_index, 0])
    if sample_index == 0:
        return np.random.default_rng([engine_seed, request_index])
    return np.random.default_rng([engine_seed, request_index, sample_index])


class LogitsState:
    """What steps 1b-4 (allowed_token_ids, bad_words, min_tokens, logit_bias, penalties) read
    of one sequence's history, kept up to date by ``observe`` as each token is committed --
    never recounted."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        stop_token_ids: Iterable[int],
        vocab_size: int,
        bad_words_ids: Sequence[tuple[int, ...]] = (),
    ) -> None:
        self.params = params
        self.num_generated = 0
        self.allowed = None  # allowed_token_ids as a mask over the vocabulary
        if params.allowed_token_ids:
            self.allowed = np.zeros(vocab_size, dtype=bool)
            self.allowed[list(params.allowed_token_ids)] = True
        # bad_words: the one-token words, always banned; the longer ones, banned at their
        # last token after the tokens before it (prompt or generated), and the prompt's tail
        # that such a prefix may begin in.
        self.banned = np.array([w[0] for w in bad_words_ids if len(w) == 1], dtype=np.int64)
        self.bad_sequences = [w for w in bad_words_ids if len(w) > 1]
        longest = max((len(w) for w in self.bad_sequences), default=1)
        self.prompt_tail = list(prompt_token_ids[len(prompt_token_ids) - (longest - 1) :])
        self.stop_ids = np.array(sorted(stop_token_ids), dtype=np.int64)
        bias = params.logit_bias or {}
        self.bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self.bias_values = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
        self.generated: list[int] = []  # what rollback_to takes back
        self.seen = None  # prompt and generated tokens, for repetition_penalty
        if params.repetition_penalty != 1.0:
            self.prompt_seen = np.zeros(vocab_size, dtype=bool)
            self.prompt_seen[np.asarray(list(prompt_token_ids), dtype=np.int64)] = True
            self.seen = self.prompt_seen.copy()
        self.counts = None  # generated tokens, for frequency and presence penalties
        if params.frequency_penalty or params.presence_penalty:
            self.counts = np.zeros(vocab_size, dtype=np.int64)

    def observe(self, token_id: int) -> None:
        """Count a token the sequence just drew (before the next one is drawn: speculative
        decoding draws several per step)."""
        self.num_generated += 1
        self.generated.append(token_id)
        if self.seen is not None:
            self.seen[token_id] = True
        if self.counts is not None:
            self.counts[token_id] += 1

    def _ends_with(self, tokens: tuple[int, ...]) -> bool:
        """Whether the sequence so far (prompt, then generated) ends with ``tokens``."""
        k = len(tokens)
        tail = self.generated[-k:]
        if len(tail) < k:
            tail = self.prompt_tail[len(self.prompt_tail) - (k - len(tail)) :] + tail
        return tuple(tail) == tokens

    def rollback_to(self, num_generated: int) -> None:
        """Forget the tokens observed after the first ``num_generated`` (a failed step's)."""
        while self.num_generated > num_generated:
            token_id = self.generated.pop()
            self.num_generated -= 1
            if self.counts is not None:
                self.counts[token_id] -= 1
            if self.seen is not None:
                self.seen[token_id] = self.prompt_seen[token_id] or token_id in self.generated

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """Steps 1b-4 on a (vocab,) row: a new float64 row (the raw one is left alone)."""
        p = self.params
        out = logits.astype(np.float64)
        if self.allowed is not None:
            out[~self.allowed] = -np.inf
        if self.banned.size:
            out[self.banned] = -np.inf
        for word in self.bad_sequences:
            if self._ends_with(word[:-1]):
                out[word[-1]] = -np.inf
        if self.num_generated < p.min_tokens:
            out[self.stop_ids] = -np.inf
        if self.bias_ids.size:
            out[self.bias_ids] += self.bias_values
        if self.seen is not None:
            seen = out[self.seen]
            out[self.seen] = np.where(
                seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty
            )
        if self.counts is not None:
            out -= self.counts * p.frequency_penalty + (self.counts > 0) * p.presence_penalty
        return out


def logits_state(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    stop_token_ids: Iterable[int],
    vocab_size: int,
    bad_words_ids: Sequence[tuple[int, ...]] = (),
) -> LogitsState | None:
    """A ``LogitsState`` for a sequence whose params read its history; None (no work at
    all, per step or per token) for the common case that does not. ``bad_words_ids``: the
    token sequences of ``params.bad_words`` (``bad_words_token_ids``)."""
    if not params.uses_history:
        return None
    return LogitsState(params, prompt_token_ids, stop_token_ids, vocab_size, bad_words_ids)


def bad_words_sequences(words: Sequence[str], encode) -> list[tuple[int, ...]]:
    """A request's ``bad_words`` as the token sequences they ban (``bad_words_token_ids``,
    ``encode``: the tokenizer's, without special tokens; None: the engine has none), within
    ``MAX_BAD_WORDS_TOKENS`` tokens in all: each step checks every one."""
    if not words:
        return []
    if encode is None:
        raise InvalidRequestError(
            "bad_words are banned as the tokens they encode to, and this engine has no "
            "tokenizer (tokenizer.json): use logit_bias or allowed_token_ids",
            field="bad_words",
        )
    sequences = bad_words_token_ids(words, encode)
    total = sum(map(len, sequences))
    if total > MAX_BAD_WORDS_TOKENS:
        raise InvalidRequestError(
            f"bad_words encode to {total} tokens (both spellings); at most "
            f"{MAX_BAD_WORDS_TOKENS} are allowed",
            field="bad_words",
        )
    return sequences


def check_something_to_draw(
    params: SamplingParams,
    vocab_size: int,
    stop_token_ids: set[int],
    bad_words_ids: Sequence[tuple[int, ...]],
) -> None:
    """Every position must leave a token to draw: ``allowed_token_ids`` (else the vocabulary)
    less every token ``bad_words`` may ban (a word's last token: always for a one-token word,
    after the rest of it for a longer one -- which the prompt or the tokens drawn may spell),
    and less the stop tokens while ``min_tokens`` holds them back. Otherwise the request could
    fail halfway, after queueing: ``InvalidRequestError`` now instead."""
    allowed = set(params.allowed_token_ids) if params.allowed_token_ids else None
    banned = {w[-1] for w in bad_words_ids}
    if (len(allowed - banned) if allowed is not None else vocab_size - len(banned)) == 0:
        raise InvalidRequestError(
            "bad_words may ban every token allowed_token_ids allows (or the whole "
            "vocabulary; a word's last token is banned after the rest of it): a step could "
            "be left with no token to draw",
            field="bad_words",
        )
    if not params.min_tokens:
        return
    if allowed is None:
        left = vocab_size - len(banned | stop_token_ids)
    else:
        left = len(allowed - banned - stop_token_ids)
    if left == 0:  # min_tokens masks the stop tokens: nothing left
        raise InvalidRequestError(
            f"min_tokens {params.min_tokens} with every token that may be drawn a stop "
            "token (stop_token_ids and EOS): the first tokens would have no token to draw",
            field="min_tokens",
        )


def bad_words_token_ids(words: Sequence[str], encode) -> list[tuple[int, ...]]:
    """The token sequences ``bad_words`` bans, by vLLM's rule: each word as it begins a text
    and, where that differs, as it follows a space (``" " + word``, with the same number of
    tokens and another first token), encoded without special tokens (``encode(text)``)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        if alone:
            sequences.append(alone)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
            sequences.append(spaced)
    return sequences


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy request samples from: temperature, min_p, top-k, top-p."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.min_p > 0:
        # Probability below min_p x the top token's: gone (the top token always stays).
        probs = np.exp(scaled - scaled.max())
        scaled[probs < params.min_p * probs.max()] = -np.inf
    if 0 < params.top_k < scaled.size:
        kth_largest = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled[scaled < kth_largest] = -np.inf
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        probs = _top_p(scaled, probs, params.top_p)
        probs /= probs.sum()
    return probs


TOP_P_CANDIDATES = (256, 4096)  # tokens ranked by top-p, in turn, before the whole vocabulary


def _top_p(scaled: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """``probs`` with only the smallest set of most likely tokens whose mass reaches
    ``top_p`` left: a token is kept if the mass *before* it is still below ``top_p`` (so the
    top token always is), ranked by scaled logit, ties by the higher id first.

    Ranking the whole vocabulary is a sort of 150k logits, 20 ms a token; the tokens kept are
    nearly always a few of the most likely. So only the candidates -- every token at least
    as large as the k-th largest for k in ``TOP_P_CANDIDATES``, ties included -- are ranked;
    if their mass reaches ``top_p``, no token outside them can be kept (all of them come
    before it), and the kept set, its mass sums and the result are exactly the whole
    ranking's. If not, the next k, then the whole vocabulary (a flat distribution)."""
    for count in (*TOP_P_CANDIDATES, scaled.size):
        if count >= scaled.size:
            candidates = np.arange(scaled.size)
        else:
            kth_largest = np.partition(scaled, -count)[-count]
            candidates = np.flatnonzero(scaled >= kth_largest)  # ascending ids
            if probs[candidates].sum() < top_p * (1 - 1e-9):  # short of it: no need to rank
                continue
        # Ascending stable sort of ascending ids, read from the top: ties, higher id first.
        order = candidates[np.argsort(scaled[candidates], kind="stable")[::-1]]
        mass = np.cumsum(probs[order])
        if mass[-1] >= top_p or order.size == scaled.size:
            kept = order[mass - probs[order] < top_p]
            out = np.zeros_like(probs)
            out[kept] = probs[kept]
            return out
    raise AssertionError("unreachable: the whole vocabulary always ends the loop")


class NoDistributionError(ValueError):
    """A row of logits gives no distribution to sample from: a NaN, a +inf (inf - inf is NaN
    in the softmax) or no finite value at all. Sampling it would silently give the last
    token (``searchsorted`` past a NaN cdf) or the first NaN's (``argmax``)."""


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token id from a (vocab,) row of logits (one uniform draw if not greedy).

    ``logits`` are the row after steps 2-4 (``LogitsState.apply``) where the request has any.
    ``NoDistributionError`` unless its largest value is finite (which rules out NaN, +inf and
    a row of -inf): ``SamplingParams`` and ``add_request`` refuse every setting that could
    cause one from finite logits, so this is the last guard, against a model's own NaN.
    """
    top = logits.max()
    if not np.isfinite(top):
        raise NoDistributionError(
            f"no distribution to sample from: the logits' largest value is {top} (NaN, +inf, "
            "or every token masked)"
        )
    if params.greedy:
        return int(np.argmax(logits))
    cdf = np.cumsum(probabilities(logits, params))
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(token, cdf.size - 1)
