"""Structured outputs and tool calls over the OpenAI API, as clients use them.

* ``response_format`` (``json_schema``, ``json_object``) and vLLM's ``structured_outputs``
  (``regex``, ``choice``, whitespace options) on chat and completions: what comes back matches
  (checked with ``jsonschema``, ``re.fullmatch``, membership);
* ``tools`` with ``tool_choice`` "required" and named: the answer is ``tool_calls`` whose
  arguments validate against the tool's parameters; "auto" with the Hermes parser (the model's
  output forced into a Qwen-style call by a ``structured_outputs`` choice); streamed tool-call
  deltas add up to the non-streamed answer;
* every bad value is a 400 naming its field, with nothing queued; a constraint is compiled
  before its request reaches the engine thread;
* ``tools`` and an earlier turn's ``tool_calls`` and ``tool`` result reach the chat template.

stories260K is a tiny model that writes stories, not JSON: under a constraint it may wander
until ``max_tokens``. So the schemas are small (enums, short strings, one-digit integers), the
JSON is compact, and only outputs that finished are validated -- of which each test asks for
enough to mean something.
"""

import json
import re
import shutil
import threading
from pathlib import Path

import pytest
from conftest import require_module

from mie.engine.llm_engine import LLMEngine
from mie.engine.tokenizer import Tokenizer

httpx = require_module("httpx")
openai = require_module("openai")
jsonschema = require_module("jsonschema")
serve = require_module("mie.serve")  # the server stack: starlette, uvicorn
build_app, serve_in_thread = serve.build_app, serve.serve_in_thread
from mie.engine.chat import ChatTemplate  # noqa: E402
from mie.serve.protocol import parse_messages  # noqa: E402
from mie.serve.tools import parse_tool_request  # noqa: E402

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
MODEL = "stories260K"
TIMEOUT = 60.0
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(6)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
# Unsteered under "required", stories260K adds made-up members to the call object (vLLM's
# schema allows them) until max_tokens: a nudge towards '}' (128) and no ',' (432) where the
# schema leaves a choice ends the calls.
STEER_CALLS = {"128": 10, "432": -100}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'


class Server:
    def __init__(self, url: str, engine: LLMEngine):
        self.url, self.engine = url, engine
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
        )

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json={"model": MODEL, **body}, timeout=TIMEOUT)

    def chat(self, **body):
        return self.client.chat.completions.create(model=MODEL, messages=CHAT, **body)

    def streamed_chat(self, **body) -> tuple[str | None, list[dict], str]:
        """A streamed chat answer put together as a client does: its content, its tool calls
        (``id``, ``name``, ``arguments`` appended by ``index``) and its finish reason."""
        content, calls, finish = None, {}, None
        for chunk in self.chat(stream=True, **body):
            choice = chunk.choices[0]
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index not in calls and delta.type == "function"
                    calls[delta.index] = {
                        "id": delta.id,
                        "name": delta.function.name,
                        "arguments": "",
                    }
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
        return content, [calls[i] for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def server():
    """A server with tool_choice "auto" enabled (``--enable-auto-tool-choice
    --tool-call-parser hermes``)."""
    engine = LLMEngine(STORIES, backend="python", num_blocks=256, max_num_seqs=16)
    with serve_in_thread(build_app(engine, STORIES, auto_tool_parser="hermes")) as url:
        yield Server(url, engine)


@pytest.fixture(scope="module")
def plain():
    """A server without auto tool choice (the default)."""
    engine = LLMEngine(STORIES, backend="python", num_blocks=64, max_num_seqs=4)
    with serve_in_thread(build_app(engine, STORIES)) as url:
        yield Server(url, engine)


def finished(outputs: list, reasons=("stop",)) -> list:
    return [o for o in outputs if o.finish_reason in reasons]


# -- response_format and structured_outputs -----------------------------------------------------
def test_json_schema_answers_validate_against_the_schema(server):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chats = [
        server.chat(
            response_format=response_format, max_tokens=40, seed=s, extra_body=COMPACT
        ).choices[0]
        for s in SEEDS
    ]
    completions = [
        server.client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=40,
            seed=s,
            extra_body={"response_format": response_format, **COMPACT},
        ).choices[0]
        for s in SEEDS
    ]
    texts = [c.message.content for c in finished(chats)] + [c.text for c in finished(completions)]
    assert len(texts) >= len(SEEDS)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_answers_are_json_objects(server):
    # Unsteered, stories260K writes one key for ever: a nudge towards '"' (313) ends its
    # strings, and no ',' (432) ends the object after its first member.
    steer = {"313": 5, "432": -100}
    choices = [
        server.chat(
            response_format={"type": "json_object"},
            max_tokens=60,
            seed=s,
            logit_bias=steer,
            extra_body=COMPACT,
        ).choices[0]
        for s in SEEDS
    ]
    assert len(finished(choices)) >= len(SEEDS) // 2
    for choice in finished(choices):
        assert isinstance(json.loads(choice.message.content), dict)


def test_structured_outputs_regex_and_choice_match(server):
    regex = r"(yes|no), [a-z]{1,6}\."
    for s in SEEDS:
        completion = server.client.completions.create(
            model=MODEL,
            prompt="Is it sunny?",
            max_tokens=20,
            seed=s,
            extra_body={"structured_outputs": {"regex": regex}},
        ).choices[0]
        assert completion.finish_reason == "stop" and re.fullmatch(regex, completion.text)
        chat = server.chat(
            max_tokens=20, seed=s, extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}}
        ).choices[0]
        assert chat.finish_reason == "stop" and chat.message.content in ("Paris", "Rome")


def test_vllms_older_guided_fields_constrain_as_structured_outputs_does(server):
    # Clients still send vLLM's guided_* spellings; ignored, they would get free text.
    regex = r"(yes|no), [a-z]{1,6}\."
    for s in SEEDS[:3]:
        guided = server.client.completions.create(
            model=MODEL,
            prompt="Is it sunny?",
            max_tokens=20,
            seed=s,
            extra_body={"guided_regex": regex},
        ).choices[0]
        assert guided.finish_reason == "stop" and re.fullmatch(regex, guided.text)
        chat = server.chat(
            max_tokens=20, seed=s, extra_body={"guided_choice": ["Paris", "Rome"]}
        ).choices[0]
        assert chat.finish_reason == "stop" and chat.message.content in ("Paris", "Rome")


def test_a_constraint_is_compiled_before_the_engine_thread_sees_its_request(server, monkeypatch):
    grammar = server.engine.grammar
    threads = []
    compile_ = grammar.compile

    def recording(params):
        threads.append(threading.current_thread().name)
        return compile_(params)

    monkeypatch.setattr(grammar, "compile", recording)
    unique = {"structured_outputs": {"choice": ["Paris", "Rome", "compiled-first"]}}
    misses = grammar.misses
    server.chat(max_tokens=8, seed=1, extra_body=unique)
    # Compiled once, first off the engine thread; add_request's sample matcher then finds it.
    assert grammar.misses == misses + 1
    assert threads[0] != "mie-engine" and threads[1:] and set(threads[1:]) == {"mie-engine"}


# -- tools ----------------------------------------------------------------------------------------
def check_calls(message) -> None:
    assert message.content is None
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_constrains_to_vllms_array_of_calls_with_the_defs_at_the_top():
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [
        tool(
            "go",
            {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/place"}},
                "$defs": {"place": place},
            },
        ),
        tool("stay"),
    ]
    request = parse_tool_request({"tools": tools, "tool_choice": "required"}, None)
    constraint = request.constraint()
    assert constraint.disable_any_whitespace
    assert constraint.json == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["go"]},
                        "parameters": {
                            "type": "object",
                            "properties": {"to": {"$ref": "#/$defs/place"}},
                        },
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["stay"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
        "$defs": {"place": place},
    }
    assert "$defs" in tools[0]["function"]["parameters"]  # the client's tools are left alone
    named = {"type": "function", "function": {"name": "go"}}
    request = parse_tool_request({"tools": tools, "tool_choice": named}, None)
    assert request.constraint().json == tools[0]["function"]["parameters"]


def test_required_tool_choice_answers_calls_that_validate(server):
    choices = [
        server.chat(
            tools=TOOLS, tool_choice="required", max_tokens=120, seed=s, logit_bias=STEER_CALLS
        ).choices[0]
        for s in SEEDS
    ]
    done = finished(choices, ("tool_calls",))
    assert len(done) >= len(SEEDS) // 2
    for choice in done:
        assert choice.message.tool_calls
        check_calls(choice.message)
    for choice in choices:  # cut off: no calls, the partial text is content
        assert choice.finish_reason in ("tool_calls", "length")


def test_a_named_tool_choice_answers_one_call_to_it(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = [
        server.chat(tools=TOOLS, tool_choice=named, max_tokens=40, seed=s).choices[0] for s in SEEDS
    ]
    done = finished(choices)  # OpenAI's and vLLM's finish reason for a named call: "stop"
    assert len(done) >= len(SEEDS) // 2
    for choice in choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
    for choice in done:
        check_calls(choice.message)


def test_auto_tool_choice_finds_a_hermes_call_and_keeps_the_text_before_it(server):
    text = "Let me check.\n" + HERMES_CALL + "\n</tool_call>"
    forced = {"structured_outputs": {"choice": [text]}}
    choice = server.chat(tools=TOOLS, max_tokens=120, seed=0, extra_body=forced).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Rome", "days": 2},
    )
    # With no call in the text, the answer is the text.
    plain = server.chat(
        tools=TOOLS, max_tokens=20, seed=0, extra_body={"structured_outputs": {"choice": ["Rome"]}}
    ).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == (
        "Rome",
        None,
        "stop",
    )


def test_parallel_tool_calls_false_answers_at_most_one_call(server):
    # "auto": the output forced to two Hermes calls; OpenAI's meaning of false is at most one
    # call, which vLLM gives by keeping the first.
    second = HERMES_CALL.replace("Rome", "Oslo")
    forced = {"structured_outputs": {"choice": [f"{HERMES_CALL}</tool_call>{second}</tool_call>"]}}
    for parallel, cities in ((True, ["Rome", "Oslo"]), (False, ["Rome"])):
        for stream in (False, True):
            body = {"tools": TOOLS, "max_tokens": 300, "seed": 0, "extra_body": forced}
            body["parallel_tool_calls"] = parallel
            if stream:
                _, calls, finish = server.streamed_chat(**body)
                arguments = [json.loads(c["arguments"]) for c in calls]
            else:
                choice = server.chat(**body).choices[0]
                finish = choice.finish_reason
                arguments = [json.loads(c.function.arguments) for c in choice.message.tool_calls]
            assert finish == "tool_calls" and [a["city"] for a in arguments] == cities
    # "required": the array itself is held to one call.
    request = parse_tool_request(
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, None
    )
    assert request.constraint().json["maxItems"] == 1
    assert (
        "maxItems"
        not in parse_tool_request({"tools": TOOLS, "tool_choice": "required"}, None)
        .constraint()
        .json
    )


def test_required_calls_read_the_name_and_parameters_only():
    # vLLM's "required" schema lets a call carry keys beside name and parameters: a key
    # called "arguments" is one of them, not the call's arguments.
    request = parse_tool_request({"tools": TOOLS, "tool_choice": "required"}, None)
    text = '[{"name":"get_weather","parameters":{"city":"Rome"},"arguments":{"zzz":1}}]'
    (call,) = request.extract(text).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})
    (call,) = request.extract(text.replace('{"zzz":1}', "5")).calls
    assert json.loads(call.arguments) == {"city": "Rome"}


@pytest.mark.parametrize(
    "body",
    [
        {"tool_choice": "required", "max_tokens": 120, "logit_bias": STEER_CALLS},
        {"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 30},
        {"tool_choice": "required", "max_tokens": 25},  # cut off: content, no calls
        {  # auto: text, then a Hermes call, forced
            "max_tokens": 120,
            "extra_body": {
                "structured_outputs": {"choice": ["Sure. " + HERMES_CALL + "</tool_call>"]}
            },
        },
    ],
    ids=["required", "named", "required-cut-off", "auto"],
)
def test_streamed_tool_call_deltas_add_up_to_the_whole_answer(server, body):
    for seed in SEEDS[:3]:
        whole = server.chat(tools=TOOLS, seed=seed, **body).choices[0]
        content, calls, finish = server.streamed_chat(tools=TOOLS, seed=seed, **body)
        assert (content, finish) == (whole.message.content, whole.finish_reason)
        expected = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in whole.message.tool_calls or []
        ]
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
        assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)


# -- what is refused -----------------------------------------------------------------------------
CMPL = {"prompt": "Once", "max_tokens": 4}
ASK = {"messages": CHAT, "max_tokens": 4}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(name="f", parameters=None, type_="function") -> dict:
    return {"type": type_, "function": {"name": name, "parameters": parameters or {}}}


BAD = [
    ("completions", {**CMPL, "response_format": {"type": "xml"}}, "response_format"),
    ("completions", {**CMPL, "response_format": "json"}, "response_format"),
    ("chat/completions", {**ASK, "response_format": {"type": "json_schema"}}, "response_format"),
    (
        "chat/completions",
        {**ASK, "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
        "response_format",
    ),
    ("chat/completions", {**ASK, "response_format": schema_format([1])}, "response_format"),
    ("chat/completions", {**ASK, "response_format": schema_format(BAD_SCHEMA)}, "response_format"),
    (
        "chat/completions",
        {**ASK, "response_format": schema_format({"type": "string", "format": "weird"})},
        "response_format",
    ),
    (
        "chat/completions",
        {**ASK, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    ("completions", {**CMPL, "structured_outputs": {"regex": "(a|b"}}, "structured_outputs"),
    ("completions", {**CMPL, "guided_regex": "(a|b"}, "guided_regex"),
    (
        "completions",
        {**CMPL, "guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
        "guided_choice",
    ),
    (
        "completions",
        {**CMPL, "structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
    ),
    ("completions", {**CMPL, "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("completions", {**CMPL, "structured_outputs": {"json": "{nope"}}, "structured_outputs"),
    ("completions", {**CMPL, "structured_outputs": {"json": "null"}}, "structured_outputs"),
    (
        "chat/completions",
        {**ASK, "tools": TOOLS, "parallel_tool_calls": "no"},
        "parallel_tool_calls",
    ),
    ("chat/completions", {**ASK, "tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ("chat/completions", {**ASK, "tools": TOOLS, "parallel_tool_calls": 0}, "parallel_tool_calls"),
    ("completions", {**CMPL, "structured_outputs": {"backend": "xgrammar"}}, "structured_outputs"),
    ("completions", {**CMPL, "structured_outputs": "json"}, "structured_outputs"),
    ("completions", {**CMPL, "structured_outputs": {}}, "structured_outputs"),  # no kind
    ("chat/completions", {**ASK, "structured_outputs": {}}, "structured_outputs"),
    (
        "completions",
        {**CMPL, "structured_outputs": {"disable_any_whitespace": True}},
        "structured_outputs",
    ),
    ("completions", {**CMPL, "structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs"),
    (
        "completions",
        {**CMPL, "response_format": {"type": "json_object"}, "ignore_eos": True},
        "ignore_eos",
    ),
    (
        "chat/completions",
        {**ASK, "tools": TOOLS, "tool_choice": "required", "min_tokens": 2},
        "min_tokens",
    ),
    ("completions", {**CMPL, "tools": [tool()]}, "tools"),
    ("chat/completions", {**ASK, "tools": tool()}, "tools"),
    ("chat/completions", {**ASK, "tools": [tool(type_="retrieval")]}, "tools"),
    ("chat/completions", {**ASK, "tools": [tool("get weather")]}, "tools"),
    ("chat/completions", {**ASK, "tools": [tool("f" * 65)]}, "tools"),
    ("chat/completions", {**ASK, "tools": [tool(parameters=[1])]}, "tools"),
    ("chat/completions", {**ASK, "tools": [tool(), tool()]}, "tools"),
    ("chat/completions", {**ASK, "tools": [{"type": "function"}]}, "tools"),
    (  # two tools' $defs of one name, which "required" would gather at the top
        "chat/completions",
        {
            **ASK,
            "tools": [
                tool("a", {"$defs": {"d": {"type": "string"}}}),
                tool("b", {"$defs": {"d": {"type": "integer"}}}),
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "chat/completions",
        {**ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("chat/completions", {**ASK, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat/completions", {**ASK, "tool_choice": "required"}, "tool_choice"),
    (
        "chat/completions",
        {
            **ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice",
    ),
    (  # a function whose parameters the grammar engine cannot enforce
        "chat/completions",
        {
            **ASK,
            "tools": [tool("f", BAD_SCHEMA)],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tool_choice",
    ),
    ("chat/completions", {**ASK, "functions": [tool()["function"]]}, "functions"),
    (
        "chat/completions",
        {
            **ASK,
            "messages": CHAT
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ],
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "chat/completions",
        {**ASK, "messages": CHAT + [{"role": "tool", "content": "18C"}]},
        "messages[1].tool_call_id",
    ),
]


def test_every_bad_value_is_a_400_naming_its_field_with_nothing_queued(server):
    arrivals = server.engine._num_arrivals  # counts every request the engine accepted
    for route, body, param in BAD:
        response = server.post(f"/v1/{route}", body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error"), (body, error)
    assert server.engine._num_arrivals == arrivals
    assert not server.engine.has_unfinished_requests()


def test_auto_tool_choice_needs_the_server_flags(plain):
    arrivals = plain.engine._num_arrivals
    response = plain.post("/v1/chat/completions", {**ASK, "tools": TOOLS, "tool_choice": "auto"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert plain.engine._num_arrivals == arrivals
    # Tools without a tool_choice are then only shown to the model: "none".
    answer = plain.chat(tools=TOOLS, max_tokens=4, seed=0).choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason == "length"
    # "none" is always allowed.
    assert plain.chat(tools=TOOLS, tool_choice="none", max_tokens=4).choices[0].message.content


# -- the chat template sees the tools -----------------------------------------------------------
# In the style of Qwen2.5's: the tools' JSON in the system prompt, an earlier call as a
# <tool_call> block of JSON (its arguments an object), a tool's result as <tool_response>.
TOOL_TEMPLATE = (
    "{% if tools %}system: You may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% for c in m.tool_calls %}assistant: <tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "</tool_call>\n{% endfor %}"
    "{% elif m.role == 'tool' %}tool: <tool_response>{{ m.content }}</tool_response>\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}assistant:"
)
HISTORY = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
]
SHORT_TOOLS = [  # stories260K's context is 512 tokens
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
EXPECTED_PROMPT = (
    "system: You may call these functions:\n<tools>\n"
    + "".join(json.dumps(t) + "\n" for t in SHORT_TOOLS)
    + "</tools>\n"
    'user: Weather?\nassistant: <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
    "</tool_call>\ntool: <tool_response>noon</tool_response>\nassistant:"
)


@pytest.fixture(scope="module")
def tool_template_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tool-template")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        shutil.copy(STORIES / name, directory)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOL_TEMPLATE})
    )
    engine = LLMEngine(directory, backend="python", num_blocks=64, max_num_seqs=4)
    with serve_in_thread(build_app(engine, directory, model_name=MODEL)) as url:
        yield Server(url, engine), directory


def test_tools_and_the_tool_call_history_reach_the_chat_template(tool_template_server):
    server, directory = tool_template_server
    template = ChatTemplate(directory, Tokenizer(directory))
    messages = parse_messages({"messages": HISTORY})
    assert template.apply(messages, SHORT_TOOLS) == EXPECTED_PROMPT
    body = {"messages": HISTORY, "tools": SHORT_TOOLS, "max_tokens": 1}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    expected_tokens = len(template.encode(EXPECTED_PROMPT))
    assert response.json()["usage"]["prompt_tokens"] == expected_tokens
    without_tools = server.post("/v1/chat/completions", {**body, "tools": None}).json()
    assert without_tools["usage"]["prompt_tokens"] < expected_tokens
