"""Sampling parameters and the sampler: from one row of logits to one token.

The order of the filters is Hugging Face's: temperature, then top-k, then top-p. A temperature
below ``GREEDY_TEMPERATURE`` (1e-5, vLLM's ``_SAMPLING_EPS``) means greedy (argmax), which needs
no randomness at all; dividing logits by a smaller one (down to 5e-324) would overflow.

Ties: top-k keeps every token tied with the k-th largest logit (as Hugging Face's warper
does). Top-p ranks tokens by their scaled logit, highest first, and among exactly equal logits
the *higher* token id first -- the order of Hugging Face's and vLLM's ascending stable sort,
read from the top -- then keeps the smallest prefix of that ranking whose mass reaches top_p.
Ranking by logit rather than by probability matters when two distinct logits round to the same
probability (e.g. 0.0 and 1e-45): the larger logit wins, as in Hugging Face.

Reproducibility: every request owns its random generator, seeded from the request's own
``seed`` (or, when it has none, from the engine seed and the request's arrival index), and
draws exactly one uniform number per sampled token. What a request samples therefore never
depends on which other requests happen to share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
SEED_RANGE = (-(2**63), 2**64 - 1)  # torch.manual_seed's range; negative seeds wrap (+2**64)


class InvalidRequestError(ValueError):
    """A request or its sampling parameters are invalid; nothing was changed."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's names and defaults)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(f"SamplingParams: {message}")

        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            fail(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            fail(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        low, high = SEED_RANGE
        if self.seed is not None and not (_is_int(self.seed) and low <= self.seed <= high):
            fail(f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")
        stops = self.stop_token_ids
        if stops is None:
            stops = ()
        if not isinstance(stops, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in stops):
            fail(f"stop_token_ids must be a list of non-negative ints, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not isinstance(self.ignore_eos, bool):
            fail(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def request_rng(
    params: SamplingParams, engine_seed: int, request_index: int
) -> np.random.Generator:
    """The request's own generator: its seed if given, else (engine seed, arrival index)."""
    if params.seed is not None:
        return np.random.default_rng(params.seed % 2**64)  # -1 -> 2**64 - 1, as in torch
    return np.random.default_rng([engine_seed, request_index])


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy request samples from: temperature, top-k, top-p."""
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        kth_largest = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled[scaled < kth_largest] = -np.inf
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p: a token is
        # kept if the mass *before* it is still below top_p (so the top token always is).
        order = np.argsort(scaled, kind="stable")[::-1]  # by logit; ties: higher id first
        mass_before = np.cumsum(probs[order]) - probs[order]
        probs[order[mass_before >= params.top_p]] = 0.0
        probs /= probs.sum()
    return probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token id from a (vocab,) row of logits (one uniform draw if not greedy)."""
    if params.greedy:
        return int(np.argmax(logits))
    cdf = np.cumsum(probabilities(logits, params))
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(token, cdf.size - 1)
