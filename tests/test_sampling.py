"""Sampling: parameter validation, greedy, and the filtered distribution against HF's warpers."""

import numpy as np
import pytest
from conftest import require_module
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from mie.engine import sampling
from mie.engine.sampling import (
    InvalidRequestError,
    SamplingParams,
    probabilities,
    request_rng,
    sample,
)

torch = require_module("torch")
logits_process = require_module("transformers.generation.logits_process")
TemperatureLogitsWarper = logits_process.TemperatureLogitsWarper
TopKLogitsWarper = logits_process.TopKLogitsWarper
TopPLogitsWarper = logits_process.TopPLogitsWarper


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_parameters_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, -1, 1.0, 16)
    assert p.stop_token_ids == () and p.seed is None and not p.ignore_eos


# Distinct logits, including ones so close that their probabilities are equal (0.0 and 1e-45):
# Hugging Face ranks those by logit, and so does mie. Exact ties are the next test's business.
logit_rows = st.integers(2, 60).flatmap(
    lambda n: st.lists(
        st.one_of(
            st.floats(-8, 8, width=32), st.sampled_from([0.0, 1e-45, -1.1754943508222875e-38])
        ),
        min_size=n,
        max_size=n,
        unique=True,
    )
)


def hf_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


@settings(max_examples=200, deadline=None)
@given(
    row=logit_rows,
    temperature=st.floats(0.2, 3.0),
    top_k=st.one_of(st.sampled_from([-1, 0]), st.integers(1, 70)),  # -1, 0: disabled
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
)
@example(row=[6.0, -1.1754943508222875e-38, 0.0], temperature=2.0, top_k=-1, top_p=0.9375)
@example(row=[0.0, 1e-45], temperature=0.7, top_k=3, top_p=0.5)
def test_filtered_distribution_matches_transformers_warpers(row, temperature, top_k, top_p):
    logits = np.array(row, dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    np.testing.assert_allclose(
        probabilities(logits, params), hf_probabilities(logits, params), atol=1e-9
    )


def top_p_kept_by_the_documented_rule(logits: np.ndarray, params: SamplingParams) -> set[int]:
    """The tie rule written out plainly: rank by scaled logit, highest first, exactly equal
    logits by the higher token id first; keep tokens while the mass before them < top_p."""
    scaled = [float(x) / params.temperature for x in logits]
    probs = np.exp(np.array(scaled) - max(scaled))
    probs /= probs.sum()
    ranking = sorted(range(len(scaled)), key=lambda i: (scaled[i], i), reverse=True)
    kept, mass = set(), 0.0
    for i in ranking:
        if mass >= params.top_p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@settings(max_examples=200, deadline=None)
@given(
    row=st.lists(st.sampled_from([-2.0, 0.0, 0.5, 1.0]), min_size=2, max_size=12),
    top_p=st.floats(0.05, 0.999),
)
@example(row=[1.0, 1.0], top_p=0.5)  # two equal tokens, the cut between them: the higher id stays
def test_exact_ties_follow_the_documented_rule(row, top_p):
    logits = np.array(row, dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    kept = set(np.flatnonzero(probabilities(logits, params) > 0).tolist())
    expected = top_p_kept_by_the_documented_rule(logits, params)
    # Mass sums are compared in float64 in both; a boundary within rounding of top_p may
    # differ by the one token at the cut, so the rule is checked away from it.
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assume(not np.any(np.isclose(np.cumsum(np.sort(probs)[::-1]), top_p, rtol=0, atol=1e-9)))
    assert kept == expected


def test_two_equal_tokens_cut_in_half_keep_the_higher_id():
    params = SamplingParams(temperature=1.0, top_p=0.5)
    probs = probabilities(np.array([1.0, 1.0], dtype=np.float32), params)
    assert probs.tolist() == [0.0, 1.0]


@settings(max_examples=100, deadline=None)
@given(row=logit_rows, top_p=st.floats(0.05, 1.0), seed=st.integers(0, 2**32 - 1))
@example(row=[0.0, 1.401298464324817e-45], top_p=0.5, seed=0)
def test_sampled_token_is_always_allowed(row, top_p, seed):
    logits = np.array(row, dtype=np.float32)
    params = SamplingParams(temperature=0.7, top_k=3, top_p=top_p)
    allowed = hf_probabilities(logits, params) > 0
    rng = np.random.default_rng(seed)
    for _ in range(5):
        assert allowed[sample(logits, params, rng)]


def test_greedy_is_argmax_and_needs_no_rng():
    logits = np.array([0.1, 3.0, -1.0, 2.9], dtype=np.float32)
    assert sample(logits, SamplingParams(temperature=0), rng=None) == 1


def test_empirical_frequencies_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(1234)
    draws = [sample(logits, SamplingParams(), rng) for _ in range(20000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_request_rng_is_reproducible_and_independent_of_other_requests():
    seeded = SamplingParams(seed=7)
    a = request_rng(seeded, engine_seed=0, request_index=3).random(4)
    b = request_rng(seeded, engine_seed=99, request_index=50).random(4)
    np.testing.assert_array_equal(a, b)  # the request's own seed wins
    unseeded = SamplingParams()
    c = request_rng(unseeded, 0, 1).random(4)
    np.testing.assert_array_equal(c, request_rng(unseeded, 0, 1).random(4))
    assert not np.array_equal(c, request_rng(unseeded, 0, 2).random(4))


def probabilities_ranking_every_token(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """``probabilities`` as first written: top-p ranks the whole vocabulary (one stable sort).
    The oracle for ``_top_p``, which ranks only the most likely candidates."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.min_p > 0:
        probs = np.exp(scaled - scaled.max())
        scaled[probs < params.min_p * probs.max()] = -np.inf
    if 0 < params.top_k < scaled.size:
        kth_largest = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled[scaled < kth_largest] = -np.inf
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(scaled, kind="stable")[::-1]
        mass_before = np.cumsum(probs[order]) - probs[order]
        probs[order[mass_before >= params.top_p]] = 0.0
        probs /= probs.sum()
    return probs


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    size=st.integers(1, 300),
    spread=st.sampled_from([0.1, 1.0, 5.0, 30.0]),
    temperature=st.sampled_from([0.3, 1.0, 2.0]),
    top_k=st.sampled_from([-1, 5, 50]),
    top_p=st.floats(0.01, 0.999),
    min_p=st.sampled_from([0.0, 0.05]),
    candidates=st.sampled_from([(1, 2), (4, 16), (256, 4096)]),
)
def test_top_p_on_the_likeliest_candidates_equals_ranking_every_token(
    data, size, spread, temperature, top_k, top_p, min_p, candidates
):
    """Bit for bit, on peaked and flat rows with ties (logits from a few values), with every
    candidate stage taken (small stages force the fallbacks)."""
    values = st.sampled_from([-2.0, -0.5, 0.0, 0.25, 1.0, 3.0])
    logits = np.array(data.draw(st.lists(values, min_size=size, max_size=size))) * spread
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = probabilities_ranking_every_token(logits.astype(np.float32), params)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
        got = sampling.probabilities(logits.astype(np.float32), params)
    assert np.array_equal(got, expected)
