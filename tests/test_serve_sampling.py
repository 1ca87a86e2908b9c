"""The sampling request surface over HTTP: n, best_of, log-probabilities, echo, penalties.

One live stories260K server for the module (pure-Python backend, as in test_serve.py), spoken
to with the official ``openai`` client; one more, briefly, on the fast backend. The oracle for
every answer is offline ``LLM.generate`` with the same parameters (itself checked against
transformers by the engine's tests): the same seed gives the same tokens, and the
log-probabilities are the same numbers. Scoring a text (``echo`` with ``max_tokens: 0``) is
also checked against transformers' own log-softmax.
"""

import json
import math
import time
from pathlib import Path

import pytest
from conftest import require_fast, require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine
from mie.engine.tokenizer import Tokenizer

httpx = require_module("httpx")
openai = require_module("openai")
torch = require_module("torch")
transformers = require_module("transformers")
serve = require_module("mie.serve")  # the server stack: starlette, uvicorn
build_app, serve_in_thread = serve.build_app, serve.serve_in_thread

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
MODEL = "stories260K"
TIMEOUT = 60.0
PROMPT = "Once upon a time"
CHAT_MESSAGES = [{"role": "user", "content": "Tell me about a cat."}]
CHAT_PROMPT = "User: Tell me about a cat.\nAssistant:"  # the default template's rendering

torch.set_num_threads(1)


class Server:
    """A live server, its offline oracle (same backend), and clients."""

    def __init__(self, url: str, backend: str):
        self.url = url
        self.llm = LLM(STORIES, backend=backend, num_blocks=512)
        self.tokenizer = Tokenizer(STORIES)
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
        )

    def offline(self, prompt, **params):
        return self.llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=TIMEOUT)

    def token_text(self, token_id: int, logprob=None) -> str:
        """How the server spells a token in log-probabilities: the engine's text in context,
        else (the prompt's first token) its text at the start of a text ("" for BOS)."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])


def start(backend: str, **engine_args):
    engine = LLMEngine(STORIES, backend=backend, num_blocks=512, max_num_seqs=32, **engine_args)
    return serve_in_thread(build_app(engine, STORIES))


@pytest.fixture(scope="module")
def server():
    with start("python") as url:
        yield Server(url, "python")


def completion_params(**params) -> dict:
    """The wire's fields for offline ``SamplingParams`` (logit_bias keys as strings)."""
    wire = dict(params)
    if "logit_bias" in wire:
        wire["logit_bias"] = {str(k): v for k, v in wire["logit_bias"].items()}
    return wire


def extra(wire: dict) -> tuple[dict, dict]:
    """Split fields the openai client knows from vLLM's extensions (sent as extra_body)."""
    known = {
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "n",
        "best_of",
        "logprobs",
        "echo",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "stop",
        "stream",
        "stream_options",
        "top_logprobs",
    }
    return (
        {k: v for k, v in wire.items() if k in known},
        {k: v for k, v in wire.items() if k not in known},
    )


def create(server: Server, *, chat: bool = False, prompt: str = PROMPT, **params):
    known, extension = extra(completion_params(**params))
    if chat:
        return server.client.chat.completions.create(
            model=MODEL, messages=CHAT_MESSAGES, extra_body=extension, **known
        )
    return server.client.completions.create(
        model=MODEL, prompt=prompt, extra_body=extension, **known
    )


# -- the sampling knobs -------------------------------------------------------------------------
knobs = st.fixed_dictionaries(
    {"seed": st.integers(0, 2**32), "max_tokens": st.integers(1, 40)},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, 1.3]),
        "top_k": st.sampled_from([-1, 0, 1, 5, 40]),
        "top_p": st.sampled_from([0.5, 0.9, 1.0]),
        "min_p": st.sampled_from([0.0, 0.05, 0.3]),
        "presence_penalty": st.sampled_from([-1.0, 0.0, 0.8, 2.0]),
        "frequency_penalty": st.sampled_from([-0.5, 0.0, 1.5]),
        "repetition_penalty": st.sampled_from([0.8, 1.0, 1.3]),
        "min_tokens": st.integers(0, 10),
        "logit_bias": st.dictionaries(
            st.integers(0, 511), st.sampled_from([-100, -3, 5, 100]), max_size=3
        ),
        "allowed_token_ids": st.sampled_from([list(range(256, 512)), [2, 300, 317, 410]]),
        "bad_words": st.sampled_from([["Lily"], ["the", "a big"]]),
        "stop": st.sampled_from([["."], [" the", "!"]]),
        "include_stop_str_in_output": st.booleans(),
    },
)


@settings(max_examples=25, deadline=None)
@given(params=knobs, chat=st.booleans())
def test_every_sampling_knob_gives_the_offline_answer(server, params, chat):
    params["min_tokens"] = min(params.get("min_tokens", 0), params["max_tokens"])
    expected = server.offline(CHAT_PROMPT if chat else PROMPT, **params).outputs[0]
    got = create(server, chat=chat, **params)
    text = got.choices[0].message.content if chat else got.choices[0].text
    assert text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    assert got.choices[0].stop_reason == expected.stop_reason
    assert got.usage.completion_tokens == len(expected.token_ids)


def test_skip_special_tokens_false_shows_them_as_offline(server):
    # Past the story's end (ignore_eos) greedy draws "<s>": shown only when asked.
    params = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    for skip in (True, False):
        expected = server.offline(PROMPT, skip_special_tokens=skip, **params).outputs[0]
        got = create(server, skip_special_tokens=skip, **params).choices[0]
        assert got.text == expected.text and ("<s>" in got.text) == (not skip)


def test_truncate_prompt_tokens_keeps_the_tail_and_usage_counts_it(server):
    text = "Once upon a time, there was a little girl named Lily. " * 60  # > the context
    expected = server.offline(text, temperature=0, max_tokens=6, truncate_prompt_tokens=30)
    got = create(server, prompt=text, temperature=0, max_tokens=6, truncate_prompt_tokens=30)
    assert got.choices[0].text == expected.outputs[0].text
    assert got.usage.prompt_tokens == 30
    chat = create(server, chat=True, temperature=0, max_tokens=6, truncate_prompt_tokens=5)
    assert chat.usage.prompt_tokens == 5
    refused = server.post("/v1/completions", {**GOOD, "truncate_prompt_tokens": 10_000})
    assert refused.status_code == 400 and "truncate_prompt_tokens" in refused.text


def test_logit_bias_takes_token_ids_as_string_keys(server):
    # +100 on one token makes it the greedy choice every time: an oracle of its own.
    token = server.tokenizer.encode(" cat", add_special_tokens=False)[-1]
    got = create(server, max_tokens=5, temperature=0, logit_bias={token: 100}, ignore_eos=True)
    assert got.choices[0].text == server.tokenizer.decode([token] * 5)


# -- n and best_of --------------------------------------------------------------------------------
def test_n_choices_are_the_offline_samples_and_usage_counts_them_all(server):
    params = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 30}
    expected = server.offline(PROMPT, **params)
    got = create(server, **params)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [o.text for o in expected.outputs]
    assert len({c.text for c in got.choices}) > 1, "the samples must differ"
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in expected.outputs)
    chat = create(server, chat=True, **params)
    expected = server.offline(CHAT_PROMPT, **params)
    assert [c.message.content for c in chat.choices] == [o.text for o in expected.outputs]


def test_best_of_returns_the_n_most_likely_samples(server):
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 12}
    every = server.offline(PROMPT, n=4, logprobs=0, **params).outputs
    # The oracle: rank all four samples by the sum of their tokens' log-probabilities.
    total = [
        sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)) for o in every
    ]
    best = sorted(range(4), key=lambda i: -total[i])[:2]
    got = create(server, n=2, best_of=4, **params)
    assert [c.text for c in got.choices] == [every[i].text for i in best]
    assert [c.index for c in got.choices] == [0, 1]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in every)
    offline = server.offline(PROMPT, n=2, best_of=4, **params)
    assert sorted(c.text for c in got.choices) == sorted(o.text for o in offline.outputs)
    # Streaming cannot show the best before the end: one event with the whole answer.
    events = list(create(server, n=2, best_of=4, stream=True, **params))
    assert len(events) == 1 and [c.text for c in events[0].choices] == [c.text for c in got.choices]


def test_streamed_choices_carry_their_index_and_usage_counts_all(server):
    params = {"n": 3, "temperature": 0.9, "seed": 3, "max_tokens": 25}
    expected = server.offline(PROMPT, **params).outputs
    chunks = list(create(server, stream=True, stream_options={"include_usage": True}, **params))
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [o.text for o in expected]
    assert finish == [o.finish_reason for o in expected]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    chat = list(create(server, chat=True, stream=True, **params))
    expected = server.offline(CHAT_PROMPT, **params).outputs
    texts, roles = ["", "", ""], set()
    for chunk in chat:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.add(choice.index)
    assert texts == [o.text for o in expected] and roles == {0, 1, 2}


def metrics(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    return {
        name: float(value)
        for line in text.splitlines()
        if line and line[0] != "#"
        for name, value in [line.rsplit(" ", 1)]
    }


def pool_is_whole_once_idle(server: Server) -> bool:
    """Once nothing runs or waits: every block free or held by the prefix cache alone."""
    deadline = time.monotonic() + 30
    while (m := metrics(server))["mie_num_requests_running"] or m["mie_num_requests_waiting"]:
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.02)
    return (
        m["mie_kv_cache_blocks_free"] + m["mie_prefix_cache_blocks"]
        == (m["mie_kv_cache_blocks_total"])
    )


def test_a_client_leaving_a_stream_of_n_choices_frees_every_sample(server):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "n": 4,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "seed": 1,
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT
    ) as response:
        events = (json.loads(x[6:]) for x in response.iter_lines() if x.startswith("data: {"))
        indices = {next(events)["choices"][0]["index"] for _ in range(12)}
    assert indices == {0, 1, 2, 3}, "every sample streams from the start"
    assert pool_is_whole_once_idle(server)


def first_stop(text: str, stop: str) -> str:
    return text[: text.index(stop)] if stop in text else text


def test_each_choice_ends_at_its_own_stop_string(server):
    params = {"n": 4, "temperature": 1.0, "seed": 21, "max_tokens": 40}
    expected = server.offline(PROMPT, **params).outputs
    got = create(server, stop=["."], **params)
    assert [c.text for c in got.choices] == [first_stop(o.text, ".") for o in expected]
    stopped = [c.finish_reason == "stop" for c in got.choices]
    assert any(stopped), "at least one sample says something and a full stop"
    streamed = ["", "", "", ""]
    for chunk in create(server, stop=["."], stream=True, **params):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in got.choices]
    assert pool_is_whole_once_idle(server)


def test_a_choice_ended_by_its_stop_string_is_computed_no_more(server):
    # Three choices; one says a full stop after a few tokens, the others not within
    # max_tokens. The stopped sample leaves the engine's batches at once: the engine generates
    # exactly the tokens the clients get (/metrics counts them), not the stopped choice's
    # max_tokens too.
    params = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 16}
    offline = server.offline(PROMPT, **params).outputs

    def tokens_to_stop(token_ids: list[int]) -> int:  # the tokens until "." is in the text
        ends = (
            k for k in range(1, len(token_ids) + 1) if "." in server.tokenizer.decode(token_ids[:k])
        )
        return next(ends, len(token_ids))

    kept = [tokens_to_stop(o.token_ids) for o in offline]
    assert sorted(kept) == [kept[0], 16, 16] and kept[0] < 12, "choice 0 stops early, alone"
    assert pool_is_whole_once_idle(server)
    generated = metrics(server)["mie_generation_tokens_total"]
    got = create(server, stop=["."], **params)
    assert [c.text for c in got.choices] == [first_stop(o.text, ".") for o in offline]
    assert [c.finish_reason for c in got.choices] == ["stop", "length", "length"]
    assert got.usage.completion_tokens == sum(kept)
    assert pool_is_whole_once_idle(server)
    assert metrics(server)["mie_generation_tokens_total"] - generated == sum(kept)
    # Streamed: the same pieces, the same work.
    generated = metrics(server)["mie_generation_tokens_total"]
    streamed = ["", "", ""]
    for chunk in create(server, stop=["."], stream=True, **params):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in got.choices]
    assert pool_is_whole_once_idle(server)
    assert metrics(server)["mie_generation_tokens_total"] - generated == sum(kept)


def test_best_of_ranks_the_samples_as_cut_by_their_stop_strings(server):
    # Every sample, cut at its stop string, with its tokens' log-probabilities: each is a
    # prefix of the offline sample; best_of must pick the one whose kept tokens sum highest.
    params = {"temperature": 1.0, "seed": 0, "max_tokens": 40}
    offline = server.offline(PROMPT, n=5, logprobs=0, **params).outputs
    every = create(server, n=5, logprobs=0, stop=[" the"], **params).choices
    totals = []
    for choice, out in zip(every, offline, strict=True):
        kept = len(choice.logprobs.token_logprobs)
        # Within float32 rounding: once a sample stops, the server's batches are smaller
        # than the offline run's, and a batch's matrix products round a little differently.
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp[t].logprob for t, lp in zip(out.token_ids[:kept], out.logprobs, strict=False)],
            abs=1e-6,
        )
        totals.append(sum(choice.logprobs.token_logprobs))
    assert any(c.finish_reason == "stop" for c in every), "a stop string cut some sample"
    (best,) = create(server, n=1, best_of=5, stop=[" the"], **params).choices
    assert best.text == every[max(range(5), key=lambda i: totals[i])].text
    # Ranked on the whole samples instead, another one would win: the cut matters here.
    whole = [
        sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)) for o in offline
    ]
    assert max(range(5), key=lambda i: whole[i]) != max(range(5), key=lambda i: totals[i])


# -- log-probabilities --------------------------------------------------------------------------
def assert_completion_logprobs(server, logprobs, token_ids, expected, k):
    """The legacy shape against the engine's ``{token: Logprob}`` per position."""
    offset = 0
    for i, (token, candidates) in enumerate(zip(token_ids, expected, strict=True)):
        text = server.token_text(token, None if candidates is None else candidates[token])
        assert logprobs.tokens[i] == text
        assert logprobs.text_offset[i] == offset
        offset += len(text)
        if candidates is None:
            assert logprobs.token_logprobs[i] is None and logprobs.top_logprobs[i] is None
            continue
        assert logprobs.token_logprobs[i] == pytest.approx(candidates[token].logprob, abs=1e-6)
        top = logprobs.top_logprobs[i]
        assert len(top) == len(candidates) and k <= len(top) <= k + 1  # the token + top k
        for t, lp in candidates.items():
            assert top[server.token_text(t, lp)] == pytest.approx(lp.logprob, abs=1e-6)
        values = list(top.values())
        assert values == sorted(values, reverse=True), "most likely first"


def test_completion_logprobs_are_the_offline_ones(server):
    params = {"temperature": 0.8, "seed": 9, "max_tokens": 20, "logprobs": 3}
    expected = server.offline(PROMPT, **params).outputs[0]
    got = create(server, **params).choices[0]
    assert got.text == expected.text
    assert_completion_logprobs(server, got.logprobs, expected.token_ids, expected.logprobs, 3)
    # Streamed, the pieces add up to the same lists (text_offset runs on across chunks).
    chunks = list(create(server, stream=True, **params))
    whole = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for chunk in chunks:
        for key in whole:
            whole[key] += getattr(chunk.choices[0].logprobs, key)
    assert whole == got.logprobs.model_dump()


def test_return_tokens_as_token_ids_spells_every_token_by_its_id(server):
    # vLLM's field: each token and each alternative is "token_id:<id>", completions and chat.
    params = {"temperature": 0.8, "seed": 9, "max_tokens": 8, "logprobs": 2}
    expected = server.offline(PROMPT, **params).outputs[0]
    got = create(server, return_tokens_as_token_ids=True, **params).choices[0]
    assert got.logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    for alternatives, candidates in zip(got.logprobs.top_logprobs, expected.logprobs, strict=True):
        assert set(alternatives) == {f"token_id:{t}" for t in candidates}
    chat_expected = server.offline(CHAT_PROMPT, **params).outputs[0]
    chat = create(
        server,
        chat=True,
        return_tokens_as_token_ids=True,
        top_logprobs=2,
        **{**params, "logprobs": True},
    ).choices[0]
    spelled = [entry.token for entry in chat.logprobs.content]
    assert spelled == [f"token_id:{t}" for t in chat_expected.token_ids]


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_logprobs_in_vllms_shape_are_the_offline_ones(server, chat):
    # vLLM's extension: the top k of every prompt position (None for the first), on each
    # completion choice, or beside a chat's choices.
    expected = server.offline(CHAT_PROMPT if chat else PROMPT, max_tokens=3, prompt_logprobs=2)
    response = server.post(
        "/v1/chat/completions" if chat else "/v1/completions",
        {
            "model": MODEL,
            **({"messages": CHAT_MESSAGES} if chat else {"prompt": PROMPT}),
            "max_tokens": 3,
            "prompt_logprobs": 2,
            "n": 2,
            "seed": 1,
        },
    ).json()
    wires = (
        [response["prompt_logprobs"]]
        if chat
        else [c["prompt_logprobs"] for c in response["choices"]]
    )
    for wire in wires:
        assert wire[0] is None and len(wire) == len(expected.prompt_token_ids)
        for position, candidates in zip(wire[1:], expected.prompt_logprobs[1:], strict=True):
            assert {int(t) for t in position} == set(candidates)
            for t, lp in candidates.items():
                got = position[str(t)]
                assert got["rank"] == lp.rank and got["decoded_token"] == lp.decoded_token
                assert got["logprob"] == pytest.approx(lp.logprob, abs=1e-6)


def test_echo_puts_the_prompt_and_its_logprobs_first(server):
    params = {"temperature": 0.8, "seed": 4, "max_tokens": 6, "logprobs": 2}
    expected = server.offline(PROMPT, prompt_logprobs=2, **params)
    got = create(server, echo=True, **params).choices[0]
    out = expected.outputs[0]
    assert got.text == PROMPT + out.text
    assert_completion_logprobs(
        server,
        got.logprobs,
        expected.prompt_token_ids + out.token_ids,
        expected.prompt_logprobs + out.logprobs,
        2,
    )
    streamed = list(create(server, echo=True, stream=True, **params))
    assert "".join(c.choices[0].text for c in streamed) == got.text
    assert sum((c.choices[0].logprobs.tokens for c in streamed), []) == got.logprobs.tokens


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt", [PROMPT, [1, 403, 407, 2, 403, 407, 298], "日本"])
@pytest.mark.parametrize("truncate", [None, 2])
def test_echoed_text_is_what_the_echoed_tokens_spell(server, skip, prompt, truncate):
    # A truncated prompt (its kept tail), token ids, special tokens shown: the echoed text is
    # transformers' decode of the tokens computed (less the bytes of a character the cut
    # split, which no token spells), the tokens' texts add up to it, and each text_offset
    # points at its token. "日本" is byte tokens: truncated, it starts inside a character.
    hf = transformers.AutoTokenizer.from_pretrained(STORIES)
    ids = hf.encode(prompt) if isinstance(prompt, str) else prompt
    kept = ids[-truncate:] if truncate else ids
    params = {"temperature": 0, "max_tokens": 4, "logprobs": 0, "skip_special_tokens": skip}
    got = create(server, prompt=prompt, echo=True, truncate_prompt_tokens=truncate, **params)
    choice = got.choices[0]
    if isinstance(prompt, str) and not truncate and skip:
        echoed = prompt  # as given
    else:
        echoed = hf.decode(kept, skip_special_tokens=skip).lstrip("\ufffd")
    assert choice.text.startswith(echoed) and got.usage.prompt_tokens == len(kept)
    assert ("</s>" in choice.text) == (not skip and 2 in kept)
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert "".join(tokens) == choice.text
    assert all(choice.text[o:].startswith(t) for t, o in zip(tokens, offsets, strict=True))


def transformers_prompt_logprobs(token_ids: list[int]) -> list[float]:
    """log P(token i | tokens before it) for i >= 1, from transformers' own forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, token_ids[i]].item() for i in range(1, len(token_ids))]


def test_echo_with_max_tokens_0_scores_a_text_as_evaluation_harnesses_do(server):
    text = "Once upon a time there was a little cat"
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    (choice,) = answer["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
    ids = server.tokenizer.encode(text)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None  # the first token has no context
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        transformers_prompt_logprobs(ids), abs=1e-4
    )
    offline = server.offline(text, prompt_logprobs=1, max_tokens=1, temperature=0)
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        [lp[t].logprob for t, lp in zip(ids[1:], offline.prompt_logprobs[1:], strict=True)],
        abs=1e-6,
    )
    # The same through a stream: the prompt and its scores, then the finish.
    chunks = list(
        create(server, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    scores = sum((c.choices[0].logprobs.token_logprobs for c in chunks), [])
    assert scores == logprobs["token_logprobs"]


def transformers_next_logprobs(token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax for the token after ``token_ids``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0, -1].double(), -1)


def test_is_greedy_tells_a_leading_space_apart(server):
    """lm-evaluation-harness scores a continuation with ``echo``, ``max_tokens: 1`` and
    ``logprobs: 1``, and calls it greedy when at each of its positions the token is the most
    likely (its key is the argmax's, or its log-probability is the top one). After "Lily
    built a big sand" stories260K's most likely token is ``c``; the continuation " c" is
    ``▁c``. Both decode alone to "c": keyed so, the continuation's value overwrote the
    argmax's and lm-eval called " c" greedy. In context they are " c" and "c"."""
    context = server.tokenizer.encode("Lily built a big sand")
    hf = transformers_next_logprobs(context)
    argmax = int(hf.argmax())
    space_c = server.tokenizer.encode(" c", add_special_tokens=False)[-1]
    assert server.tokenizer.decode([argmax]) == server.tokenizer.decode([space_c]) == "c"
    assert argmax != space_c  # the oracle: " c" is not greedy, "c" is

    def score(continuation: int):
        ids = context + [continuation]
        got = server.client.completions.create(
            model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
        )
        logprobs = got.choices[0].logprobs
        top = logprobs.top_logprobs[len(context)]
        token, value = logprobs.tokens[len(context)], logprobs.token_logprobs[len(context)]
        assert "".join(logprobs.tokens[: len(ids)]) == server.tokenizer.decode(ids)
        assert got.choices[0].text.startswith(server.tokenizer.decode(ids))
        assert value == pytest.approx(hf[continuation].item(), abs=1e-4)
        assert top[token] == value
        return token, top, value

    token, top, value = score(space_c)
    assert token == " c" and len(top) == 2, "the continuation and the argmax, apart"
    assert top["c"] == pytest.approx(hf[argmax].item(), abs=1e-4)
    assert max(top, key=top.get) == "c" != token  # is_greedy by key: False
    assert value < max(top.values())  # is_greedy by value (lm-eval 0.4): False
    token, top, value = score(argmax)
    assert token == "c" and len(top) == 1 and max(top, key=top.get) == token  # greedy
    assert value == max(top.values())


def test_chat_logprobs_have_the_chat_shape(server):
    params = {"temperature": 0.7, "seed": 2, "max_tokens": 15}
    expected = server.offline(CHAT_PROMPT, logprobs=3, **params).outputs[0]
    got = create(server, chat=True, logprobs=True, top_logprobs=3, **params).choices[0]
    assert got.message.content == expected.text
    content = got.logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, token, candidates in zip(
        content, expected.token_ids, expected.logprobs, strict=True
    ):
        assert entry.token == server.token_text(token, candidates[token])
        assert entry.logprob == pytest.approx(candidates[token].logprob, abs=1e-6)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        top = sorted(candidates.items(), key=lambda item: -item[1].logprob)[:3]
        assert [a.token for a in entry.top_logprobs] == [server.token_text(t, lp) for t, lp in top]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(
            [lp.logprob for _, lp in top], abs=1e-6
        )
    # Each token's text in context, leading space included: together, the message.
    assert "".join(e.token for e in content) == got.message.content
    assert any(e.token.startswith(" ") for e in content)
    plain = create(server, chat=True, logprobs=True, **params).choices[0]
    assert [e.top_logprobs for e in plain.logprobs.content] == [[]] * len(content)
    streamed = list(create(server, chat=True, logprobs=True, top_logprobs=3, stream=True, **params))
    tokens = [
        e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in content]


# -- refusals -----------------------------------------------------------------------------------
GOOD = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
CHAT = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4}
BAD = [
    # (route, body, param)
    ("completions", {**GOOD, "n": 0}, "n"),
    ("completions", {**GOOD, "n": 129}, "n"),
    ("completions", {**GOOD, "n": 2, "temperature": 0}, "n"),
    ("completions", {**GOOD, "best_of": 2, "temperature": 0}, "best_of"),
    ("completions", {**GOOD, "n": 3, "best_of": 2}, "best_of"),
    ("completions", {**GOOD, "n": "2"}, "n"),
    ("completions", {**GOOD, "logprobs": 21}, "logprobs"),
    ("completions", {**GOOD, "logprobs": -1}, "logprobs"),
    ("completions", {**GOOD, "logprobs": True}, "logprobs"),
    ("completions", {**GOOD, "echo": "yes"}, "echo"),
    ("completions", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("completions", {**GOOD, "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {**GOOD, "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {**GOOD, "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {**GOOD, "min_p": 1.5}, "min_p"),
    ("completions", {**GOOD, "min_tokens": -1}, "min_tokens"),
    ("completions", {**GOOD, "min_tokens": 5}, "min_tokens"),
    ("completions", {**{**GOOD, "max_tokens": None}, "min_tokens": 17}, "min_tokens"),
    ("completions", {**GOOD, "logit_bias": {"cat": 1}}, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary
    ("completions", {**GOOD, "logit_bias": [1]}, "logit_bias"),
    ("completions", {**GOOD, "seed": 2**64}, "seed"),
    ("completions", {**GOOD, "suffix": "x"}, "suffix"),
    ("completions", {**GOOD, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("completions", {**GOOD, "stop": ["x", ""]}, "stop"),
    # vLLM's extensions that would change the answer, which mie does not implement
    ("completions", {**GOOD, "skip_special_tokens": 0}, "skip_special_tokens"),
    ("completions", {**GOOD, "return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ("completions", {**GOOD, "add_special_tokens": "no"}, "add_special_tokens"),
    ("completions", {**GOOD, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {**GOOD, "truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens"),
    ("completions", {**GOOD, "use_beam_search": 1}, "use_beam_search"),
    ("completions", {**GOOD, "allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {**GOOD, "allowed_token_ids": [5, 99999]}, "allowed_token_ids"),
    ("completions", {**GOOD, "bad_words": "cat"}, "bad_words"),
    ("chat/completions", {**CHAT, "bad_words": [""]}, "bad_words"),
    ("completions", {**GOOD, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {**GOOD, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {**GOOD, "prompt_logprobs": 1, "echo": True}, "prompt_logprobs"),
    ("chat/completions", {**CHAT, "chat_template": "{{ 'x' }}"}, "chat_template"),
    ("chat/completions", {**CHAT, "add_generation_prompt": 0}, "add_generation_prompt"),
    ("chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {**CHAT, "logprobs": 2}, "logprobs"),
    ("chat/completions", {**CHAT, "best_of": 2}, "best_of"),
    ("chat/completions", {**CHAT, "echo": "yes"}, "echo"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("completions", {**GOOD, "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {**CHAT, "n": 2, "temperature": 0}, "n"),
    ("chat/completions", {**CHAT, "presence_penalty": -2.01}, "presence_penalty"),
]


def test_every_bad_value_is_a_400_naming_its_field_and_nothing_is_queued(server):
    for route, body, param in BAD:
        response = server.post(f"/v1/{route}", body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error" and error["message"]
    metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert "mie_num_requests_waiting 0" in metrics and "mie_num_requests_running 0" in metrics


def test_the_no_op_values_of_unsupported_fields_are_accepted(server):
    body = {
        **CHAT,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "temperature": 0,
        "add_generation_prompt": True,
        "chat_template_kwargs": {},
        "skip_special_tokens": True,
    }
    assert server.post("/v1/chat/completions", body).status_code == 200
    assert (
        server.post(
            "/v1/completions",
            {
                **GOOD,
                "suffix": "",
                "echo": False,
                "best_of": 1,
                "include_stop_str_in_output": False,
            },
        ).status_code
        == 200
    )


# -- the fast backend ---------------------------------------------------------------------------
def test_fast_backend_serves_n_logprobs_echo_and_penalties_like_offline():
    require_fast()
    with start("fast") as url:
        fast = Server(url, "fast")
        params = {
            "n": 2,
            "temperature": 0.9,
            "seed": 8,
            "max_tokens": 12,
            "logprobs": 2,
            "presence_penalty": 0.5,
            "repetition_penalty": 1.2,
            "min_tokens": 3,
        }
        expected = fast.offline(PROMPT, prompt_logprobs=2, **params)
        got = create(fast, echo=True, **params)
        for choice, out in zip(got.choices, expected.outputs, strict=True):
            assert choice.text == PROMPT + out.text
            assert_completion_logprobs(
                fast,
                choice.logprobs,
                expected.prompt_token_ids + out.token_ids,
                expected.prompt_logprobs + out.logprobs,
                2,
            )
        assert not any(math.isnan(x) for x in got.choices[0].logprobs.token_logprobs[1:])
