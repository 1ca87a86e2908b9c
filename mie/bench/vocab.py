"""A real-size byte-level BPE vocabulary, built on the spot.

Grammar-constrained decoding costs time per token in proportion to the vocabulary: the engine
checks every token's bytes against the grammar's state to build the mask of allowed tokens.
Benchmarks of it therefore need a vocabulary of a served model's size (Qwen2's 151,643 tokens,
Llama 3's 128,000) and shape (byte-level BPE: many tokens with a leading space, JSON
punctuation fused with quotes). mie ships none (its test model has 512 tokens) and downloads
nothing, so :func:`byte_level_bpe` trains one with the ``tokenizers`` library on a generated
corpus: the same seed gives the same tokenizer, byte for byte.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
STORIES = Path(__file__).resolve().parents[2] / "tests" / "data" / "heldout"

_JSON_KEYS = (
    "id name type value items properties title description created_at updated_at user_id "
    "email age score price quantity status tags address city country zip latitude longitude "
    "enabled count total results data error message code url path version"
).split()
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _story_words() -> list[str]:
    text = (STORIES / "tinystories_like.txt").read_text(encoding="utf-8")
    return text.replace(END_OF_TEXT, " ").split()


def _random_word(rng: random.Random) -> str:
    """A random lower-case string: these supply the distinct merges a large vocabulary needs
    (the stories alone have a few thousand distinct words)."""
    word = "".join(rng.choices(_LETTERS, k=rng.randint(3, 10)))
    return word.capitalize() if rng.random() < 0.1 else word


def _json_line(rng: random.Random, words: list[str]) -> str:
    """One JSON-looking object: keys, quoted strings, numbers, booleans, nesting."""
    fields = []
    for _ in range(rng.randint(2, 6)):
        key = rng.choice(_JSON_KEYS)
        kind = rng.random()
        if kind < 0.35:
            value = f'"{rng.choice(words)} {_random_word(rng)}"'
        elif kind < 0.6:
            value = str(rng.randint(-1000, 100_000))
        elif kind < 0.75:
            value = f"{rng.uniform(-100, 100):.{rng.randint(1, 4)}f}"
        elif kind < 0.85:
            value = rng.choice(("true", "false", "null"))
        else:
            strings = [f'"{rng.choice(words)}"' for _ in range(rng.randint(1, 3))]
            value = "[" + ", ".join(strings) + "]"
        fields.append(f'"{key}": {value}')
    return "{" + ", ".join(fields) + "}"


def _corpus(vocab_size: int, seed: int) -> Iterator[str]:
    """Lines of stories' words, JSON-ish objects and random-letter words: one random word per
    wanted token, which leaves the trainer more distinct merges than it needs."""
    rng = random.Random(seed)
    words = _story_words()
    for _ in range(max(200, vocab_size // 100)):
        yield " ".join(rng.choices(words, k=40))
        yield _json_line(rng, words)
        yield " ".join(_random_word(rng) for _ in range(100))


def byte_level_bpe(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A GPT-2/Qwen2-style byte-level BPE tokenizer of ``vocab_size`` tokens (for any size from
    a few thousand to 200,000 the trainer reaches it exactly), ``<|endoftext|>`` included as
    token 0: the ByteLevel pre-tokenizer (the GPT-2 split, no prefix space) and decoder, all
    256 bytes in the alphabet. Deterministic: the same ``vocab_size`` and ``seed`` give the same
    ``to_str()``. About 5 s for 150,000 tokens on two cores."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(vocab_size, seed), trainer=trainer)
    return tokenizer
