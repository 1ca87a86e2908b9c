"""Beam search with an extreme finite ``length_penalty``.

transformers' score ``sum / length ** length_penalty`` raises for ±2000 or ±1e308 (2 ** 2000
is an ``OverflowError``; 2 ** -2000 is 0, a ``ZeroDivisionError``), which would crash
``beam_search`` after the whole search. ``length_score`` saturates the score instead and ranks the
hypotheses it saturates in log space: no crash, and the order of the exact scores.
"""

from decimal import Decimal, localcontext
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mie import LLM, BeamSearchParams, InvalidRequestError
from mie.engine.beam_search import length_score

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
EXTREMES = [2000.0, -2000.0, 1e308, -1e308, 5e-324, -5e-324]


def exact_log_magnitude(total: float, length: int, length_penalty: float) -> Decimal:
    """ln(-score) of the exact score ``total / length ** length_penalty`` (total < 0), lower
    is better: in decimal arithmetic of 60 digits, whose exponent range holds 1e308 * ln(4096)
    (floats would overflow to inf and tie)."""
    with localcontext() as context:
        context.prec = 60
        return Decimal(-total).ln() - Decimal(length_penalty) * Decimal(length).ln()


@settings(max_examples=400, deadline=None)
@given(
    totals=st.lists(st.floats(-1e4, -1e-300), min_size=2, max_size=2),
    lengths=st.lists(st.integers(1, 4096), min_size=2, max_size=2),
    length_penalty=st.one_of(
        st.sampled_from(EXTREMES), st.floats(allow_nan=False, allow_infinity=False)
    ),
)
# The power underflows (3942 ** -90 is below float's range) while the score does not:
# -4.7e-285 * 3942 ** 90 is about -1.9e39, better than -1 * 3 ** 90 = -8.7e42.
@example(totals=[-1.0, -4.7015389193622275e-285], lengths=[3, 3942], length_penalty=-90.0)
def test_length_score_never_raises_and_orders_as_the_exact_score(totals, lengths, length_penalty):
    (a, b) = (length_score(t, n, length_penalty) for t, n in zip(totals, lengths, strict=True))
    exact = [
        exact_log_magnitude(t, n, length_penalty) for t, n in zip(totals, lengths, strict=True)
    ]
    if abs(exact[0] - exact[1]) > Decimal("1e-6") * max(1, abs(exact[0])):  # clearly apart
        assert (a > b) == (exact[0] < exact[1])


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -0.7, 2.0])
def test_ordinary_scores_are_transformers_formula(length_penalty):
    for total, length in [(-3.5, 4), (-0.25, 1), (-12.0, 17)]:
        score = total / length**length_penalty
        assert length_score(total, length, length_penalty) == (score, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("length_penalty", EXTREMES)
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beam_search_with_an_extreme_length_penalty_finishes_in_order(
    backend, length_penalty, early_stopping
):
    llm = LLM(STORIES, backend=backend, num_blocks=128)
    params = BeamSearchParams(3, 12, length_penalty=length_penalty, early_stopping=early_stopping)
    (out,) = llm.beam_search(["Once upon a time"], params, use_tqdm=False)
    assert len(out.sequences) == 3
    ranks = [
        exact_log_magnitude(s.cum_logprob, len(s.logprobs), length_penalty) for s in out.sequences
    ]
    assert ranks == sorted(ranks)  # best (smallest magnitude) first
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("value", [10**400, -(10**400), float("inf"), float("nan")])
@pytest.mark.parametrize("name", ["length_penalty", "temperature"])
def test_beam_search_params_refuse_numbers_beyond_float(name, value):
    with pytest.raises(InvalidRequestError, match=name):
        BeamSearchParams(2, 4, **{name: value})
