"""A prompt, checked: from what a caller passes to the token ids the scheduler gets.

Exactly the documented prompt types are accepted -- a str, a list or tuple of ints (or a
1-D integer NumPy array), or a dict with ``prompt_token_ids`` (and optionally the ``prompt``
text they came from) or ``prompt`` -- and anything else, or anything that could never fit the
model, is an ``InvalidRequestError`` saying why, before any work proportional to its size:
a text too long to fit the context is refused before the tokenizer sees it -- unless the
request asks for its prompt to be cut to its last tokens (``truncate_prompt_tokens``), when
the whole text is tokenized and its tail kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mie.checks import is_int
from mie.engine.sampling import InvalidRequestError
from mie.engine.tokenizer import Tokenizer

Prompt = str | list[int] | dict


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """``LLM.generate``'s and ``LLM.beam_search``'s first argument as a list of prompts: one
    prompt (a str, a dict, or a list of token ids) or a list or tuple of them."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(
            f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}",
            field="prompt",
        )
    return list(prompts)


def prompt_token_ids(
    prompt: Prompt,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    vocab_size: int,
    keep_last: int | None = None,
) -> tuple[str | None, list[int]]:
    """A prompt's text (if any) and token ids, every id in ``[0, vocab_size)`` and at most
    ``max_model_len`` of them; with ``keep_last``, only its last ``keep_last`` tokens (vLLM's
    ``truncate_prompt_tokens``: the text stays whole)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidRequestError(
                    f"'prompt' must be a str, got {text!r:.80}", field="prompt"
                )
            ids = prompt["prompt_token_ids"]
            return text, checked_token_ids(ids, max_model_len, vocab_size, keep_last)
        if "prompt" not in prompt:
            raise InvalidRequestError(
                "a dict prompt needs 'prompt_token_ids' or 'prompt'", field="prompt"
            )
        prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"'prompt' must be a str, got {prompt!r:.80}", field="prompt")
    if isinstance(prompt, str):
        token_ids = encode_prompt(prompt, tokenizer, None if keep_last else max_model_len)
        return prompt, checked_token_ids(token_ids, max_model_len, vocab_size, keep_last)
    return None, checked_token_ids(prompt, max_model_len, vocab_size, keep_last)


def prompt_tokens_kept(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps (-1: the context
    length; None: all of them), refusing more than the context."""
    cut = truncate_prompt_tokens
    if cut is None:
        return None
    if cut == -1:
        return max_model_len
    if cut > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens {cut} exceeds the model's context length {max_model_len}",
            field="truncate_prompt_tokens",
        )
    return cut


def check_fits_context(prompt_length: int, max_tokens: int, max_model_len: int) -> None:
    """The rule where a request must get every token it asks for (a beam search; a request
    over HTTP, as vLLM's server rules): prompt + ``max_tokens`` within the context, else an
    ``InvalidRequestError`` naming the prompt. (Offline, ``LLMEngine`` ends a longer request
    at the context's end instead, as vLLM's offline engine does.)"""
    if prompt_length + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context length {max_model_len}",
            field="prompt",
        )


def encode_prompt(text: str, tokenizer: Tokenizer | None, max_model_len: int | None) -> list[int]:
    """Tokenize a prompt, refusing first what the tokenizer cannot take or what could
    never fit: the work is bounded by the context length, not by the input's size (None: a
    prompt to be truncated, whose tokens are all needed to find its tail)."""
    if tokenizer is None:
        raise InvalidRequestError(
            "this model has no tokenizer (no tokenizer.json, or a GGUF file without a "
            "vocabulary): prompts must be token ids (a list of ints, or a dict with "
            "'prompt_token_ids')",
            field="prompt",
        )
    if not text:
        raise InvalidRequestError("the prompt is empty", field="prompt")
    limit = max_model_len * tokenizer.max_token_chars if max_model_len else len(text)
    if len(text) > limit:
        raise InvalidRequestError(
            f"the prompt has {len(text)} characters: it cannot fit the model's context of "
            f"{max_model_len} tokens (at most {limit} characters)",
            field="prompt",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"the prompt is not valid Unicode: {exc.reason} at character {exc.start}",
            field="prompt",
        ) from None
    try:
        return tokenizer.encode(text)
    except Exception as exc:  # the Rust tokenizer raises its own types on odd input
        raise InvalidRequestError(
            f"the tokenizer cannot encode the prompt: {exc}", field="prompt"
        ) from exc


def checked_token_ids(
    token_ids: object, max_model_len: int, vocab_size: int, keep_last: int | None = None
) -> list[int]:
    """``token_ids`` as a list of Python ints, if it is a non-empty sequence of at most
    ``max_model_len`` integers in ``[0, vocab_size)`` (bools are not token ids), after
    keeping its last ``keep_last`` (None: all)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise InvalidRequestError(
                f"token ids must be a 1-D integer array, got {token_ids.dtype} of shape "
                f"{token_ids.shape}",
                field="prompt",
            )
        token_ids = token_ids.tolist()
    elif not isinstance(token_ids, (list, tuple)):
        raise InvalidRequestError(
            "a prompt is a string, a list of token ids or a dict, got "
            f"{type(token_ids).__name__}: {token_ids!r:.80}",
            field="prompt",
        )
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", field="prompt")
    if keep_last is not None:
        token_ids = token_ids[-keep_last:]
    if len(token_ids) > max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(token_ids)} tokens, more than the model's context length "
            f"{max_model_len}",
            field="prompt",
        )
    for t in token_ids:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"token id {t!r:.40} is outside the vocabulary [0, {vocab_size})", field="prompt"
            )
    return [int(t) for t in token_ids]
