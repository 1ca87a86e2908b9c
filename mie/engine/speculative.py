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
MAX_LOOKUP_BACKOFF_STEPS = 8  # a lookup costs ~5 us: look again at least every 8 tokens
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


class NgramIndex:
    """Prompt lookup over one growing token sequence, in O(1) per new token and per lookup.

    ``propose`` returns up to ``k`` tokens that followed the most recent earlier occurrence of
    the sequence's last ``n`` tokens, for the longest ``n`` from ``lookup_max`` down to
    ``lookup_min`` that occurs; [] if none does. Scanning the whole sequence for each ``n``
    every step would cost 0.1-0.4 ms at a few thousand tokens -- a third of a small model's
    step -- so the index keeps, for every n-gram seen, where the token after its latest
    occurrence is, and only the tokens added since the last call are indexed."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._follower: dict[tuple[int, ...], int] = {}  # n-gram -> where its follower is
        self._indexed = 1  # the followers at positions below this are indexed

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for i in range(self._indexed, len(token_ids)):  # the n-grams token i followed
            for n in range(self.lookup_min, min(self.lookup_max, i) + 1):
                self._follower[tuple(token_ids[i - n : i])] = i
        self._indexed = max(self._indexed, len(token_ids))
        for n in range(min(self.lookup_max, len(token_ids) - 1), self.lookup_min - 1, -1):
            start = self._follower.get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start : start + k]
        return []


def ngram_proposal(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """``NgramIndex.propose`` once, over a whole sequence (the benchmark replays outputs)."""
    return NgramIndex(lookup_min, lookup_max).propose(token_ids, k)


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

    A lookup that finds nothing costs its own time (5 us of stories260K's 200 us step, every
    step, on text that does not repeat itself), so after ``e`` of them in a row the sample
    sits out ``min(2**(e - 1), MAX_LOOKUP_BACKOFF_STEPS)`` tokens before looking again; a
    lookup that finds something starts that count afresh. (Looking at least every 8 tokens
    costs under 0.5% of the steps and misses at most 8 tokens of a repeat that begins.)

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
