"""GGUF files made the way users make them, for tests/test_gguf_oracle.py.

Every file here comes out of llama.cpp's own tools, never out of mie: its converter
``convert_hf_to_gguf.py`` writes F32, F16, BF16 and Q8_0 files from a Hugging Face checkpoint
directory (``--outtype``), and its quantizer (``llama_model_quantize``, default parameters,
from the F32 file) writes Q4_0 and Q4_K_M. So a test holding mie's logits on such a file to
llama.cpp's checks mie's reader against the files people download, not against mie's own idea
of the format.

The checkpoints converted:

* ``stories260K``: the trained tiny Llama the repository ships (its ``tokenizer.json`` goes
  through the converter's Hugging Face Llama path; its down projection has 172 inputs, not a
  multiple of 32, so llama.cpp keeps that matrix out of Q4_0 / Q4_K).
* ``llama``, ``mistral``, ``qwen2``, ``qwen3``: tiny random checkpoints built by transformers'
  own classes with ``build_hf_model`` of tests/test_model_hf.py (weights redrawn so every
  norm, bias and projection matters), saved with safetensors, float32. Their dimensions are
  multiples of 32 so every matrix can be Q4_0; ``qwen3`` is 256 wide so some matrices are
  whole Q4_K super-blocks, and its head_dim (16) is not hidden / heads (32).

The random checkpoints' tokenizer: the converter insists on one. For Qwen2 / Qwen3 its only
offline path is sentencepiece's ``tokenizer.model`` (the BPE path needs a pre-tokenizer whose
hash it knows, i.e. a real Qwen tokenizer). So a 512-piece sentencepiece BPE model is trained
here (``sentencepiece`` package, deterministic, a few milliseconds) on the repository's
held-out TinyStories-like text and put into every random checkpoint, BOS 1 and EOS 2 as in its
``config.json``. The tests give token ids directly, so the tokenizer matters only to the
converter (and to mie's reader, which must accept what the converter wrote).

Files are cached under ``build/gguf-tests/`` so that a second session reuses them:
``checkpoints/<name>-<key>/`` (key: the recipe and the versions of torch, transformers and
sentencepiece) and ``<name>-<key>/<type>.gguf`` (key: every byte of the checkpoint directory
converted, and of the converter's sources). Quantized files go one level down, into
``llama_cpp-<version>/``, since the quantizer is llama-cpp-python's library. Each file is
written under a temporary name and renamed, so an interrupted session leaves no half file.

Opt-in as tests/test_perplexity.py: the converter is needed from ``LLAMA_CPP_SOURCE`` (its
``CONVERTER_MISSING`` reason when unset), the quantizer from llama-cpp-python (its
``LLAMA_CPP_MISSING``).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import shutil
from pathlib import Path

import pytest
from conftest import CONVERTER_MISSING, LLAMA_CPP_MISSING, require_module
from test_perplexity import script

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "gguf-tests"
STORIES = ROOT / "models" / "stories260K"
TOKENIZER_TEXT = ROOT / "tests" / "data" / "heldout" / "tinystories_like.txt"
VOCAB = 512  # stories260K's, and the trained sentencepiece model's

CONVERTED = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py --outtype
QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
TYPES = CONVERTED + tuple(QUANTIZED)

RANDOM_SPECS = {
    # name: build_hf_model's spec (architecture, saved dtype, heads, kv heads, head_dim,
    # hidden, layers, tied, other config arguments); intermediate is 3 * hidden / 2.
    "llama": ("llama", "float32", 4, 2, 16, 64, 2, False),
    "mistral": ("mistral", "float32", 8, 2, 16, 128, 2, True, {"sliding_window": None}),
    "qwen2": ("qwen2", "float32", 4, 2, 16, 64, 2, True),
    "qwen3": ("qwen3", "float32", 8, 4, 16, 256, 2, False),
}
MODELS = ("stories260K", *RANDOM_SPECS)
SPECIAL_TOKENS = {"bos_token_id": 1, "eos_token_id": 2}  # the sentencepiece model's


def converter_source() -> Path:
    """llama.cpp's tree holding ``convert_hf_to_gguf.py``, or a skip saying how to get it."""
    if not os.environ.get("LLAMA_CPP_SOURCE"):
        pytest.skip(CONVERTER_MISSING)
    require_module("torch")  # the converter imports both
    require_module("sentencepiece")
    return script.llama_cpp_source(None)


def require_llama_cpp():
    """llama-cpp-python, or a skip with tests/test_perplexity.py's reason."""
    return pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)


def gguf_file(name: str, kind: str) -> Path:
    """``name``'s checkpoint as a GGUF file of type ``kind`` (one of ``TYPES``), made by
    llama.cpp's tools the first time it is asked for and taken from the cache after."""
    directory = converted_directory(name)
    if kind in CONVERTED:
        return _cached(directory / f"{kind}.gguf", lambda out: _convert(name, kind, out))
    llama_cpp = require_llama_cpp()
    f32 = gguf_file(name, "f32")
    quantized = directory / f"llama_cpp-{llama_cpp.__version__}" / f"{kind}.gguf"
    return _cached(quantized, lambda out: script.quantize(f32, out, QUANTIZED[kind]))


def checkpoint(name: str) -> Path:
    """The Hugging Face checkpoint directory ``name`` stands for (built once, then cached)."""
    if name == "stories260K":
        return STORIES
    torch = require_module("torch")
    transformers = require_module("transformers")
    sentencepiece = require_module("sentencepiece")
    spec = RANDOM_SPECS[name]
    recipe = [repr(spec), repr(SPECIAL_TOKENS), TOKENIZER_TEXT.read_bytes()]
    recipe += [torch.__version__, transformers.__version__, sentencepiece.__version__]
    directory = CACHE / "checkpoints" / f"{name}-{_digest(recipe)}"
    if not directory.is_dir():
        partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        _save_random_checkpoint(spec, partial)
        partial.rename(directory)
    return directory


@functools.cache
def converted_directory(name: str) -> Path:
    """Where ``name``'s GGUF files live: keyed by the checkpoint's bytes and the converter's."""
    source = converter_source()
    model_dir = checkpoint(name)
    inputs = [_tree_digest(model_dir, "*"), _converter_digest(source)]
    return CACHE / f"{name}-{_digest(inputs)}"


def _save_random_checkpoint(spec: tuple, directory: Path) -> None:
    """``build_hf_model``'s model of ``spec``, saved as safetensors, with a trained
    sentencepiece ``tokenizer.model``."""
    from test_model_hf import build_hf_model

    arch, dtype, *shape = spec
    other = shape[6] if len(shape) > 6 else {}
    spec = (arch, getattr(require_module("torch"), dtype), *shape[:6], {**other, **SPECIAL_TOKENS})
    build_hf_model(spec, seed=0, vocab=VOCAB).save_pretrained(directory)
    (directory / "tokenizer.model").write_bytes(sentencepiece_model())


@functools.cache
def sentencepiece_model() -> bytes:
    """A 512-piece sentencepiece BPE model trained on the held-out TinyStories-like text,
    with byte fallback (every text encodes), ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2."""
    sentencepiece = require_module("sentencepiece")
    text = TOKENIZER_TEXT.read_text(encoding="utf-8").replace(script.STORY_SEPARATOR, "")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]),
        model_writer=model,
        vocab_size=VOCAB,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


def _convert(name: str, kind: str, out: Path) -> None:
    script.convert(converter_source(), checkpoint(name), kind, out)


def _cached(path: Path, make) -> Path:
    """``path``, made by ``make(temporary path)`` and renamed into place if not there yet."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        make(partial)
        partial.rename(path)
    return path


def _converter_digest(source: Path) -> str:
    """The converter's identity: every Python file it runs (the script, its ``conversion``
    package and the ``gguf`` package it writes with)."""
    files = [source / "convert_hf_to_gguf.py"]
    for package in ("conversion", "gguf-py"):
        files += sorted((source / package).rglob("*.py"))
    return _digest([f.relative_to(source).as_posix().encode() + f.read_bytes() for f in files])


def _tree_digest(directory: Path, pattern: str) -> str:
    files = sorted(p for p in directory.glob(pattern) if p.is_file())
    return _digest([f.name.encode() + f.read_bytes() for f in files])


def _digest(parts: list) -> str:
    sha = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        sha.update(len(data).to_bytes(8, "little") + data)
    return sha.hexdigest()[:16]
