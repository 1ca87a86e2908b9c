"""``python -m mie``: streaming generation on the real model, and one-line errors."""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def mie(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mie", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_prints_the_greedy_story_transformers_writes():
    result = mie("generate", "--model", str(STORIES), "--prompt", "Once upon a time",
                 "--temperature", "0", "--max-tokens", "80")  # fmt: skip
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES)
    ids = tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(
        model.generate(ids, do_sample=False, max_new_tokens=80)[0], skip_special_tokens=True
    )
    assert result.stdout == expected + "\n"
    assert "Lily" in result.stdout


def test_help_lists_the_subcommands():
    result = mie("--help")
    assert result.returncode == 0 and "generate" in result.stdout


def test_bad_inputs_print_one_line_and_exit_nonzero(tmp_path):
    cases = [
        ("generate", "--model", str(tmp_path / "missing"), "--prompt", "x"),
        ("generate", "--model", str(STORIES), "--prompt", "x", "--top-p", "1.5"),
        ("generate", "--model", str(STORIES), "--prompt", "x", "--max-tokens", "-1"),
        ("generate", "--model", str(STORIES), "--prompt", "x", "--max-tokens", "9999"),
        ("generate", "--model", str(STORIES), "--prompt", "x", "--backend", "gpu"),
        ("generate", "--model", str(STORIES)),
        ("nonsense",),
    ]
    for args in cases:
        result = mie(*args)
        assert result.returncode != 0, args
        assert "Traceback" not in result.stderr, args
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(errors) == 1, (args, result.stderr)


# -- corrupted checkpoints: one line, a non-zero exit, never a traceback ---------------------------

ORIGINAL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def edit_json(name: str, **changes):
    def corrupt(directory: Path) -> None:
        path = directory / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return corrupt


def write(name: str, content: bytes):
    def corrupt(directory: Path) -> None:
        (directory / name).write_bytes(content)

    return corrupt


def raw_config(key: str, text: str):
    """config.json with ``key`` set to raw JSON text (``Infinity``, ``NaN``, huge integers)."""

    def corrupt(directory: Path) -> None:
        path = directory / "config.json"
        body = json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != key})
        path.write_text(body[:-1] + f', "{key}": {text}}}')

    return corrupt


def safetensors_header(edit):
    """model.safetensors with its header (a dict) changed by ``edit``."""

    def corrupt(directory: Path) -> None:
        path = directory / "model.safetensors"
        content = path.read_bytes()
        (length,) = struct.unpack("<Q", content[:8])
        header = json.loads(content[8 : 8 + length])
        text = edit(header)
        header_bytes = (text if isinstance(text, str) else json.dumps(header)).encode()
        path.write_bytes(
            struct.pack("<Q", len(header_bytes)) + header_bytes + content[8 + length :]
        )

    return corrupt


def poison_weight(name: str, value: float):
    def corrupt(directory: Path) -> None:
        tensors = load_file(STORIES / "model.safetensors")
        tensors[name].flat[3] = value
        save_file(tensors, directory / "model.safetensors")

    return corrupt


def truncate_weights(directory: Path) -> None:
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def shard_index(text: str):
    def corrupt(directory: Path) -> None:
        (directory / "model.safetensors").unlink()
        (directory / "model.safetensors.index.json").write_text(text)

    return corrupt


def remove(name: str):
    return lambda directory: (directory / name).unlink()


def huge_shape(header: dict) -> None:
    header["extra"] = {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]}


def huge_digits(header: dict) -> str:
    return json.dumps(header).replace('"shape": [', '"shape": [1' + "0" * 5000 + ", ", 1)


CORRUPTIONS = {
    # (what is broken, file the message names, a fragment of the message)
    "header length past the file": (
        write("model.safetensors", struct.pack("<Q", 2**63) + b"{}"), "model.safetensors",
        "header length",
    ),
    "huge shape (issue 11)": (safetensors_header(huge_shape), "model.safetensors", "'extra'"),
    "integer past the digits limit": (
        safetensors_header(huge_digits), "model.safetensors", "not valid JSON",
    ),
    "truncated data": (truncate_weights, "model.safetensors", "data_offsets"),
    "NaN weight": (
        poison_weight("model.layers.2.mlp.down_proj.weight", float("nan")), "model.safetensors",
        "'model.layers.2.mlp.down_proj.weight': 1 of",
    ),
    "infinite embedding": (
        poison_weight("model.embed_tokens.weight", float("inf")), "model.safetensors",
        "'model.embed_tokens.weight': 1 of",
    ),
    "no weights": (remove("model.safetensors"), "", "neither model.safetensors"),
    "shard index not an object": (shard_index("[]"), "model.safetensors.index.json", "not a JSON"),
    "shard index escapes": (
        shard_index('{"weight_map": {"lm_head.weight": "../x"}}'), "model.safetensors.index.json",
        "bad shard file name",
    ),
    "rms_norm_eps Infinity (issue 11)": (
        raw_config("rms_norm_eps", "Infinity"), "config.json", "rms_norm_eps",
    ),
    "rope_theta Infinity (issue 11)": (
        raw_config("rope_parameters", '{"rope_theta": Infinity}'), "config.json", "rope_theta",
    ),
    "rope_theta NaN": (
        edit_json("config.json", rope_parameters=None, rope_theta=float("nan")), "config.json",
        "rope_theta",
    ),
    "head_dim 0 (issue 11)": (edit_json("config.json", head_dim=0), "config.json", "head_dim"),
    "negative vocabulary": (edit_json("config.json", vocab_size=-512), "config.json", "vocab_size"),
    "heads not divisible": (
        edit_json("config.json", num_key_value_heads=3), "config.json", "num_key_value_heads 3",
    ),
    "config not JSON": (write("config.json", b"{"), "config.json", "not valid JSON"),
    "config a list": (write("config.json", b"[]"), "config.json", "not a JSON object"),
    "config integer past the digits limit": (
        raw_config("vocab_size", "5" * 5000), "config.json", "not valid JSON",
    ),
    "no config": (remove("config.json"), "config.json", "cannot read"),
    "eos outside the vocabulary": (
        write("generation_config.json", b'{"eos_token_id": [2, 99999]}'),
        "generation_config.json", "outside the vocabulary",
    ),
    "tokenizer_config not JSON (issue 11)": (
        write("tokenizer_config.json", b"{oops"), "tokenizer_config.json", "not valid JSON",
    ),
    "tokenizer_config not an object (issue 11)": (
        write("tokenizer_config.json", b"[1, 2]"), "tokenizer_config.json", "not a JSON object",
    ),
    "chat_template a number": (
        edit_json("tokenizer_config.json", chat_template=5), "tokenizer_config.json",
        "chat_template",
    ),
    "bos_token a number": (
        edit_json("tokenizer_config.json", bos_token=1), "tokenizer_config.json", "bos_token",
    ),
    "tokenizer.json broken": (
        write("tokenizer.json", b'{"model": {"type": "BPE"'), "tokenizer.json", "cannot load",
    ),
}  # fmt: skip


@pytest.fixture
def broken_copy(tmp_path):
    """A writable copy of stories260K to break."""
    directory = tmp_path / "stories260K"
    directory.mkdir()
    for name in [*ORIGINAL_FILES, "model.safetensors"]:
        shutil.copyfile(STORIES / name, directory / name)
    return directory


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mie: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("case", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_generate_on_a_corrupted_checkpoint_prints_one_error_line_naming_the_file(
    broken_copy, case
):
    corrupt, file_name, fragment = CORRUPTIONS[case]
    corrupt(broken_copy)
    result = mie("generate", "--model", str(broken_copy), "--prompt", "x", "--max-tokens", "2")
    assert_one_error_line(result, str(broken_copy / file_name), fragment)
    assert result.stdout == ""  # nothing generated before the error


@pytest.mark.parametrize(
    "case",
    [
        "rms_norm_eps Infinity (issue 11)",
        "NaN weight",
        "tokenizer_config not an object (issue 11)",
        "chat_template a number",
    ],
)
def test_serve_on_a_corrupted_checkpoint_exits_with_one_error_line(broken_copy, case):
    corrupt, file_name, fragment = CORRUPTIONS[case]
    corrupt(broken_copy)
    result = mie("serve", "--model", str(broken_copy), "--port", "0")
    assert_one_error_line(result, str(broken_copy / file_name), fragment)


def test_serve_refuses_a_chat_template_that_is_not_jinja(broken_copy):
    edit_json("tokenizer_config.json", chat_template="{% for m in messages %}")(broken_copy)
    result = mie("serve", "--model", str(broken_copy), "--port", "0")
    assert_one_error_line(
        result, str(broken_copy / "tokenizer_config.json"), "chat_template is not valid Jinja"
    )


def test_unexpected_errors_are_one_line_too_and_a_traceback_with_verbose(monkeypatch, capsys):
    """A bug (here: an injected TypeError) is still one line; -v shows the traceback."""
    from mie import cli

    def broken_engine(args):
        raise TypeError("injected\nover two lines")

    monkeypatch.setattr(cli, "make_engine", broken_engine)
    argv = ["generate", "--model", str(STORIES), "--prompt", "x"]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == (
        "mie: error: internal error, TypeError (run with -v for the traceback): injected over "
        "two lines\n"
    )
    with pytest.raises(TypeError):
        cli.main([*argv, "-v"])

    def no_memory(args):
        raise MemoryError

    monkeypatch.setattr(cli, "make_engine", no_memory)
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == "mie: error: out of memory\n"
