"""Each precision mode's accuracy on stories260K, held to its documented bound.

``mie.bench.accuracy.BOUNDS`` is the one source: bench/RESULTS.md prints the same numbers.
Every mode (weights float32 / bfloat16 / float16 / int8, each with a float32, bfloat16 and
float16 KV cache) is compared with float32 weights and a float32 cache on the same backend:
the largest teacher-forced logit error and the top-1 agreement over every position of fixed
story texts, and the agreement of 256 greedily generated tokens from fixed openings. The
float32 reference itself is held to transformers within 1e-4 in tests/test_model_hf.py
(bfloat16 weights with a float32 cache too), so these tests need not trust it blindly.

The metrics are checked first on hand-made inputs, so a bug in the measuring code cannot
make every mode look good.
"""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mie.bench import accuracy
from mie.bench.accuracy import BOUNDS, GREEDY_TOKENS, KV_CACHE_DTYPES, STORIES, WEIGHTS
from mie.engine.tokenizer import Tokenizer
from mie.model import Model

MODES = [(weights, kv) for weights, _, _ in WEIGHTS for kv in KV_CACHE_DTYPES]
FORMATS = {label: (dtype, quantization) for label, dtype, quantization in WEIGHTS}

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason=f"{STORIES} not found")


# -- the measuring code, on hand-made inputs -------------------------------------------------


def test_every_mode_has_a_bound():
    assert sorted(BOUNDS) == sorted(MODES)


def test_compare_logits_by_hand():
    reference = [np.array([[1.0, 3.0, -2.0], [0.5, 0.0, 0.25]], dtype=np.float32)]
    logits = [np.array([[1.0, 2.5, -2.0], [0.5, 0.75, 0.25]], dtype=np.float32)]
    got = accuracy.compare_logits(reference, logits)
    assert got["positions"] == 2
    assert got["max_abs_error"] == 0.75
    assert got["logit_scale"] == 3.0
    assert got["relative_error"] == 0.25
    assert got["top1_agreement"] == 0.5  # row 0 keeps token 1; row 1 moves from 0 to 1


def test_compare_greedy_by_hand():
    reference = np.array([[5, 6, 7, 8], [1, 2, 3, 4]])
    tokens = np.array([[5, 6, 0, 8], [1, 2, 3, 4]])
    got = accuracy.compare_greedy(reference, tokens)
    assert got["greedy_tokens"] == 4
    assert got["greedy_prefix"] == (2 + 4) / 8
    assert got["greedy_overall"] == 7 / 8
    assert got["first_divergence"] == 2


def token_grids(shape):
    """Two integer arrays of ``shape`` drawn from a tiny vocabulary, so that they agree often."""
    grid = hnp.arrays(np.int64, shape, elements=st.integers(0, 2))
    return st.tuples(grid, grid)


@settings(max_examples=50)
@given(hnp.array_shapes(min_dims=2, max_dims=2, max_side=8).flatmap(token_grids))
def test_greedy_prefix_counts_tokens_before_the_first_difference(pair):
    reference, tokens = pair
    got = accuracy.compare_greedy(reference, tokens)
    prefix = 0
    for ref_row, row in zip(reference.tolist(), tokens.tolist(), strict=True):
        for a, b in zip(ref_row, row, strict=True):
            if a != b:
                break
            prefix += 1
    assert got["greedy_prefix"] == prefix / reference.size
    assert got["greedy_prefix"] <= got["greedy_overall"]
    assert (got["greedy_overall"] == 1.0) == bool((reference == tokens).all())


# -- every mode against its bound ------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs():
    tokenizer = Tokenizer(STORIES)
    texts = [tokenizer.encode(text) for text in accuracy.STORY_TEXTS]
    prompts = [tokenizer.encode(text) for text in accuracy.GREEDY_PROMPTS]
    return texts, prompts


_measured: dict = {}


def measure(backend, weights: str, kv: str, inputs) -> tuple[list[np.ndarray], np.ndarray]:
    """Teacher-forced logits and greedy tokens of one mode (each computed once per run)."""
    key = backend.name, weights, kv
    if key not in _measured:
        texts, prompts = inputs
        dtype, quantization = FORMATS[weights]
        model = Model.from_pretrained(
            STORIES, backend.kernels, dtype=dtype, quantization=quantization
        )
        _measured[key] = (
            accuracy.teacher_forced_logits(model, backend, texts, kv),
            accuracy.greedy_tokens(model, backend, prompts, GREEDY_TOKENS, kv),
        )
    return _measured[key]


@pytest.mark.parametrize(("weights", "kv"), MODES)
def test_mode_is_within_its_documented_bound(backend, weights, kv, inputs):
    """Logit error, top-1 agreement and greedy agreement against float32, all three at once
    (one model and two runs per mode)."""
    bound = BOUNDS[weights, kv]
    reference_logits, reference_tokens = measure(backend, "float32", "float32", inputs)
    logits, tokens = measure(backend, weights, kv, inputs)
    got = accuracy.compare_logits(reference_logits, logits)
    greedy = accuracy.compare_greedy(reference_tokens, tokens)
    assert got["max_abs_error"] <= bound.max_abs_error, got
    assert got["top1_agreement"] >= bound.min_top1, got
    assert greedy["greedy_prefix"] >= bound.min_greedy_prefix, greedy


def test_narrow_modes_do_differ_from_float32(backend, inputs):
    """The modes are what they claim: every narrow one changes some logit (a mode that
    silently computed in float32 would pass its bound trivially)."""
    for weights, kv in MODES[1:]:
        logits, _ = measure(backend, weights, kv, inputs)
        reference, _ = measure(backend, "float32", "float32", inputs)
        assert accuracy.compare_logits(reference, logits)["max_abs_error"] > 0, (weights, kv)


def test_the_documented_table_prints_these_bounds():
    """bench/RESULTS.md's stories260K rows show ``BOUNDS`` (the table is pasted from
    ``python -m mie.bench.accuracy``): a bound changed in one place and not the other fails."""
    doc = (Path(__file__).resolve().parents[1] / "bench" / "RESULTS.md").read_text()
    lines = [line for line in doc.splitlines() if line.startswith("| stories260K |")]
    rows = [line.split("|")[1:-1] for line in lines]
    documented = {
        (cells[1].strip(), cells[2].strip()): [cell.strip() for cell in cells[-3:]]
        for cells in rows
    }
    assert sorted(documented) == sorted(MODES)
    for mode, bound in BOUNDS.items():
        error, top1, greedy = documented[mode]
        assert float(error) == bound.max_abs_error, mode
        assert float(top1.removesuffix("%")) / 100 == pytest.approx(bound.min_top1), mode
        assert float(greedy.removesuffix("%")) / 100 == pytest.approx(bound.min_greedy_prefix)
