"""The HTTP server, live on a free loopback port, spoken to with the official ``openai`` client.

Two servers, each started once per module in a background thread and stopped after it:

* stories260K (a real model, no chat template), with the prefix cache on;
* a random-weight tiny Llama built by transformers and saved with ``save_pretrained``, given
  stories260K's tokenizer and a Jinja chat template, behind an API key, with one running
  sequence and a waiting queue of one (for the 503 test).

The oracle for every answer is offline generation (``mie.LLM.generate``, itself tested
against transformers) on the same prompt and sampling parameters; for chat templates it is
transformers' ``apply_chat_template``. Every wait is bounded; the backend is the pure-Python
one, whose steps do not compete with the HTTP thread for OpenMP threads.
"""

import asyncio
import json
import math
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require_fast, require_module

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine

httpx = require_module("httpx")
openai = require_module("openai")
torch = require_module("torch")
transformers = require_module("transformers")
AutoTokenizer = transformers.AutoTokenizer
LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
serve = require_module("mie.serve")  # the server stack: starlette, uvicorn
build_app, serve_in_thread = serve.build_app, serve.serve_in_thread

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
BACKEND = "python"
TIMEOUT = 60.0  # seconds, for any single HTTP exchange
API_KEY = "test-key"
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation cannot start with the assistant') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '<<SYS>> ' + m['content'] + ' <</SYS>> ' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)

torch.set_num_threads(1)


# -- servers and oracles ----------------------------------------------------------------------
class Server:
    """A live server: its base URL, offline oracle, and clients."""

    def __init__(self, url: str, model_dir: Path, name: str, api_key: str | None):
        self.url, self.model_dir, self.name, self.api_key = url, model_dir, name, api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.llm = LLM(model_dir, backend=BACKEND, num_blocks=256)
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=TIMEOUT
        )

    def offline(self, prompt, **params):
        """Offline ``LLM.generate`` of one prompt: the oracle."""
        return self.llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=TIMEOUT,
        )

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        kwargs.setdefault("headers", self.headers)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, timeout=TIMEOUT, **kwargs)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=TIMEOUT).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing is running or waiting (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["mie_num_requests_running"] == 0 and m["mie_num_requests_waiting"] == 0:
                return m
            assert time.monotonic() < deadline, "the server did not become idle"
            time.sleep(0.02)


def pool_is_whole(m: dict[str, float]) -> bool:
    """Every block is free or held by the prefix cache alone (the idle invariant)."""
    held_by_nobody_else = m["mie_kv_cache_blocks_free"] + m["mie_prefix_cache_blocks"]
    return held_by_nobody_else == m["mie_kv_cache_blocks_total"]


@pytest.fixture(scope="module")
def stories():
    engine = LLMEngine(STORIES, backend=BACKEND, num_blocks=1024, max_num_seqs=32)
    with serve_in_thread(build_app(engine, STORIES)) as url:
        yield Server(url, STORIES, "stories260K", None)


def build_tiny_llama(directory: Path) -> None:
    """Random weights of order one, stories260K's tokenizer files plus a chat template."""
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1]))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(STORIES / name, directory / name)
    tokenizer_config = json.loads((STORIES / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(directory)
    engine = LLMEngine(directory, backend=BACKEND, num_blocks=256, max_num_seqs=1)
    app = build_app(engine, directory, model_name="tiny", api_key=API_KEY, max_queue=1)
    with serve_in_thread(app) as url:
        yield Server(url, directory, "tiny", API_KEY)


def stream_text(chunks) -> tuple[str, str | None]:
    """Concatenated text deltas and the finish reason of a completions or chat stream."""
    text, finish_reason = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            text += delta
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason


# -- answers equal offline generation -----------------------------------------------------------
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "Ben had a red ball"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_offline_generate(stories, prompt):
    expected = stories.offline(prompt, temperature=0, max_tokens=120)
    got = stories.client.completions.create(
        model=stories.name, prompt=prompt, max_tokens=120, temperature=0
    )
    choice = got.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert got.model == stories.name and got.object == "text_completion"


def test_streamed_completion_equals_offline_generate_and_ends_with_usage(stories):
    expected = stories.offline("The sun was", temperature=0, max_tokens=200)
    chunks = list(
        stories.client.completions.create(
            model=stories.name,
            prompt="The sun was",
            max_tokens=200,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 10, "tokens must arrive as they are produced, not in one piece"
    assert stream_text(chunks) == (expected.outputs[0].text, expected.outputs[0].finish_reason)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        expected.outputs[0].token_ids
    )


def test_seeded_sampling_equals_offline_generate(stories):
    params = {"temperature": 0.9, "top_p": 0.9, "max_tokens": 60, "seed": 7}
    expected = stories.offline("Lily wanted to", **params)
    got = stories.client.completions.create(model=stories.name, prompt="Lily wanted to", **params)
    assert got.choices[0].text == expected.outputs[0].text


def test_chat_default_template_equals_offline_generate_on_its_documented_prompt(stories):
    # No chat_template in stories260K: one "Role: content" line per message, then "Assistant:".
    messages = [
        {"role": "system", "content": "Tell a story."},
        {"role": "user", "content": "Once upon a time"},
    ]
    expected = stories.offline(
        "System: Tell a story.\nUser: Once upon a time\nAssistant:", temperature=0, max_tokens=80
    )
    got = stories.client.chat.completions.create(
        model=stories.name, messages=messages, max_tokens=80, temperature=0
    )
    assert got.choices[0].message.content == expected.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(
        stories.client.chat.completions.create(
            model=stories.name, messages=messages, max_tokens=80, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert stream_text(chunks) == (expected.outputs[0].text, expected.outputs[0].finish_reason)


@pytest.mark.parametrize("stop, min_tokens", [("Lily", 0), (" was", 12)])
def test_stop_strings_end_the_text_before_them(stories, stop, min_tokens):
    # With min_tokens, vLLM's rule: the text runs on to at least min_tokens tokens, and a stop
    # string there is passed over; the first one ending after the text of those tokens ends
    # the answer. The boundary comes from the offline tokens, decoded by transformers.
    full = stories.offline("Once upon a time", temperature=0, max_tokens=60).outputs[0]
    hf = transformers.AutoTokenizer.from_pretrained(STORIES)
    prefix = hf.decode(full.token_ids[:min_tokens], skip_special_tokens=True)
    assert full.text.startswith(prefix)
    assert (stop in prefix) == bool(min_tokens), "min_tokens passes over a stop string"
    end = full.text.index(stop, max(0, len(prefix) - len(stop) + 1))  # the first after it
    kwargs = {
        "model": stories.name,
        "prompt": "Once upon a time",
        "max_tokens": 60,
        "temperature": 0,
        "stop": [stop],
        "extra_body": {"min_tokens": min_tokens},
    }
    got = stories.client.completions.create(**kwargs)
    assert got.choices[0].text == full.text[:end] and got.choices[0].finish_reason == "stop"
    assert got.choices[0].stop_reason == stop  # vLLM's field: which stop string it was
    assert stream_text(stories.client.completions.create(**kwargs, stream=True)) == (
        full.text[:end],
        "stop",
    )
    # vLLM's include_stop_str_in_output: the text runs through the stop string.
    kwargs["extra_body"]["include_stop_str_in_output"] = True
    got = stories.client.completions.create(**kwargs)
    assert got.choices[0].text == full.text[: end + len(stop)]
    assert stream_text(stories.client.completions.create(**kwargs, stream=True)) == (
        full.text[: end + len(stop)],
        "stop",
    )
    chat = stories.client.chat.completions.create(
        model=stories.name,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=60,
        temperature=0,
        stop=[" the"],
    )
    choice = chat.choices[0]
    assert " the" not in choice.message.content and choice.stop_reason == " the"


def test_the_most_stop_strings_allowed_cost_the_other_clients_nothing(stories):
    # 16 stop strings of 1024 characters, each the story's own opening repeated (so the text
    # starts out matching all of them, held back, until it departs from the repetition):
    # the answer is the offline one, and so is a concurrent client's.
    full = stories.offline("Once upon a time", temperature=0, max_tokens=200).outputs[0].text
    stops = [(full[:40] * 30)[: 1023 - i] + "#" for i in range(16)]
    kwargs = {
        "model": stories.name,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "temperature": 0,
    }

    async def both():
        async with stories.async_client() as client:
            return await asyncio.wait_for(
                asyncio.gather(
                    client.completions.create(**kwargs, stop=stops),
                    client.completions.create(**{**kwargs, "prompt": "The little dog"}),
                ),
                TIMEOUT,
            )

    with_stops, other = asyncio.run(both())
    assert with_stops.choices[0].text == full
    assert (
        other.choices[0].text
        == stories.offline("The little dog", temperature=0, max_tokens=200).outputs[0].text
    )


def test_tiny_model_completions_equal_offline_generate(tiny):
    for prompt in ["Once upon a time", [1, 300, 17, 99, 42]]:
        expected = tiny.offline(prompt, temperature=0, max_tokens=50)
        got = tiny.client.completions.create(
            model=tiny.name, prompt=prompt, max_tokens=50, temperature=0
        )
        assert got.choices[0].text == expected.outputs[0].text
        assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
        streamed = tiny.client.completions.create(
            model=tiny.name, prompt=prompt, max_tokens=50, temperature=0, stream=True
        )
        assert stream_text(streamed)[0] == expected.outputs[0].text


def test_chat_template_renders_like_transformers_apply_chat_template(tiny):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Tell me a story"},
    ]
    hf = AutoTokenizer.from_pretrained(tiny.model_dir)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    expected = tiny.offline({"prompt_token_ids": ids}, temperature=0, max_tokens=40)
    got = tiny.client.chat.completions.create(
        model=tiny.name, messages=messages, max_tokens=40, temperature=0
    )
    assert got.usage.prompt_tokens == len(ids)
    assert got.choices[0].message.content == expected.outputs[0].text
    with pytest.raises(openai.BadRequestError, match="cannot start with the assistant"):
        tiny.client.chat.completions.create(
            model=tiny.name, messages=[{"role": "assistant", "content": "x"}], max_tokens=5
        )


def test_models_health_and_metrics(stories):
    models = stories.client.models.list()
    assert [m.id for m in models.data] == [stories.name]
    assert httpx.get(stories.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    m = stories.metrics()
    for name in (
        "mie_num_requests_running",
        "mie_num_requests_waiting",
        "mie_kv_cache_usage_ratio",
        "mie_prefix_cache_hit_rate",
        "mie_generation_tokens_total",
        "mie_num_preemptions_total",
        "mie_time_to_first_token_seconds_count",
        "mie_inter_token_latency_seconds_count",
        'mie_time_to_first_token_seconds_bucket{le="+Inf"}',
    ):
        assert name in m, name
    itl_inf_bucket = m['mie_inter_token_latency_seconds_bucket{le="+Inf"}']
    assert itl_inf_bucket == m["mie_inter_token_latency_seconds_count"] > 0


# -- many clients at once ---------------------------------------------------------------------
def test_32_concurrent_streams_share_the_batch_and_return_every_block(stories):
    start = stories.wait_idle()
    assert pool_is_whole(start)
    cases = [
        (
            f"{PROMPTS[i % 4]} and {'the cat ' * (i % 5)}",
            {"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i, "top_k": 40},
            16 + 4 * (i % 8),
        )
        for i in range(32)
    ]

    async def one(client, prompt, params, max_tokens):
        openai_params = {k: v for k, v in params.items() if k != "top_k"}
        stream = await client.completions.create(
            model=stories.name,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"top_k": params["top_k"]} if "top_k" in params else None,
            **openai_params,
        )
        text, finish_reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return text, finish_reason

    async def all_of_them():
        async with stories.async_client() as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, *case) for case in cases)), TIMEOUT
            )

    results = asyncio.run(all_of_them())
    offline = stories.llm.generate(
        [prompt for prompt, _, _ in cases],
        [SamplingParams(max_tokens=n, **params) for _, params, n in cases],
        use_tqdm=False,
    )
    for case, got, expected in zip(cases, results, offline, strict=True):
        assert got == (expected.outputs[0].text, expected.outputs[0].finish_reason), case
    end = stories.wait_idle()
    assert pool_is_whole(end)
    steps = end["mie_engine_steps_total"] - start["mie_engine_steps_total"]
    tokens = end["mie_generation_tokens_total"] - start["mie_generation_tokens_total"]
    assert tokens >= 4 * steps, "the clients' requests were batched together"


def test_disconnected_clients_free_their_blocks_and_the_others_are_unaffected(stories):
    # Nine requests run together: four read to the end; four streaming clients and one
    # non-streaming client hang up once all nine are running. No wall-clock assumption: the
    # survivors still have hundreds of steps to go when the others leave.
    start = stories.wait_idle()
    aborts_before = start['mie_request_finished_total{finish_reason="abort"}']
    prompts = [f"{p} one day" for p in PROMPTS] * 2
    body = {"model": stories.name, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    all_running, survivors_done = asyncio.Event(), []

    async def survivor(client, prompt):
        text = ""
        async with client.stream(
            "POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        survivors_done.append(prompt)
        return text

    async def leaver(client, prompt):  # reads a few events, then hangs up
        async with client.stream(
            "POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}
        ) as response:
            lines = response.aiter_lines()
            for _ in range(3):
                await anext(lines)
            await all_running.wait()

    async def impatient(client, prompt):  # gives up on a non-streaming request
        request = asyncio.ensure_future(
            client.post("/v1/completions", json={**body, "prompt": prompt})
        )
        await all_running.wait()
        request.cancel()  # httpx drops the connection
        with pytest.raises(asyncio.CancelledError):
            await request

    async def watch():
        """Let the clients leave once all nine run; return how many survivors had finished
        when the server had counted the five aborts."""
        deadline = time.monotonic() + TIMEOUT
        while not all_running.is_set():
            assert time.monotonic() < deadline, "the nine requests never ran together"
            m = await asyncio.to_thread(stories.metrics)
            if m["mie_num_requests_running"] == 9:
                all_running.set()
            await asyncio.sleep(0.005)
        while True:
            assert time.monotonic() < deadline, "the departed clients' requests were not aborted"
            m = await asyncio.to_thread(stories.metrics)
            if m['mie_request_finished_total{finish_reason="abort"}'] - aborts_before == 5:
                return len(survivors_done)
            await asyncio.sleep(0.005)

    async def run():
        async with httpx.AsyncClient(base_url=stories.url, timeout=TIMEOUT) as client:
            tasks = [survivor(client, p) for p in prompts[:4]]
            tasks += [leaver(client, p) for p in prompts[4:]] + [impatient(client, prompts[0])]
            return await asyncio.wait_for(asyncio.gather(watch(), *tasks), TIMEOUT)

    survivors_done_at_abort, *results = asyncio.run(run())
    assert survivors_done_at_abort == 0, "aborts happen at once, while the others still run"
    offline = stories.llm.generate(prompts[:4], SamplingParams(**body_params(body)), use_tqdm=False)
    assert results[:4] == [out.outputs[0].text for out in offline]
    assert pool_is_whole(stories.wait_idle())


def body_params(body: dict) -> dict:
    return {k: body[k] for k in ("max_tokens", "temperature", "ignore_eos")}


# -- bad input --------------------------------------------------------------------------------
GOOD = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8}
CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}]}
BAD_REQUESTS = [
    # (path, body, status, param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "malformed JSON"),
    ("/v1/completions", [1, 2], 400, None, "JSON object"),
    ("/v1/completions", {"model": "stories260K"}, 400, "prompt", "'prompt' is required"),
    ("/v1/completions", {"prompt": "x"}, 400, "model", "'model' is required"),
    ("/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens", "must be an integer"),
    ("/v1/completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens", "must be an integer"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "must be a number"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream", "must be a boolean"),
    ("/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt", "must be a string"),
    ("/v1/completions", {**GOOD, "prompt": ["a", ""]}, 400, "prompt", "'prompt[1]' is empty"),
    (
        "/v1/completions",
        {**GOOD, "prompt": [[1], [1, 99999]]},
        400,
        "prompt",
        "prompt[1]: token id 99999 is outside the vocabulary",
    ),
    ("/v1/completions", {**GOOD, "max_tokens": 600}, 400, "prompt", "context length 512"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 600}, 400, "messages", "context length 512"),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {**GOOD, "suffix": "x"}, 400, "suffix", "not supported"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/chat/completions", {"model": "stories260K"}, 400, "messages", "required"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "empty"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
        "must be one of",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0].content",
        "string",
    ),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {**GOOD, "prompt": "x" * (1 << 20)}, 400, None, "too large"),
    ("/v1/completions", {**GOOD, "stop": ["x"] * 17}, 400, "stop", "at most 16"),
    ("/v1/completions", {**GOOD, "stop": "x" * 1025}, 400, "stop", "at most 1024"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 17}, 400, "stop", "at most 16"),
    ("/v1/completions", {**GOOD, "seed": -(2**64)}, 400, "seed", "seed"),
    ("/v1/completions", {**GOOD, "temperature": 10**400}, 400, "temperature", "out of range"),
]


def test_every_bad_request_gets_its_error_while_a_stream_runs_on(stories):
    body = {
        "model": stories.name,
        "prompt": "The little dog",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", stories.url + "/v1/completions", json=body, timeout=TIMEOUT
    ) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for path, bad, status, param, words in BAD_REQUESTS:
            response = stories.post(path, bad)
            assert response.status_code == status, (bad, response.text)
            error = response.json()["error"]
            assert words in error["message"], (words, error)
            assert error["param"] == param and error["type"] == "invalid_request_error"
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in [first, *lines]
            if line.startswith("data: {")
        )
    expected = stories.offline("The little dog", **body_params(body)).outputs[0].text
    assert text == expected
    ok = stories.client.completions.create(model=stories.name, prompt="Hi", max_tokens=4)
    assert ok.choices[0].finish_reason == "length"


def test_unknown_routes_and_methods_are_openai_style_errors(stories):
    response = httpx.get(stories.url + "/v1/nothing", timeout=TIMEOUT)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = httpx.get(stories.url + "/v1/completions", timeout=TIMEOUT)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_api_key_is_required_on_the_api_routes(tiny):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = tiny.post("/v1/completions", {"model": "tiny", "prompt": "x"}, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.get(tiny.url + "/v1/models", timeout=TIMEOUT)
    assert response.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(tiny.url + "/health", timeout=TIMEOUT).status_code == 200
    assert [m.id for m in tiny.client.models.list().data] == ["tiny"]


def test_a_full_waiting_queue_is_503_with_retry_after(tiny):
    # One running sequence (max_num_seqs=1) and a waiting queue of one (--max-queue 1).
    body = {
        "model": "tiny",
        "prompt": "Once",
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
    }
    url = tiny.url + "/v1/completions"
    with httpx.Client(headers=tiny.headers, timeout=TIMEOUT) as client:
        with client.stream("POST", url, json=body) as running:
            assert running.status_code == 200
            with client.stream("POST", url, json=body) as waiting:
                assert waiting.status_code == 200
                refused = tiny.post("/v1/completions", {**body, "stream": False})
                assert refused.status_code == 503
                assert refused.headers["Retry-After"] == "1"
                assert refused.json()["error"]["code"] == "queue_full"
    # Both clients hung up: their requests are aborted and the server serves again.
    tiny.wait_idle()
    ok = tiny.client.completions.create(model="tiny", prompt="x", max_tokens=3)
    assert ok.usage.completion_tokens <= 3


# -- the command line -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_listens_on_loopback_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "mie", "serve", "--model", str(STORIES), "--port", str(port)]
    command += ["--backend", BACKEND, "--num-blocks", "64"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
        )
        got = client.completions.create(model="stories260K", prompt="Once", max_tokens=5)
        assert got.usage.completion_tokens == 5
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    assert f"http://127.0.0.1:{port}" in log_path.read_text()


def test_serve_command_refuses_bad_settings_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "mie", "serve", "--model", str(STORIES), "--max-queue", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == "mie: error: max_queue must be at least 1, got 0"


def test_fast_backend_serves_and_reports_its_scheduler_state():
    require_fast()
    engine = LLMEngine(STORIES, backend="fast", num_blocks=64)
    with serve_in_thread(build_app(engine, STORIES)) as url:
        server = Server(url, STORIES, "stories260K", None)
        expected = server.offline("Once upon a time", temperature=0, max_tokens=30)
        got = server.client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=30, temperature=0
        )
        assert got.choices[0].text == expected.outputs[0].text
        assert pool_is_whole(server.wait_idle())
