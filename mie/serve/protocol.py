"""The OpenAI wire format: request bodies in (validated), JSON responses and SSE chunks out.

Everything here is plain data in, plain data out, so it is independent of the HTTP stack
and of the engine. Every problem with a request is an ``APIError`` carrying the HTTP status
and OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from mie.engine.sampling import SamplingParams

ROLES = ("system", "user", "assistant")

# Stop strings are matched on the engine thread after every step, so their number and size
# bound work every other client waits for. OpenAI allows 4 stop strings; 16 leaves room for
# chat templates with several end markers, and 1024 characters is far beyond any real stop
# marker (tens of characters). The matcher's state is then at most 16K small ints per request.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters
MAX_MESSAGE_SHOWN = 1000  # an error message is cut here: it may quote the client's input

# Fields of OpenAI's API that mie does not implement: accepted only at their no-op values,
# so a client that relies on one gets a clear 400 instead of a silently different answer.
UNSUPPORTED = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "response_format": ({"type": "text"},),
}


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE_SHOWN:
            message = message[: MAX_MESSAGE_SHOWN - 3] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- requests ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """What a completion or chat request asks for, besides its prompt or messages."""

    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]  # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=max_tokens,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying why it is not one.

    ``json.loads`` refuses input in more ways than ``JSONDecodeError``: invalid UTF-8 is a
    ``UnicodeDecodeError``, an integer of more than 4300 digits a plain ``ValueError``
    (Python's int-parsing limit), and arrays nested a few thousand deep a ``RecursionError``.
    All of them are the client's malformed body.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise bad_request(f"malformed JSON body: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def parse_options(body: dict, model_name: str, *, chat: bool) -> Options:
    """Check the model name and every common field's type and range (OpenAI's rules)."""
    model = _field(body, "model", str, "a string", required=True)
    if model != model_name:
        raise bad_request(
            f"the model {_show(model)} does not exist; this server serves '{model_name}'",
            param="model",
            code="model_not_found",
        )
    for name, allowed in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(_same_json(value, a) for a in allowed):
            raise bad_request(f"'{name}' is not supported by mie (got {_show(value)})", param=name)
    max_tokens_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else None
    max_tokens_name = max_tokens_name or "max_tokens"
    max_tokens = _field(body, max_tokens_name, int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{max_tokens_name}' must be at least 1, got {_show(max_tokens)}",
                          param=max_tokens_name)  # fmt: skip
    temperature = _number(body, "temperature", default=1.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise bad_request(f"'temperature' must be >= 0, got {temperature}", param="temperature")
    top_p = _number(body, "top_p", default=1.0)
    if not 0 < top_p <= 1:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _field(body, "top_k", int, "an integer", default=-1)
    if top_k != -1 and top_k < 1:
        raise bad_request(f"'top_k' must be -1 (disabled) or >= 1, got {_show(top_k)}",
                          param="top_k")  # fmt: skip
    stop = _field(body, "stop", (str, list), "a string or a list of strings", default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                          "allowed", param="stop", code="stop_limit")  # fmt: skip
    for s in stop:
        if len(s) > MAX_STOP_LENGTH:
            raise bad_request(f"a stop string has {len(s)} characters; at most "
                              f"{MAX_STOP_LENGTH} are allowed", param="stop",
                              code="stop_limit")  # fmt: skip
        _check_unicode(s, "stop")
    stop_token_ids = _field(body, "stop_token_ids", list, "a list of integers", default=[])
    if not all(_is_int(t) and t >= 0 for t in stop_token_ids):
        raise bad_request("'stop_token_ids' must be non-negative integers", param="stop_token_ids")
    stream = _field(body, "stream", bool, "a boolean", default=False)
    stream_options = _field(body, "stream_options", dict, "an object", default={})
    include_usage = _field(stream_options, "include_usage", bool, "a boolean", default=False)
    return Options(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=_field(body, "seed", int, "an integer"),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_field(body, "ignore_eos", bool, "a boolean", default=False),
        stream=stream,
        include_usage=include_usage,
    )


def parse_prompt(body: dict) -> str | list[int]:
    """A completion's prompt: a string or a list of token ids (or a list holding one)."""
    prompt = _field(body, "prompt", (str, list), "a string or a list of token ids", required=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' is empty", param="prompt")
        if not all(_is_int(t) for t in prompt):
            raise bad_request(
                "'prompt' must be a string or a list of token ids; mie takes one prompt "
                "per request",
                param="prompt",
            )
    elif not prompt:
        raise bad_request("'prompt' is empty", param="prompt")
    else:
        _check_unicode(prompt, "prompt")
    return prompt


def parse_messages(body: dict) -> list[dict[str, str]]:
    """Chat messages as ``[{"role", "content"}]`` with text content (text parts joined)."""
    messages = _field(body, "messages", list, "a list of messages", required=True)
    if not messages:
        raise bad_request("'messages' must not be empty", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)}",
                              param=f"{where}.role")  # fmt: skip
        parsed.append({"role": role, "content": _text_content(message.get("content"), where)})
    return parsed


def _text_content(content: object, where: str) -> str:
    text = None
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        text = "".join(p["text"] for p in content)
    if text is not None:
        _check_unicode(text, f"{where}.content")
        return text
    raise bad_request(
        f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
    )


def _field(body: dict, name: str, kind, what: str, *, default=None, required: bool = False):
    """``body[name]`` if present and of JSON type ``kind`` (null counts as absent)."""
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"'{name}' is required", param=name)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(_is_json_kind(value, k) for k in kinds):
        raise bad_request(f"'{name}' must be {what}, got {_json_type(value)}", param=name)
    return value


def _number(body: dict, name: str, *, default: float) -> float:
    """A number field as a float: an integer too large for a float is a 400, not an
    ``OverflowError``."""
    value = _field(body, name, float, "a number", default=default)
    try:
        return float(value)
    except OverflowError:
        raise bad_request(f"'{name}' is out of range, got {_show(value)}", param=name) from None


def _check_unicode(text: str, param: str) -> None:
    """Text must be encodable: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no
    tokenizer (or UTF-8 encoder) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"'{param}' is not valid Unicode: a lone surrogate {text[exc.start]!r} at "
            f"character {exc.start}",
            param=param,
        ) from None


def _show(value: object, limit: int = 60) -> str:
    """``repr`` of a client's value, cut short (it may be a megabyte, or a 4000-digit int)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_json_kind(value: object, kind: type) -> bool:
    if kind is int:
        return _is_int(value)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same_json(a: object, b: object) -> bool:
    """Equal as JSON values: 0 == 0.0, but False != 0."""
    if _is_json_kind(a, float) and _is_json_kind(b, float):
        return a == b
    return type(a) is type(b) and a == b


def _json_type(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


# -- responses --------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(request_id, created, model, text, finish_reason, usage_) -> dict:
    """A whole ``text_completion`` (``stream: false``)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(request_id, "text_completion", created, model, [choice], usage_)


def completion_chunk(request_id, created, model, text, finish_reason=None) -> dict:
    """One streamed piece of a completion: the new text, and the finish reason at the end."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(request_id, "text_completion", created, model, [choice])


def chat_completion(request_id, created, model, text, finish_reason, usage_) -> dict:
    """A whole ``chat.completion`` (``stream: false``)."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    return _envelope(request_id, "chat.completion", created, model, [choice], usage_)


def chat_chunk(request_id, created, model, delta: dict, finish_reason=None) -> dict:
    """One streamed ``chat.completion.chunk``: the first delta carries the role."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(request_id, "chat.completion.chunk", created, model, [choice])


def usage_chunk(request_id, created, model, object_: str, usage_: dict) -> dict:
    """The last streamed chunk when ``stream_options.include_usage``: no choices, the usage."""
    return _envelope(request_id, object_, created, model, [], usage_)


def _envelope(request_id, object_, created, model, choices, usage_=None) -> dict:
    body = {"id": request_id, "object": object_, "created": created, "model": model,
            "choices": choices}  # fmt: skip
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_chunk(error: APIError) -> dict:
    """A streamed error, in OpenAI's shape: ``{"error": {...}}`` (the ``openai`` client raises
    ``APIError`` on it); ``[DONE]`` follows."""
    return error.body()


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` ends a stream)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
