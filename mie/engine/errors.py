"""The engine's own errors: the one every invalid request raises, whichever part of the engine
finds the problem, and the tokenizer's."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or its sampling parameters are invalid; nothing was changed.

    ``field``: the argument at fault (a ``SamplingParams`` field, ``prompt``...) when one is,
    so a caller can name it without reading the message (the server's 400 ``param``).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TokenizerError(ValueError):
    """tokenizer.json or tokenizer_config.json (or a GGUF file's vocabulary) is missing,
    cannot be read, or is malformed; the message names the file."""
