"""Tokenizer wrapper and streaming detokenization on the real stories260K tokenizer."""

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mie.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(MODEL)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


def test_encode_matches_transformers(tokenizer, hf_tokenizer):
    for text in ["Once upon a time", "Lily and Ben went to the park.", "héllo 日本 🎉"]:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 512


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer(tmp_path)


@settings(max_examples=150, deadline=None)
@given(text=st.text(min_size=1, max_size=40), cut=st.integers(0, 60))
def test_streamed_deltas_add_up_and_never_split_a_character(tokenizer, text, cut):
    ids = tokenizer.encode(text)
    prompt, generated = ids[: 1 + cut % len(ids)], ids[1 + cut % len(ids) :]
    prompt_text, full_text = tokenizer.decode(prompt), tokenizer.decode(ids)
    assume("\ufffd" not in full_text and full_text.startswith(prompt_text))
    stream = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [stream.add(t) for t in generated]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full_text[len(prompt_text) :]
