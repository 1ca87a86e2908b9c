"""A GGUF file alone, through every entry point: ``LLM``, the CLI and the OpenAI server.

The file is stories260K as llama.cpp's converter writes it -- its weights (tests/gguf_writer.py)
and its vocabulary (scripts/gguf_vocab_oracle.py's ``stories_metadata``, the converter's own
``gguf.LlamaHfVocab`` and ``SpecialVocab``, checked against the converter's output in
tests/test_gguf_vocab.py) -- plus a chat template, with nothing else beside it. What it must
do is what the directory it came from does: the same tokens from the same token ids, text
cut as llama.cpp cuts it (tests/test_gguf_vocab.py), chat through the file's template,
structured outputs through the grammar engine, errors naming the file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from conftest import STORIES, load_script, require_module
from gguf_writer import write_gguf

from mie import LLM, SamplingParams
from mie.engine.errors import InvalidRequestError
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import StructuredOutputsParams
from mie.engine.tokenizer import Tokenizer, TokenizerError

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory) -> Path:
    vocab = load_script("gguf_vocab_oracle").stories_metadata(STORIES)
    path = tmp_path_factory.mktemp("gguf") / "stories260K-f32.gguf"
    return write_gguf(
        STORIES,
        path,
        gguf.GGMLQuantizationType.F32,
        metadata={**vocab, "tokenizer.chat_template": TEMPLATE},
    )


def test_the_file_generates_what_its_directory_generates_from_the_same_ids(stories_gguf):
    from_file, from_dir = LLM(str(stories_gguf)), LLM(str(STORIES))
    prompt_ids = from_file.engine.tokenizer.encode("Once upon a time, a little girl")
    assert prompt_ids[0] == 1  # BOS, as llama.cpp adds it for this vocabulary
    params = SamplingParams(max_tokens=40, temperature=0.0)
    ours = from_file.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
    theirs = from_dir.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids
    assert ours.text == theirs.text  # both decode SentencePiece pieces the same way
    # Text prompts are cut as llama.cpp cuts them: the file's pieces, not tokenizer.json's.
    text = from_file.generate(["Once upon a time, a little girl"], params)[0]
    assert text.prompt_token_ids == prompt_ids


def test_the_tokenizer_comes_from_the_file_and_serializes_for_the_grammar_engine(stories_gguf):
    tokenizer = Tokenizer(stories_gguf)
    assert tokenizer.config["chat_template"] == TEMPLATE
    assert tokenizer.bos_token_id == 1 and tokenizer.config_path == str(stories_gguf)
    llguidance = require_module("llguidance")
    llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=512, eos_token=[2])
    llm = LLM(str(stories_gguf))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(
        max_tokens=60,
        temperature=0.8,
        seed=3,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    text = llm.generate(["Once upon a time"], params)[0].outputs[0].text
    assert text.lstrip().startswith("{")


def test_a_broken_vocabulary_is_a_tokenizer_error_naming_the_file(tmp_path):
    vocab = load_script("gguf_vocab_oracle").stories_metadata(STORIES)
    bad = write_gguf(
        STORIES, tmp_path / "bad.gguf", metadata={**vocab, "tokenizer.ggml.model": "wordpiece"}
    )
    with pytest.raises(TokenizerError, match=str(bad)):
        LLMEngine(bad)


def test_the_cli_generates_from_the_file_and_names_a_broken_one(stories_gguf, tmp_path):
    def mie(*args):
        return subprocess.run(
            [sys.executable, "-m", "mie", *args], capture_output=True, text=True, timeout=300
        )

    done = mie(
        "generate",
        "--model",
        str(stories_gguf),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "20",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Once upon a time") and len(done.stdout) > 40
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(stories_gguf.read_bytes()[:5000])
    done = mie("generate", "--model", str(truncated), "--prompt", "x")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("mie: error: ") and str(truncated) in line


def test_the_server_chats_through_the_files_template(stories_gguf):
    openai = require_module("openai")
    serve = require_module("mie.serve")
    engine = LLMEngine(stories_gguf, backend="python", num_blocks=64)
    app = serve.build_app(engine, stories_gguf, model_name="stories260K-f32.gguf")
    with serve.serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-")
        reply = client.chat.completions.create(
            model="stories260K-f32.gguf",
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=16,
            temperature=0,
        )
        # The prompt is the file's template, rendered: BOS, one line per message, the opener.
        expected = Tokenizer(stories_gguf).encode("user: Tell me a story\nassistant:", False)
        assert reply.usage.prompt_tokens == 1 + len(expected)
        assert reply.choices[0].message.content


def test_a_file_without_a_vocabulary_runs_on_token_ids(tmp_path):
    """llama.cpp's ``no_vocab`` (what ``--peers`` writes) and a file with no
    ``tokenizer.ggml.*`` at all: no tokenizer, token-id prompts only, as a directory without
    tokenizer.json."""
    for name, metadata in [("none", {}), ("no_vocab", {"tokenizer.ggml.model": "no_vocab"})]:
        path = write_gguf(STORIES, tmp_path / f"{name}.gguf", metadata=metadata)
        llm = LLM(str(path))
        assert llm.engine.tokenizer is None
        out = llm.generate([{"prompt_token_ids": [1, 400, 300]}], SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        with pytest.raises(InvalidRequestError, match="no tokenizer .* must be token ids"):
            llm.generate(["Once upon a time"], SamplingParams(max_tokens=4))
