"""``python -m mie``: streaming generation on the real model, and one-line errors."""

import subprocess
import sys
from pathlib import Path

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
