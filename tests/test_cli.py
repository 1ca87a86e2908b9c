"""``python -m mie``: streaming generation on the real model, and one-line errors."""

import argparse
import contextlib
import io
import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import require_module
from hypothesis import assume, given, settings
from hypothesis import strategies as st

safetensors_numpy = require_module("safetensors.numpy")
load_file, save_file = safetensors_numpy.load_file, safetensors_numpy.save_file
transformers = require_module("transformers")
AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def mie(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mie", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_prints_the_greedy_story_transformers_writes():
    result = mie(
        "generate",
        "--model",
        str(STORIES),
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
        "--max-tokens",
        "80",
    )
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES)
    ids = tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(
        model.generate(ids, do_sample=False, max_new_tokens=80)[0], skip_special_tokens=True
    )
    assert result.stdout == expected + "\n"
    assert "Lily" in result.stdout


def test_a_generation_cut_by_the_context_says_so():
    prompt = "Once upon a time, there was a little girl named Lily. " * 33  # 497 of 512 tokens
    result = mie("generate", "--model", str(STORIES), "--prompt", prompt, "--max-tokens", "9999")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().endswith("[stopped at the model's context length 512]")
    result = mie("generate", "--model", str(STORIES), "--prompt", "Lily", "--max-tokens", "3")
    assert result.stderr.strip().endswith("[stopped at max_tokens=3; raise --max-tokens]")


def test_help_lists_the_subcommands():
    result = mie("--help")
    assert result.returncode == 0 and "generate" in result.stdout


def test_bad_inputs_print_one_line_and_exit_nonzero(tmp_path):
    cases = [
        ("generate", "--model", str(tmp_path / "missing"), "--prompt", "x"),
        ("generate", "--model", str(STORIES), "--prompt", "x", "--top-p", "1.5"),
        ("generate", "--model", str(STORIES), "--prompt", "x", "--max-tokens", "-1"),
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
        write("model.safetensors", struct.pack("<Q", 2**63) + b"{}"),
        "model.safetensors",
        "header length",
    ),
    "huge shape": (safetensors_header(huge_shape), "model.safetensors", "'extra'"),
    "integer past the digits limit": (
        safetensors_header(huge_digits),
        "model.safetensors",
        "not valid JSON",
    ),
    "truncated data": (truncate_weights, "model.safetensors", "data_offsets"),
    "NaN weight": (
        poison_weight("model.layers.2.mlp.down_proj.weight", float("nan")),
        "model.safetensors",
        "'model.layers.2.mlp.down_proj.weight': 1 of",
    ),
    "infinite embedding": (
        poison_weight("model.embed_tokens.weight", float("inf")),
        "model.safetensors",
        "'model.embed_tokens.weight': 1 of",
    ),
    "no weights": (remove("model.safetensors"), "", "neither model.safetensors"),
    "shard index not an object": (shard_index("[]"), "model.safetensors.index.json", "not a JSON"),
    "shard index escapes": (
        shard_index('{"weight_map": {"lm_head.weight": "../x"}}'),
        "model.safetensors.index.json",
        "bad shard file name",
    ),
    "rms_norm_eps Infinity": (
        raw_config("rms_norm_eps", "Infinity"),
        "config.json",
        "rms_norm_eps",
    ),
    "rope_theta Infinity": (
        raw_config("rope_parameters", '{"rope_theta": Infinity}'),
        "config.json",
        "rope_theta",
    ),
    "rope_theta NaN": (
        edit_json("config.json", rope_parameters=None, rope_theta=float("nan")),
        "config.json",
        "rope_theta",
    ),
    "head_dim 0": (edit_json("config.json", head_dim=0), "config.json", "head_dim"),
    "negative vocabulary": (edit_json("config.json", vocab_size=-512), "config.json", "vocab_size"),
    "heads not divisible": (
        edit_json("config.json", num_key_value_heads=3),
        "config.json",
        "num_key_value_heads 3",
    ),
    "config not JSON": (write("config.json", b"{"), "config.json", "not valid JSON"),
    "config a list": (write("config.json", b"[]"), "config.json", "not a JSON object"),
    "config integer past the digits limit": (
        raw_config("vocab_size", "5" * 5000),
        "config.json",
        "not valid JSON",
    ),
    "no config": (remove("config.json"), "config.json", "cannot read"),
    "eos outside the vocabulary": (
        write("generation_config.json", b'{"eos_token_id": [2, 99999]}'),
        "generation_config.json",
        "outside the vocabulary",
    ),
    "tokenizer_config not JSON": (
        write("tokenizer_config.json", b"{oops"),
        "tokenizer_config.json",
        "not valid JSON",
    ),
    "tokenizer_config not an object": (
        write("tokenizer_config.json", b"[1, 2]"),
        "tokenizer_config.json",
        "not a JSON object",
    ),
    "chat_template a number": (
        edit_json("tokenizer_config.json", chat_template=5),
        "tokenizer_config.json",
        "chat_template",
    ),
    "bos_token a number": (
        edit_json("tokenizer_config.json", bos_token=1),
        "tokenizer_config.json",
        "bos_token",
    ),
    "tokenizer.json broken": (
        write("tokenizer.json", b'{"model": {"type": "BPE"'),
        "tokenizer.json",
        "cannot load",
    ),
}


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
        "rms_norm_eps Infinity",
        "NaN weight",
        "tokenizer_config not an object",
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


# -- help, usage, limits and start-up messages ----------------------------------------------------


def subcommand_parsers() -> dict:
    from mie import cli

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction))
    return dict(commands.choices)


def test_generate_help_states_the_engine_defaults():
    """--temperature 1.0 (random sampling), --block-size 16, --max-num-seqs 32, read off the
    engine; argparse wraps lines, so compare with whitespace collapsed."""
    help_text = " ".join(subcommand_parsers()["generate"].format_help().split())
    assert "--temperature TEMPERATURE 0 = greedy; above 0 samples at random (default: 1.0)" in (
        help_text
    )
    assert "--block-size BLOCK_SIZE tokens per KV block (default: 16)" in help_text
    assert "--max-num-seqs MAX_NUM_SEQS most sequences running at once (default: 32)" in help_text


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_with_a_value_states_its_default_once(command):
    """A flag whose default is a value shows it, taken from the parser (one source), and no
    help text says 'default' twice."""
    parser = subcommand_parsers()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help is None:
            continue
        shown = formatter._get_help_string(action) % {"default": action.default}
        if all(action.default is not skip for skip in (None, False, argparse.SUPPRESS)):
            assert str(action.default) in shown, (action.option_strings, shown)
        assert shown.count("default") <= 1, shown


@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_a_misspelled_flag_gets_the_subcommands_usage_and_a_suggestion(data):
    """Drop or swap a letter of any flag: the error shows the subcommand's usage, not the
    top-level one, and suggests the flag meant (unless the typo is itself an abbreviation
    argparse accepts)."""
    from mie import cli

    parsers = subcommand_parsers()
    command = data.draw(st.sampled_from(sorted(parsers)))
    flags = [f for a in parsers[command]._actions for f in a.option_strings if f.startswith("--")]
    flag = data.draw(st.sampled_from(flags))
    i = data.draw(st.integers(2, len(flag) - 2))
    typo = data.draw(
        st.sampled_from(
            [flag[:i] + flag[i + 1 :], flag[:i] + flag[i + 1] + flag[i] + flag[i + 2 :]]
        )
    )
    assume(not any(f.startswith(typo) for f in flags))
    required = ["--model", "m", "--prompt", "p"] if command == "generate" else ["--model", "m"]
    argv = [command, *required, typo, "1"]
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(stderr):
        cli.main(argv)
    assert exit_.value.code == 2
    err = stderr.getvalue()
    assert err.startswith(f"usage: python -m mie {command} "), err
    assert f"error: unrecognized arguments: {typo} 1" in err
    assert "did you mean --" in err


def test_misspelled_flag_regression_from_the_issue():
    result = mie("generate", "--model", str(STORIES), "--prompt", "x", "--temprature", "0")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m mie generate ")
    assert result.stderr.strip().endswith(
        "python -m mie generate: error: unrecognized arguments: --temprature 0 "
        "(did you mean --temperature?)"
    )


class FakeEngine:
    """Streams ``texts`` as successive outputs, the last one ending with ``finish_reason``
    after ``num_tokens`` tokens (one token a step before it)."""

    max_model_len = 512

    def __init__(self, texts: list[str], finish_reason: str, num_tokens: int) -> None:
        last = len(texts) - 1
        self.outputs = [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(
                        text=t,
                        finish_reason=finish_reason if k == last else None,
                        token_ids=[0] * (num_tokens if k == last else k + 1),
                    )
                ]
            )
            for k, t in enumerate(texts)
        ]

    def add_request(self, prompt, params) -> None:
        self.params = params

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs)

    def step(self) -> list:
        return [self.outputs.pop(0)]


@pytest.mark.parametrize(
    ("finish_reason", "num_tokens", "extra", "note"),
    [
        ("length", 7, [], "[stopped at max_tokens=7; raise --max-tokens]\n"),
        ("stop", 5, [], ""),
        ("length", 7, ["--ignore-eos"], ""),  # asked for exactly max_tokens: nothing was cut
        ("length", 5, [], "[stopped at the model's context length 512]\n"),
        ("length", 5, ["--ignore-eos"], "[stopped at the model's context length 512]\n"),
    ],
)
def test_generate_says_on_stderr_when_max_tokens_cut_the_text(
    monkeypatch, capsys, finish_reason, num_tokens, extra, note
):
    from mie import cli

    texts = [" there", " there was a", " there was a gi"]
    engine = FakeEngine(texts, finish_reason, num_tokens)
    monkeypatch.setattr(cli, "make_engine", lambda args: engine)
    argv = ["generate", "--model", "m", "--prompt", "Once,", "--max-tokens", "7", *extra]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "Once, there was a gi\n"  # the text is untouched: the note is on stderr
    assert err == note


def test_generate_stopped_by_max_tokens_mid_story_prints_the_note():
    result = mie(
        "generate",
        "--model",
        str(STORIES),
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
        "--max-tokens",
        "5",
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "[stopped at max_tokens=5; raise --max-tokens]\n"
    assert result.stdout.startswith("Once upon a time")


def test_the_safetensors_file_instead_of_its_directory_says_to_pass_the_directory(tmp_path):
    result = mie("generate", "--model", str(STORIES / "model.safetensors"), "--prompt", "x")
    assert_one_error_line(
        result, "is a file but not GGUF: pass the directory that holds it", f"({STORIES})"
    )


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_checkpoint_without_tokenizer_json_says_the_cli_needs_it(broken_copy, command):
    (broken_copy / "tokenizer.json").unlink()
    args = ["--prompt", "x"] if command == "generate" else ["--port", "0"]
    result = mie(command, "--model", str(broken_copy), *args)
    assert_one_error_line(result, f"{broken_copy} has no tokenizer.json", "needs the checkpoint")
    assert "token ids" not in result.stderr


def test_serve_prints_what_it_loaded_without_verbose_and_answers_there():
    """One start-up line on stderr: model, architecture, parameters (counted here from the
    checkpoint's own tensors), the KV pool, the backend and the URL, which then answers."""
    expected_params = sum(a.size for a in load_file(STORIES / "model.safetensors").values())
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mie",
            "serve",
            "--model",
            str(STORIES),
            "--port",
            "0",
            "--num-blocks",
            "64",
            "--backend",
            "python",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stderr.readline()
        match = re.fullmatch(
            rf"mie serve: model {re.escape(str(STORIES))} \(llama, ([\d,]+) parameters, float32 "
            r"([\d.]+) MiB\); KV pool 64 blocks x 16 = 1,024 tokens \(([\d.,]+) MiB, float32\); "
            r"backend python; listening on "
            r"(http://127\.0\.0\.1:\d+)\n",
            line,
        )
        assert match, line
        assert int(match[1].replace(",", "")) == expected_params
        config = json.loads((STORIES / "config.json").read_text())
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        kv_bytes = 64 * 16 * config["num_hidden_layers"] * 2 * config["num_key_value_heads"]
        assert float(match[2]) == pytest.approx(expected_params * 4 / 2**20, abs=0.005)
        assert float(match[3].replace(",", "")) == pytest.approx(
            kv_bytes * head_dim * 4 / 2**20, abs=0.005
        )  # float32 K and V
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(match[4] + "/health", timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(30)


def test_serve_reports_a_port_in_use_before_loading_the_model(tmp_path):
    """The port is bound first: with a missing model, the error is still the port's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = mie("serve", "--model", str(tmp_path / "missing"), "--port", str(port))
    assert_one_error_line(result, f"cannot listen on 127.0.0.1:{port}", "choose another --port")


def test_serve_reports_a_host_it_cannot_resolve_in_one_line():
    result = mie("serve", "--model", str(STORIES), "--host", "no-such-host.invalid")
    assert_one_error_line(result, "cannot listen on no-such-host.invalid:8000")


def test_serve_refuses_auto_tool_choice_without_a_parser_in_one_line():
    result = mie("serve", "--model", str(STORIES), "--port", "0", "--enable-auto-tool-choice")
    assert_one_error_line(result, "--enable-auto-tool-choice needs --tool-call-parser")
    result = mie("serve", "--model", str(STORIES), "--tool-call-parser", "mistral")
    assert result.returncode == 2 and "invalid choice: 'mistral'" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "70000"),  # before: listened on 70000 - 65536 = 4464
        ("--port", "-1"),
        ("--timeout-request", "nan"),  # before: a server whose request deadline never came
        ("--timeout-request", "0"),
        ("--timeout-keep-alive", "inf"),
        ("--timeout-keep-alive", "-5"),
        ("--shutdown-grace", "nan"),
        ("--shutdown-grace", "-1"),
        ("--max-body-bytes", "0"),  # every request body would be too large
        ("--max-body-bytes", "-5"),
        ("--max-body-bytes", "1.5"),
    ],
)
def test_serve_refuses_a_port_or_duration_out_of_range_naming_the_flag(flag, value):
    started = time.monotonic()
    result = mie("serve", "--model", str(STORIES), flag, value)
    assert result.returncode == 2, result.stderr  # argparse's status for a bad argument
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and f"error: argument {flag}: '{value}'" in errors[0], result.stderr
    assert time.monotonic() - started < 30, "refused before loading the model"


def test_serve_takes_the_edges_of_the_ranges():
    parser = subcommand_parsers()["serve"]
    edges = [
        "--port",
        "65535",
        "--shutdown-grace",
        "0",
        "--timeout-request",
        "1e-3",
        "--timeout-keep-alive",
        "1e9",
    ]
    args = parser.parse_args(["--model", "m", *edges])
    assert (args.port, args.shutdown_grace, args.timeout_request) == (65535, 0.0, 1e-3)
    assert parser.parse_args(["--model", "m", "--port", "0"]).port == 0
    assert parser.parse_args(["--model", "m", "--max-body-bytes", "1"]).max_body_bytes == 1


BAD_ENGINE_SETTINGS = [
    {"block_size": 0},
    {"max_num_seqs": -1},
    {"num_blocks": 0},
    {"max_num_batched_tokens": -3},
    {"seed": -1},
    {"kv_cache_dtype": "int4"},
    {"enable_chunked_prefill": "yes"},
]


@pytest.mark.parametrize("bad", BAD_ENGINE_SETTINGS, ids=lambda bad: next(iter(bad)))
def test_engine_settings_are_checked_without_a_model_exactly_as_the_engine_checks_them(bad):
    from mie.engine.config import EngineConfig
    from mie.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError) as by_the_engine:
        LLMEngine(STORIES, **bad)
    with pytest.raises(ValueError) as without_a_model:
        EngineConfig.from_settings(**bad)
    assert str(without_a_model.value) == str(by_the_engine.value)
    EngineConfig.from_settings(block_size=8, max_num_seqs=4, num_blocks=16)  # good ones pass
    with pytest.raises(TypeError, match="no setting"):
        EngineConfig.from_settings(block_sise=8)


def test_generate_ends_the_text_before_a_stop_string():
    args = ["generate", "--model", str(STORIES), "--prompt", "Once upon a time"]
    args += ["--temperature", "0", "--max-tokens", "60"]
    full = mie(*args)
    assert full.returncode == 0, full.stderr
    text = full.stdout[len("Once upon a time") : -1]
    assert "Lily" in text and "." in text
    cut = mie(*args, "--stop", "Lily", "--stop", ".")
    assert cut.returncode == 0, cut.stderr
    end = min(text.index("Lily"), text.index("."))
    assert cut.stdout == "Once upon a time" + text[:end] + "\n"
    assert cut.stderr == ""  # stopped by a stop string: no max_tokens note
