"""A checkpoint file that is listed but unreadable is an error naming it.

A Hugging Face cache links each file of a snapshot to a blob; when the blob is missing (an
interrupted download, a pruned cache) the link dangles. ``os.path.exists`` is False for it,
and for a link that loops, so ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json`` would be silently taken as absent: the model would load with no
tokenizer, or with other EOS tokens. A file is absent only if it is not in the directory at all
(``mie.checkpoint.listed``); a listed one is read, and its error names it.
"""

import os
import re
import shutil
from pathlib import Path

import pytest

from mie.checkpoint import CheckpointError
from mie.engine.llm_engine import LLMEngine
from mie.engine.tokenizer import Tokenizer, TokenizerError, read_tokenizer_config
from mie.model import ModelConfig

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def broken_link(directory: Path, name: str, kind: str) -> Path:
    """Replace ``name`` in ``directory`` by a symlink that dangles or loops."""
    path = directory / name
    path.unlink()
    if kind == "dangling":
        path.symlink_to(directory / "blobs" / "missing-blob")
    else:  # a loop of two links
        other = directory / f"{name}.loop"
        other.symlink_to(path)
        path.symlink_to(other)
    assert os.path.lexists(path) and not path.exists()
    return path


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    directory = tmp_path / "stories"
    shutil.copytree(STORIES, directory)
    return directory


@pytest.mark.parametrize("kind", ["dangling", "looping"])
@pytest.mark.parametrize("name", FILES)
def test_an_unreadable_listed_file_is_an_error_naming_it(checkpoint, name, kind):
    path = broken_link(checkpoint, name, kind)
    with pytest.raises((TokenizerError, CheckpointError)) as caught:
        LLMEngine(checkpoint, num_blocks=8)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("kind", ["dangling", "looping"])
def test_each_reader_names_the_file(checkpoint, kind):
    tokenizer = broken_link(checkpoint, "tokenizer.json", kind)
    with pytest.raises(TokenizerError, match=re.escape(str(tokenizer))):
        Tokenizer(checkpoint)
    config = broken_link(checkpoint, "tokenizer_config.json", kind)
    with pytest.raises(TokenizerError, match=re.escape(str(config))):
        read_tokenizer_config(checkpoint)
    generation = broken_link(checkpoint, "generation_config.json", kind)
    with pytest.raises(CheckpointError, match=re.escape(str(generation))):
        ModelConfig.from_pretrained(checkpoint)


@pytest.mark.parametrize("name", FILES)
def test_a_file_really_absent_is_still_optional(checkpoint, name):
    (checkpoint / name).unlink()
    engine = LLMEngine(checkpoint, num_blocks=8)
    assert (engine.tokenizer is None) == (name == "tokenizer.json")
