"""Sampling: parameter validation, greedy, and the filtered distribution against HF's warpers."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mie.engine.sampling import (
    InvalidRequestError,
    SamplingParams,
    probabilities,
    request_rng,
    sample,
)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 0}, "top_k"),
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


# Distinct logits: with exact ties, which of two equal tokens survives a cut is arbitrary
# (and differs between sort implementations), so the oracle comparison excludes them.
logit_rows = st.integers(2, 60).flatmap(
    lambda n: st.lists(st.floats(-8, 8, width=32), min_size=n, max_size=n, unique=True)
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
    top_k=st.one_of(st.just(-1), st.integers(1, 70)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
)
def test_filtered_distribution_matches_transformers_warpers(row, temperature, top_k, top_p):
    logits = np.array(row, dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    np.testing.assert_allclose(
        probabilities(logits, params), hf_probabilities(logits, params), atol=1e-9
    )


@settings(max_examples=100, deadline=None)
@given(row=logit_rows, top_p=st.floats(0.05, 1.0), seed=st.integers(0, 2**32 - 1))
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
