"""Tool calls in a model's text: ``--tool-call-parser hermes | llama3_json``.

With ``tool_choice: "auto"`` the model decides whether to call a tool, in the format its chat
template taught it; a parser finds the calls in the generated text afterwards (vLLM's
``--enable-auto-tool-choice --tool-call-parser``). Two formats are read, as vLLM's
``Hermes2ProToolParser`` and ``Llama3JsonToolParser`` read them:

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, possibly several; the text before the first one is the
  message's content (text between or after calls is dropped, as vLLM drops it). A last
  ``<tool_call>`` left unclosed still counts if its JSON is complete.
* ``llama3_json`` (Llama 3.1, 3.2, with the JSON tool format): the output is
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
  ``<|python_tag|>``, several separated by ``;``. The calls start at the first ``{`` (or
  ``<|python_tag|>``) and must run to the end of the text (whitespace aside); the text before
  them is the content.

Either way it is all or nothing: if any call is not complete JSON with a string ``name`` and an
object of arguments, there are no calls and the whole text is content -- a client never gets
half a call. Arguments are re-serialized (``json.dumps``, non-ASCII kept), as vLLM does.

For streaming, ``held_from`` says where text that may still turn out to be a call begins: the
server sends content up to there and decides the rest when the choice ends (``extract`` on the
whole text), so the streamed pieces always add up to the non-streamed answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One function call: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Extracted:
    """A generated text read by a parser: the content (None if empty) and the calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


def no_calls(text: str) -> Extracted:
    return Extracted(text or None, ())


def call_from_json(value: object) -> ToolCall | None:
    """A decoded call ``{"name": str, "arguments" | "parameters": object}``, else None."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value["arguments"] if "arguments" in value else value.get("parameters")
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def held_from(text: str, markers: tuple[str, ...]) -> int:
    """Where in ``text`` a call may begin: the first complete marker, else the longest tail of
    the text that is the beginning of a marker (it may still become one), else its end."""
    found = [i for marker in markers if (i := text.find(marker)) >= 0]
    if found:
        return min(found)
    for start in range(max(len(text) - max(map(len, markers)) + 1, 0), len(text)):
        if any(marker.startswith(text[start:]) for marker in markers):
            return start
    return len(text)


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (see the module doc)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> Extracted:
        start = text.find(self.START)
        if start < 0:
            return no_calls(text)
        calls = []
        for match in self.CALL.finditer(text):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            try:
                call = call_from_json(json.loads(body))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return no_calls(text)
            calls.append(call)
        return Extracted(text[:start] or None, tuple(calls))

    def held_from(self, text: str) -> int:
        return held_from(text, (self.START,))


class Llama3JsonToolParser:
    """``{"name": ..., "parameters": ...}; {...}`` after an optional ``<|python_tag|>``."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    MARKERS = (PYTHON_TAG, "{")

    def extract(self, text: str) -> Extracted:
        start = held_from(text, self.MARKERS)
        rest = text[start:]
        if rest.startswith(self.PYTHON_TAG):
            rest = rest[len(self.PYTHON_TAG) :]
        decoder = json.JSONDecoder()
        calls, position = [], _skip_space(rest, 0)
        while position < len(rest):
            try:
                value, position = decoder.raw_decode(rest, position)
            except (ValueError, RecursionError):
                return no_calls(text)
            call = call_from_json(value)
            if call is None:
                return no_calls(text)
            calls.append(call)
            position = _skip_space(rest, position)
            if position < len(rest):
                if rest[position] != ";":
                    return no_calls(text)
                position = _skip_space(rest, position + 1)
        if not calls:
            return no_calls(text)
        return Extracted(text[:start] or None, tuple(calls))

    def held_from(self, text: str) -> int:
        return held_from(text, self.MARKERS)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


ToolParser = HermesToolParser | Llama3JsonToolParser
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
