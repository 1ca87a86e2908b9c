"""Chat messages -> one prompt: the checkpoint's Jinja chat template, or a plain default.

A checkpoint's ``chat_template.jinja`` or ``tokenizer_config.json`` may carry its template
(a Jinja string, or a list of named templates: "tool_use" for a request with tools when there
is one, else "default", as transformers chooses). It is rendered the way transformers'
``apply_chat_template`` renders it (``transformers.utils.chat_template_utils``), since the
published templates are written against that environment and nothing else:

* a sandboxed Jinja environment with ``trim_blocks``, ``lstrip_blocks`` and the loop-controls
  extension (``{% break %}``, ``{% continue %}``); a ``{% generation %}`` block (which
  transformers uses to mark the assistant's tokens) renders its body;
* the globals ``raise_exception`` (a template refusing the messages), ``strftime_now``
  (Llama 3.x writes today's date into its system header with it, else a fixed 2024 date)
  and ``tojson`` as transformers overrides it (no HTML escaping, non-ASCII kept);
* the variables ``messages``, ``add_generation_prompt`` (True unless the request says
  otherwise), ``tools`` and ``documents`` (the request's, or None: retrieved texts for the
  templates that show them, such as Command R's and Granite's), every special token the
  config names (``bos_token``, ``eos_token``, ``unk_token``, ...; a token the config leaves out
  stays undefined, as there) and the request's ``chat_template_kwargs`` (vLLM's: Qwen3's
  ``enable_thinking``, say; they may override a special token, as in transformers);
* ``continue_final_message`` (vLLM's and transformers'): the prompt ends inside the last
  message, for the model to continue it (a "prefilled" answer), found as transformers finds
  it -- a tag appended to the message's text, the rendered text cut where the tag begins.

The text is encoded *without* adding special tokens, since the template spells out the ones
it wants. A template that raises (Mistral's "conversation roles must alternate ...") is an
``InvalidRequestError`` naming ``messages`` from ``apply`` (over HTTP, a 400 naming it).

``chat_messages`` checks the messages and gives them the shapes the templates read, for
``LLM.chat`` and the server alike.

Checkpoints without a template (stories260K) get ``DEFAULT_TEMPLATE``: one line per message,
``"<Role>: <content>"``, then ``"Assistant:"`` for the model to continue; that prompt is
encoded like a completion prompt (with BOS when the tokenizer adds one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mie.checks import short_repr
from mie.engine.sampling import InvalidRequestError
from mie.engine.tokenizer import (
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS,
    TOKENIZER_CONFIG,
    Tokenizer,
    TokenizerError,
    read_tokenizer_config,
)

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the continued message's end
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
"""Template variables a request's ``chat_template_kwargs`` may not set: the ones it has
fields of its own for."""


class ChatTemplate:
    """Renders and encodes chat messages for one checkpoint."""

    def __init__(
        self, model_dir: str | Path, tokenizer: Tokenizer | None, template: str | None = None
    ) -> None:
        """``template``: a Jinja template of the caller's own in place of the checkpoint's
        (``LLM.chat``'s ``chat_template``; it writes its special tokens itself, as a
        checkpoint's does)."""
        # The tokenizer's config (a GGUF file's is in its metadata), else the checkpoint's.
        config = tokenizer.config if tokenizer is not None else read_tokenizer_config(model_dir)
        if template is not None and not isinstance(template, str):
            message = f"chat_template must be a str, got {short_repr(template)}"
            raise InvalidRequestError(message, field="chat_template")
        source = config.get("chat_template") if template is None else template
        if isinstance(source, list):  # [{"name": ..., "template": ...}] (checked when read)
            named = {t["name"]: t["template"] for t in source}
        else:
            named = {"default": source} if isinstance(source, str) else {}
        self.from_checkpoint = bool(named)
        self._tokenizer = tokenizer
        self._special_tokens = {
            name: text
            for name in SPECIAL_TOKENS
            if (text := _token_text(config.get(name))) is not None
        }
        env = template_environment()
        try:
            self._templates = {name: env.from_string(text) for name, text in named.items()}
        except jinja2.TemplateSyntaxError as exc:
            if template is not None:
                message = f"chat_template is not valid Jinja ({exc})"
                raise InvalidRequestError(message, field="chat_template") from None
            path = tokenizer.config_path if tokenizer else Path(model_dir) / TOKENIZER_CONFIG
            if (Path(model_dir) / CHAT_TEMPLATE_FILE).is_file():
                path = Path(model_dir) / CHAT_TEMPLATE_FILE
            raise TokenizerError(f"{path}: chat_template is not valid Jinja ({exc})") from None
        if not named:
            self._templates["default"] = env.from_string(DEFAULT_TEMPLATE)

    def apply(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> str:
        """The prompt text, by default ending with the assistant's turn opened;
        ``InvalidRequestError`` if the template refuses the messages (its
        ``raise_exception``, or an undefined value it trips over). ``tools``: the request's
        function definitions, for templates that show them to the model (``{"type":
        "function", "function": {...}}`` each, as transformers passes OpenAI-style tools).
        ``continue_final_message``: end the text inside the last message instead (it needs
        ``add_generation_prompt`` False). ``template_kwargs``: more template variables.
        ``documents``: texts for retrieval-augmented templates (``{"title", "text"}`` each,
        as transformers passes them)."""
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message needs add_generation_prompt false (the model "
                    "continues the last message rather than starting a new one)",
                    field="continue_final_message",
                )
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise InvalidRequestError(
                    "continue_final_message: the last message has no text to continue",
                    field="messages",
                )
            messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
        reserved = sorted(set(template_kwargs or ()) & set(RESERVED))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own "
                "fields do",
                field="chat_template_kwargs",
            )
        template = self._templates.get("tool_use") if tools else None
        template = template or self._templates.get("default")
        if template is None:
            raise InvalidRequestError(
                f"this checkpoint's chat templates ({', '.join(self._templates)}) have no "
                "'default' ('tool_use' serves requests with tools)",
                field="messages",
            )
        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                **{**self._special_tokens, **(template_kwargs or {})},
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template: {exc}", field="messages") from None
        if not continue_final_message:
            return text
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise InvalidRequestError(
                "continue_final_message: the chat template drops the last message's text, so "
                "the prompt cannot end inside it",
                field="messages",
            )
        end = text.rindex(tag)
        # The template kept the tag's trailing space: the text before it is the message's;
        # otherwise it trimmed the message's trailing whitespace, and so does the prompt.
        kept = text[end : end + len(CONTINUE_TAG)] == CONTINUE_TAG
        return text[:end] if kept else text[:end].rstrip()

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a rendered prompt: with the tokenizer's special tokens (BOS) only for
        the default template, unless the request says (vLLM's ``add_special_tokens``; see the
        module doc)."""
        if add_special_tokens is None:
            add_special_tokens = not self.from_checkpoint
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


def template_environment() -> jinja2.Environment:
    """The Jinja environment transformers' ``apply_chat_template`` renders templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body. (transformers also
    records where it falls, to mask the assistant's tokens in training; serving has no use
    for that.)"""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _token_text(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes ``<``, ``>``,
    ``&`` and ``'`` for HTML, and writes non-ASCII as ``\\u`` escapes)."""
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def chat_messages(messages: object) -> list[dict]:
    """Chat messages as the chat template reads them (vLLM's shapes): ``{"role", "content"}``
    with text content (text parts joined by newlines), and ``name`` when given; an
    assistant's earlier ``tool_calls`` (its content may then be null, given to the template
    as ""; an empty list is dropped, so that templates take their plain assistant path),
    each call's ``arguments`` decoded from their JSON text into an object as templates
    expect; a ``tool`` message's result with its ``tool_call_id``. ``InvalidRequestError``
    naming the part at fault (``messages[2].content``) for anything else."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise InvalidRequestError("'messages' must be a list of messages", field="messages")
    if not messages:
        raise InvalidRequestError("'messages' must not be empty", field="messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", field=where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {short_repr(role)}",
                field=f"{where}.role",
            )
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        content = message.get("content")
        if tool_calls is not None and content is None:
            one = {"role": role, "content": ""}
        else:
            one = {"role": role, "content": _text_content(content, where)}
        if tool_calls is not None:
            calls = _tool_calls(tool_calls, f"{where}.tool_calls")
            if calls:  # [] is dropped: templates then take their plain assistant path (vLLM)
                one["tool_calls"] = calls
        for name in ("name", "tool_call_id") if role == "tool" else ("name",):
            value = message.get(name)
            if value is not None and not isinstance(value, str):
                message = f"{where}.{name} must be a string"
                raise InvalidRequestError(message, field=f"{where}.{name}")
            if value is not None:
                one[name] = value
        if role == "tool" and "tool_call_id" not in one:
            raise InvalidRequestError(
                f"{where}.tool_call_id is required for a tool message",
                field=f"{where}.tool_call_id",
            )
        parsed.append(one)
    return parsed


def _tool_calls(calls: object, where: str) -> list[dict]:
    """An assistant's earlier calls, ``[{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]``, with the arguments decoded (vLLM does so for the templates:
    Qwen's and Llama's print them with ``tojson``)."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list of tool calls", field=where)
    parsed = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id", ""), str)
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise InvalidRequestError(
                f"{at} must be {{'id', 'type': 'function', 'function': {{'name': a string, "
                "'arguments': a JSON text}}}}",
                field=at,
            )
        try:
            arguments = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            raise InvalidRequestError(
                f"{at}.function.arguments is not JSON: {short_repr(function['arguments'])}",
                field=f"{at}.function.arguments",
            ) from None
        one = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if "id" in call:
            one["id"] = call["id"]
        parsed.append(one)
    return parsed


def _text_content(content: object, where: str) -> str:
    """A message's text: a string, or a list of text parts joined by newlines (vLLM's)."""
    text = None
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        text = "\n".join(p["text"] for p in content)  # vLLM's joining
    if text is None:
        raise InvalidRequestError(
            f"{where}.content must be a string or a list of text parts", field=f"{where}.content"
        )
    try:  # JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer accepts
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"'{where}.content' is not valid Unicode: a lone surrogate {text[exc.start]!r} at "
            f"character {exc.start}",
            field=f"{where}.content",
        ) from None
    return text
