"""Log-probabilities against transformers: ``log_softmax`` of its logits, within 1e-4.

For generated tokens (``logprobs``) and prompt tokens (``prompt_logprobs``), on tiny random
Llama / Qwen2 models and stories260K, both backends: the token's own log-probability, its
rank, and the top-k alternatives. Prompts are computed in chunks, preempted, recomputed,
rolled back and offered a cached prefix; the prompt's log-probabilities still come out once
per position, each from the raw logits. Each token's text (``decoded_token``) is its text in
context, against transformers' tokenizer decoding the whole sequence.
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import require_module, run_through_failures, run_to_completion
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine
from mie.engine.logprobs import log_softmax, position_logprobs
from mie.engine.sampling import MAX_LOGPROBS
from mie.engine.tokenizer import IncrementalDetokenizer
from mie.serve.protocol import completion_logprobs

torch = require_module("torch")
transformers = require_module("transformers")
from test_model_hf import SPECS, build_hf_model  # noqa: E402  (after the skip above)

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
TOLERANCE = 1e-4


def hf_logprobs(hf, token_ids: list[int]) -> np.ndarray:
    """transformers' log_softmax at every position of ``token_ids`` (row p predicts p + 1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0].to(torch.float64)
    return torch.log_softmax(logits, dim=-1).numpy()


def check_position(ours: dict, token: int, k: int, expected: np.ndarray) -> None:
    """One position's dict against transformers' row: the token's value and rank, and the
    top-k alternatives (any order among values within the tolerance)."""
    assert next(iter(ours)) == token, "the token at the position comes first"
    for t, entry in ours.items():
        assert abs(entry.logprob - expected[t]) < TOLERANCE, (t, entry, expected[t])
        # rank: 1 + tokens strictly more likely, allowing for near-ties within the tolerance
        low = 1 + np.count_nonzero(expected > expected[t] + TOLERANCE)
        high = 1 + np.count_nonzero(expected > expected[t] - TOLERANCE)
        assert low <= entry.rank <= high, (t, entry.rank, low, high)
    alternatives = [t for t in ours if t != token or len(ours) == k]
    assert len(ours) in (k, k + 1) and len(set(ours)) == len(ours)
    kth = np.sort(expected)[-k] if k else np.inf
    assert all(expected[t] >= kth - TOLERANCE for t in alternatives[:k])


def text_in_context(hf_tokenizer, before: list[int], token: int) -> str | None:
    """What ``token`` adds after ``before`` to transformers' decoding of the whole sequence
    (no window): the text from the last point where ``before``'s text ended on a whole
    character, or "" while the sequence ends inside a character (a stream cannot show it
    yet). The texts of a sequence's tokens then add up to its decoded text.

    None where no text can be right: a byte that makes a run of bytes invalid UTF-8 turns
    the *earlier* whole characters of the run into U+FFFD too (the tokenizer decodes a run
    at once), changing text that a stream has already shown.
    """

    def decode(ids):
        return hf_tokenizer.decode(ids, skip_special_tokens=True)

    whole = len(before)
    while whole > 0 and decode(before[:whole]).endswith("\ufffd"):
        whole -= 1
    base, full = decode(before[:whole]), decode(before + [token])
    if not full.startswith(base):
        return None
    return "" if full.endswith("\ufffd") else full[len(base) :]


def check_texts(hf_tokenizer, before: list[int], ours: dict) -> None:
    """Every candidate's ``decoded_token`` at the position after ``before``, in context."""
    for t, entry in ours.items():
        expected = text_in_context(hf_tokenizer, before, t)
        assert expected is None or entry.decoded_token == expected, (before, t, expected)


def check_request(out, hf, k_gen: int | None, k_prompt: int | None, hf_tokenizer=None) -> None:
    """``out`` against transformers' model (and, given ``hf_tokenizer``, its texts)."""
    prompt = out.prompt_token_ids
    for completion in out.outputs if k_gen is not None else ():
        tokens = prompt + completion.token_ids
        expected = hf_logprobs(hf, tokens[:-1])
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (token, ours) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            check_position(ours, token, k_gen, expected[len(prompt) - 1 + i])
            if hf_tokenizer is not None:
                check_texts(hf_tokenizer, tokens[: len(prompt) + i], ours)
        total = sum(expected[len(prompt) - 1 + i, t] for i, t in enumerate(completion.token_ids))
        assert abs(completion.cumulative_logprob - total) < TOLERANCE * len(tokens)
    if k_prompt is None:
        assert out.prompt_logprobs is None
        return
    expected = hf_logprobs(hf, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        check_position(out.prompt_logprobs[p], prompt[p], k_prompt, expected[p - 1])
        if hf_tokenizer is not None:
            check_texts(hf_tokenizer, prompt[:p], out.prompt_logprobs[p])


# -- the computation alone ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    # exact ties, and distinct values far enough apart that rounding cannot tie them
    row=st.lists(
        st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0])
        | st.integers(-500, 500).map(lambda x: x / 100),
        min_size=1,
        max_size=30,
    ),
    data=st.data(),
)
def test_position_logprobs_is_the_sorted_distribution(row, data):
    logits = np.array(row, dtype=np.float32)
    token = data.draw(st.integers(0, len(row) - 1))
    k = data.draw(st.integers(0, 25))
    expected = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    ours = position_logprobs(log_softmax(logits), token, k)
    # The top-k by the documented order (value, then lower id), after the token itself.
    ranking = sorted(range(len(row)), key=lambda t: (-expected[t], t))[: min(k, len(row))]
    assert list(ours) == [token] + [t for t in ranking if t != token]
    for t, entry in ours.items():
        np.testing.assert_allclose(entry.logprob, expected[t], atol=1e-12)
        assert entry.rank == 1 + sum(expected[u] > expected[t] for u in range(len(row)))


# -- tiny random models -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama-gqa2-hd16-tied-fp32", "qwen2-gqa1-hd16-untied-fp32"])
def tiny(request, tmp_path_factory):
    spec = SPECS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    build_hf_model(spec, seed=7).save_pretrained(directory)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, hf


def test_tiny_models_chunked_prefix_cached_and_preempted(tiny, backend):
    """Prompts in chunks of 7 tokens (blocks of 4), a second copy of a prompt the prefix
    cache could lend, and a pool so small that requests are preempted and recomputed."""
    directory, hf = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 320, n).tolist() for n in (23, 9, 30)]
    prompts.append(prompts[0])  # the same prompt again: its prefix is cached by then
    engine = LLMEngine(
        directory,
        backend=backend,
        block_size=4,
        num_blocks=18,
        max_num_batched_tokens=7,
        max_num_seqs=4,
    )
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, logprobs=5, prompt_logprobs=5),
        SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=0),
        SamplingParams(temperature=0.7, seed=2, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, logprobs=20, prompt_logprobs=20),
    ]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = run_to_completion(engine)
    assert engine.stats.preemptions > 0, "the pool was meant to force preemption"
    for request_id, sp in zip(ids, params, strict=True):
        check_request(done[request_id], hf, sp.logprobs, sp.prompt_logprobs)


def test_logprobs_are_raw_whatever_the_sampling_knobs(tiny):
    """Penalties, bias, temperature and filters change the token picked, not the
    log-probabilities reported: they are the model's."""
    directory, hf = tiny
    engine = LLMEngine(directory, block_size=4, num_blocks=40)
    params = SamplingParams(
        temperature=0.5,
        top_k=5,
        min_p=0.1,
        seed=4,
        max_tokens=10,
        repetition_penalty=1.5,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        logit_bias={7: 3.0},
        min_tokens=3,
        logprobs=4,
    )
    engine.add_request(list(range(40, 60)), params)
    (out,) = run_to_completion(engine).values()
    check_request(out, hf, 4, None)


# -- stories260K ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_hf():
    return transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stories_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(STORIES)


def test_stories260k_generated_and_prompt_logprobs(stories_hf, stories_tokenizer, backend):
    llm = LLM(STORIES, backend=backend, num_blocks=64, max_num_batched_tokens=32)
    prompt = "One day, Tom and his mom went to the park. They saw a big dog and a little bird."
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, logprobs=5, prompt_logprobs=5)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    check_request(out, stories_hf, 5, 5, stories_tokenizer)
    # The sampled tokens' texts, leading spaces included, add up to the text.
    completion = out.outputs[0]
    texts = [
        lp[t].decoded_token for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    assert "".join(texts) == completion.text and any(t.startswith(" ") for t in texts)
    # Asked again, the whole prompt could be borrowed from the prefix cache: it is
    # recomputed instead, and gives the same log-probabilities.
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.prompt_logprobs == out.prompt_logprobs
    plain = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].logprobs is None
    assert plain.outputs[0].cumulative_logprob is None


def test_a_rolled_back_step_records_nothing_twice(stories_hf, stories_tokenizer):
    """Forward passes that fail mid-prompt and mid-generation: every prompt position and
    every generated token is recorded once, with transformers' values and texts."""
    engine = LLMEngine(STORIES, num_blocks=64, max_num_batched_tokens=8, max_num_seqs=4)
    model, calls = engine.model, [0]

    class Flaky:  # the model, its forward failing on calls 2, 5 and 9
        def __getattr__(self, name):
            return getattr(model, name)

        def forward(self, *args):
            calls[0] += 1
            if calls[0] in (2, 5, 9):
                raise RuntimeError("injected")
            return model.forward(*args)

    engine.model = Flaky()
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=6, logprobs=2, prompt_logprobs=2)
    engine.add_request("Once upon a time, there was a little girl named Lily who", params)
    done, failures = run_through_failures(engine)
    assert failures == 3
    (out,) = done.values()
    check_request(out, stories_hf, 2, 2, stories_tokenizer)


def test_a_prompt_preempted_halfway_is_recorded_once(stories_hf, stories_tokenizer, backend):
    """A long prompt computed in chunks runs out of blocks halfway (a long generation holds
    most of the pool) and is preempted; when readmitted it computes everything again, and the
    positions recorded before the preemption are not recorded twice."""
    engine = LLMEngine(
        STORIES, backend=backend, num_blocks=8, max_num_batched_tokens=16, max_num_seqs=4
    )
    engine.add_request(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )
    for _ in range(85):  # 89 tokens: 6 of the 8 blocks
        engine.step()
    prompt = engine.tokenizer.encode("Lily and Ben went to the park with their mom. " * 4)[:60]
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=3)
    request_id = engine.add_request(prompt, params)
    partial = []
    while engine.has_unfinished_requests():
        preempted = engine.stats.preemptions
        outputs = {o.request_id: o for o in engine.step()}
        request = engine._requests.get(request_id)
        if engine.stats.preemptions > preempted and request is not None:
            partial.append(len(request.prompt_logprobs))
        if request_id in outputs and outputs[request_id].finished:
            out = outputs[request_id]
    assert partial and 1 < partial[0] < len(prompt), "meant to preempt it inside its prompt"
    assert out.outputs[0].logprobs is None
    check_request(out, stories_hf, None, 3, stories_tokenizer)


# -- texts in context, against transformers' tokenizer -------------------------------------------
def stories_vocabulary(hf_tokenizer) -> tuple[list[int], list[int], dict[int, int]]:
    """stories260K's ordinary tokens, its special tokens, and its byte-fallback tokens by byte."""
    vocab = hf_tokenizer.get_vocab()
    special = sorted(hf_tokenizer.all_special_ids)
    by_byte = {int(piece[3:5], 16): i for piece, i in vocab.items() if piece.startswith("<0x")}
    ordinary = sorted(set(vocab.values()) - set(special) - set(by_byte.values()))
    return ordinary, special, by_byte


@st.composite
def token_sequences(draw, hf_tokenizer):
    """Token ids as a model could produce them: ordinary tokens (``▁c`` and ``c`` alike),
    special tokens anywhere, and characters outside the vocabulary spelled in byte-fallback
    tokens (1 to 4 per character) -- whole characters, since a run of bytes that is not
    valid UTF-8 makes the tokenizer turn *earlier* complete characters into U+FFFD too,
    which no stream can show."""
    ordinary, special, by_byte = stories_vocabulary(hf_tokenizer)
    characters = st.characters(
        min_codepoint=0x80, blacklist_categories=("Cs",), blacklist_characters="\ufffd"
    )
    piece = st.one_of(
        st.sampled_from(ordinary).map(lambda t: [t]),
        st.sampled_from(special).map(lambda t: [t]),
        characters.map(lambda c: [by_byte[b] for b in c.encode()]),
    )
    pieces = draw(st.lists(piece, min_size=1, max_size=25))
    return [t for p in pieces for t in p]


@pytest.fixture(scope="module")
def stories_llm():
    return LLM(STORIES, num_blocks=128)


def first_token_text(tokenizer, token_id: int) -> str:
    """The server's text for a prompt's first token (no log-probabilities, no context)."""
    return IncrementalDetokenizer(tokenizer, []).add(token_id)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_token_texts_are_in_context_and_keys_distinct(stories_llm, stories_tokenizer, data):
    """For random sequences of stories260K's tokens (prompt + 3 generated), with the 20 most
    likely alternatives at every position: each candidate's text is what it adds in context
    (transformers decoding the whole sequence), the tokens' texts joined are the decoded
    text, and the completions shape's ``top_logprobs`` keeps every alternative under its
    own key, mapped to its own log-probability -- ``▁c`` (" c") and ``c`` ("c") apart."""
    prompt = data.draw(token_sequences(stories_tokenizer), label="prompt")
    params = SamplingParams(
        temperature=1.0,
        seed=data.draw(st.integers(0, 2**32 - 1)),
        max_tokens=3,
        logprobs=MAX_LOGPROBS,
        prompt_logprobs=MAX_LOGPROBS,
    )
    out = stories_llm.generate(prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = prompt + completion.token_ids
    positions = out.prompt_logprobs + completion.logprobs
    for i in range(1, len(ids)):
        check_texts(stories_tokenizer, ids[:i], positions[i])

    tokenizer = stories_llm.engine.tokenizer
    shape = completion_logprobs(
        ids,
        positions,
        lambda t, lp: lp.decoded_token if lp is not None else first_token_text(tokenizer, t),
    )
    whole = stories_tokenizer.decode(ids, skip_special_tokens=True)
    streamable = all(
        text_in_context(stories_tokenizer, ids[:i], ids[i]) is not None for i in range(len(ids))
    )
    if streamable and not whole.endswith("\ufffd"):  # (generated bytes may leave a
        assert "".join(shape["tokens"]) == whole  # character unfinished, or invalid)
    assert "".join(shape["tokens"][len(prompt) :]) == completion.text
    offsets = [sum(map(len, shape["tokens"][:i])) for i in range(len(ids))]
    assert shape["text_offset"] == offsets
    for i in range(1, len(ids)):
        top, candidates = shape["top_logprobs"][i], positions[i]
        assert len(top) == len(candidates), "one key per alternative"
        assert top[shape["tokens"][i]] == shape["token_logprobs"][i] == candidates[ids[i]].logprob
        texts = {t: text_in_context(stories_tokenizer, ids[:i], t) for t in candidates}
        for t, entry in candidates.items():
            if texts[t] is None:  # no text is right (see text_in_context): the rule for
                texts[t] = entry.decoded_token  # keys still holds on the engine's text
            rivals = [u for u in candidates if u != t and texts[u] == texts[t]]
            # Among tokens sharing a text, the token at the position keeps it, else the most
            # likely; the others are spelled by id (protocol.distinct_texts).
            owner = (
                ids[i]
                if ids[i] in rivals + [t]
                else min(rivals + [t], key=lambda u: (-candidates[u].logprob, u))
            )
            key = texts[t] if t == owner else f"token_id:{t}"
            assert top[key] == entry.logprob, (i, t, key, top)
