"""One sample's grammar matcher: a failed step puts it back exactly where it was; and drawing
among the allowed tokens is drawing from the masked row.

The engine moves a matcher past each drawn token before the step commits and rolls it back
(``GrammarMatcher.rollback_to``) when the step fails. Oracle: the set of tokens allowed next,
before and after a consume + rollback, must be the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import SamplingParams, StructuredOutputsParams
from mie.engine.sampling import sample
from mie.engine.structured import GrammarCompiler
from mie.engine.tokenizer import Tokenizer

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
EOS = (1, 2)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = Tokenizer(STORIES)
    return GrammarCompiler(tokenizer.to_json(), 512, list(EOS))


def allowed(matcher) -> set[int]:
    return set(np.flatnonzero(matcher.allowed()).tolist())


def spell(compiler, text: str) -> list[int]:
    return compiler.tokenizer.tokenize_str(text)


@pytest.mark.parametrize(
    "constraint, text",
    [
        (StructuredOutputsParams(choice=["yes", "no"]), "yes"),  # finished: only EOS follows
        (StructuredOutputsParams(regex="[a-z]+"), "yes"),  # accepting, may go on
        (StructuredOutputsParams(json={"type": "integer"}), "12"),
    ],
    ids=["finished", "accepting", "json"],
)
def test_rolling_back_the_end_of_sequence_token_restores_the_state_before_it(
    compiler, constraint, text
):
    matcher = compiler.matcher(constraint)
    for token in spell(compiler, text):
        matcher.consume(token)
    before, consumed = allowed(matcher), matcher.num_consumed
    assert EOS[0] in before
    matcher.consume(EOS[0])  # a step drew EOS, then failed
    matcher.rollback_to(consumed)
    assert allowed(matcher) == before


def test_rolling_back_several_tokens_restores_each_state(compiler):
    matcher = compiler.matcher(StructuredOutputsParams(regex="(ab|cd)+x"))
    states = []
    for token in spell(compiler, "abcdab"):
        states.append((matcher.num_consumed, allowed(matcher)))
        matcher.consume(token)
    for num_consumed, expected in reversed(states):
        matcher.rollback_to(num_consumed)
        assert allowed(matcher) == expected


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 64),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 3, 10]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**32),
)
def test_drawing_among_the_allowed_tokens_is_drawing_from_the_masked_row(
    data, vocab, temperature, top_k, top_p, min_p, seed
):
    """The engine samples a constrained row among its allowed tokens only; the definition is
    the whole row with every other token at -inf. Same token, for every setting, with ties
    (logits drawn from a few values) and a single allowed token (forced)."""
    logits = np.array(
        data.draw(st.lists(st.sampled_from([-3.0, 0.0, 0.5, 2.0]), min_size=vocab, max_size=vocab)),
        dtype=np.float32,
    )
    allowed = np.array(data.draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)))
    allowed[data.draw(st.integers(0, vocab - 1))] = True
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    masked = np.where(allowed, logits, -np.inf)
    expected = sample(masked, params, np.random.default_rng(seed))
    candidates = np.flatnonzero(allowed)
    got = candidates[sample(logits[candidates], params, np.random.default_rng(seed))]
    assert got == expected
