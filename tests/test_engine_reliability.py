"""No request can break the engine for the others: fault injection into steps, validation
before anything is queued, bounded per-request work (on both backends).

The clean run is the oracle for the fault runs: the same requests on a fresh engine without
faults. A step that fails is rolled back and re-queued, so every request -- not only the
unaffected ones -- must end with exactly the tokens of the clean run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    assert_drained,
    backend_named,
    engine_of,
    stories_tokenizer,
    stories_with_window,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams, StepError, StructuredOutputsParams
from mie.engine.beam_search import BeamSearchParams
from mie.engine.llm_engine import LLMEngine, RequestStalledError
from mie.engine.sampling import InvalidRequestError, probabilities, sample
from mie.engine.structured import StructuredOutputsError
from mie.engine.tokenizer import IncrementalDetokenizer
from mie.model import Model
from mie.scheduler import RequestTooLongError, SchedulerStallError

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "The sun was", "Ben had"]


@functools.cache
def stories_model(backend_name: str) -> Model:
    return Model.from_pretrained(STORIES, backend_named(backend_name).kernels)


def new_engine(backend_name: str = "python", **kwargs) -> LLMEngine:
    return engine_of(stories_model(backend_name), backend_name, **kwargs)


def drain(engine: LLMEngine, on_error=None) -> dict[str, tuple[list[int], str, str]]:
    """Step until done; a failed step is handed to ``on_error`` (default: step again)."""
    done = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except (StepError, KeyboardInterrupt, MemoryError) as exc:
            engine.scheduler.check_integrity()
            if on_error is not None:
                on_error(exc)
            continue
        engine.scheduler.check_integrity()
        for out in outputs:
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.text, c.finish_reason)
    return done


class Faults:
    """Makes the model's forward pass, or the detokenizer's decode, raise on chosen calls."""

    def __init__(self, forward_failures, decode_failures, kinds):
        self.forward_failures = set(forward_failures)
        self.decode_failures = set(decode_failures)
        self.kinds = kinds
        self.forward_calls = self.decode_calls = self.raised = 0

    def exception(self, index: int) -> BaseException:
        self.raised += 1
        kind = self.kinds[index % len(self.kinds)]
        return kind(f"injected fault #{self.raised}")

    def install(self, engine: LLMEngine) -> None:
        forward, decode = engine.model.forward, engine.tokenizer.decode

        def failing_forward(*args):
            self.forward_calls += 1
            if self.forward_calls in self.forward_failures:
                raise self.exception(self.forward_calls)
            return forward(*args)

        def failing_decode(ids, *args, **kwargs):
            self.decode_calls += 1
            if self.decode_calls in self.decode_failures:
                raise self.exception(self.decode_calls)
            return decode(ids, *args, **kwargs)

        # Per-engine wrappers: the model and tokenizer objects are shared, so wrap shallow
        # copies instead of patching them in place.
        engine.model = _Proxy(engine.model, forward=failing_forward)
        engine.tokenizer = _Proxy(engine.tokenizer, decode=failing_decode)
        for request in engine._requests.values():
            for seq_sample in request.samples:
                if seq_sample.detokenizer is not None:
                    seq_sample.detokenizer._tokenizer = engine.tokenizer


class _Proxy:
    def __init__(self, target, **overrides):
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._target, name)


request_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.8, 1.5]),
    top_p=st.sampled_from([1.0, 0.9]),
    max_tokens=st.integers(1, 40),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    ignore_eos=st.booleans(),
)
# Constrained requests: a failed step must put each one's grammar matcher back where it was,
# or its next mask (and so its tokens) would differ from the clean run's.
constrained_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.8, 1.5]),
    max_tokens=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    structured_outputs=st.sampled_from(
        [
            StructuredOutputsParams(regex=r"[a-z ]{1,30}\.( [a-z]+)*"),
            StructuredOutputsParams(choice=["yes", "no", "a little dog"]),
            StructuredOutputsParams(
                json={"type": "object", "properties": {"n": {"type": "integer"}}},
                disable_any_whitespace=True,
            ),
        ]
    ),
)


@pytest.mark.parametrize("backend_name", ["python", "fast"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=st.lists(st.one_of(request_params, constrained_params), min_size=1, max_size=6),
    forward_failures=st.sets(st.integers(1, 60), max_size=6),
    decode_failures=st.sets(st.integers(1, 400), max_size=4),
    kinds=st.lists(st.sampled_from([RuntimeError, MemoryError, KeyboardInterrupt]), min_size=1),
    num_blocks=st.sampled_from([12, 64]),
    prefix_caching=st.booleans(),
    speculative=st.sampled_from(
        [
            None,
            {"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
            {"model": str(STORIES), "num_speculative_tokens": 2},
        ]
    ),
)
def test_failed_steps_roll_back_and_every_request_ends_as_in_a_clean_run(
    backend_name,
    params,
    forward_failures,
    decode_failures,
    kinds,
    num_blocks,
    prefix_caching,
    speculative,
):
    """A faulty run (steps failing at random points, of every kind) ends every request as a
    clean run does; so does one that speculates (proposals change no token, and a failed
    step rolls them back with the rest: the blocks of rejected proposals, the draft's)."""

    def submit(engine):
        return [
            engine.add_request(PROMPTS[i % len(PROMPTS)], p, request_id=f"r{i}")
            for i, p in enumerate(params)
        ]

    options = {"num_blocks": num_blocks, "prefix_caching": prefix_caching, "seed": 5}
    clean = new_engine(backend_name, **options)
    submit(clean)
    expected = drain(clean)

    speculative = speculative and {**speculative, "disable_by_batch_size": 64}
    engine = new_engine(backend_name, speculative_config=speculative, **options)
    submit(engine)
    faults = Faults(forward_failures, decode_failures, kinds)
    faults.install(engine)
    errors = []
    assert drain(engine, on_error=errors.append) == expected
    assert len(errors) == faults.raised
    for error in errors:  # Exceptions are wrapped and name the batch; the rest propagate
        assert isinstance(error, (StepError, KeyboardInterrupt))
        if isinstance(error, StepError):
            assert error.request_ids and set(error.request_ids) <= set(expected)
            assert "injected fault" in str(error.__cause__)
    assert_drained(engine)


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_aborting_a_failed_batch_spares_the_waiting_requests(backend_name):
    # A request that makes every step fail (a "poison" request) must not wedge the engine:
    # the server aborts the failed batch's requests; the others then run exactly as alone.
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=3)
    clean = new_engine(backend_name, max_num_seqs=2)
    for i in range(5):
        clean.add_request(PROMPTS[i], params, request_id=f"r{i}")
    expected = drain(clean)

    engine = new_engine(backend_name, max_num_seqs=2)
    for i in range(5):
        engine.add_request(PROMPTS[i], params, request_id=f"r{i}")
    forward = engine.model.forward
    calls = []

    def forward_failing_once_poisoned(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("poison")
        return forward(*args)

    engine.model = _Proxy(engine.model, forward=forward_failing_once_poisoned)
    aborted = []

    def abort_batch(error):
        assert isinstance(error, StepError)
        for request_id in error.request_ids:
            assert engine.abort_request(request_id)
            aborted.append(request_id)

    done = drain(engine, on_error=abort_batch)
    assert aborted and len(aborted) <= 2  # only the failed batch
    assert set(done) == set(expected) - set(aborted)
    for request_id, result in done.items():
        assert result == expected[request_id]
    assert_drained(engine)


# -- the scheduler livelock --------------------------------------------------------------------
@pytest.fixture(scope="module")
def windowed_stories(tmp_path_factory) -> Path:
    return stories_with_window(tmp_path_factory.mktemp("windowed"), 64)


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_a_cached_prefix_longer_than_the_window_does_not_livelock(backend_name, windowed_stories):
    """A sliding-window model in a pool smaller than its context, prefix cache on. The first
    request fills the pool and is cached; the second starts with it, so the blocks it would
    borrow are idle cached ones and none is free (0 free, 8 evictable). It borrows the
    prefix, gives the blocks before its window straight back, and finishes, instead of
    waiting forever with every step empty."""
    engine = LLMEngine(
        windowed_stories,
        backend=backend_named(backend_name),
        block_size=16,
        num_blocks=8,
        max_num_seqs=1,
        max_num_batched_tokens=128,
    )
    assert engine.scheduler.sliding_window == 64
    prefix = list(range(5, 133))
    engine.add_request({"prompt_token_ids": prefix}, SamplingParams(max_tokens=1), "first")
    assert set(drain(engine)) == {"first"}
    pool, cache = engine.pool, engine.scheduler.prefix_cache
    assert (pool.num_free, cache.num_evictable) == (0, 8)
    prompt = {"prompt_token_ids": prefix + list(range(200, 300))}
    engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0), "second")
    done = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        done.update((out.request_id, out) for out in engine.step() if out.finished)
        engine.scheduler.check_integrity()
    assert not engine.has_unfinished_requests(), (
        f"livelock: {len(engine.scheduler.waiting)} waiting, {pool.num_free} free, "
        f"{cache.num_evictable} evictable"
    )
    second = done["second"].outputs[0]
    assert len(second.token_ids) == 5 and second.finish_reason == "length"
    assert engine.stats.prefix_hit_tokens == 128  # it did borrow the cached prefix
    assert_drained(engine)


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_a_stalled_request_is_aborted_with_an_error_naming_it(backend_name, caplog):
    """Were the scheduler ever unable to admit the request at the head of an idle engine's
    queue again, the step must not come back empty, forever: it raises
    ``RequestStalledError`` (a ``StepError``) naming that request, which the engine has
    aborted, logs it, and the next steps serve the others as in a clean run. Forced here by a
    block table outside the scheduler holding the whole pool."""
    params = SamplingParams(temperature=0, max_tokens=6)
    clean = new_engine(backend_name, num_blocks=8)
    clean.add_request(PROMPTS[1], params, request_id="other")
    expected = drain(clean)

    engine = new_engine(backend_name, num_blocks=8)
    hog = engine.backend.BlockTable(engine.pool, 16)
    assert hog.append_tokens(8 * 16)
    engine.add_request(PROMPTS[0], params, request_id="stalled")
    engine.add_request(PROMPTS[1], params, request_id="other")
    with caplog.at_level("ERROR", logger="mie"), pytest.raises(RequestStalledError) as info:
        engine.step()
    error = info.value
    assert isinstance(error, StepError) and error.request_ids == ("stalled",)
    assert isinstance(error.__cause__, SchedulerStallError)
    assert str(error).startswith("request 'stalled' aborted, it could not be scheduled: ")
    assert "0 free and 0 evictable blocks of 8" in str(error)
    assert "'stalled' aborted" in caplog.text
    assert engine.abort_request("stalled") is False  # already gone
    assert engine.stats.steps == 0  # no empty step was counted
    hog.release()
    assert drain(engine) == expected
    assert_drained(engine)


def test_generate_interrupted_leaves_no_request_and_no_block_behind():
    llm = LLM.__new__(LLM)
    llm.engine = new_engine()
    forward = llm.engine.model.forward
    calls = []

    def interrupted_forward(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return forward(*args)

    llm.engine.model = _Proxy(llm.engine.model, forward=interrupted_forward)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(max_tokens=30), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_drained(llm.engine)
    # ... and the engine still works.
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5))
    assert len(out[0].outputs[0].token_ids) == 5


# -- validation before anything is queued ------------------------------------------------------


def snapshot(engine: LLMEngine):
    sched = engine.scheduler
    return (
        engine.num_unfinished_requests,
        engine._num_arrivals,
        len(sched.waiting),
        len(sched.running),
        engine.pool.num_free,
    )


BAD_REQUESTS = [
    # (prompt, params kwargs, message)
    (b"\x01\x02", {}, "prompt is a string"),
    ({1, 2, 3}, {}, "prompt is a string"),
    (frozenset({4}), {}, "prompt is a string"),
    (iter([1, 2]), {}, "prompt is a string"),
    (range(3), {}, "prompt is a string"),
    (3.5, {}, "prompt is a string"),
    (None, {}, "prompt is a string"),
    (np.array([1.0, 2.0]), {}, "integer array"),
    (np.array([[1, 2]]), {}, "integer array"),
    ([1, 2.0], {}, "outside the vocabulary"),
    ([1, True], {}, "outside the vocabulary"),
    ([1, "2"], {}, "outside the vocabulary"),
    ([2**63], {}, "outside the vocabulary"),
    ([2**64 + 5], {}, "outside the vocabulary"),
    ([-1], {}, "outside the vocabulary"),
    ([], {}, "empty"),
    ("", {}, "empty"),
    ({"prompt": 5}, {}, "'prompt' must be a str"),
    ({"prompt_token_ids": [1], "prompt": 7}, {}, "'prompt' must be a str"),
    ({"prompt_token_ids": {1, 2}}, {}, "prompt is a string"),
    ({}, {}, "needs 'prompt_token_ids'"),
    ("abc\ud800", {}, "not valid Unicode"),
    ("\udfff", {}, "not valid Unicode"),
    ([1] * 100_000, {}, "more than the model's context"),
    ("Once", {"stop_token_ids": [10**6]}, "in the vocabulary"),
]


@pytest.mark.parametrize("prompt, kwargs, match", BAD_REQUESTS)
def test_bad_requests_are_refused_with_nothing_changed(prompt, kwargs, match):
    engine = new_engine()
    engine.add_request("Once upon a time", SamplingParams(max_tokens=3))
    engine.step()
    before = snapshot(engine)
    with pytest.raises(InvalidRequestError, match=match) as refused:
        engine.add_request(prompt, SamplingParams(**kwargs))
    assert refused.value.field == ("stop_token_ids" if kwargs.get("stop_token_ids") else "prompt")
    assert snapshot(engine) == before
    engine.scheduler.check_integrity()


@pytest.mark.parametrize(
    "refuse, field",
    [
        (lambda e: e.add_request("Once", SamplingParams(), request_id=5), "request_id"),
        (lambda e: e.add_request("Once", SamplingParams(), request_id="r"), "request_id"),
        (lambda e: e.add_request("Once", {"max_tokens": 3}), "params"),
        (lambda e: e.add_request("Once", SamplingParams(n=3, temperature=1)), "n"),
        (lambda e: e.add_request("Once", SamplingParams(best_of=3, temperature=1)), "best_of"),
        (lambda e: e.finish_sample("r", 4), "index"),
        (lambda e: e.finish_sample("r", 0, text_end=-1), "text_end"),
        (lambda e: BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
        (lambda e: BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
    ],
)
def test_every_refusal_names_its_field(refuse, field):
    # What a server's 400 names as its param (mie.serve.protocol.engine_refusal).
    engine = new_engine(max_num_seqs=4)  # at most 2 samples a request
    engine.add_request("Once upon a time", SamplingParams(max_tokens=3), request_id="r")
    with pytest.raises(InvalidRequestError) as refused:
        refuse(engine)
    assert refused.value.field == field


@pytest.mark.parametrize(
    "bad, match",
    [
        ([10**6], "outside the vocabulary"),
        ("", "empty"),
        ([1] * 513, "context length"),
        ([1] * 300, "request too long"),
    ],  # the last: the scheduler's RequestTooLongError
)
def test_a_refused_prompt_refuses_its_whole_batch_with_nothing_changed(bad, match):
    """``add_requests`` (a client's batch): the prompts before the refused one are taken back,
    down to the arrival count that seeds later unseeded requests."""
    engine = new_engine(num_blocks=16)  # 256 tokens
    engine.add_request("Once upon a time", SamplingParams(max_tokens=3))
    engine.step()
    before = snapshot(engine)
    batch = ["Lily", [1, 400, 401], bad, "Tom"]
    with pytest.raises(ValueError, match=match) as info:
        engine.add_requests(batch, SamplingParams(max_tokens=8), ["b0", "b1", "b2", "b3"])
    assert info.value.prompt_index == 2
    assert snapshot(engine) == before
    engine.scheduler.check_integrity()
    engine.add_requests(["Lily", "Tom"], SamplingParams(max_tokens=2), ["b0", "b1"])  # ids free
    assert engine.num_unfinished_requests == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": {1, 2}}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": True}, "top_k"),
        ({"max_tokens": "16"}, "max_tokens"),
    ],
)
def test_sampling_params_refuse_loose_types(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_a_rejected_request_does_not_shift_later_unseeded_samples():
    params = SamplingParams(temperature=1.0, max_tokens=8)

    def run(with_rejections: bool):
        engine = new_engine(num_blocks=8)  # 128 tokens: a 200-token request never fits
        ids = []
        for prompt in PROMPTS[:3]:
            if with_rejections:
                for bad in ("abc\ud800", [10**6], "x" * 10**7):
                    with pytest.raises(InvalidRequestError):
                        engine.add_request(bad, params)
                with pytest.raises(RequestTooLongError):  # refused by the scheduler itself
                    engine.add_request(prompt, SamplingParams(max_tokens=200))
            ids.append(engine.add_request(prompt, params))
        done = drain(engine)
        return [done[i][0] for i in ids]

    assert run(True) == run(False)


def test_negative_seeds_are_accepted_and_wrap_like_torch_but_minus_one_is_none_as_in_vllm():
    engine = new_engine()
    a = engine.add_request("Once", SamplingParams(seed=-2, max_tokens=10))
    b = engine.add_request("Once", SamplingParams(seed=2**64 - 2, max_tokens=10))
    done = drain(engine)
    assert done[a][0] == done[b][0]
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=np.int8(-1)).seed is None
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_automatic_ids_never_collide_with_explicit_ones():
    engine = new_engine()
    explicit = [engine.add_request("Once", request_id=str(i)) for i in range(3)]
    automatic = [engine.add_request("Once") for _ in range(3)]
    assert len(set(explicit + automatic)) == 6
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("Once", request_id=automatic[0])
    with pytest.raises(InvalidRequestError, match="request_id must be a str"):
        engine.add_request("Once", request_id=7)


def test_a_huge_prompt_string_is_refused_before_it_is_tokenized():
    engine = new_engine()
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer = _Proxy(
        engine.tokenizer, encode=lambda *a, **k: calls.append(1) or encode(*a, **k)
    )
    with pytest.raises(InvalidRequestError, match="cannot fit"):
        engine.add_request("a" * (engine.max_model_len * engine.tokenizer.max_token_chars + 1))
    assert not calls


# -- sampling: numerically safe for every accepted temperature ------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    row=st.lists(
        st.floats(-3.0000000054977558e38, 3.0000000054977558e38, width=32), min_size=2, max_size=40
    ),
    temperature=st.one_of(
        st.sampled_from([5e-324, 1e-310, 1e-45, 1e-20, 9.99e-6, 1e-5, 1.01e-5]),
        st.floats(5e-324, 1e-3),
        st.floats(1e-3, 1e6),
    ),
    top_p=st.sampled_from([1.0, 0.5, 1e-9]),
    top_k=st.sampled_from([-1, 1, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sampling_is_safe_for_every_accepted_temperature(row, temperature, top_p, top_k, seed):
    logits = np.array(row, dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    token = sample(logits, params, np.random.default_rng(seed))
    assert 0 <= token < logits.size
    if params.greedy:
        assert token == int(np.argmax(logits))
    else:
        probs = probabilities(logits, params)
        assert np.isfinite(probs).all() and abs(probs.sum() - 1) < 1e-9
        assert probs[token] > 0


def test_a_subnormal_temperature_is_greedy():
    logits = np.array([0.5, 3.0, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    for temperature in (5e-324, 1e-300, 1e-6):
        assert sample(logits, SamplingParams(temperature=temperature), rng) == 1


# -- per-request work is bounded ------------------------------------------------------------------


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_token_ids = tokenizer.special_token_ids
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(  # runs of one token: long runs of <0x80>..<0xFF> never complete a character
        st.tuples(
            st.one_of(st.integers(0, 511), st.integers(3 + 0x80, 3 + 0xFF)), st.integers(1, 40)
        ),
        min_size=1,
        max_size=10,
    )
)
def test_detokenizer_window_stays_bounded(runs):
    tokens = [token for token, count in runs for _ in range(count)]
    # Byte tokens that never complete a character (e.g. 0xFF), or special tokens that decode
    # to nothing, used to grow the decoded window without limit: O(n) work per token.
    counting = CountingTokenizer(stories_tokenizer())
    detok = IncrementalDetokenizer(counting, [1, 400])
    text = "".join(detok.add(t) for t in tokens)
    assert counting.longest <= 16  # a constant, however long the runs (40 tokens here)
    assert isinstance(text, str)


def test_detokenizer_emits_a_run_of_invalid_bytes_instead_of_waiting_forever():
    tokenizer = stories_tokenizer()
    invalid = tokenizer.encode("\xff", add_special_tokens=False)  # byte-fallback tokens
    detok = IncrementalDetokenizer(tokenizer, [1])
    bad_byte = tokenizer._tokenizer.token_to_id("<0xFF>")
    assert bad_byte is not None, invalid
    deltas = [detok.add(bad_byte) for _ in range(40)]
    assert "".join(deltas).count("\ufffd") >= 30


# -- engine settings ------------------------------------------------------------------------------

BAD_SETTINGS = [
    ("block_size", 0, "block_size must be a positive int"),
    ("block_size", 1.5, "block_size must be a positive int"),
    ("block_size", None, "block_size must be a positive int"),
    ("block_size", 10**9, "cannot allocate a KV pool"),
    ("num_blocks", 0, "num_blocks must be a positive int"),
    ("num_blocks", 10**20, "cannot allocate a KV pool"),
    ("kv_cache_memory", 0, "kv_cache_memory must be a positive int"),
    ("kv_cache_memory", 1.5, "kv_cache_memory must be a positive int"),
    ("kv_cache_memory", None, "kv_cache_memory must be a positive int"),
    ("kv_cache_memory", 10**30, "cannot allocate a KV pool"),
    ("max_num_seqs", 0, "max_num_seqs must be a positive int"),
    ("max_num_seqs", None, "max_num_seqs must be a positive int"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be a positive int"),
    ("prefix_caching", None, "prefix_caching must be a bool"),
    ("prefix_caching", "yes", "prefix_caching must be a bool"),
    ("seed", -1, "seed must be a non-negative int"),
    ("seed", 2.0, "seed must be a non-negative int"),
    ("allow_non_finite_weights", 1, "allow_non_finite_weights must be a bool"),
]


@pytest.mark.parametrize("name, value, match", BAD_SETTINGS)
def test_bad_engine_settings_are_refused_by_name(name, value, match):
    settings = {"num_blocks": None} if name == "kv_cache_memory" else {}
    settings[name] = value
    with pytest.raises(ValueError, match=match):
        new_engine(**settings)


@pytest.mark.parametrize("where", ["mask", "consume"])
def test_a_failing_grammar_fails_its_own_request_only(monkeypatch, where):
    """A constrained sample whose grammar matcher fails mid-generation (in its mask, or on
    the token drawn) fails the step naming that request alone: a server aborting the named
    requests spares the batch-mates, which were re-queued and end as in a clean run."""
    from mie.engine.llm_engine import GrammarFailedError
    from mie.engine.structured import GrammarMatcher

    choice = StructuredOutputsParams(regex="[a-z ]{1,40}")
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=12),
        SamplingParams(temperature=0.8, seed=2, max_tokens=12, structured_outputs=choice),
        SamplingParams(temperature=0, max_tokens=12),
    ]

    def submit(engine):
        for i, p in enumerate(params):
            engine.add_request(PROMPTS[i], p, request_id=f"r{i}")

    clean = new_engine()
    submit(clean)
    expected = drain(clean)

    engine = new_engine()
    submit(engine)
    culprit = engine._requests["r1"].samples[0].matcher
    calls = 0
    if where == "mask":
        error = GrammarMatcher.error.fget

        def failing_error(matcher):
            nonlocal calls
            calls += matcher is culprit
            return "injected" if matcher is culprit and calls == 3 else error(matcher)

        monkeypatch.setattr(GrammarMatcher, "error", property(failing_error))
    else:
        consume = GrammarMatcher.consume

        def failing_consume(matcher, token_id):
            nonlocal calls
            calls += matcher is culprit
            if matcher is culprit and calls == 3:
                raise StructuredOutputsError("injected")
            consume(matcher, token_id)

        monkeypatch.setattr(GrammarMatcher, "consume", failing_consume)
    errors = []

    def abort_named(exc):  # what the server does with a failed step
        errors.append(exc)
        for request_id in exc.request_ids:
            engine.abort_request(request_id)

    done = drain(engine, on_error=abort_named)
    assert len(errors) == 1 and errors[0].request_ids == ("r1",)
    assert isinstance(errors[0].__cause__, GrammarFailedError)
    assert "'r1'" in str(errors[0].__cause__) and "injected" in str(errors[0].__cause__)
    assert done == {k: v for k, v in expected.items() if k != "r1"}
    assert_drained(engine)
