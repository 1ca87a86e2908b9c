"""Stop strings (``SamplingParams.stop``): the matcher alone against a naive rule, then the
engine, offline, against transformers.

The matcher (``mie.engine.stop_strings``) must find exactly the first stop string however the
text is cut into tokens, hold back only what may still become one, and do O(1) amortized
work per character and stop string. The engine must end a sample at the token that completed
a stop string -- greedy tokens a prefix of transformers' ``generate``, the text transformers'
decode cut before the stop string (through it with ``include_stop_str_in_output``) -- with
speculative decoding, ``n > 1``, ``min_tokens``, preemption and failed steps alike, its blocks
back in the pool at once.
"""

from pathlib import Path

import pytest
from conftest import require_module, run_through_failures, run_to_completion
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams
from mie.engine import llm_engine
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import InvalidRequestError
from mie.engine.stop_strings import MAX_STOP_LENGTH, MAX_STOP_STRINGS, StopMatcher

torch = require_module("torch")
transformers = require_module("transformers")

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
PROMPT = "Once upon a time"


# -- stop strings -------------------------------------------------------------------------------
def first_stop(text: str, stops: list[str], protected: int = 0) -> str:
    """Reading left to right, the text before the first stop string completed (the longer
    one if two complete together) after the first ``protected`` characters (the text of the
    first ``min_tokens`` tokens, where none may end), or all of it."""
    return first_stop_match(text, stops, protected)[0]


def first_stop_match(text: str, stops: list[str], protected: int = 0) -> tuple[str, str | None]:
    """``first_stop``'s text, and the stop string completed (None: none)."""
    for end in range(protected + 1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    protected=st.one_of(st.just(0), st.integers(0, 30)),
    cuts=st.sets(st.integers(1, 30)),
)
def test_streaming_with_stop_strings_shows_exactly_the_text_before_the_first_one(
    text, stops, protected, cuts
):
    # The engine's text grows by a few characters a step (a token); the client sees what
    # visible_text allows, and that must not depend on how the text was cut into tokens.
    # With min_tokens the first ``protected`` characters may not end a stop string (set
    # before any of them is read, as the server sets it while the first tokens arrive).
    protected = min(protected, len(text))
    expected = first_stop(text, stops, protected)
    matcher, shown, start = StopMatcher(tuple(stops)), "", 0
    matcher.protected = protected
    for end in [*sorted(c for c in cuts if c < len(text)), len(text)]:
        matcher.feed(text[start:end])
        start = end
        visible = text[: matcher.visible(finished=end == len(text))]
        assert visible.startswith(shown), "text once shown is never taken back"
        shown = visible
        if matcher.stop_at is not None:
            break
    assert shown == expected
    assert (matcher.stop_at is not None) == (expected != text)
    if not protected:
        assert (matcher.stop_at is not None) == any(s in text for s in stops)


def naive_held(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that is a proper beginning of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\u00e9\U0001f600", max_size=60),
    stops=st.lists(st.text(alphabet="ab\u00e9\U0001f600", min_size=1, max_size=8), max_size=5),
    data=st.data(),
)
def test_stop_matcher_agrees_with_the_naive_rule_at_every_cut(text, stops, data):
    # Longer strings over a small alphabet (many partial matches, long KMP failure chains),
    # cut at random places: after every piece the matcher's state is the naive answer.
    matcher, read = StopMatcher(tuple(stops)), 0
    while read < len(text):
        end = data.draw(st.integers(read + 1, len(text)))
        matcher.feed(text[read:end])
        read = end
        expected = first_stop(text[:read], stops)
        if matcher.stop_at is not None:
            assert text[: matcher.stop_at] == expected
            assert first_stop(text, stops) == expected  # what is found stays found
            return
        assert expected == text[:read], "a complete stop string was missed"
        assert matcher.held == naive_held(text[:read], stops)
        assert matcher.visible(finished=False) == read - matcher.held
    assert matcher.visible(finished=True) == len(text) == len(first_stop(text, stops))


class CountingTable(list):
    """A KMP failure table that counts its lookups: the matcher's only work beyond one
    comparison per character and stop string."""

    lookups = 0

    def __getitem__(self, i):
        CountingTable.lookups += 1
        return super().__getitem__(i)


def counted(matcher: StopMatcher) -> StopMatcher:
    matcher._failure = [CountingTable(t) for t in matcher._failure]
    CountingTable.lookups = 0
    return matcher


@pytest.mark.parametrize("piece", ["aaaa", "ab" * 8, "aab"])
def test_stop_matching_work_does_not_grow_with_the_stop_strings_length(piece):
    # A 400 KB stop string the text keeps almost matching. Rescanning every prefix of it each
    # step would be O(L^2) work per step; the matcher falls back along its failure table at
    # most once per character read (each lookup shortens the match, which grows by at most
    # one a character), after an O(L) table built once.
    stop = "a" * 400_000 + "b"
    matcher = counted(StopMatcher((stop,)))
    for _ in range(1000):  # a token a step
        matcher.feed(piece)
    assert matcher.stop_at is None or piece != "aaaa"
    assert CountingTable.lookups <= matcher.length
    if piece == "aaaa":
        assert matcher.held == 4000


def test_stop_matching_at_the_limits_does_bounded_work_and_is_exact():
    # 16 stop strings of 1024 characters, all almost matching all the time.
    stops = tuple("a" * (MAX_STOP_LENGTH - 1 - i) + "b" for i in range(MAX_STOP_STRINGS))
    matcher = counted(StopMatcher(stops))
    text = "a" * 4000
    for i in range(0, len(text), 4):
        matcher.feed(text[i : i + 4])
        assert matcher.visible(finished=False) == i + 4 - min(i + 4, MAX_STOP_LENGTH - 1)
    assert matcher.stop_at is None
    matcher.feed("b")
    assert matcher.stop_at == len(text) + 1 - MAX_STOP_LENGTH  # the longest stop, ending there
    assert matcher.stop_string == stops[0]
    assert CountingTable.lookups <= MAX_STOP_STRINGS * (len(text) + 1)


def test_each_sample_gets_a_fresh_stop_matcher_sharing_the_tables():
    first = StopMatcher(("ab",))
    first.feed("xa")
    second = first.fresh()
    assert second.held == 0 and first.held == 1
    second.feed("ab")
    assert second.stop_at == 0 and first.stop_at is None


# -- the engine, offline ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(STORIES)


def hf_greedy(hf, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for ``prompt``: (prompt ids, generated ids)."""
    model, tokenizer = hf
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    return input_ids[0].tolist(), out[0, input_ids.shape[1] :].tolist()


def hf_text(tokenizer, prompt_ids: list[int], generated: list[int]) -> str:
    """transformers' text of the generated tokens after the prompt."""
    before = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return tokenizer.decode(prompt_ids + generated, skip_special_tokens=True)[len(before) :]


def expected_cut(tokenizer, prompt_ids, generated, stops, *, min_tokens=0, include=False):
    """The oracle: the first prefix of ``generated`` whose transformers text completes a stop
    string (none ending in the text of the first ``min_tokens`` tokens), and the text then
    shown. (tokens, text, stop string), or the whole of ``generated`` and None."""
    protected = len(hf_text(tokenizer, prompt_ids, generated[:min_tokens]))
    for m in range(1, len(generated) + 1):
        text = hf_text(tokenizer, prompt_ids, generated[:m])
        before, stop = first_stop_match(text, stops, protected)
        if stop is not None:  # the one completed first, not a longer one beginning there too
            return generated[:m], before + stop if include else before, stop
    return generated, hf_text(tokenizer, prompt_ids, generated), None


@pytest.fixture(scope="module")
def greedy(hf):
    prompt_ids, generated = hf_greedy(hf, PROMPT, 60)
    return prompt_ids, generated, hf_text(hf[1], prompt_ids, generated)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), include=st.booleans(), min_tokens=st.sampled_from([0, 0, 5, 20]))
def test_greedy_output_ends_at_the_first_stop_string_as_transformers_text_says(
    hf, greedy, data, include, min_tokens
):
    # Stop strings cut out of the answer itself (so they occur, often mid-token, sometimes
    # several times) and one that never does.
    prompt_ids, generated, text = greedy
    pieces = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 12)).map(
        lambda p: text[p[0] : p[0] + p[1]]
    )
    stops = data.draw(st.lists(pieces | st.just("#never#"), min_size=1, max_size=3))
    params = SamplingParams(
        temperature=0,
        max_tokens=60,
        stop=stops,
        include_stop_str_in_output=include,
        min_tokens=min_tokens,
    )
    llm = LLM(STORIES, num_blocks=64)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    tokens, shown, stop = expected_cut(
        hf[1], prompt_ids, generated, stops, min_tokens=min_tokens, include=include
    )
    assert out.token_ids == tokens
    assert out.text == shown
    assert out.stop_reason == stop
    assert out.finish_reason == ("stop" if stop is not None else "length")
    llm.engine.scheduler.clear_prefix_cache()
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("include", [False, True])
def test_of_two_stop_strings_one_token_completes_the_first_completed_ends_the_text(
    hf, greedy, include
):
    # " l" completes both " was a " (its space) and " was a l": the text ends at the one
    # completed first, reading left to right, whatever the list's order (vLLM takes the
    # first of its list that the step's text holds: here " was a l").
    prompt_ids, generated, text = greedy
    assert " was a l" in text
    stops = [" was a l", " was a "]
    params = SamplingParams(
        temperature=0, max_tokens=60, stop=stops, include_stop_str_in_output=include
    )
    out = LLM(STORIES, num_blocks=64).generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    tokens, shown, stop = expected_cut(hf[1], prompt_ids, generated, stops, include=include)
    assert (out.token_ids, out.text, out.stop_reason) == (tokens, shown, stop)
    assert stop == " was a " and shown.endswith(" was a " if include else " there")


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_speculative_steps_end_at_the_token_that_completed_the_stop_string(backend, monkeypatch):
    # The answer repeats itself, so proposals are accepted in runs; stop strings cut out of
    # it end the output inside such runs: the tokens after the one that completed the stop
    # string are dropped, and the output is plain decoding's, token for token.
    prompt = "Lily wanted to play with the ball. Lily wanted to play with the ball. Lily"
    plain = LLM(STORIES, backend=backend, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=80)
    text = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    stops = list(dict.fromkeys(text[end - 9 : end] for end in range(12, len(text), 7)))
    speculative = LLM(STORIES, backend=backend, num_blocks=64, speculative_config=NGRAM)
    cut_in_runs = []
    verify = LLMEngine._verify

    def recording(self, sample, proposals, rows, allowed):
        tokens = verify(self, sample, proposals, rows, allowed)
        if sample.stopped_by_string and len(tokens) > 1:
            cut_in_runs.append(len(proposals) + 1 - len(tokens))
        return tokens

    monkeypatch.setattr(LLMEngine, "_verify", recording)
    for stop in stops:
        for include in (False, True):
            p = SamplingParams(
                temperature=0, max_tokens=80, stop=[stop], include_stop_str_in_output=include
            )
            want = plain.generate(prompt, p, use_tqdm=False)[0].outputs[0]
            got = speculative.generate(prompt, p, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.text, got.stop_reason) == (
                want.token_ids,
                want.text,
                want.stop_reason,
            )
            assert got.text == (text[: text.index(stop) + len(stop) * include])
    assert any(cut_in_runs), "no stop string completed inside an accepted run: nothing tested"
    engine = speculative.engine
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.draft is None


def test_each_sample_ends_at_its_own_stop_string_and_frees_its_blocks(backend):
    # n=4 sampled: every sample draws the tokens it draws without stop strings (its own
    # generator), cut at its own first stop string; a finished sample leaves the batch.
    base = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    reference = LLM(STORIES, backend=backend).generate(PROMPT, base, use_tqdm=False)[0]
    stops = [" the", "."]
    llm = LLM(STORIES, backend=backend, num_blocks=64)
    engine = llm.engine
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, stop=stops
    )
    engine.add_request(PROMPT, params, "r")
    running = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        running.append(len(engine.scheduler.running))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(STORIES)
    prompt_ids = final.prompt_token_ids
    stopped = 0
    for got, want in zip(final.outputs, reference.outputs, strict=True):
        tokens, shown, stop = expected_cut(hf_tokenizer, prompt_ids, want.token_ids, stops)
        assert (got.token_ids, got.text, got.stop_reason) == (tokens, shown, stop)
        stopped += stop is not None
    assert stopped >= 2, "the stop strings ended too few samples to test anything"
    assert min(running) < 4 or stopped == 0, "finished samples left the batch"
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.scheduler.check_integrity()


def test_text_shown_while_running_is_never_taken_back(greedy):
    # Step by step: each output's text is a prefix of the final one, so a client streaming
    # it never sees text a stop string later removes; the held-back tail is at most the
    # longest stop string but one character.
    _, _, text = greedy
    stop = text[30:45]  # "t" and " " begin many other places: held back often
    stops = [stop, " t" + "x" * 10]
    engine = LLMEngine(STORIES, num_blocks=64)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=60, stop=stops), "r")
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    assert seen[-1] == text[: text.index(stop)]
    assert all(seen[-1].startswith(s) for s in seen)
    assert any(len(a) == len(b) for a, b in zip(seen, seen[1:], strict=False)), (
        "nothing was ever held back"
    )


@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_a_failed_step_rolls_the_stop_matching_back(backend, where, monkeypatch):
    # A step fails in the forward pass, or in sampling after some samples of the batch have
    # drawn (and read their tokens' text into their stop matchers): each failed step is
    # undone, matchers included, and the outputs are those of a run that never failed.
    prompts = [PROMPT, "The little dog", "Lily wanted to"]
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=40, stop=[" the", "ed"], n=2)
    clean = LLM(STORIES, backend=backend, num_blocks=64).generate(prompts, params, use_tqdm=False)
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    calls = []

    def failing(call):
        def wrapper(*args):
            calls.append(None)
            if len(calls) in ((3, 7, 12, 20) if where == "forward" else (5, 14, 23, 35)):
                raise RuntimeError("injected")
            return call(*args)

        return wrapper

    if where == "forward":
        engine.model.forward = failing(engine.model.forward)
    else:
        monkeypatch.setattr(llm_engine, "sample_token", failing(llm_engine.sample_token))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, str(i))
    done, failures = run_through_failures(engine)
    assert failures == 4
    for i, want in enumerate(clean):
        got = done[str(i)]
        assert [(c.token_ids, c.text, c.stop_reason) for c in got.outputs] == [
            (c.token_ids, c.text, c.stop_reason) for c in want.outputs
        ]
    assert any(c.stop_reason for out in clean for c in out.outputs)
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_stop_token_is_the_stop_reason_and_its_text_shown_on_request(hf, greedy):
    prompt_ids, generated, _ = greedy
    stop = generated[6]
    cut = generated[: generated.index(stop) + 1]
    llm = LLM(STORIES)
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=60, stop_token_ids=[stop], include_stop_str_in_output=include
        )
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == cut and out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == hf_text(hf[1], prompt_ids, cut if include else cut[:-1])
    eos = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=400), use_tqdm=False)
    assert eos[0].outputs[0].finish_reason == "stop" and eos[0].outputs[0].stop_reason is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stop": ""},
        {"stop": ["a", ""]},
        {"stop": [1]},
        {"stop": {"a": 1}},
        {"stop": ["x"] * (MAX_STOP_STRINGS + 1)},
        {"stop": "x" * (MAX_STOP_LENGTH + 1)},
        {"include_stop_str_in_output": 1},
    ],
)
def test_bad_stop_strings_are_refused_naming_the_field(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == next(iter(kwargs))


def test_stop_strings_are_normalized():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == () and SamplingParams(stop=None).stop == ()


def test_an_engine_without_a_tokenizer_refuses_stop_strings(tmp_path):
    import shutil

    model_dir = tmp_path / "no_tokenizer"
    shutil.copytree(STORIES, model_dir)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        (model_dir / name).unlink(missing_ok=True)
    engine = LLMEngine(model_dir, num_blocks=16)
    if engine.tokenizer is not None:
        pytest.fail("the copy still has a tokenizer")
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1, 2, 3], SamplingParams(stop=["x"]))
    assert info.value.field == "stop" and not engine.has_unfinished_requests()
    run_to_completion(engine)
