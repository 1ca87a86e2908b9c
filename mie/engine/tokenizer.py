"""The tokenizer (Hugging Face ``tokenizers``, from ``tokenizer.json``) and streaming decode.

Streaming text one token at a time is subtle: with byte-fallback BPE a multi-byte character
(an emoji, a CJK ideograph) may span several tokens, and decoding a token alone may also lose
a leading space that only appears in context. ``IncrementalDetokenizer`` therefore re-decodes
a short window of recent tokens and emits only text that is complete: while the window still
ends in the replacement character U+FFFD (an unfinished UTF-8 sequence), it waits.
"""

from __future__ import annotations

import functools
from pathlib import Path

from mie.checkpoint import CheckpointError, listed, read_json
from mie.checks import short_repr as _short
from mie.engine.errors import TokenizerError
from mie.gguf_file import GGUFFile

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers' save_pretrained puts it now
# The special tokens a tokenizer config may name, all handed to its chat template (as
# transformers' ``SPECIAL_TOKENS_ATTRIBUTES`` are).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Encode prompts and decode token ids with a checkpoint's ``tokenizer.json``, or with
    the vocabulary of a GGUF file (``model`` is then the file: ``mie.engine.gguf_vocab``).

    ``config`` is what a ``tokenizer_config.json`` holds (special tokens, ``chat_template``),
    from the checkpoint's, or from the GGUF file's metadata; ``config_path`` names its file.
    ``gguf_metadata``: that file's metadata, when the caller has read it already (parsing a
    large vocabulary takes a while).
    """

    def __init__(self, model: str | Path, *, gguf_metadata: dict | None = None) -> None:
        self._gguf_metadata = None
        if Path(model).is_file():
            self._gguf_metadata = _gguf_metadata(model) if gguf_metadata is None else gguf_metadata
            self._tokenizer, self.config = _gguf_tokenizer(self._gguf_metadata, str(model))
            self.config_path = str(model)
        else:
            self._tokenizer = _tokenizer_json(Path(model) / "tokenizer.json")
            self.config = read_tokenizer_config(model)
            self.config_path = str(Path(model) / TOKENIZER_CONFIG)
        bos = special_token_text(self.config, "bos_token")
        self.bos_token_id = _special_id(self._tokenizer, bos)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` leaves out: the added tokens
        marked special (BOS, EOS, ``<unk>``, chat markers)."""
        added = self._tokenizer.get_added_tokens_decoder()
        return frozenset(token_id for token_id, token in added.items() if token.special)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest token
        string in the vocabulary (byte-level and byte-fallback spellings are at least as long
        as the text they decode to), doubled for normalizers that drop characters. A prompt
        longer than the context times this cannot fit, and is refused before it is encoded."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        return 2 * max((len(token) for token in vocab), default=1)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizers`` serializes it: what the grammar engine reads. A
        GGUF file's SentencePiece vocabulary encodes through a Python step ``tokenizers``
        cannot serialize; the grammar engine gets the same vocabulary and decoding built
        serializably (``build_tokenizer(..., serializable=True)``) -- it reads the tokens'
        bytes, never how prompts are cut."""
        if self._gguf_metadata is None:
            return self._tokenizer.to_str()
        tokenizer, _ = _gguf_tokenizer(self._gguf_metadata, self.config_path, serializable=True)
        return tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the special tokens the tokenizer adds (e.g. BOS) unless
        ``add_special_tokens`` is False (a rendered chat template already spells them out)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _tokenizer_json(path: Path):
    """The ``tokenizers`` tokenizer a ``tokenizer.json`` describes; ``TokenizerError`` naming
    the file for anything else."""
    if not listed(path):  # a dangling symlink fails below, naming the file
        raise TokenizerError(f"{path}: no tokenizer.json (pass token ids instead of text)")
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return HFTokenizer.from_file(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the Rust library's own types; a Rust panic is neither
        raise TokenizerError(f"{path}: cannot load tokenizer: {_one_line(exc)}") from None


def _gguf_metadata(path: str | Path) -> dict:
    """A GGUF file's metadata; a file that cannot be read is a ``TokenizerError`` naming it."""
    try:
        return GGUFFile(path).metadata
    except CheckpointError as exc:
        raise TokenizerError(str(exc)) from None


def _gguf_tokenizer(metadata: dict, path: str, serializable: bool = False):
    """A GGUF file's tokenizer and tokenizer config, built from its metadata as llama.cpp
    reads it (``mie.engine.gguf_vocab``)."""
    from mie.engine.gguf_vocab import build_tokenizer

    return build_tokenizer(metadata, path, serializable=serializable)


def read_tokenizer_config(model_dir: str | Path) -> dict:
    """The checkpoint's ``tokenizer_config.json`` (``{}`` when there is none), checked, with
    its ``chat_template`` replaced by ``chat_template.jinja`` when the checkpoint has one (as
    transformers loads it: its ``save_pretrained`` writes the template there, not into the
    config).

    The fields mie reads must have the types transformers writes: ``chat_template`` a string
    or a list of ``{"name": str, "template": str}``, special tokens (``SPECIAL_TOKENS``) a
    string or ``{"content": str, ...}``. Anything else is a ``TokenizerError`` naming the
    file, not a template or token silently ignored (or an ``AttributeError`` at start-up).
    """
    path = Path(model_dir) / TOKENIZER_CONFIG
    config = _read_tokenizer_config(path) if listed(path) else {}
    template = Path(model_dir) / CHAT_TEMPLATE_FILE
    if listed(template):
        try:
            config["chat_template"] = template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{template}: cannot be read as UTF-8 text: {exc}") from None
    return config


def _read_tokenizer_config(path: Path) -> dict:
    """``read_tokenizer_config``'s reading and checking of ``tokenizer_config.json``."""
    try:
        config = read_json(path)
    except CheckpointError as exc:  # the message already names the file
        raise TokenizerError(str(exc)) from None
    template = config.get("chat_template")
    if not (
        template is None
        or isinstance(template, str)
        or (
            isinstance(template, list)
            and all(
                isinstance(t, dict)
                and isinstance(t.get("name"), str)
                and isinstance(t.get("template"), str)
                for t in template
            )
        )
    ):
        raise TokenizerError(
            f"{path}: chat_template must be a string or a list of "
            f'{{"name": string, "template": string}}, got {_short(template)}'
        )
    for name in SPECIAL_TOKENS:
        token = config.get(name)
        if not (
            token is None
            or isinstance(token, str)
            or (isinstance(token, dict) and isinstance(token.get("content"), str))
        ):
            raise TokenizerError(
                f'{path}: {name} must be a string or {{"content": string}}, got {_short(token)}'
            )
    return config


def special_token_text(config: dict, name: str) -> str | None:
    """A special token's text from a checked tokenizer config (a string or ``{"content": ...}``)."""
    token = config.get(name)
    return token.get("content") if isinstance(token, dict) else token


def _special_id(tokenizer, text: str | None) -> int | None:
    """The id of a special token's text, if the vocabulary has it."""
    return tokenizer.token_to_id(text) if text is not None else None


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (the Rust library's may span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class IncrementalDetokenizer:
    """Turn a growing list of generated token ids into text deltas that are safe to print.

    ``prefix_offset..read_offset`` is a window of tokens already turned into text; decoding
    from ``prefix_offset`` gives the context that keeps spaces right, and only the part beyond
    the window's own text is new. Same idea as vLLM's ``detokenize_incrementally``. Special
    tokens (BOS, EOS, chat markers) add no text unless ``skip_special_tokens`` is False
    (``SamplingParams``' field); skipped, they are left out of the window altogether, so a
    run of them (a prompt of ``<unk>`` markers) cannot fill the context and cost the next
    token its leading space (``▁and`` after "t" and five ``<unk>`` is " and", as
    transformers decodes the whole sequence).
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._tokens = [t for t in prompt_token_ids if t not in self._skipped]
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - self.CONTEXT_TOKENS, 0)
        # The context window must not start inside a multi-byte character: byte-fallback
        # decoders turn a whole run of bytes into U+FFFD once one of them is invalid. A UTF-8
        # character is at most 4 bytes, so at most 3 steps back reach its first byte.
        for _ in range(3):
            window = self._tokens[self._prefix_offset : self._read_offset]
            if self._prefix_offset == 0 or "\ufffd" not in self._decode(window):
                break
            self._prefix_offset -= 1

    MAX_UNREAD_TOKENS = 8  # a UTF-8 character spans at most 4 byte tokens

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty).

        The work per token is bounded: the decoded window never holds more than
        ``CONTEXT_TOKENS`` + ``MAX_UNREAD_TOKENS`` tokens. Past that many tokens without
        visible text (bytes that never make a character), the text so far is emitted as
        it decodes -- with U+FFFD for bytes that never became a character -- and the window
        moves on, instead of re-decoding an ever longer tail every step. A skipped special
        token adds nothing and is not kept.
        """
        if token_id in self._skipped:
            return ""
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        unread = len(self._tokens) - self._read_offset
        if unread <= self.MAX_UNREAD_TOKENS and (
            full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text)
        ):
            return ""  # an unfinished character, or nothing visible yet: wait
        self._prefix_offset = max(self._read_offset, len(self._tokens) - self.CONTEXT_TOKENS)
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :]

    def peek(self, token_id: int) -> str:
        """The text ``add(token_id)`` would return, the detokenizer left as it was: a token's
        text *in context* (``▁c`` after "sand" is " c", where decoded alone it is "c"), for
        the log-probabilities of the token there and of its alternatives. Like ``add``, a
        token that leaves a character unfinished (a byte-fallback token) or adds nothing to
        the text (a skipped special token) gets ""; the token that completes a character
        gets all of it, so the texts of a sequence's tokens add up to its text."""
        state = self.checkpoint()
        try:
            return self.add(token_id)
        finally:
            self.restore(state)

    def checkpoint(self) -> tuple[int, int, int]:
        """What ``add`` changes, for ``restore`` (the engine undoes a failed step with it)."""
        return len(self._tokens), self._prefix_offset, self._read_offset

    def restore(self, state: tuple[int, int, int]) -> None:
        num_tokens, self._prefix_offset, self._read_offset = state
        del self._tokens[num_tokens:]
