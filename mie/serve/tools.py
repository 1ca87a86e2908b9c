"""Chat's ``tools`` and ``tool_choice``: the calls a request allows, and those an answer makes.

``tools`` are OpenAI's function definitions, checked here and handed to the chat template
as they came (transformers' ``apply_chat_template(tools=...)``: templates that render tools
print them). ``tool_choice`` decides what the answer is (vLLM's rules):

* ``"none"`` (the default without ``--enable-auto-tool-choice``): text, as without tools;
* ``"required"``: the output is constrained to a JSON array of one or more calls
  ``[{"name": <a tool's>, "parameters": <its parameters>}]`` (vLLM's schema, with every tool's
  ``$defs`` gathered at the top), and the answer is those calls, ``finish_reason:
  "tool_calls"``;
* ``{"type": "function", "function": {"name": ...}}``: the output is constrained to that
  function's parameters schema and is the arguments of one call to it (``finish_reason:
  "stop"``, as OpenAI and vLLM answer a named call);
* ``"auto"`` (the default with ``--enable-auto-tool-choice``): the model writes freely; the
  server's ``--tool-call-parser`` finds its calls (``tool_parsers``), ``finish_reason:
  "tool_calls"`` when it found some.

``parallel_tool_calls: false`` allows at most one call (OpenAI's meaning): "required"'s array
is constrained to one item, and of "auto"'s calls the first is kept (as vLLM filters them).

A forced call's constraint asks for compact JSON (no whitespace between tokens): the server
reads it, a client never sees it, and every whitespace token a model could spend there is one
a small model might repeat until ``max_tokens``.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, replace

from mie.checks import short_repr as _show
from mie.engine.sampling import InvalidRequestError
from mie.engine.structured import StructuredOutputsParams
from mie.serve import protocol
from mie.serve.protocol import Options, bad_request
from mie.serve.tool_parsers import Extracted, ToolCall, ToolParser, no_calls

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOL_CHOICES = ("none", "auto", "required")
NAMED = "function"  # ToolRequest.choice for {"type": "function", "function": {"name": ...}}
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes none (vLLM's)


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools (as the template gets them; None: none given) and its choice:
    ``"none"``, ``"auto"`` (with the server's ``parser``), ``"required"`` or ``NAMED``
    (``function`` is then the function's name); ``parallel``: more than one call allowed."""

    tools: list[dict] | None = None
    choice: str = "none"
    function: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether the answer may be tool calls."""
        return self.choice != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """What a forced choice constrains the output to (None for "none" and "auto")."""
        if self.choice == NAMED:
            schema = self._parameters()[self.function]
        elif self.choice == "required":
            schema = required_schema(self.tools)
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def constrain(self, options: Options) -> Options:
        """``options`` with a forced choice's constraint on the output; a forced call and a
        ``response_format`` or ``structured_outputs`` constraint together are a 400 (vLLM:
        one or the other)."""
        constraint = self.constraint()
        if constraint is None:
            return options
        if options.beam_width is not None:  # the search ranks raw log-probabilities
            raise bad_request(
                "a forced 'tool_choice' is not supported with 'use_beam_search'",
                param="tool_choice",
            )
        if options.sampling.structured_outputs is not None:
            raise bad_request(
                f"a forced tool choice constrains the output already: give it or "
                f"'{options.constraint_param}', not both",
                param="tool_choice",
            )
        try:  # SamplingParams' own rules: no ignore_eos or min_tokens with a constraint
            sampling = replace(options.sampling, structured_outputs=constraint)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param=exc.field) from None
        return replace(options, sampling=sampling, constraint_param="tool_choice")

    def _parameters(self) -> dict[str, dict]:
        return {
            tool["function"]["name"]: tool["function"].get("parameters") or NO_PARAMETERS
            for tool in self.tools or []
        }

    def extract(self, text: str) -> Extracted:
        """The calls in a choice's whole text (see the module doc); none if it has none."""
        if self.choice == NAMED:
            return Extracted(None, (ToolCall(self.function, text),))
        extracted = (
            _required_calls(text) if self.choice == "required" else self.parser.extract(text)
        )
        if not self.parallel and len(extracted.calls) > 1:
            return Extracted(extracted.content, extracted.calls[:1])
        return extracted

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """The choice's finish reason: "tool_calls" when "auto" found calls or "required"'s
        array was complete (it stopped rather than ran out of tokens), else the engine's."""
        if called and reason in ("stop", "length") and self.choice == "auto":
            return "tool_calls"
        if called and reason == "stop" and self.choice == "required":
            return "tool_calls"
        return reason


def required_schema(tools: list[dict]) -> dict:
    """vLLM's schema for ``tool_choice: "required"``: an array of at least one call, each
    ``{"name": <one tool's name>, "parameters": <that tool's parameters>}``; the tools'
    ``$defs`` move to the top so their ``$ref``s (``#/$defs/...``) resolve there."""
    alternatives, defs = [], {}
    for tool in tools:
        function = tool["function"]
        parameters = copy.deepcopy(function.get("parameters") or NO_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise bad_request(
                    f"the tools define '$defs' {_show(name)} twice, differently",
                    param="tools",
                )
            defs[name] = schema
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": alternatives},
    }
    if defs:
        schema["$defs"] = defs
    return schema


def _required_calls(text: str) -> Extracted:
    """The output of "required", ``[{"name", "parameters"}, ...]``, as calls (none if it is not
    complete: it ran out of tokens). Only ``name`` and ``parameters`` are read: the schema,
    vLLM's, lets a call have other keys, and one named ``arguments`` is not its arguments."""
    try:
        values = json.loads(text)
    except (ValueError, RecursionError):
        return no_calls(text)
    calls = [_required_call(v) for v in values] if isinstance(values, list) else []
    if not calls or None in calls:
        return no_calls(text)
    return Extracted(None, tuple(calls))


def _required_call(value: object) -> ToolCall | None:
    """One item of "required"'s array as a call, else None."""
    if not isinstance(value, dict):
        return None
    name, parameters = value.get("name"), value.get("parameters")
    if not isinstance(name, str) or not name or not isinstance(parameters, dict):
        return None
    return ToolCall(name, json.dumps(parameters, ensure_ascii=False))


def parse_tool_request(body: dict, parser: ToolParser | None) -> ToolRequest:
    """``tools`` and ``tool_choice`` of a chat request, checked (a 400 naming the field);
    ``parser``: the server's for "auto" (None: "auto" is refused, as vLLM refuses it
    without ``--enable-auto-tool-choice``)."""
    tools = body.get("tools")
    if tools is not None:
        _check_tools(tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):  # (1 == True: not `in`)
        raise bad_request(
            f"'parallel_tool_calls' must be a boolean, got {_show(parallel)}",
            param="parallel_tool_calls",
        )
    choice = body.get("tool_choice")
    if choice is None:  # vLLM: "auto" when it can, else tools are only shown to the model
        choice = "auto" if tools and parser is not None else "none"
    if choice == "none":
        return ToolRequest(tools or None)
    if isinstance(choice, dict):
        return ToolRequest(tools, NAMED, _named_function(choice, tools))
    if choice not in TOOL_CHOICES:
        raise bad_request(
            '\'tool_choice\' must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {_show(choice)}',
            param="tool_choice",
        )
    if tools is None:
        raise bad_request(f"'tool_choice' {_show(choice)} needs 'tools'", param="tool_choice")
    if not tools:  # OpenAI's and vLLM's reading of "required" with no tools: "none"
        return ToolRequest(None)
    if choice == "auto" and parser is None:
        raise bad_request(
            "'tool_choice' \"auto\" needs the server started with --enable-auto-tool-choice "
            "and --tool-call-parser",
            param="tool_choice",
        )
    parser = parser if choice == "auto" else None
    return ToolRequest(tools, choice, parser=parser, parallel=parallel is not False)


def _check_tools(tools: object) -> None:
    """OpenAI's function definitions: ``{"type": "function", "function": {"name",
    "description", "parameters"}}``, names distinct."""
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function definitions", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f"{where} must be {{'type': 'function', 'function': {{...}}}}: only functions "
                "are tools",
                param="tools",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise bad_request(
                f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got "
                f"{_show(name)}",
                param="tools",
            )
        if name in names:
            raise bad_request(f"{where}: two tools are named {_show(name)}", param="tools")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(
                f"{where}.function.parameters must be a JSON schema (an object)", param="tools"
            )


def _named_function(choice: dict, tools: list[dict] | None) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            "'tool_choice' must name a function as "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {_show(choice)}',
            param="tool_choice",
        )
    if name not in {tool["function"]["name"] for tool in tools or []}:
        raise bad_request(
            f"'tool_choice' names the function {_show(name)}, which 'tools' does not define",
            param="tool_choice",
        )
    return name


def tool_call_id() -> str:
    """A call's id, vLLM's spelling."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def wire_calls(extracted: Extracted) -> list[dict]:
    """A whole answer's ``tool_calls``."""
    return [protocol.tool_call(tool_call_id(), c.name, c.arguments) for c in extracted.calls]


class ToolCallStream:
    """One streamed choice of a request that may call tools: each piece of text in, the
    content and call deltas a client may have now out.

    A named call's text is its arguments, streamed as they come. Otherwise text that may be
    a call is held back (all of "required"'s; "auto"'s from where its parser says a call may
    start) and decided when the choice ends, by the same ``extract`` a whole answer uses: so
    the pieces add up to the non-streamed answer exactly."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.called = False
        self._named_id: str | None = None

    def feed(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        """The content and the ``tool_calls`` deltas to send after ``piece``."""
        self.text += piece
        if self.request.choice == NAMED:
            self.called = True
            if self._named_id is None:
                self._named_id = tool_call_id()
                return "", protocol.tool_call_deltas(
                    0, self._named_id, self.request.function, piece
                )
            return "", [{"index": 0, "function": {"arguments": piece}}] if piece else []
        if not finished:
            if self.request.choice == "required":
                return "", []
            return self._content_up_to(self.request.parser.held_from(self.text)), []
        extracted = self.request.extract(self.text)
        if not extracted.calls:
            return self._content_up_to(len(self.text)), []
        self.called = True
        content = (extracted.content or "")[self.sent :]
        deltas = []
        for index, call in enumerate(extracted.calls):
            deltas += protocol.tool_call_deltas(index, tool_call_id(), call.name, call.arguments)
        return content, deltas

    def _content_up_to(self, end: int) -> str:
        content = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return content
