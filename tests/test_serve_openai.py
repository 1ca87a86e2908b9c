"""The OpenAI API as clients use it: batches of prompts, and the fields clients read.

* ``prompt`` as a batch on ``/v1/completions`` (a list of strings, a list of token-id lists;
  lm-evaluation-harness sends ``--batch_size`` prompts per request): choice ``p * n + i`` is
  sample ``i`` of prompt ``p``, whole or streamed, the usage counts every prompt, scoring
  (``echo`` + ``logprobs`` + ``max_tokens: 0``) works per prompt, and a bad prompt refuses the
  whole batch with nothing queued;
* ``created`` is each response's own time, ``GET /v1/models/{id}``, ``system_fingerprint``,
  chat's ``refusal: null``, ``usage: null`` on every streamed chunk before the last.

One live stories260K server (pure-Python backend), spoken to with the official ``openai``
client, and with raw httpx where the client hides whether a field is null or missing (it
reads both as None). The oracle for a batch is each prompt alone: offline ``LLM.generate``
with the same parameters, or the same server with one prompt per request.
"""

import json
import time
from pathlib import Path

import pytest
from conftest import require_module

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine
from mie.engine.tokenizer import Tokenizer

httpx = require_module("httpx")
openai = require_module("openai")
serve = require_module("mie.serve")  # the server stack: starlette, uvicorn
build_app, serve_in_thread = serve.build_app, serve.serve_in_thread
from mie.serve.app import system_fingerprint  # noqa: E402
from mie.serve.protocol import MAX_CHOICES  # noqa: E402

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
MODEL = "stories260K"
TIMEOUT = 60.0
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The cat"]
CHAT = [{"role": "user", "content": "Tell me about a cat."}]


class Server:
    """A live server, its engine (to look at what was queued), an offline oracle, clients."""

    def __init__(self, url: str, engine: LLMEngine):
        self.url, self.engine = url, engine
        self.started = time.time()
        self.llm = LLM(STORIES, backend="python", num_blocks=256)
        self.tokenizer = Tokenizer(STORIES)
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
        )

    def offline(self, prompt, **params):
        return self.llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=TIMEOUT)

    def events(self, path: str, body: dict) -> list[dict]:
        """A streamed answer's events as JSON, raw (``[DONE]`` checked and left out)."""
        with httpx.stream(
            "POST", self.url + path, json={**body, "stream": True}, timeout=TIMEOUT
        ) as response:
            assert response.status_code == 200, response.read()
            data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return [json.loads(d) for d in data[:-1]]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(STORIES, backend="python", num_blocks=512, max_num_seqs=32)
    with serve_in_thread(build_app(engine, STORIES)) as url:
        yield Server(url, engine)


# -- prompt batches ---------------------------------------------------------------------------
def test_a_batch_answers_each_prompt_as_choice_prompt_times_n_plus_sample(server):
    params = {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 8}
    response = server.client.completions.create(model=MODEL, prompt=PROMPTS, **params)
    assert [c.index for c in response.choices] == list(range(len(PROMPTS) * 2))
    prompt_tokens = completion_tokens = 0
    for p, prompt in enumerate(PROMPTS):
        expected = server.offline(prompt, **params)
        for i, sample in enumerate(expected.outputs):
            choice = response.choices[p * 2 + i]
            assert (choice.text, choice.finish_reason) == (sample.text, sample.finish_reason)
            completion_tokens += len(sample.token_ids)
        prompt_tokens += len(expected.prompt_token_ids)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == completion_tokens


def test_batches_of_token_ids_and_one_token_id_list_answer_as_the_texts(server):
    ids = [server.tokenizer.encode(p) for p in PROMPTS]

    def texts(prompt) -> list[str]:
        response = server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0
        )
        return [c.text for c in response.choices]

    by_text = texts(PROMPTS)
    assert len(by_text) == len(PROMPTS)
    assert texts(ids) == by_text
    assert [texts(one)[0] for one in ids] == by_text  # one token-id list: one prompt
    assert [texts([one])[0] for one in PROMPTS] == by_text  # a batch of one


def test_a_streamed_batch_indexes_every_chunk_and_adds_up_to_the_whole_answer(server):
    params = {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 10, "logprobs": 1}
    whole = server.client.completions.create(model=MODEL, prompt=PROMPTS, **params)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = None
    stream = server.client.completions.create(
        model=MODEL, prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **params
    )
    ids = set()
    for chunk in stream:
        ids.add(chunk.id)
        if not chunk.choices:  # the last one
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        assert 0 <= choice.index < len(PROMPTS) * 2
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage
    assert len(ids) == 1  # one response


def test_a_batch_with_best_of_above_n_streams_as_one_event(server):
    """best_of > n is known only at the end, batch or not: the whole answer as one event."""
    body = {
        "model": MODEL,
        "prompt": PROMPTS[:2],
        "n": 2,
        "best_of": 3,
        "temperature": 1.0,
        "seed": 9,
        "max_tokens": 6,
    }
    whole = server.post("/v1/completions", body).json()
    (event,) = server.events("/v1/completions", body)
    assert [c["index"] for c in event["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in event["choices"]] == [c["text"] for c in whole["choices"]]
    assert event["usage"] == whole["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_scoring_a_batch_scores_each_prompt_as_alone(server, stream):
    """lm-evaluation-harness's log-likelihood request: ``echo``, ``logprobs``, ``max_tokens:
    0`` over a batch of texts of different lengths."""
    params = {"echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}

    def scores(prompt) -> dict[int, dict]:
        if not stream:
            response = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, **params})
            assert response.status_code == 200, response.text
            return {c["index"]: c for c in response.json()["choices"]}
        choices: dict[int, dict] = {}
        for event in server.events("/v1/completions", {"model": MODEL, "prompt": prompt, **params}):
            (piece,) = event["choices"]
            choice = choices.setdefault(piece["index"], {"text": "", "logprobs": {}})
            choice["text"] += piece["text"]
            for key, values in (piece["logprobs"] or {}).items():
                choice["logprobs"].setdefault(key, []).extend(values)
        return choices

    batch = scores(PROMPTS)
    assert sorted(batch) == list(range(len(PROMPTS)))
    for p, prompt in enumerate(PROMPTS):
        (alone,) = scores(prompt).values()
        assert batch[p]["text"] == alone["text"] == prompt
        ours, theirs = batch[p]["logprobs"], alone["logprobs"]
        assert (ours["tokens"], ours["text_offset"]) == (theirs["tokens"], theirs["text_offset"])
        # The same numbers, up to float32 rounding: batched with other prompts, a row's
        # matrix products may sum in another order.
        assert ours["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], abs=1e-5)
        pairs = zip(ours["top_logprobs"][1:], theirs["top_logprobs"][1:], strict=True)
        for top, alone_top in pairs:
            assert top == pytest.approx(alone_top, abs=1e-5)
        assert batch[p]["logprobs"]["token_logprobs"][0] is None  # BOS: no context
        assert len(batch[p]["logprobs"]["tokens"]) == len(server.tokenizer.encode(prompt))


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (["Once", ""], "'prompt[1]' is empty"),  # refused while reading the request
        ([[1, 400], [1, 99999], [1]], "prompt[1]: token id 99999 is outside the vocabulary"),
        (["Once", "x " * 150], "prompt[1]: prompt (302 tokens) + max_tokens"),  # the engine's
        (["Once"] * (MAX_CHOICES + 1), "are allowed per request"),
    ],
)
def test_a_bad_prompt_refuses_the_whole_batch_with_nothing_queued(server, prompt, words):
    arrivals = server.engine._num_arrivals  # what seeds later unseeded requests
    response = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 300})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and words in error["message"], error
    assert server.engine._num_arrivals == arrivals
    assert server.engine.num_unfinished_requests == 0
    ok = server.client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=2)
    assert len(ok.choices) == 2


def test_a_batch_is_bounded_with_its_samples(server):
    """prompts x best_of <= 128 as read (like one request's samples), and then the engine's
    share: one client's batch takes at most half the sequence slots, as one request may."""
    body = {"model": MODEL, "prompt": ["Hi"] * 33, "n": 2, "best_of": 4, "max_tokens": 1}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "prompt_limit"
    share = server.engine.max_samples_per_request  # 16 of the server's 32 slots
    over = server.post("/v1/completions", {**body, "prompt": ["Hi"] * (share // 4 + 1)})
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "prompt_limit"
    assert f"at most {share} are allowed per request" in error["message"]
    assert server.engine.num_unfinished_requests == 0
    ok = server.post("/v1/completions", {**body, "prompt": ["Hi"] * (share // 4)})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == share // 2


# -- the fields clients read --------------------------------------------------------------------
def test_created_is_each_responses_own_time(server):
    while int(time.time()) <= int(server.started):  # a second later than the server's start
        time.sleep(0.05)
    before = int(time.time())
    completion = server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    chat = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    chunks = list(
        server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True)
    )
    after = int(time.time())
    for created in (completion.created, chat.created, *(c.created for c in chunks)):
        assert before <= created <= after
    assert len({c.created for c in chunks}) == 1  # one stream, one time (as OpenAI's)


def test_models_answers_the_model_by_id_and_404_for_any_other(server):
    model = server.client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "mie")
    assert model.model_dump() == server.client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        server.client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"
    raw = httpx.get(f"{server.url}/v1/models/org/some-model", timeout=TIMEOUT)
    assert raw.status_code == 404
    error = raw.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "'org/some-model'" in error["message"]


def test_system_fingerprint_names_the_setup_in_every_response_and_chunk(server):
    fingerprint = system_fingerprint(server.engine)
    assert fingerprint.startswith("fp_") and len(fingerprint) == 15
    client = server.client
    seen = [
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).system_fingerprint,
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).system_fingerprint,
    ]
    for stream in (
        client.completions.create(
            model=MODEL,
            prompt=["Hi", "Yo"],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        ),
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True),
    ):
        seen += [chunk.system_fingerprint for chunk in stream]
    assert set(seen) == {fingerprint}
    # The same setup: the same string (another start, another replica); another: another.
    assert system_fingerprint(LLMEngine(STORIES, backend="python", num_blocks=8)) == fingerprint
    other = LLMEngine(STORIES, backend="python", num_blocks=8, kv_cache_dtype="float16")
    assert system_fingerprint(other) != fingerprint


def test_chat_messages_carry_a_null_refusal(server):
    response = server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 3, "n": 2, "temperature": 1},
    )
    for choice in response.json()["choices"]:
        assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
    events = server.events(
        "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3}
    )
    first = events[0]["choices"][0]["delta"]  # as OpenAI's: role, empty content, refusal
    assert first == {"role": "assistant", "content": "", "refusal": None}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_with_include_usage_every_chunk_before_the_last_has_null_usage(server, path):
    body = {"model": MODEL, "max_tokens": 4, "n": 2, "temperature": 1, "seed": 3}
    body.update({"prompt": PROMPTS[:2]} if "chat" not in path else {"messages": CHAT})
    events = server.events(path, {**body, "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert len(chunks) > 2
    for chunk in chunks:
        assert "usage" in chunk and chunk["usage"] is None, chunk
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    # Without it, no chunk has the key (as OpenAI's).
    assert all("usage" not in chunk for chunk in server.events(path, body))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_counts_every_chunks_choice_so_far(server, path):
    # vLLM's stream_options.continuous_usage_stats: each chunk's usage is the request's
    # prompt tokens and its choice's tokens so far; the last chunk has the totals.
    body = {"model": MODEL, "max_tokens": 6, "n": 2, "temperature": 1, "seed": 5}
    body.update({"prompt": PROMPTS[0]} if "chat" not in path else {"messages": CHAT})
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = server.events(path, {**body, "stream_options": options})
    whole = server.post(path, body).json()
    so_far = {0: 0, 1: 0}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
        assert usage["completion_tokens"] >= so_far[choice["index"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        so_far[choice["index"]] = usage["completion_tokens"]
    assert (
        sum(so_far.values())
        == whole["usage"]["completion_tokens"]
        == last["usage"]["completion_tokens"]
    )


def test_continuous_usage_counts_each_choices_own_prompt_and_nothing_for_a_score(server):
    # A batch: each chunk counts its own prompt's tokens (vLLM's rule), the last all of
    # them; scoring a text (echo, max_tokens 0) generates nothing, on every chunk too.
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 3, "stream_options": options}
    *chunks, last = server.events("/v1/completions", body)
    counts = [server.tokenizer.encode(p) for p in PROMPTS[:2]]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert chunk["usage"]["prompt_tokens"] == len(counts[choice["index"]])
    assert last["usage"]["prompt_tokens"] == sum(map(len, counts))
    score = {**body, "prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 0}
    for chunk in server.events("/v1/completions", score):
        assert chunk["usage"]["completion_tokens"] == 0


# -- /tokenize and /detokenize (vLLM's) ----------------------------------------------------------
def test_tokenize_and_detokenize_agree_with_transformers_and_with_usage(server):
    hf = require_module("transformers").AutoTokenizer.from_pretrained(STORIES)
    for text in ["Once upon a time", 'Lily said, "Hi!" 😀 é', " two  spaces"]:
        for special in (True, False):
            body = {"model": MODEL, "prompt": text, "add_special_tokens": special}
            got = server.post("/tokenize", body).json()
            expected = hf.encode(text, add_special_tokens=special)
            assert got["tokens"] == expected and got["count"] == len(expected)
            assert got["max_model_len"] == server.engine.max_model_len
            back = server.post("/detokenize", {"model": MODEL, "tokens": expected}).json()
            assert back == {"prompt": hf.decode(expected)}  # special tokens kept, as vLLM
    # A chat: the tokens /v1/chat/completions computes, which its usage counts.
    counted = server.post("/tokenize", {"model": MODEL, "messages": CHAT}).json()["count"]
    answer = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert counted == answer.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "return_token_strs": True}, 400, None),
        ("/detokenize", {"model": MODEL, "tokens": [1, 512]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [1, True]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_bodies_naming_the_field(
    server, path, body, status, param
):
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == (param or next(k for k in body if k not in ("model", "prompt")))
