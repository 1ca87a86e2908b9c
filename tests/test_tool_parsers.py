"""The tool-call parsers (``mie.serve.tool_parsers``) on outputs as the models write them.

Hermes: Qwen2.5 / Qwen3 answer a tool-using prompt with ``<tool_call>\\n{json}\\n</tool_call>``
blocks (one per call, newline-separated), sometimes after a sentence. Llama 3.1 / 3.2 with the
JSON tool format answer ``{"name": ..., "parameters": {...}}``, optionally after
``<|python_tag|>``, several joined by ``; ``. Whatever is not a complete call stays content.

``ToolCallStream`` is checked against the parsers: however a text is cut into streamed pieces,
the content and call deltas it sends add up to what the parser finds in the whole text.
"""

import json
import random

import pytest

from mie.serve.tool_parsers import (
    Extracted,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCall,
)
from mie.serve.tools import ToolCallStream, ToolRequest

WEATHER = {"location": "San Francisco, CA, USA", "unit": "celsius"}


def call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


# -- Hermes (Qwen2.5, Qwen3) --------------------------------------------------------------------
QWEN_ONE = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
    '"San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>'
)
QWEN_TWO = (
    QWEN_ONE + '\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": '
    '"San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>'
)
HERMES_CASES = [
    (QWEN_ONE, Extracted(None, (call("get_current_temperature", WEATHER),))),
    (
        QWEN_TWO,
        Extracted(
            None,
            (
                call("get_current_temperature", WEATHER),
                call(
                    "get_temperature_date",
                    {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
                ),
            ),
        ),
    ),
    (
        "I'll check the weather first.\n" + QWEN_ONE,
        Extracted("I'll check the weather first.\n", (call("get_current_temperature", WEATHER),)),
    ),
    # non-ASCII arguments are kept as they are (vLLM: ensure_ascii=False)
    (
        '<tool_call>\n{"name": "translate", "arguments": {"text": "café ☕"}}\n</tool_call>',
        Extracted(None, (call("translate", {"text": "café ☕"}),)),
    ),
    # the last call left unclosed (generation stopped at EOS) counts if its JSON is whole
    (
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA", "unit": "celsius"}}\n',
        Extracted(None, (call("get_current_temperature", WEATHER),)),
    ),
    ("The weather is sunny today.", Extracted("The weather is sunny today.", ())),
]
HERMES_CONTENT_ONLY = [
    # cut off by max_tokens in the middle of the arguments
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Fr',
    # not JSON
    "<tool_call>\nget_current_temperature(location='Paris')\n</tool_call>",
    # no arguments object
    '<tool_call>\n{"name": "get_current_temperature"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "location=Paris"}\n</tool_call>',
    # no name
    '<tool_call>\n{"arguments": {"location": "Paris"}}\n</tool_call>',
    # one good call and one broken: all or nothing
    QWEN_ONE + '\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"loc',
    # the tag's beginning only
    "Let me think <tool_ca",
]


@pytest.mark.parametrize("text, expected", HERMES_CASES)
def test_hermes_finds_qwen_calls_and_keeps_the_text_before_them(text, expected):
    assert HermesToolParser().extract(text) == expected


@pytest.mark.parametrize("text", HERMES_CONTENT_ONLY)
def test_hermes_leaves_anything_but_complete_calls_as_content(text):
    assert HermesToolParser().extract(text) == Extracted(text, ())


# -- Llama 3.1 / 3.2 JSON -----------------------------------------------------------------------
LLAMA_CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        Extracted(None, (call("get_weather", {"city": "Paris", "days": 3}),)),
    ),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        Extracted(None, (call("get_weather", {"city": "Paris"}),)),
    ),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        Extracted(
            None,
            (
                call("get_weather", {"city": "Paris"}),
                call("get_time", {"timezone": "Europe/Paris"}),
            ),
        ),
    ),
    (  # "arguments" instead of "parameters", as some prompts ask; nested objects
        '{"name": "book", "arguments": {"trip": {"from": "Paris", "to": "Rome"}}}\n',
        Extracted(None, (call("book", {"trip": {"from": "Paris", "to": "Rome"}}),)),
    ),
    (
        'Sure, let me look that up. {"name": "get_weather", "parameters": {"city": "Paris"}}',
        Extracted("Sure, let me look that up. ", (call("get_weather", {"city": "Paris"}),)),
    ),
    (  # a trailing separator (as vLLM's pattern, which ends at the last object, reads it)
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; ',
        Extracted(None, (call("get_weather", {"city": "Paris"}),)),
    ),
    ("Paris is sunny in June.", Extracted("Paris is sunny in June.", ())),
]
LLAMA_CONTENT_ONLY = [
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut off
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and then I will answer.',
    '{"city": "Paris"}',  # JSON, not a call
    "Use {braces} for sets.",
    '{"name": "get_weather", "parameters": {"city": "Paris"}} {"name": "get_time"}',
    # two whole calls, but not separated by ";"
    '{"name": "get_weather", "parameters": {}}\n{"name": "get_time", "parameters": {}}',
]


@pytest.mark.parametrize("text, expected", LLAMA_CASES)
def test_llama3_json_finds_calls_after_the_optional_python_tag(text, expected):
    assert Llama3JsonToolParser().extract(text) == expected


@pytest.mark.parametrize("text", LLAMA_CONTENT_ONLY)
def test_llama3_json_leaves_anything_but_complete_calls_as_content(text):
    assert Llama3JsonToolParser().extract(text) == Extracted(text, ())


def test_held_from_is_where_a_call_may_begin():
    hermes, llama = HermesToolParser(), Llama3JsonToolParser()
    assert hermes.held_from("Let me check <tool_call>{") == len("Let me check ")
    assert hermes.held_from("Let me check <tool_") == len("Let me check ")
    assert hermes.held_from("a < b") == len("a < b")
    assert hermes.held_from("x <") == len("x ")
    assert llama.held_from('Sure {"name"') == len("Sure ")
    assert llama.held_from("Sure <|python") == len("Sure ")
    assert llama.held_from("No calls here.") == len("No calls here.")


# -- streaming adds up to the whole answer ------------------------------------------------------
def streamed(request: ToolRequest, text: str, seed: int) -> tuple[str, list[dict]]:
    """The content and the reassembled calls a client gets from ``text`` cut at random."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream, content, calls = ToolCallStream(request), "", {}
    for i, piece in enumerate(pieces):
        delta_content, deltas = stream.feed(piece, finished=i == len(pieces) - 1)
        content += delta_content
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] not in calls and delta["type"] == "function"
                calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    "parser, text",
    [(HermesToolParser(), t) for t, _ in HERMES_CASES]
    + [(HermesToolParser(), t) for t in HERMES_CONTENT_ONLY]
    + [(Llama3JsonToolParser(), t) for t, _ in LLAMA_CASES]
    + [(Llama3JsonToolParser(), t) for t in LLAMA_CONTENT_ONLY],
)
def test_a_streamed_auto_answer_adds_up_to_the_whole_one(parser, text):
    request = ToolRequest([], "auto", parser=parser)
    whole = parser.extract(text)
    expected_calls = [{"name": c.name, "arguments": c.arguments} for c in whole.calls]
    for seed in range(20):
        content, calls = streamed(request, text, seed)
        assert (content or None, calls) == (whole.content, expected_calls), seed


def test_a_streamed_named_or_required_answer_adds_up_to_the_whole_one():
    named = ToolRequest([], "function", function="get_weather")
    required = ToolRequest([], "required")
    arguments = '{"city":"Paris","days":3}'
    array = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"t","parameters":{}}]'
    for seed in range(20):
        assert streamed(named, arguments, seed) == (
            "",
            [{"name": "get_weather", "arguments": arguments}],
        )
        assert streamed(required, array, seed) == (
            "",
            [
                {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"name": "t", "arguments": "{}"},
            ],
        )
        # cut off by max_tokens: no calls, the text is content
        assert streamed(required, array[:30], seed) == (array[:30], [])


def test_text_that_may_begin_a_call_is_held_back_until_it_cannot():
    stream = ToolCallStream(ToolRequest([], "auto", parser=HermesToolParser()))
    assert stream.feed("It is <", finished=False) == ("It is ", [])
    assert stream.feed("b> sunny", finished=False) == ("<b> sunny", [])
    assert stream.feed(" <tool_call>{", finished=False) == (" ", [])
    assert stream.feed("nonsense", finished=True) == ("<tool_call>{nonsense", [])
