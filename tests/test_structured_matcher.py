"""One sample's grammar matcher: a failed step puts it back exactly where it was.

The engine moves a matcher past each drawn token before the step commits and rolls it back
(``GrammarMatcher.rollback_to``) when the step fails. Oracle: the set of tokens allowed next,
before and after a consume + rollback, must be the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mie import StructuredOutputsParams
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
