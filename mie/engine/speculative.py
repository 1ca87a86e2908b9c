"""Speculative decoding: guess the next tokens cheaply, let the model check them all at once.

At batch 1 a decode step reads every weight once to compute one token; computing a few more
positions in the same pass costs little more (the weights are read once either way). So each
step the engine *proposes* up to ``k`` tokens to follow a sequence's newest one, the scheduler
gives them slots (``Scheduler.step(proposals)``), the model computes all ``k + 1`` positions in
one forward pass, and the engine keeps the proposals the model agrees with plus one token of
its own (``LLMEngine._verify``); the scheduler cuts the rejected ones' slots off the block
table. A step then yields 1 to ``k + 1`` tokens for about the price of one.

Proposals come from a draft model (``mie.engine.draft_model``: a small checkpoint with the
target's vocabulary, ``k`` greedy steps over its own paged cache) or, here, from **n-gram
prompt lookup** (vLLM's ``"ngram"``, transformers'
``prompt_lookup_num_tokens``): the last ``n`` tokens, ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, are looked up in the sequence's earlier text (prompt and output), the
most recent match first, and the ``k`` tokens that followed it there are the proposal. On
input-grounded work (retelling, copying, editing a text in the prompt) they are often right.

**Verification changes nothing but the speed.** At each verified position the engine draws
the sample's token exactly as plain decoding would -- the same logits processing (grammar,
penalties, ``logit_bias``, ``min_tokens``, the sampling knobs) over the tokens before it, the
same draw from the sample's own generator -- and a proposal is accepted when it *is* that
token; the first one that is not ends the run, and the token drawn there replaces it. So the
text is token for token plain decoding's, greedy or sampled (a seeded request gives the same
text with speculation or without), and a wrong proposal costs compute, never correctness.
This is rejection sampling (Leviathan et al. 2023; vLLM's ``RejectionSampler``) for a draft
that proposes one token with certainty, as prompt lookup and greedy draft models do: that
accepts a proposal ``d`` with probability ``p(d)``, which is exactly the probability that
the plain draw is ``d``, so coupling acceptance to the plain draw loses no acceptance and
keeps every random number where plain decoding would have used it.

**When not to guess.** A wrong proposal costs its positions' compute. A sample whose proposals
keep failing proposes fewer tokens, less and less often (``ProposalPolicy``), and with
``disable_by_batch_size`` or more sequences decoding nobody proposes: a large batch is
compute-bound, and verifying guesses would only slow it down (vLLM's rule of the same name).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mie.checks import positive_int, short_repr

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
MAX_BACKOFF_STEPS = 32
MAX_LOOKUP_BACKOFF_STEPS = 8  # a lookup costs ~6 us: look again at least every 8 tokens
FIRST_PROPOSAL_SIZE = 2  # a sample's first proposal (``ProposalPolicy``), at most k


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 8}``, or
    ``{"model": <draft checkpoint directory>, "num_speculative_tokens": k}`` (method
    ``"draft_model"``: ``mie.engine.draft_model``)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # the draft model's directory (method "draft_model")

    @classmethod
    def parse(cls, value: object, name: str = "speculative_config") -> SpeculativeConfig | None:
        """A ``SpeculativeConfig`` from a dict, its JSON text (the CLI's ``--speculative-config``)
        or itself; None stays None. Anything else is a ``ValueError`` naming the key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{name} must be a JSON object, got {short_repr(value)}: {exc}"
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a dict (or its JSON text), got {short_repr(value)}")
        settings = dict(value)
        model = settings.pop("model", None)
        method = settings.pop("method", "ngram" if model is None else "draft_model")
        if method not in METHODS:
            raise ValueError(f"{name}: method {method!r} is not supported; mie has {list(METHODS)}")
        if (method == "draft_model") != (model is not None):
            raise ValueError(
                f"{name}: method 'draft_model' and 'model' (the draft's checkpoint directory) "
                f"go together, got method {method!r} and model {short_repr(model)}"
            )
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"{name}['model'] must be a directory path, got {short_repr(model)}")
        known = ["num_speculative_tokens", "disable_by_batch_size"]
        if method == "ngram":
            known += ["prompt_lookup_max", "prompt_lookup_min"]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ValueError(
                f"{name} has no key {unknown[0]!r} for method {method!r}; its keys are method, "
                f"{'model, ' if model is not None else ''}{', '.join(known)}"
            )
        if "num_speculative_tokens" not in settings:
            raise ValueError(f"{name} needs num_speculative_tokens (how many tokens to propose)")
        checked = {
            key: positive_int(settings[key], f"{name}[{key!r}]", limit=None) for key in settings
        }
        lookup_max = checked.get("prompt_lookup_max", checked.get("prompt_lookup_min"))
        lookup_min = checked.get("prompt_lookup_min", lookup_max)
        if lookup_max is None:
            lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
        if lookup_min > lookup_max:
            raise ValueError(
                f"{name}: prompt_lookup_min ({lookup_min}) must not exceed prompt_lookup_max "
                f"({lookup_max})"
            )
        return cls(
            checked["num_speculative_tokens"],
            method,
            lookup_max,
            lookup_min,
            checked.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE),
            model,
        )


MAX_NGRAM_VOCAB = 0x110000
"""The vocabulary n-gram speculation takes: ``NgramLookup`` keeps each token as one character
of a Python str, ``chr(token)``, and characters stop at 0x10FFFF (1,114,112 token ids; the
largest vocabularies in use have about 256K)."""


def check_ngram_vocabulary(config: SpeculativeConfig | None, vocab_size: int) -> None:
    """ValueError, when the engine is built, if n-gram speculation is asked of a model whose
    vocabulary ``NgramLookup`` cannot hold."""
    if config is not None and config.method == "ngram" and vocab_size > MAX_NGRAM_VOCAB:
        raise ValueError(
            f"n-gram speculation keeps each token as one character: vocabularies of at most "
            f"{MAX_NGRAM_VOCAB:,} tokens, and this model's has {vocab_size:,}"
        )


class NgramLookup:
    """Prompt lookup over one growing token sequence: the most recent earlier occurrence of
    its last ``n`` tokens, found by C's substring search.

    ``propose`` returns up to ``k`` tokens that followed the most recent earlier occurrence of
    the sequence's last ``n`` tokens, for the longest ``n`` from ``lookup_max`` down to
    ``lookup_min`` that occurs; [] if none does. The sequence is kept as a str, one character
    per token (``chr(token)``; ``MAX_NGRAM_VOCAB``), so that "the most recent earlier
    occurrence" is ``str.rfind`` of its last ``n`` characters, searching from the end: about
    1 us over 4,000 tokens when nothing matches, and nothing at all on the steps that do not
    look (``ProposalPolicy`` has a sample sit out most of them on text that does not repeat).
    Only the tokens added since the last call are converted. (Scanning the token list in
    Python would cost 0.1-0.4 ms at a few thousand tokens; a dict from every n-gram to where it
    last occurred, updated for every token, cost 9.3 us a lookup in free generation on
    stories260K against 5.7 for this -- both mostly the interpreter finding its data again
    after a forward pass -- and kept three tuples per token; the tokens as 8-byte integers in
    a bytearray took 7.4, and its search 3-5 us over 4,000 tokens.)"""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._text = ""  # one character per token seen so far

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        self._text += "".join(map(chr, token_ids[len(self._text) :]))
        text = self._text
        end = len(token_ids) - 1  # an occurrence ending by here has a token after it
        for n in range(min(self.lookup_max, end), self.lookup_min - 1, -1):
            start = text.rfind(text[-n:], 0, end)
            if start >= 0:
                return token_ids[start + n : start + n + k]
        return []


def ngram_proposal(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """``NgramLookup.propose`` once, over a whole sequence (the benchmark replays outputs)."""
    return NgramLookup(lookup_min, lookup_max).propose(token_ids, k)


class ProposalPolicy:
    """How many tokens a sample proposes next: adapted to how its proposals fare.

    A wrong proposal costs its position's compute (on a small model, a verified row costs a
    good part of a decode step), so a sample proposes fewer tokens after a miss and more after
    a full hit -- transformers' assisted-generation heuristic: all of them accepted, two more
    (up to ``num_speculative_tokens``); any rejected, one fewer (at least one). A sample's
    first proposal is ``FIRST_PROPOSAL_SIZE`` tokens, not ``num_speculative_tokens``: until
    its lookups have been right, most of a long proposal's rows are wasted (on free text
    nearly all of them), and two full hits take it from 2 to 6. After ``f`` verifications in
    a row that accepted nothing it also sits out its next ``min(2**f, MAX_BACKOFF_STEPS)``
    tokens (decode steps without proposals, one token each) before proposing again. On free
    text, where lookups rarely hit, the wasted verification falls to about one row every
    ``MAX_BACKOFF_STEPS`` steps.

    A lookup that finds nothing costs its own time (about 6 us of stories260K's 115-145 us
    step, every step, on text that does not repeat itself), so after ``e`` of them in a row
    the sample sits out ``min(2**(e - 1), MAX_LOOKUP_BACKOFF_STEPS)`` tokens before looking
    again; a lookup that finds something starts that count afresh. (Looking every 8 tokens
    costs about 0.5% of the steps' time and misses at most 8 tokens of a repeat that begins.)

    The sit-out is kept as the output length to resume at, so that a step without proposals
    costs the policy nothing: it hears only of what a committed step did (``record``,
    ``found_nothing``), so a failed step leaves nothing to undo."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.max_size = num_speculative_tokens
        self.size = min(FIRST_PROPOSAL_SIZE, num_speculative_tokens)
        self.failures = 0  # verifications in a row that accepted nothing
        self.empty_lookups = 0  # lookups in a row that found nothing to propose
        self.resume_at = 0  # no proposals while the sample has fewer output tokens

    def next_size(self, num_output_tokens: int) -> int:
        """How many tokens to propose in the next step of a sample that has generated
        ``num_output_tokens`` (0: none)."""
        return 0 if num_output_tokens < self.resume_at else self.size

    def steps_sitting_out(self, num_output_tokens: int) -> int:
        """How many decode steps, this one first, the sample is sure to propose nothing in,
        having generated ``num_output_tokens``: it gains one token a step while sitting out."""
        return max(self.resume_at - num_output_tokens, 0)

    def record(self, num_proposed: int, num_accepted: int, num_output_tokens: int) -> None:
        """A decode step of the sample committed with ``num_proposed`` (at least one)
        proposals verified and ``num_accepted`` of them accepted; the sample now has
        ``num_output_tokens``."""
        self.empty_lookups = 0
        if num_accepted == num_proposed:
            self.size = min(self.size + 2, self.max_size)
        else:
            self.size = max(self.size - 1, 1)
        if num_accepted:
            self.failures = 0
        else:
            self.failures += 1
            self.resume_at = num_output_tokens + min(2**self.failures, MAX_BACKOFF_STEPS)

    def found_nothing(self, num_output_tokens: int) -> None:
        """A decode step of the sample committed after its lookup found nothing to propose;
        the sample now has ``num_output_tokens``."""
        self.empty_lookups += 1
        wait = min(2 ** (self.empty_lookups - 1), MAX_LOOKUP_BACKOFF_STEPS)
        self.resume_at = num_output_tokens + wait
