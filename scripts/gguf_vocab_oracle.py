"""llama.cpp's tokenization of a fixed corpus for each test vocabulary, recorded for CI.

    python scripts/gguf_vocab_oracle.py [--out tests/data/gguf_vocab_oracle.json]

mie's GGUF tokenizer (``mie/engine/gguf_vocab.py``) must give llama.cpp's token ids. CI has no
llama.cpp (it is the opt-in ``peers`` extra), so this script -- run where llama-cpp-python is
installed -- tokenizes ``CORPUS`` with llama.cpp for every vocabulary of ``VOCABULARIES`` and
writes the ids and the detokenized texts to a JSON file that is committed; a CI test rebuilds
the same vocabulary-only GGUF files (``write_vocabulary``, with ``gguf.GGUFWriter``) and checks
mie against the recorded ids. The vocabularies:

* ``stories260K``: ``models/stories260K``'s vocabulary written as llama.cpp's converter writes
  it (``convert_hf_to_gguf.py``'s ``_set_vocab_llama_hf``: ``gguf.LlamaHfVocab`` and
  ``gguf.SpecialVocab``; an opt-in test checks it against the converter's own output). Every
  score is -1000, so llama.cpp's SentencePiece merging is all tie-breaks.
* ``llama-ties``: the same tokens with few distinct scores, ``<unk>`` of the unknown type, a
  control token and two user-defined tokens (one, " the end", words the merges could also
  form, spelt with spaces as the converter writes a user-defined token).
* ``phi-3``: ``llama-ties`` named Phi-3 (``general.name``), for llama.cpp's rule that special
  tokens then swallow the whitespace after them.
* ``bpe-<pre>``: a byte-level BPE trained here (``tokenizers``' ``BpeTrainer``, deterministic)
  on ``TRAINING_TEXT``, with chat-style special tokens, a whole word no merge makes and a
  control-looking token typed normal, written as ``convert_hf_to_gguf.py``'s
  ``_set_vocab_gpt2`` writes one, once per ``tokenizer.ggml.pre`` name in ``PRE_NAMES``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
ORACLE = ROOT / "tests" / "data" / "gguf_vocab_oracle.json"

# One tokenizer.ggml.pre name for each behaviour mie knows (mie.engine.gguf_vocab.PRE_TOKENIZERS).
PRE_NAMES = ("default", "gpt-2", "trillion", "llama-bpe", "dbrx", "qwen2", "stablelm2", "smollm")
PRE_NAMES += ("starcoder",)
BPE_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # control tokens
BPE_USER_DEFINED = ("[[tool]]",)  # an added token that is not special
# A normal token no merge makes: a whole pre-token that is a token is taken as is only where
# llama.cpp ignores merges (llama-bpe), so the ids differ there.
BPE_WHOLE_WORD = " façade"
CONTROL_LOOKING = "<|eot_id|>"  # written as a normal token: llama.cpp makes it a control token

CORPUS = (
    "",
    " ",
    "Once upon a time, there was a little girl named Lily.",
    "Lily and Tom went to the park. They saw a big, red ball!",
    "  two leading spaces and two trailing  ",
    "\tTabs\tand\nnewlines\n\n\nand\r\nCRLF\n",
    "     five spaces, then\t\t two tabs",
    "Café, naïve, résumé, Ångström, façade.",
    "日本語のテキストと中文字符。",
    "Emoji: 🙂🚀👩‍💻 and ✓ ✗ ★",
    "def add(a, b):\n    return a + b  # sum\n",
    "if (x <= 10 && y != 0) { z = x / y; }",
    "Digits 1234567890 and 3.14159 and 007, 1,000,000.",
    "don't won't it's we're they've I'm you'll he'd 'quoted'",
    "Hello ? World ! yes . no , ' maybe ' 's",
    "rock 'n' roll, 'tis 'twas, he 'd, we 'll, they 're, you 've, I 'm, it 's",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|endoftext|>",
    "It was the end<|eot_id|>",
    "<s>Once</s> upon<unk> a time",
    "call [[tool]] now, [[tool]][[tool]] twice",
    "<|im_start|> \n user<|im_end|>\t\nnext</s>  after<s> kept<|endoftext|> kept <unk>\n.",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "\n",
    "a",
    "ab ba aba bab abab",
)

TRAINING_TEXT = "\n".join(CORPUS[2:]) * 3 + (
    "\nThe little dog ran to the big tree. She was happy and they played all day.\n"
    "Numbers like 2024, 42 and 100 appear in stories too, don't they?\n"
)


# -- the vocabularies ---------------------------------------------------------------------------


@functools.cache
def stories_metadata(model_dir: Path = STORIES) -> dict[str, object]:
    """The tokenizer metadata llama.cpp's converter writes for stories260K
    (``_set_vocab_llama_hf``), made with the same ``gguf`` classes (cached: not to change)."""
    import gguf

    vocab = gguf.LlamaHfVocab(model_dir)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text.decode("utf-8") if isinstance(text, bytes) else text)
        scores.append(float(score))
        types.append(int(kind))
    metadata: dict[str, object] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
    }
    metadata.update(_special_vocab(gguf.SpecialVocab(model_dir, n_vocab=len(tokens))))
    return metadata


def _special_vocab(special) -> dict[str, object]:
    """What ``gguf.SpecialVocab.add_to_gguf`` writes, as metadata."""
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "sep": "seperator", "pad": "padding"}
    metadata: dict[str, object] = {}
    for kind, token_id in special.special_token_ids.items():
        metadata[f"tokenizer.ggml.{names.get(kind, kind)}_token_id"] = int(token_id)
    for kind, value in special.add_special_token.items():
        metadata[f"tokenizer.ggml.add_{kind}_token"] = bool(value)
    if special.merges:
        metadata["tokenizer.ggml.merges"] = list(special.merges)
    if special.chat_template is not None:
        metadata["tokenizer.chat_template"] = special.chat_template
    return metadata


def llama_ties_metadata() -> dict[str, object]:
    """stories260K's tokens with scores tied in fives, ``<unk>`` of the unknown type (2), a
    control and two user-defined tokens."""
    metadata = dict(stories_metadata())
    tokens = list(metadata["tokenizer.ggml.tokens"]) + ["<|im_start|>", "[[tool]]", " the end"]
    types = [2] + list(metadata["tokenizer.ggml.token_type"])[1:] + [3, 4, 4]
    scores = [float(-(i % 5)) for i in range(len(tokens))]
    metadata.update(
        {
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores,
        }
    )
    return metadata


def phi3_metadata() -> dict[str, object]:
    """``llama-ties`` with ``<|endoftext|>`` and named Phi-3: llama.cpp's special tokens then
    swallow the whitespace after them, but for ``<unk>``, ``<s>`` and ``<|endoftext|>``."""
    metadata = llama_ties_metadata()
    metadata["general.name"] = "Phi-3 mini (mie test vocabulary)"
    for key, value in (
        ("tokenizer.ggml.tokens", "<|endoftext|>"),
        ("tokenizer.ggml.token_type", 3),
        ("tokenizer.ggml.scores", 0.0),
    ):
        metadata[key] = [*metadata[key], value]
    return metadata


def train_bpe():
    """A small byte-level BPE trained on ``TRAINING_TEXT`` (the same every time)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(BPE_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    tokenizer.add_tokens([AddedToken(text, special=False) for text in BPE_USER_DEFINED])
    return tokenizer


def bpe_metadata(pre: str) -> dict[str, object]:
    """The trained BPE as ``_set_vocab_gpt2`` writes a vocabulary, with ``pre``."""
    tokenizer = train_bpe()
    model = json.loads(tokenizer.to_str())["model"]
    from tokenizers import pre_tokenizers

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    [(whole_word, _)] = pre_tokenizers.ByteLevel(False, use_regex=False).pre_tokenize_str(
        BPE_WHOLE_WORD
    )
    assert whole_word not in vocab
    tokens += [whole_word, CONTROL_LOOKING]
    types = [3 if t in BPE_SPECIAL else 4 if t in BPE_USER_DEFINED else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }


def vocabularies() -> dict[str, dict[str, object]]:
    """Every test vocabulary's metadata, by name."""
    found = {
        "stories260K": stories_metadata(),
        "llama-ties": llama_ties_metadata(),
        "phi-3": phi3_metadata(),
    }
    found.update({f"bpe-{pre}": bpe_metadata(pre) for pre in PRE_NAMES})
    return found


def write_vocabulary(path: Path, metadata: dict[str, object]) -> Path:
    """A vocabulary-only GGUF file llama.cpp loads (``vocab_only``): the metadata, under the
    ``llama`` architecture with the least of its hyperparameters llama.cpp reads."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in metadata.items():
        if key == "tokenizer.ggml.scores":
            writer.add_array(key, [float(v) for v in value])
        elif key == "tokenizer.ggml.token_type":
            writer.add_token_types(value)
        elif key.endswith("_token_id"):
            writer.add_uint32(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_metadata(path: Path) -> dict[str, object]:
    """A GGUF file's key/value metadata as plain Python values."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {field.name: field.contents() for field in reader.fields.values()}


# -- llama.cpp ----------------------------------------------------------------------------------


def llama_cpp_tokenize(path: Path, texts: tuple[str, ...] = CORPUS) -> list[dict[str, object]]:
    """llama.cpp's ids for each text (``add_bos=True, special=True``) and its detokenized
    text (``llama_detokenize``, ``remove_special=False``) of the ids without the BOS
    ``add_bos`` put in front, special tokens left out (``text``) and rendered (``special``)."""
    from llama_cpp import Llama

    llm = Llama(str(path), vocab_only=True, verbose=False)
    results = []
    for text in texts:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        body = llm.tokenize(text.encode(), add_bos=False, special=True)
        results.append(
            {
                "input": text,
                "ids": ids,
                "body": body,
                "text": detokenize(llm, body, special=False),
                "special": detokenize(llm, body, special=True),
            }
        )
    return results


def detokenize(llm, ids: list[int], special: bool) -> str:
    """llama.cpp's own ``llama_detokenize`` (llama-cpp-python's ``Llama.detokenize`` goes
    token by token, without llama.cpp's first-space and clean-up rules)."""
    import ctypes

    import llama_cpp

    size = 64 + 16 * len(ids)
    buffer = ctypes.create_string_buffer(size)
    array = (llama_cpp.llama_token * len(ids))(*ids)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    n = llama_cpp.llama_detokenize(vocab, array, len(ids), buffer, size, False, special)
    assert 0 <= n <= size, n
    return buffer.raw[:n].decode("utf-8", errors="replace")


def record(out: Path) -> dict[str, object]:
    import llama_cpp

    recorded: dict[str, object] = {
        "how": "python scripts/gguf_vocab_oracle.py: llama.cpp (llama-cpp-python "
        f"{llama_cpp.__version__}) on vocabulary-only GGUF files written by write_vocabulary",
        "llama_cpp_python": llama_cpp.__version__,
        "vocabularies": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, metadata in vocabularies().items():
            path = write_vocabulary(Path(tmp) / f"{name}.gguf", metadata)
            recorded["vocabularies"][name] = llama_cpp_tokenize(path)
    out.write_text(json.dumps(recorded, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return recorded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ORACLE)
    args = parser.parse_args(argv)
    recorded = record(args.out)
    print(f"{args.out}: {len(recorded['vocabularies'])} vocabularies x {len(CORPUS)} texts")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
