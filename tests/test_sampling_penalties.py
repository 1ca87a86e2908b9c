"""Penalties and the remaining sampling knobs against transformers' processors or the formula.

Each processor is driven the way the engine drives it -- ``LogitsState.observe`` one committed
token at a time -- and compared at every step with an oracle handed the whole history, so the
incremental bookkeeping is checked too. End to end: greedy generation with a penalty on the
real stories260K model equals transformers' ``generate`` with the same processor.
"""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import (
    InvalidRequestError,
    LogitsState,
    bad_words_token_ids,
    logits_state,
    probabilities,
    sample,
)
from mie.engine.structured import StructuredOutputsParams

torch = require_module("torch")
transformers = require_module("transformers")
lp = require_module("transformers.generation.logits_process")

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
VOCAB = 12

token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=20)
logit_rows = st.lists(st.floats(-6, 6, width=32), min_size=VOCAB, max_size=VOCAB)


def driven(params: SamplingParams, prompt: list[int], generated: list[int], stops=()):
    """A LogitsState fed ``generated`` the way the engine feeds it: one token at a time."""
    state = LogitsState(params, prompt, stops, VOCAB)
    for token in generated:
        state.observe(token)
    return state


def hf(processor, history: list[int], row: np.ndarray) -> np.ndarray:
    ids = torch.tensor([history], dtype=torch.long)
    return processor(ids, torch.tensor(row, dtype=torch.float64)[None])[0].numpy()


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    prompt=token_lists.filter(bool),
    generated=token_lists,
    penalty=st.floats(0.1, 3.0),
)
def test_repetition_penalty_matches_transformers(row, prompt, generated, penalty):
    params = SamplingParams(repetition_penalty=penalty)
    row = np.array(row, dtype=np.float32)
    ours = driven(params, prompt, generated).apply(row)
    theirs = hf(lp.RepetitionPenaltyLogitsProcessor(penalty), prompt + generated, row)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    prompt=token_lists.filter(bool),
    generated=token_lists,
    frequency=st.floats(-2, 2),
    presence=st.floats(-2, 2),
)
def test_frequency_and_presence_penalties_follow_openais_formula(
    row, prompt, generated, frequency, presence
):
    # OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence,
    # c[j] counting j among the *generated* tokens only (the prompt does not count).
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    ours = driven(params, prompt, generated).apply(np.array(row, dtype=np.float32))
    counts = Counter(generated)
    expected = [
        float(np.float32(mu)) - counts[j] * frequency - (counts[j] > 0) * presence
        for j, mu in enumerate(row)
    ]
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    prompt=token_lists.filter(bool),
    generated=token_lists,
    min_tokens=st.integers(0, 25),
    eos=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3, unique=True),
)
def test_min_tokens_matches_transformers_min_new_tokens(row, prompt, generated, min_tokens, eos):
    params = SamplingParams(min_tokens=min_tokens, max_tokens=max(min_tokens, 1))
    row = np.array(row, dtype=np.float32)
    ours = driven(params, prompt, generated, stops=eos).apply(row)
    processor = lp.MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, eos)
    np.testing.assert_array_equal(ours, hf(processor, prompt + generated, row))


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), min_size=1),
)
def test_logit_bias_matches_transformers_sequence_bias(row, bias):
    params = SamplingParams(logit_bias=bias)
    row = np.array(row, dtype=np.float32)
    ours = driven(params, [0], []).apply(row)
    processor = lp.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    # transformers keeps the bias in float32: equal to its rounding
    np.testing.assert_allclose(ours, hf(processor, [0], row), rtol=1e-6, atol=1e-5)


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    prompt=token_lists.filter(bool),
    generated=token_lists,
    min_tokens=st.integers(0, 25),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5), max_size=3),
    repetition=st.floats(0.5, 2.0),
    frequency=st.floats(-2, 2),
    presence=st.floats(-2, 2),
)
def test_all_together_apply_in_vllms_order(
    row, prompt, generated, min_tokens, bias, repetition, frequency, presence
):
    # vLLM's order: min_tokens, logit_bias, then repetition, frequency, presence. The bias
    # before the repetition penalty matters: it can flip a logit's sign, and with it whether
    # the penalty divides or multiplies.
    params = SamplingParams(
        min_tokens=min_tokens,
        max_tokens=max(min_tokens, 1),
        logit_bias=bias or None,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    row = np.array(row, dtype=np.float32)
    ours = driven(params, prompt, generated, stops=[2]).apply(row)
    history = prompt + generated
    expected = hf(lp.MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [2]), history, row)
    if bias:
        expected = hf(
            lp.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]), history, expected
        )
    expected = hf(lp.RepetitionPenaltyLogitsProcessor(repetition), history, expected)
    counts = np.bincount(np.array(generated, dtype=np.int64), minlength=VOCAB)
    expected = expected - counts * frequency - (counts > 0) * presence
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)  # float32 bias in HF


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    temperature=st.floats(0.2, 3.0),
    min_p=st.floats(0.0, 1.0),
    top_k=st.one_of(st.just(-1), st.integers(1, 15)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
)
def test_min_p_matches_transformers_in_vllms_place(row, temperature, min_p, top_k, top_p):
    # vLLM: temperature, then min_p, then top-k and top-p.
    params = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p)
    row = np.array(row, dtype=np.float32)
    scores = torch.tensor(row, dtype=torch.float64)[None]
    scores = lp.TemperatureLogitsWarper(temperature)(None, scores)
    scores = lp.MinPLogitsWarper(min_p)(None, scores)
    if top_k > 0:
        scores = lp.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = lp.TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)[0].numpy()
    np.testing.assert_allclose(probabilities(row, params), expected, atol=1e-9)


def test_no_history_no_state():
    """The common case does no per-step work: no state is built at all."""
    assert logits_state(SamplingParams(temperature=0.7, top_k=5, min_p=0.1), [1], [2], 9) is None
    assert logits_state(SamplingParams(min_tokens=1), [1], [2], 9) is not None


def test_min_tokens_blocks_stops_until_reached_then_releases_them():
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=5)
    state = LogitsState(params, [0], [1], 3)
    row = np.array([0.0, 5.0, 1.0], dtype=np.float32)  # the stop token 1 is the argmax
    picks = []
    for _ in range(3):
        token = sample(state.apply(row), params, None)
        state.observe(token)
        picks.append(token)
    assert picks == [2, 2, 1]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > max_tokens (16)
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"n": 0}, "n must"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 2, "temperature": 0}, "best_of"),
        ({"best_of": 2, "temperature": 0}, "best_of"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, torch_dtype=torch.float32)
    return (
        LLM(STORIES, num_blocks=64),
        model.eval(),
        transformers.AutoTokenizer.from_pretrained(STORIES),
    )


def test_greedy_with_repetition_penalty_and_min_tokens_equals_transformers(stories):
    llm, model, tokenizer = stories
    prompt = "The end."  # greedy with this penalty tells a 208-token story, then EOS
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            ids, do_sample=False, max_new_tokens=240, repetition_penalty=1.3, min_new_tokens=230
        )
    expected = out[0, ids.shape[1] :].tolist()
    params = SamplingParams(temperature=0, max_tokens=240, repetition_penalty=1.3, min_tokens=230)
    ours = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == expected
    # Without min_tokens the story ends before 230 tokens: the mask did the work.
    plain = SamplingParams(temperature=0, max_tokens=240, repetition_penalty=1.3)
    assert len(llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids) < 230


def test_logit_bias_forces_a_token_end_to_end(stories):
    llm = stories[0]
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=3, logit_bias={77: 100.0})
    assert llm.generate("The cat", params, use_tqdm=False)[0].outputs[0].token_ids == [77] * 8


def test_seeded_penalized_request_does_not_depend_on_the_batch(backend):
    params = SamplingParams(
        temperature=1.0,
        max_tokens=30,
        seed=99,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        min_tokens=10,
        logit_bias={5: 2.0},
        min_p=0.05,
    )
    alone = LLM(STORIES, backend=backend).generate("The little dog", params, use_tqdm=False)
    others = [SamplingParams(temperature=0.9, max_tokens=n, frequency_penalty=1.0) for n in (7, 40)]
    crowd = LLM(STORIES, backend=backend, max_num_seqs=3, num_blocks=8).generate(
        ["Lily", "The little dog", "Tom had a"], [others[0], params, others[1]], use_tqdm=False
    )
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_logit_bias_outside_the_vocabulary_is_refused_before_queueing():
    eng = LLMEngine(STORIES, num_blocks=16)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        eng.add_request("Once", SamplingParams(logit_bias={512: 1.0}))
    assert not eng.has_unfinished_requests() and eng.pool.num_free == 16


# -- allowed_token_ids and bad_words --------------------------------------------------------------
bad_sequences = st.lists(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4
)


@settings(max_examples=200, deadline=None)
@given(row=logit_rows, prompt=token_lists.filter(bool), generated=token_lists, bad=bad_sequences)
def test_bad_words_match_transformers_no_bad_words(row, prompt, generated, bad):
    # A word's last token is banned where the tokens before it end the sequence so far,
    # prompt included (a one-token word always), as transformers' processor does.
    if all(len(w) == 1 for w in bad) and len({w[0] for w in bad}) == VOCAB:
        return
    params = SamplingParams(bad_words=["(tokens given below)"])
    row = np.array(row, dtype=np.float32)
    state = LogitsState(params, prompt, (), VOCAB, bad_words_ids=bad)
    for token in generated:
        state.observe(token)
    ours = state.apply(row)
    processor = lp.NoBadWordsLogitsProcessor([list(w) for w in bad])
    np.testing.assert_array_equal(ours, hf(processor, prompt + generated, row))


@settings(max_examples=100, deadline=None)
@given(
    row=logit_rows,
    allowed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=VOCAB, unique=True),
)
def test_allowed_token_ids_match_transformers_prefix_constrained(row, allowed):
    params = SamplingParams(allowed_token_ids=allowed)
    row = np.array(row, dtype=np.float32)
    ours = driven(params, [0], []).apply(row)
    processor = lp.PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1)
    np.testing.assert_array_equal(ours, hf(processor, [0], row))


def test_bad_words_are_encoded_alone_and_after_a_space_by_vllms_rule():
    # A made-up tokenizer: "Lily" is one token at the start and after a space another one
    # (both banned); "ball" after a space takes one more token (banned alone only, as vLLM
    # does); "dog" after a space starts with the same token (alone only); leading spaces of a
    # word are dropped first.
    vocab = {
        "Lily": [5],
        " Lily": [6],
        "ball": [7, 8],
        " ball": [9, 7, 8],
        "dog": [3, 4],
        " dog": [3, 11],
    }
    ids = bad_words_token_ids(["Lily", "  ball", "dog"], lambda text: vocab[text])
    assert ids == [(5,), (6,), (7, 8), (3, 4)]


def test_greedy_with_bad_words_and_allowed_tokens_equals_transformers(stories):
    llm, model, tokenizer = stories
    prompt = "Once upon a time"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    words = ["Lily", "girl", "She loved", "big, red"]

    def hf_ids(word):  # vLLM's rule, spelled out with transformers' tokenizer
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        ok = spaced[0] != alone[0] and len(spaced) == len(alone)
        return [alone, spaced] if ok else [alone]

    bad = [seq for word in words for seq in hf_ids(word)]
    allowed = sorted(set(range(260, 512)) - {282})
    with torch.inference_mode():
        banned = model.generate(ids, do_sample=False, max_new_tokens=60, bad_words_ids=bad)
        constrained = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=30,
            prefix_allowed_tokens_fn=lambda batch, tokens: allowed,
        )
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    text = plain[0].outputs[0].text
    assert all(word in text for word in words), "the words occur without the ban"
    params = SamplingParams(temperature=0, max_tokens=60, bad_words=words)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == banned[0, ids.shape[1] :].tolist()
    assert not any(word in out.text for word in ("Lily", "She loved", "big, red"))
    params = SamplingParams(temperature=0, max_tokens=30, allowed_token_ids=allowed)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == constrained[0, ids.shape[1] :].tolist()
    assert set(out.token_ids) <= set(allowed)


def test_sampled_tokens_stay_allowed_and_speculation_changes_nothing(backend):
    allowed = list(range(300, 420))
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=40, allowed_token_ids=allowed, bad_words=["the"]
    )
    plain = LLM(STORIES, backend=backend).generate("The cat", params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}
    fast = LLM(STORIES, backend=backend, speculative_config=spec)
    again = fast.generate("The cat", params, use_tqdm=False)
    tokens = plain[0].outputs[0].token_ids
    assert set(tokens) <= set(allowed) and again[0].outputs[0].token_ids == tokens


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(allowed_token_ids=[5, 512]), "allowed_token_ids"),
        # "Lily" is token 317 alone (after a space it takes two tokens: banned alone only)
        (SamplingParams(allowed_token_ids=[317], bad_words=["Lily"]), "bad_words"),
        # "gir" is [298, 315]: 315 is banned after a 298, which the prompt may end with
        (SamplingParams(allowed_token_ids=[315], bad_words=["gir"]), "bad_words"),
        (SamplingParams(allowed_token_ids=[1, 2], min_tokens=1, max_tokens=4), "min_tokens"),
        (SamplingParams(bad_words=["x"] * 100 + ["a" * 40] * 28), "bad_words"),
    ],
)
def test_requests_that_cannot_draw_are_refused_before_queueing(params, field):
    eng = LLMEngine(STORIES, num_blocks=16)
    with pytest.raises(InvalidRequestError) as info:
        eng.add_request("Once", params)
    assert info.value.field == field
    assert not eng.has_unfinished_requests() and eng.pool.num_free == 16


@pytest.mark.parametrize("name", ["allowed_token_ids", "bad_words"])
def test_masks_that_could_contradict_a_grammar_are_refused_beside_one(name):
    # The grammar may allow only tokens the mask forbids: nothing would be left to draw.
    grammar = StructuredOutputsParams(regex="[0-9]+")
    value = [298] if name == "allowed_token_ids" else ["1"]
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_outputs=grammar, **{name: value})
    assert info.value.field == name


@pytest.mark.parametrize(
    "kwargs",
    [
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": [1.5]},
        {"allowed_token_ids": 5},
        {"bad_words": "cat"},
        {"bad_words": [""]},
        {"bad_words": [3]},
        {"bad_words": ["w"] * 129},
        {"bad_words": ["cat", "\ud800"]},  # a lone surrogate: no UTF-8 for the tokenizer
    ],
)
def test_bad_allowed_token_ids_and_bad_words_are_refused_naming_the_field(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == next(iter(kwargs))
