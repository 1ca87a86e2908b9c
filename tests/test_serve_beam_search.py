"""Beam search over HTTP (vLLM's ``use_beam_search``), against transformers' beam search.

The server runs stories260K with EOS set to '.' and ',' (test_beam_search's ``stories_eos``:
beams finish at every step, so every rule of the search acts), the pure-Python backend, the
prefix cache on. The oracle is transformers' ``generate(num_beams=n, num_return_sequences=n)``
(``hf_beam_search``) decoded by transformers' tokenizer (the text each beam adds to the
prompt's, as a completion's text is read): each choice's text, its finish
reason and the usage follow from its beam. Then what a request does besides: streamed, chat,
refused fields, a client that leaves mid-search, a step that fails mid-search.
"""

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest
from conftest import require_module
from test_serve import pool_is_whole
from test_serve_lifecycle import FaultyModel, metrics

from mie import BeamSearchParams
from mie.engine.beam_search import BeamSearch
from mie.engine.llm_engine import LLMEngine
from mie.engine.outputs import Logprob
from mie.serve.protocol import APIError

httpx = require_module("httpx")
torch = require_module("torch")
transformers = require_module("transformers")
from test_beam_search import hf_beam_search  # noqa: E402 (needs torch, as above)

serve = require_module("mie.serve")
build_app, serve_in_thread = serve.build_app, serve.serve_in_thread
beam = require_module("mie.serve.beam")
Update = require_module("mie.serve.loop").Update

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
EOS = (426, 432)  # '.' and ','
MODEL = "stories_eos"
TIMEOUT = 60.0
PROMPTS = ["Once upon a time", "The little dog"]


@pytest.fixture(scope="module")
def stories_eos(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stories") / MODEL
    directory.mkdir()
    for f in STORIES.iterdir():
        if f.is_file():
            shutil.copy(f, directory / f.name)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": list(EOS)}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return directory, hf.eval(), tokenizer


@pytest.fixture(scope="module")
def server(stories_eos):
    directory, _, _ = stories_eos
    engine = LLMEngine(directory, backend="python", num_blocks=512, max_num_seqs=16)
    engine.model = FaultyModel(engine.model, engine.scheduler)
    with serve_in_thread(build_app(engine, directory)) as url:
        yield url, engine


def post(url: str, route: str, body: dict, timeout=TIMEOUT) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": MODEL, **body}, timeout=timeout)


def wait_idle(url: str) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        m = metrics(url)
        if m["mie_num_requests_unfinished"] == 0:
            return m
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.02)


def expected_choices(stories_eos, prompt: str, n: int, max_tokens: int, length_penalty: float):
    """transformers' beams of ``prompt`` as choices: (text, finish_reason, tokens generated)."""
    _, hf, tokenizer = stories_eos
    ids = tokenizer(prompt)["input_ids"]
    params = BeamSearchParams(n, max_tokens, length_penalty=length_penalty)
    choices = []
    before = tokenizer.decode(ids, skip_special_tokens=True)
    for tokens, _ in hf_beam_search(hf, ids, params):
        stopped = tokens[-1] in EOS
        shown = ids + (tokens[:-1] if stopped else tokens)
        text = tokenizer.decode(shown, skip_special_tokens=True)[len(before) :]  # in context
        choices.append((text, "stop" if stopped else "length", len(tokens)))
    return choices


@pytest.mark.parametrize(
    "n, max_tokens, length_penalty", [(3, 12, 1.0), (2, 20, 0.0), (4, 8, -0.5)]
)
def test_a_batch_of_prompts_gets_transformers_beams_best_first(
    server, stories_eos, n, max_tokens, length_penalty
):
    url, _ = server
    body = {
        "prompt": PROMPTS,
        "n": n,
        "max_tokens": max_tokens,
        "length_penalty": length_penalty,
        "use_beam_search": True,
        "temperature": 0.7,  # vLLM's beam search takes it and, as here, changes nothing
    }
    answer = post(url, "completions", body)
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    expected = [
        c for p in PROMPTS for c in expected_choices(stories_eos, p, n, max_tokens, length_penalty)
    ]
    choices = answer["choices"]
    assert [c["index"] for c in choices] == list(range(len(PROMPTS) * n))
    assert [(c["text"], c["finish_reason"]) for c in choices] == [(t, f) for t, f, _ in expected]
    assert answer["usage"]["completion_tokens"] == sum(length for _, _, length in expected)
    assert pool_is_whole(wait_idle(url))


def test_streamed_and_chat_answers_are_the_whole_answers(server):
    url, _ = server
    body = {"prompt": PROMPTS[0], "n": 3, "max_tokens": 10, "use_beam_search": True}
    whole = post(url, "completions", body).json()
    events = []
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=TIMEOUT,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    finish = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    assert [finish[i] for i in range(3)] == [c["finish_reason"] for c in whole["choices"]]
    assert chunks[-1]["usage"] == whole["usage"]

    # A chat is a completion of its rendered prompt: the same beams as that prompt's.
    messages = [{"role": "user", "content": "Tell me a story about a cat"}]
    ids = httpx.post(
        url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=TIMEOUT
    ).json()["tokens"]
    beams = {"n": 2, "max_tokens": 10, "use_beam_search": True}
    chat = post(url, "chat/completions", {"messages": messages, **beams}).json()
    completion = post(url, "completions", {"prompt": ids, **beams}).json()
    assert [c["message"]["content"] for c in chat["choices"]] == [
        c["text"] for c in completion["choices"]
    ]
    assert chat["usage"] == completion["usage"]


GOOD = {"prompt": PROMPTS[0], "max_tokens": 5, "n": 2, "use_beam_search": True}
CHAT = {**GOOD, "messages": [{"role": "user", "content": "Hi"}]}
del CHAT["prompt"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
REFUSED = [
    ("completions", {**GOOD, "use_beam_search": "yes"}, "use_beam_search"),
    ("completions", {**GOOD, "length_penalty": "long"}, "length_penalty"),
    ("completions", {**GOOD, "best_of": 3}, "best_of"),
    ("completions", {**GOOD, "echo": True}, "echo"),
    ("completions", {**GOOD, "logprobs": 1}, "logprobs"),
    ("completions", {**GOOD, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {**GOOD, "stop": ["x"]}, "stop"),
    ("completions", {**GOOD, "stop_token_ids": [5]}, "stop_token_ids"),
    ("completions", {**GOOD, "min_tokens": 2}, "min_tokens"),
    ("completions", {**GOOD, "top_p": 0.5}, "top_p"),
    ("completions", {**GOOD, "top_k": 3}, "top_k"),
    ("completions", {**GOOD, "presence_penalty": 1}, "presence_penalty"),
    ("completions", {**GOOD, "repetition_penalty": 1.2}, "repetition_penalty"),
    ("completions", {**GOOD, "logit_bias": {"5": 3}}, "logit_bias"),
    ("completions", {**GOOD, "bad_words": ["cat"]}, "bad_words"),
    ("completions", {**GOOD, "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {**GOOD, "skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {**GOOD, "guided_regex": "a+"}, "guided_regex"),
    ("completions", {**GOOD, "n": 0}, "n"),
    ("completions", {**GOOD, "n": 9}, "n"),  # 8 = half the 16 sequence slots, as samples
    ("chat/completions", {**CHAT, "n": 9}, "n"),
    ("completions", {**GOOD, "temperature": -1}, "temperature"),
    ("completions", {**GOOD, "max_tokens": 600}, "prompt"),  # past the context
    ("chat/completions", {**CHAT, "logprobs": True}, "logprobs"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize(("route", "body", "param"), REFUSED)
def test_what_beam_search_cannot_honour_is_refused_naming_it_with_nothing_run(
    server, route, body, param
):
    url, _ = server
    before = wait_idle(url)
    answer = post(url, route, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    after = wait_idle(url)
    assert after["mie_prompt_tokens_total"] == before["mie_prompt_tokens_total"], "it ran"


def settled(url: str) -> dict[str, float]:
    """Metrics once nothing is unfinished and no token has been generated for a second: a
    beam search between two of its steps has nothing unfinished for a moment (bounded)."""
    deadline = time.monotonic() + 120
    last, since = None, time.monotonic()
    while True:
        m = metrics(url)
        now = (m["mie_generation_tokens_total"], m["mie_num_requests_unfinished"])
        if now != last:
            last, since = now, time.monotonic()
        elif now[1] == 0 and time.monotonic() - since >= 1.0:
            return m
        assert time.monotonic() < deadline, "the server did not settle"
        time.sleep(0.05)


def test_a_client_leaving_mid_search_stops_it_and_frees_every_block(server):
    url, _ = server
    beams, max_tokens = 4, 300
    body = {"prompt": PROMPTS[1], "n": beams, "max_tokens": max_tokens, "ignore_eos": True}
    body["use_beam_search"] = True
    before = settled(url)
    # Non-streamed: the client gives up while the search runs.
    with pytest.raises(httpx.ReadTimeout):
        post(url, "completions", body, timeout=httpx.Timeout(TIMEOUT, read=0.5))
    # Streamed: the beams come at the end; the client hangs up before.
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": MODEL, **body, "stream": True}
    ) as response:
        assert response.status_code == 200
        time.sleep(0.5)
    after = settled(url)
    assert pool_is_whole(after)
    # Run to their ends, the two searches would have generated this many tokens: each step a
    # token per running beam, one beam at the first.
    full = 2 * (1 + beams * (max_tokens - 1))
    generated = after["mie_generation_tokens_total"] - before["mie_generation_tokens_total"]
    assert generated < full, "a search went on after its client left"


def test_a_failed_step_fails_the_search_and_the_server_serves_on(server, stories_eos):
    url, engine = server
    model: FaultyModel = engine.model
    body = {"prompt": PROMPTS[0], "n": 3, "max_tokens": 12, "use_beam_search": True}
    for stream in (False, True):
        wait_idle(url)
        fault = model.calls + 5  # a few steps into the search
        model.fail_at = {fault: RuntimeError}
        if not stream:
            answer = post(url, "completions", body)
            assert answer.status_code == 500, answer.text
            error = answer.json()["error"]
        else:
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                json={"model": MODEL, **body, "stream": True},
                timeout=TIMEOUT,
            ) as response:
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == "engine_step_failed" and "injected fault" in error["message"]
        assert model.calls >= fault
        model.fail_at = {}
        assert pool_is_whole(wait_idle(url))
    expected = expected_choices(stories_eos, PROMPTS[0], 3, 12, 1.0)
    answer = post(url, "completions", body).json()
    assert [c["text"] for c in answer["choices"]] == [t for t, _, _ in expected]


def test_a_later_step_waits_for_a_full_queue_instead_of_failing_the_search():
    """A search under way whose next step meets a full waiting queue (a 503 ``queue_full``)
    asks again until it is taken; another refusal ends the search with that error."""

    class Step:  # one request's stream: the next token's log-probabilities
        def __init__(self, tokens):
            self.row = {t: Logprob(-1.0 - t / 10) for t in range(4)}

        async def __aiter__(self):
            yield Update("", 1, "length", token_ids=(0,), logprobs=(self.row,), final=True)

    async def run(refusals: list[str | None]) -> tuple[list, int]:
        calls = 0

        async def start_all(requests, step):
            nonlocal calls
            calls += 1
            code = refusals.pop(0) if refusals else None
            if code is not None:
                raise APIError(503, "busy", code=code)
            return [Step(tokens) for _, _, tokens in requests]

        search = BeamSearch([1, 2], BeamSearchParams(2, 3), eos_token_ids=())
        text = "{}:{}".format  # (prompt, generated) -> a text
        stream = beam.BeamSearchStream("r", search, None, start_all, lambda s: None, text)
        await stream.start()
        return [u async for u in stream], calls

    updates, calls = asyncio.run(run([None, "queue_full", "queue_full"]))
    assert calls == 5 and [u.finish_reason for u in updates] == ["length", "length"]
    updates, calls = asyncio.run(run([None, "engine_unavailable"]))
    assert calls == 2 and len(updates) == 1 and updates[0].error.status == 503


def test_a_bug_in_the_search_is_a_500_not_a_client_waiting_for_good():
    class Step:
        async def __aiter__(self):
            yield Update("", 1, "length", token_ids=(0,), logprobs=({0: Logprob(-1.0)},))

    async def start_all(requests, step):
        return [Step() for _ in requests]

    def broken(prompt, generated):
        raise RuntimeError("a bug")

    async def run() -> list:
        search = BeamSearch([1, 2], BeamSearchParams(2, 2), eos_token_ids=())
        stream = beam.BeamSearchStream("r", search, None, start_all, lambda s: None, broken)
        await stream.start()
        return [u async for u in stream]

    (update,) = asyncio.run(asyncio.wait_for(run(), 10))
    assert update.error.status == 500 and "RuntimeError: a bug" in update.error.message
