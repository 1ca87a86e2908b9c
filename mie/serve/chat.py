"""Chat messages -> one prompt: the checkpoint's Jinja chat template, or a plain default.

A checkpoint's ``tokenizer_config.json`` may carry ``chat_template`` (a Jinja string, or a
list of named templates of which "default" is used). It is rendered the way transformers'
``apply_chat_template`` renders it -- sandboxed Jinja with ``trim_blocks`` and
``lstrip_blocks``, ``messages``, ``add_generation_prompt=True``, ``bos_token``/``eos_token``
and ``raise_exception`` -- and the text is encoded *without* adding special tokens, since the
template spells out the ones it wants.

Checkpoints without a template (stories260K) get ``DEFAULT_TEMPLATE``: one line per message,
``"<Role>: <content>"``, then ``"Assistant:"`` for the model to continue; that prompt is
encoded like a completion prompt (with BOS when the tokenizer adds one).
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mie.engine.tokenizer import TOKENIZER_CONFIG, Tokenizer, TokenizerError, read_tokenizer_config
from mie.serve.protocol import bad_request

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplate:
    """Renders and encodes chat messages for one checkpoint."""

    def __init__(self, model_dir: str | Path, tokenizer: Tokenizer) -> None:
        config = read_tokenizer_config(model_dir)  # TokenizerError if malformed
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        self.from_checkpoint = isinstance(source, str)
        self._tokenizer = tokenizer
        self._special_tokens = {
            "bos_token": _token_text(config.get("bos_token")),
            "eos_token": _token_text(config.get("eos_token")),
        }
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source if self.from_checkpoint else DEFAULT_TEMPLATE)
        except jinja2.TemplateSyntaxError as exc:
            path = Path(model_dir) / TOKENIZER_CONFIG
            raise TokenizerError(f"{path}: chat_template is not valid Jinja ({exc})") from None

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text; a template that rejects the messages is a 400."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, **self._special_tokens
            )
        except jinja2.TemplateError as exc:
            raise bad_request(f"chat template: {exc}", param="messages") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt (see the module doc for special tokens)."""
        return self._tokenizer.encode(text, add_special_tokens=not self.from_checkpoint)


def _token_text(token: object) -> str:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
