"""A Hugging Face ``tokenizers`` tokenizer built from a GGUF file's vocabulary, as llama.cpp's.

A GGUF file carries its vocabulary as metadata (``tokenizer.ggml.*``), and what llama.cpp does
with that metadata is the file's truth -- not the ``tokenizer.json`` the file was converted
from. They differ: llama.cpp's converter gives every token of stories260K the score -1000, and
llama.cpp's SentencePiece tokenizer merges the highest-scoring adjacent pair, the leftmost
among equals -- so here always the leftmost -- which cuts "...a little girl named Lily." into
"▁li t t le" where stories260K's own tokenizer.json (a BPE with ranked merges) has "▁little".
A model run from a GGUF file must get llama.cpp's ids. This module reproduces llama.cpp's
tokenizer (``src/llama-vocab.cpp``, llama-cpp-python 0.3.36) for two vocabulary types:

* ``llama`` (SentencePiece): a space in front of the text and after every special token,
  spaces as "▁", then llama.cpp's bigram merging, then ``<0xXX>`` byte tokens for characters
  the vocabulary lacks. The merge order cannot be written as a ``tokenizers`` BPE's ranked
  merges -- ranks are unique and come before position, while llama.cpp's tie-break is the
  position -- so this step is a Python pre-tokenizer that cuts the text into the final pieces,
  which a merge-less BPE model maps to ids. ``tokenizers`` cannot serialize a Python
  component, so ``to_str()`` fails on these; ``build_tokenizer(..., serializable=True)`` gives
  one it can write, for readers of the vocabulary.
* ``gpt2`` (byte-level BPE with ``tokenizer.ggml.merges``): text split by llama.cpp's regexes
  for ``tokenizer.ggml.pre`` (a name not in ``PRE_TOKENIZERS`` is refused, never guessed), then
  ranked merges, decoded with llama.cpp's clean-up of spaces before punctuation where that
  name has it.

Control, unknown and user-defined tokens (``token_type`` 3, 2, 4, and the end-of-generation
texts llama.cpp makes control tokens whatever their type) are matched in the text as
llama.cpp's ``special=True`` does; control and unknown ones are dropped by
``decode(..., skip_special_tokens=True)``. BOS and EOS are added when llama.cpp adds them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping

from tokenizers import (
    AddedToken,
    NormalizedString,
    PreTokenizedString,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from mie.engine.errors import TokenizerError

# llama.cpp's token types (gguf.TokenType) that matter here.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# llama.cpp's regexes (unicode.cpp / llama-vocab.cpp), applied one after the other.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


class _Pre:
    """What one ``tokenizer.ggml.pre`` name sets in llama.cpp's BPE tokenizer."""

    def __init__(self, regexes: tuple[str, ...], *, ignore_merges=False, add_bos=False, clean=True):
        self.regexes = regexes
        self.ignore_merges = ignore_merges  # a whole pre-token that is a token is taken as is
        self.add_bos = add_bos  # the default when tokenizer.ggml.add_bos_token is absent
        self.clean_spaces = clean  # detokenizing drops the space in " ." and the like


_DIGIT_THEN_GPT2 = (r"\p{N}", _GPT2)
# Every name llama.cpp gives these regexes and flags, and nothing else (llama_vocab::impl::load).
PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ["gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "mpt", "olmo", "exaone4", "jais"],
        _Pre((_GPT2,)),
    ),
    **dict.fromkeys(["trillion", "granite-docling"], _Pre((_GPT2,), clean=False)),
    **dict.fromkeys(
        ["llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0"]
        + ["lfm2", "jina-v5-nano"],
        _Pre((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _Pre((_LLAMA3,))),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan"], _Pre((_QWEN2,), clean=False)
    ),
    **dict.fromkeys(["stablelm2", "megrez"], _Pre((_QWEN2,))),
    **dict.fromkeys(["smollm", "command-r"], _Pre(_DIGIT_THEN_GPT2, clean=False)),
    **dict.fromkeys(
        ["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"],
        _Pre(_DIGIT_THEN_GPT2),
    ),
}

# Token texts llama.cpp makes control tokens whatever their type: its "control-looking"
# end-of-generation tokens (llama_vocab::impl::load).
_CONTROL_LOOKING = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>"]
    + ["<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]"]
    + ["[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>"]
    + ["<｜end▁of▁sentence｜>", "[e~["]
)

# Special ids llama.cpp assumes when a file does not name them, per vocabulary type.
_DEFAULT_SPECIAL_IDS = {
    "llama": {"bos": 1, "eos": 2, "unknown": 0},
    "gpt2": {"bos": 11, "eos": 11},
}


def build_tokenizer(
    metadata: Mapping[str, object], where: str, *, serializable: bool = False
) -> tuple[Tokenizer, dict]:
    """The tokenizer llama.cpp makes of a GGUF file's ``tokenizer.ggml.*`` metadata, and a
    ``tokenizer_config.json``-shaped dict of what mie reads from one (special token texts,
    ``chat_template``, ``add_bos_token``, ``add_eos_token``). ``where`` names the file in
    every ``TokenizerError``.

    ``serializable``: for a ``llama`` vocabulary, a tokenizer ``to_str()`` can write -- the
    same vocabulary, special tokens and decoding, but its merges ranked by score in place of
    llama.cpp's exact order, so its ids differ where scores tie. It is for readers of the
    vocabulary (the grammar engine), never for encoding prompts."""
    vocab = _Vocab(metadata, where)
    if vocab.model == "llama":
        tokenizer = _sentencepiece(vocab, serializable)
    else:
        tokenizer = _byte_level_bpe(vocab)
    tokenizer.add_tokens(
        [
            AddedToken(
                text,
                special=kind != USER_DEFINED,
                normalized=False,
                rstrip=text in vocab.whitespace_eaters,
            )
            for text, kind in zip(vocab.tokens, vocab.types, strict=True)
            if kind in (UNKNOWN, CONTROL, USER_DEFINED)
        ]
    )
    tokenizer.post_processor = _bos_eos(vocab)
    config: dict[str, object] = {"add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos}
    for name, token_id in vocab.special_ids.items():
        config[f"{'unk' if name == 'unknown' else name}_token"] = vocab.tokens[token_id]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = vocab.get("tokenizer.chat_template", str)
    return tokenizer, config


class _Vocab:
    """The vocabulary metadata, checked: every problem is a ``TokenizerError`` naming the key."""

    def __init__(self, metadata: Mapping[str, object], where: str) -> None:
        self.metadata, self.where = metadata, where
        self.model = self.get("tokenizer.ggml.model", str, required=True)
        if self.model not in _DEFAULT_SPECIAL_IDS:
            known = ", ".join(_DEFAULT_SPECIAL_IDS)
            self.fail("tokenizer.ggml.model", f"unknown type {self.model!r} (known: {known})")
        self.tokens = self.get_list("tokenizer.ggml.tokens", str, required=True)
        n = len(self.tokens)
        # llama.cpp names an empty token "[EMPTY_<id>]", and refuses a text twice (it asserts).
        self.tokens = [text or f"[EMPTY_{i}]" for i, text in enumerate(self.tokens)]
        seen: set[str] = set()
        for text in self.tokens:
            if text in seen:
                self.fail("tokenizer.ggml.tokens", f"the token {text!r} is listed twice")
            seen.add(text)
        self.types = self.get_list("tokenizer.ggml.token_type", int, length=n) or [NORMAL] * n
        self.types = [
            CONTROL if text in _CONTROL_LOOKING else kind
            for text, kind in zip(self.tokens, self.types, strict=True)
        ]
        self.scores = self.get_list("tokenizer.ggml.scores", (float, int), length=n) or [0.0] * n
        self.pre: _Pre | None = None
        if self.model == "gpt2":
            name = self.get("tokenizer.ggml.pre", str) or "default"
            if name not in PRE_TOKENIZERS:
                known = ", ".join(PRE_TOKENIZERS)
                self.fail("tokenizer.ggml.pre", f"unknown pre-tokenizer {name!r} (known: {known})")
            self.pre = PRE_TOKENIZERS[name]
            self.merges = self.get_list("tokenizer.ggml.merges", str, required=True)
        self.special_ids = self._special_ids()
        add_bos_default = self.pre.add_bos if self.pre else True
        self.add_bos = self.get("tokenizer.ggml.add_bos_token", bool, default=add_bos_default)
        self.add_eos = self.get("tokenizer.ggml.add_eos_token", bool, default=False)
        for flag, name in ((self.add_bos, "bos"), (self.add_eos, "eos")):
            if flag and name not in self.special_ids:
                self.fail(f"tokenizer.ggml.add_{name}_token", f"set, but there is no {name} token")
        self.add_space_prefix = self.get(
            "tokenizer.ggml.add_space_prefix", bool, default=self.model == "llama"
        )
        self.whitespace_eaters = self._whitespace_eaters()

    def _whitespace_eaters(self) -> set[str]:
        """The special tokens that swallow the whitespace after them in the text: llama.cpp's
        rule for a model whose ``general.name`` says Phi-3 (all of them but three). llama.cpp
        swallows ASCII whitespace only, ``tokenizers`` any Unicode whitespace."""
        name = self.get("general.name", str, default="").lower()
        if "phi-3" not in name and "phi3" not in name:
            return set()
        kept = ("<unk>", "<s>", "<|endoftext|>")
        if missing := [text for text in (*kept, "</s>") if text not in self.tokens]:
            problem = (
                f"names a Phi-3 model, whose vocabulary llama.cpp expects to hold {missing[0]!r}"
            )
            self.fail("general.name", problem)
        special = (UNKNOWN, CONTROL, USER_DEFINED)
        eaters = {
            text for text, kind in zip(self.tokens, self.types, strict=True) if kind in special
        }
        return eaters - set(kept)

    def _special_ids(self) -> dict[str, int]:
        """``{"bos": id, ...}`` from ``tokenizer.ggml.<name>_token_id``, llama.cpp's defaults
        for the vocabulary type where absent (and left out where those are out of range)."""
        ids = {}
        for name in ("bos", "eos", "unknown", "padding"):
            key = f"tokenizer.ggml.{name}_token_id"
            token_id = self.get(key, int, default=_DEFAULT_SPECIAL_IDS[self.model].get(name))
            if token_id is None or (key not in self.metadata and token_id >= len(self.tokens)):
                continue
            if not 0 <= token_id < len(self.tokens):
                self.fail(key, f"{token_id} is out of range ({len(self.tokens)} tokens)")
            ids["pad" if name == "padding" else name] = token_id
        return ids

    def get(self, key: str, kind, *, required: bool = False, default=None):
        if key not in self.metadata:
            if required:
                self.fail(key, "missing")
            return default
        value = self.metadata[key]
        if not _is(value, kind):
            self.fail(key, f"must be {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def get_list(self, key: str, kind, *, required: bool = False, length: int | None = None):
        values = self.get(key, list, required=required)
        if values is None:
            return None
        if not all(_is(value, kind) for value in values):
            self.fail(key, f"must be a list of {_kind_name(kind)}")
        if length is not None and len(values) != length:
            self.fail(key, f"has {len(values)} entries for {length} tokens")
        return values

    def fail(self, key: str, problem: str):
        raise TokenizerError(f"{self.where}: {key}: {problem}")


def _is(value: object, kind) -> bool:
    """``isinstance``, but a bool is not an int (nor a float) here."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


# -- llama: SentencePiece as llama.cpp does it ---------------------------------------------------


def _sentencepiece(vocab: _Vocab, serializable: bool) -> Tokenizer:
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.special_ids["unknown"]] if "unknown" in vocab.special_ids else None
    if serializable:
        model = models.BPE(ids, _merges_by_score(vocab, ids), unk_token=unk, byte_fallback=True)
    else:  # the pre-tokenizer's pieces are tokens, or characters to spell in bytes
        model = models.BPE(ids, [], unk_token=unk, byte_fallback=True, ignore_merges=True)
    tokenizer = Tokenizer(model)
    spaces = [normalizers.Replace(" ", "▁")]
    if vocab.add_space_prefix:  # per stretch of text: at the start and after special tokens
        spaces.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(spaces)
    if not serializable:
        scores = dict(zip(vocab.tokens, vocab.scores, strict=True))
        tokenizer.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(_BigramMerges(scores))
    strip = [decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _merges_by_score(vocab: _Vocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every pair of tokens that concatenates to a token, the highest-scoring result first
    (equal scores in token order: where llama.cpp's leftmost-first tie-break matters, this
    differs from it)."""
    merges = [
        (-score, token_id, cut)
        for token_id, (text, score) in enumerate(zip(vocab.tokens, vocab.scores, strict=True))
        for cut in range(1, len(text))
        if text[:cut] in ids and text[cut:] in ids
    ]
    merges.sort()
    return [(vocab.tokens[i][:cut], vocab.tokens[i][cut:]) for _, i, cut in merges]


class _BigramMerges:
    """llama.cpp's ``llm_tokenizer_spm_session``: a text's characters, adjacent pairs whose
    concatenation is a token merged, the highest-scoring pair first and the leftmost among
    equal scores, until no pair is a token. Splits each stretch of text into the final pieces
    (tokens, or single characters the vocabulary lacks, which become byte tokens)."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores

    def pre_tokenize(self, text: PreTokenizedString) -> None:
        text.split(self._split)

    def _split(self, _: int, text: NormalizedString) -> list[NormalizedString]:
        ends = list(itertools.accumulate(self.piece_lengths(str(text))))
        return [text[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]

    def piece_lengths(self, text: str) -> list[int]:
        """The lengths (in characters) of ``text``'s pieces, in order."""
        size = [1] * len(text)  # symbol i spans text[i : i + size[i]]; 0 once merged away
        prev = list(range(-1, len(text) - 1))
        next_ = list(range(1, len(text))) + [-1]
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged size)

        def push(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            merged = text[left : right + size[right]]
            if merged in self.scores:
                heapq.heappush(queue, (-self.scores[merged], left, right, len(merged)))

        for i in range(1, len(text)):
            push(i - 1, i)
        while queue:
            _, left, right, merged_size = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != merged_size:
                continue  # one side has changed since the pair was queued
            size[left], size[right] = merged_size, 0
            next_[left] = next_[right]
            if next_[right] != -1:
                prev[next_[right]] = left
            push(prev[left], left)
            push(left, next_[left])
        return [n for n in size if n]


# -- gpt2: byte-level BPE ----------------------------------------------------------------------


def _byte_level_bpe(vocab: _Vocab) -> Tokenizer:
    assert vocab.pre is not None
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    merges = []
    for line in vocab.merges:
        cut = line.find(" ", 1)  # as llama.cpp: the first space after the first character
        pair = (line[:cut], line[cut + 1 :]) if cut != -1 else ("", "")
        if pair[0] not in ids or pair[1] not in ids or pair[0] + pair[1] not in ids:
            vocab.fail("tokenizer.ggml.merges", f"{line!r} does not merge two tokens into one")
        merges.append(pair)
    model = models.BPE(ids, merges, ignore_merges=vocab.pre.ignore_merges)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), "isolated") for regex in vocab.pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    steps = [decoders.ByteLevel()]
    if vocab.add_space_prefix:  # llama.cpp's detokenizer reads the flag for any vocabulary
        steps.append(decoders.Strip(" ", 1, 0))
    if vocab.pre.clean_spaces:  # llama.cpp's detokenizer's three passes, in order
        steps += [decoders.Replace(f" {c}", c) for c in "?!.,"]
        steps += [decoders.Replace(" ' ", "'")]
        steps += [decoders.Replace(f" '{s}", f"'{s}") for s in ("s", "m", "re", "ve")]
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


# -- BOS and EOS -----------------------------------------------------------------------------


def _bos_eos(vocab: _Vocab) -> processors.TemplateProcessing:
    """A post-processor adding BOS and EOS as llama.cpp's ``add_special`` does."""
    first = [vocab.tokens[vocab.special_ids["bos"]]] if vocab.add_bos else []
    last = [vocab.tokens[vocab.special_ids["eos"]]] if vocab.add_eos else []
    special = [(text, vocab.tokens.index(text)) for text in dict.fromkeys(first + last)]
    return processors.TemplateProcessing(
        single=[*first, "$A", *last],
        pair=[*first, "$A", *last, "$B:1", *last],
        special_tokens=special,
    )
