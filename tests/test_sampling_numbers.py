"""Numbers at the edges of ``SamplingParams`` and the sampler.

* A NumPy integer (``np.int64(-3)``, ``np.uint64(2**64 - 1)``, ``np.uint8(5)``) as any int
  field -- the seed first -- is the same Python int: accepted or refused alike, the same
  tokens drawn (not an ``OverflowError``). The engine seed too.
* ``10**400``, inf or NaN as any float field is ``InvalidRequestError`` naming the field
  (not an ``OverflowError`` from ``math.isfinite``).
* No distribution with a NaN is ever sampled (it would give token 511, the last, every time): a
  ``repetition_penalty`` outside ``REPETITION_PENALTY_RANGE`` (a subnormal one made +inf
  logits) is refused, so is ``min_tokens`` with every token a stop token (all masked), and a
  row with no finite maximum (a model's own NaN) fails the step naming the request.
"""

import io
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_named, require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM
from mie.checks import check_sliding_window, check_token_count, positive_int, token_ids
from mie.engine.beam_search import BeamSearchParams
from mie.engine.llm_engine import LLMEngine, StepError
from mie.engine.prompts import checked_token_ids
from mie.engine.sampling import (
    FLOAT_FIELDS,
    INT_FIELDS,
    REPETITION_PENALTY_RANGE,
    InvalidRequestError,
    LogitsState,
    NoDistributionError,
    SamplingParams,
    sample,
)
from mie.extension import BACKENDS
from mie.memory import BlockPool, BlockTable
from mie.model import Model
from mie.progress import ProgressBar
from mie.scheduler.scheduler import Scheduler

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.from_pretrained(STORIES)


def outcome(make):
    """What ``make()`` gives: ("ok", the value) or ("refused", the message); anything else
    (an OverflowError) propagates and fails the test."""
    try:
        return "ok", make()
    except InvalidRequestError as exc:
        return "refused", str(exc)


@st.composite
def numpy_int_and_value(draw):
    np_type = draw(st.sampled_from(NUMPY_INTS))
    info = np.iinfo(np_type)
    return np_type, draw(st.integers(int(info.min), int(info.max)))


@settings(max_examples=300, deadline=None)
@given(typed=numpy_int_and_value(), field=st.sampled_from(INT_FIELDS))
def test_a_numpy_integer_is_the_same_python_int(typed, field):
    np_type, x = typed
    base = {"temperature": 1.0, "max_tokens": 64} if field != "max_tokens" else {}
    ours = outcome(lambda: SamplingParams(**base, **{field: np_type(x)}))
    plain = outcome(lambda: SamplingParams(**base, **{field: x}))
    assert ours == plain
    if ours[0] == "ok":
        assert type(getattr(ours[1], field)) is int


def checks_outcome(make, shown: str, as_python: str):
    """What ``make()`` gives: ("ok", the value) or (the exception's class, its message with the
    value's text ``shown`` read as ``as_python``: a refusal quotes the value as it was given)."""
    try:
        return "ok", make()
    except Exception as exc:  # noqa: BLE001 -- the class is what is compared
        return type(exc), str(exc).replace(shown, as_python)


def table_of(num_tokens: int) -> BlockTable:
    table = BlockPool(8, 16).new_table(4)
    table.append_tokens(num_tokens)
    return table


# Every other place that takes an integer, each through mie.checks' one definition.
INTEGER_PLACES = {
    "check_sliding_window": lambda v: check_sliding_window("op", v),
    "token_ids": lambda v: token_ids([3, v], "ids"),
    "checked_token_ids (a prompt)": lambda v: checked_token_ids([1, v], 8, 512),
    "BeamSearchParams.beam_width": lambda v: BeamSearchParams(beam_width=v, max_tokens=4),
    "BeamSearchParams.max_tokens": lambda v: BeamSearchParams(beam_width=2, max_tokens=v),
    "BlockPool.refcount": lambda v: BlockPool(4, 16).refcount(v),
    "positive_int": lambda v: positive_int(v, "size"),
    "check_token_count": lambda v: check_token_count(v, "tokens"),
    "BlockTable.append_tokens": lambda v: BlockPool(4, 16).new_table(4).append_tokens(v),
    "BlockTable.release_before": lambda v: table_of(8).release_before(v),
    "BlockTable.borrow_prefix": lambda v: (
        BlockPool(8, 16).new_table(4).borrow_prefix(table_of(8), v)
    ),
    "Scheduler.max_num_seqs": lambda v: Scheduler(BlockPool(8, 16), 4, v, 2**40).max_num_seqs,
    "Scheduler.abort": lambda v: Scheduler(BlockPool(8, 16), 4, 2, 8).abort(v),
    "ProgressBar.total": lambda v: ProgressBar(v, file=io.StringIO(), live=False).total,
}


@settings(max_examples=400, deadline=None)
@given(typed=numpy_int_and_value(), place=st.sampled_from(sorted(INTEGER_PLACES)))
def test_a_numpy_integer_is_the_same_python_int_everywhere(typed, place):
    """Wherever mie takes an integer, a NumPy integer is the same Python int: accepted with
    the same result, or refused with the same exception and message."""
    np_type, x = typed
    make = INTEGER_PLACES[place]
    ours = checks_outcome(lambda: make(np_type(x)), repr(np_type(x)), repr(x))
    plain = checks_outcome(lambda: make(x), repr(x), repr(x))
    assert ours == plain


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.0, np.float64(2), "2", None])
@pytest.mark.parametrize("place", sorted(INTEGER_PLACES))
def test_no_place_takes_a_bool_or_a_float_for_an_integer(place, value):
    if place == "check_sliding_window" and value is None:
        return  # None: full attention
    with pytest.raises((ValueError, TypeError, LookupError)):
        INTEGER_PLACES[place](value)


@pytest.mark.parametrize("seed", [np.int64(-3), np.uint64(2**64 - 1), np.uint8(5), np.int8(-128)])
def test_numpy_seeds_draw_the_python_ints_tokens(backend, seed):
    llm = LLM(STORIES, backend=backend, num_blocks=32)

    def tokens(s):
        params = SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True)
        return llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids

    assert tokens(seed) == tokens(int(seed))


@settings(max_examples=20, deadline=None)
@given(typed=numpy_int_and_value().filter(lambda t: t[1] >= 0))
def test_a_numpy_engine_seed_is_the_python_int(model, typed):
    np_type, x = typed
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)  # unseeded
    runs = []
    for seed in (np_type(x), x):
        engine = LLMEngine(model, num_blocks=8, seed=seed)
        engine.add_request([1, 2, 3], params, "r")
        while engine.has_unfinished_requests():
            (out,) = engine.step()
        runs.append(out.outputs[0].token_ids)
    assert runs[0] == runs[1]


HUGE = [
    10**400,
    -(10**400),
    float("inf"),
    float("-inf"),
    float("nan"),
    np.float64("nan"),
    np.float32("inf"),
]


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(FLOAT_FIELDS), value=st.sampled_from(HUGE))
def test_a_float_field_beyond_float_is_refused_naming_it(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", HUGE)
def test_a_logit_bias_beyond_float_is_refused_naming_it(value):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={3: value})


@settings(max_examples=300, deadline=None)
@given(penalty=st.one_of(st.floats(0, 1e-3), st.floats(min_value=1e-3), st.floats(0.01, 100)))
def test_repetition_penalty_outside_its_range_is_refused(penalty):
    low, high = REPETITION_PENALTY_RANGE
    result = outcome(lambda: SamplingParams(repetition_penalty=penalty))
    assert (result[0] == "ok") == (low <= penalty <= high)
    if result[0] == "refused":
        assert "repetition_penalty" in result[1]


extreme_rows = st.lists(
    st.one_of(
        st.floats(width=32, allow_nan=False, allow_infinity=False),
        st.sampled_from([-3.4e38, 3.4e38, 0.0, -np.inf]),
    ),
    min_size=8,
    max_size=8,
).filter(lambda row: max(row) > -np.inf)


@settings(max_examples=300, deadline=None)
@given(
    row=extreme_rows,
    penalty=st.one_of(st.sampled_from(REPETITION_PENALTY_RANGE), st.floats(0.01, 100)),
    bias=st.dictionaries(st.integers(0, 7), st.floats(-100, 100)),
    temperature=st.sampled_from([0.0, 1e-5, 1.0, 3.0]),
    seen=st.lists(st.integers(0, 7), min_size=1),
)
def test_legal_params_on_finite_logits_always_give_a_distribution(
    row, penalty, bias, temperature, seen
):
    params = SamplingParams(repetition_penalty=penalty, logit_bias=bias, temperature=temperature)
    applied = LogitsState(params, seen, (), 8).apply(np.array(row, dtype=np.float32))
    assert np.isfinite(applied.max())
    token = sample(applied, params, np.random.default_rng(0))
    assert applied[token] > -np.inf


@pytest.mark.parametrize(
    "row", [[np.nan, 1.0, 2.0], [np.inf, np.inf, 0.0], [-np.inf] * 3, [0.0, np.nan, np.nan]]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_no_distribution_is_never_sampled(row, temperature):
    with pytest.raises(NoDistributionError):
        sample(np.array(row), SamplingParams(temperature=temperature), np.random.default_rng(0))


def test_min_tokens_with_every_token_a_stop_token_is_refused(backend):
    engine = LLMEngine(STORIES, backend=backend, num_blocks=16)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(min_tokens=2, stop_token_ids=list(range(vocab)), max_tokens=4)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    # All but one a stop token: that one is drawn until min_tokens.
    params = SamplingParams(min_tokens=2, stop_token_ids=list(range(1, vocab)), max_tokens=4)
    engine.add_request([1, 2, 3], params, "r")
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    assert out.outputs[0].token_ids[:2] == [0, 0]


@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_fail_the_step_naming_the_request(backend, poison, temperature):
    engine = LLMEngine(STORIES, backend=backend, num_blocks=16)
    forward = engine.model.forward

    def poisoned(*args, **kwargs):
        logits = forward(*args, **kwargs)
        logits[:, 7] = poison
        return logits

    engine.model.forward = poisoned
    engine.add_request([1, 2, 3], SamplingParams(temperature=temperature, max_tokens=3), "bad")
    with pytest.raises(StepError) as caught:
        engine.step()
    assert isinstance(caught.value.__cause__, NoDistributionError)
    assert "'bad'" in str(caught.value.__cause__) and caught.value.request_ids == ("bad",)
    del engine.model.forward  # rolled back: the request runs as if nothing happened
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("value", [5e-324, 1e-3, 1000.0, 1e308])
def test_the_server_refuses_the_same_repetition_penalties(value):
    require_module("mie.serve")  # the server stack (as tests/test_serve_protocol.py)
    from mie.serve.protocol import APIError, parse_options

    body = {"model": "m", "prompt": "x", "repetition_penalty": value}
    with pytest.raises(APIError) as caught:
        parse_options(body, "m", chat=False)
    assert caught.value.status == 400 and "repetition_penalty" in str(caught.value)


@pytest.fixture(scope="module")
def llms() -> dict:
    return {name: LLM(STORIES, backend=backend_named(name), num_blocks=32) for name in BACKENDS}


@settings(max_examples=15, deadline=None)
@given(
    penalty=st.one_of(st.sampled_from(REPETITION_PENALTY_RANGE), st.floats(0.01, 100)),
    bias=st.dictionaries(st.integers(0, 511), st.sampled_from([-100.0, 100.0]), max_size=600),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_extreme_legal_params_generate_the_same_valid_tokens_on_both_backends(
    llms, penalty, bias, temperature
):
    params = SamplingParams(
        repetition_penalty=penalty,
        logit_bias=bias,
        temperature=temperature,
        seed=3,
        max_tokens=6,
        ignore_eos=True,
    )
    runs = [
        llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
        for llm in llms.values()
    ]
    assert all(0 <= t < 512 for t in runs[0]) and len(runs[0]) == 6
    assert all(run == runs[0] for run in runs)
