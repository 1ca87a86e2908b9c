"""The structured-outputs section on a tiny Qwen2 with a 2,000-token generated vocabulary (the
real one is 0.5B-shaped with 151,646 tokens and takes about two minutes)."""

import itertools
import json
import re

import pytest

from mie.bench import __main__ as bench
from mie.bench import structured
from mie.engine import llm_engine
from mie.engine import structured as engine_structured
from mie.model import Model

TINY_QWEN2 = dict(
    structured.QWEN2_05B,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
TINY_VOCAB = 2_000


@pytest.fixture(scope="module")
def result():
    return structured.measure(TINY_QWEN2, TINY_VOCAB, quick=True, seed=0, backend=None)


def json_prefix(text: str) -> bool:
    """Whether some ending makes ``text`` a JSON document: ``text`` cut anywhere in a literal,
    a number, an escape, a string or a key, then every open container closed. (Any ending
    that parses proves it a prefix; these cover every place a document can be cut.)"""
    depth = []
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped = not escaped and char == "\\"
            in_string = escaped or char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth.append("}" if char == "{" else "]")
        elif char in "}]" and depth:
            depth.pop()
    closers = "".join(reversed(depth))
    word_ends = ["", "0", "00", "000", "0000", "n", "ue", "e", "rue", "alse", "lse", "se", "ull"]
    word_ends += ["ll", "l", "u0000"]
    string_ends = ["", '"']
    value_ends = ["", ":null", "null", '"k":null', '":null']
    for word, quote, value in itertools.product(word_ends, string_ends, value_ends):
        try:
            json.loads(text + word + quote + value + closers)
        except ValueError:
            continue
        return True
    return False


def test_json_prefix_tells_prefixes_from_other_text():
    for text in ('{"id":12', '{"id":1,"na', '{"a":[{"b":"x\\', '{"a":tr', '{"a":{"b":[1,'):
        assert json_prefix(text), text
    for text in ('{"id"}', "hello", '{"a":1}}', '{"a":1 x'):
        assert not json_prefix(text), text


def test_registered_as_a_default_section():
    assert bench.SECTIONS["structured"] is structured.run


def test_every_configuration_has_its_figures(result):
    assert [(row["batch"], row["constrained"]) for row in result["configurations"]] == [
        (1, 0),
        (1, 1),
        (16, 0),
        (16, 8),
        (16, 16),
    ]
    assert result["vocab_size"] == TINY_VOCAB
    assert result["steps"] == 4
    assert len(result["load_average"]) == 2  # at the start and at the end
    for row in result["configurations"]:
        assert row["step_ms"] > 0 and row["forward_ms"] > 0
        assert row["draw_ms"] > 0
        assert row["steps"] == 4
        assert set(row["us_per_token"]) == set(row["parts_ms"]) == set(structured.PARTS)
    compile_times = result["compile"]
    assert all(seconds > 0 for seconds in compile_times.values())
    assert compile_times["compile_cached_s"] < compile_times["compile_cold_s"]
    json.dumps(result)  # goes into --json as it is


def test_ratios_are_the_step_times_ratios(result):
    rows = {(row["batch"], row["constrained"]): row for row in result["configurations"]}
    for (batch, _), row in rows.items():
        assert row["step_time_ratio"] == row["step_ms"] / rows[batch, 0]["step_ms"]
    target = result["target"]
    assert target["batch"] == 16
    assert target["step_time_ratio"] == rows[16, 16]["step_ms"] / rows[16, 0]["step_ms"]
    assert target["speed_ratio"] == pytest.approx(1 / target["step_time_ratio"])
    assert target["met"] == (target["speed_ratio"] >= structured.TARGET_SPEED)
    added = target["added_ms"]
    assert added["step"] == pytest.approx(rows[16, 16]["step_ms"] - rows[16, 0]["step_ms"])
    parts = added["forward"] + added["grammar"] + added["draw"] + added["sampling_rest"]
    assert added["step"] == pytest.approx(parts + added["rest"])
    assert added["grammar"] == rows[16, 16]["grammar_ms"]
    for row in rows.values():  # step by step, the sampling holds the grammar's work and draws
        assert row["sampling_ms"] >= row["grammar_ms"] and row["sampling_ms"] >= row["draw_ms"]


def test_constrained_sequences_run_constrained_through_every_measured_step(result):
    """Each measured step masked exactly the constrained sequences (none had finished), the
    grammar's time counts only where there are some, and their texts are compact JSON in the
    schema's order so far; the unconstrained ones' are (nearly all) not JSON."""
    for row in result["configurations"]:
        constrained = row["constrained"]
        assert row["constrained_rows_min"] == row["constrained_rows_max"] == constrained
        assert len(row["texts"]) == constrained
        assert len(row["unconstrained_texts"]) == row["batch"] - constrained
        if constrained:
            assert all(row["us_per_token"][part] > 0 for part in structured.PARTS)
        else:
            assert row["grammar_ms"] == 0
        for text in row["texts"]:
            assert len(text) > len('{"id":')  # a token at least per step: 7 steps
            assert text.startswith('{"id":')
            assert json_prefix(text), text
            outside_strings = re.sub(r'"(\\.|[^"\\])*"?', '""', text)
            assert not any(c.isspace() for c in outside_strings), text  # compact JSON
    free = [text for row in result["configurations"] for text in row["unconstrained_texts"]]
    assert sum(json_prefix(text) for text in free) < len(free) / 2


def test_step_timer_puts_the_engine_back():
    originals = (
        Model.forward,
        llm_engine.fill_masks,
        engine_structured.unpack,
        engine_structured.GrammarMatcher.consume,
    )
    with structured.StepTimer() as timer:
        assert llm_engine.fill_masks is not engine_structured.fill_masks
        assert Model.forward is not originals[0]
    assert timer.rows == 0
    after = (
        Model.forward,
        llm_engine.fill_masks,
        engine_structured.unpack,
        engine_structured.GrammarMatcher.consume,
    )
    assert after == originals


def test_only_structured_writes_its_json_key(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(structured, "QWEN2_05B", TINY_QWEN2)
    monkeypatch.setattr(structured, "VOCAB_SIZE", TINY_VOCAB)
    path = tmp_path / "bench.json"
    assert bench.main(["--only", "structured", "--quick", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["structured_outputs"]["vocab_size"] == TINY_VOCAB
    out = capsys.readouterr().out
    assert "Structured outputs:" in out
    assert "Target: batch 16, all constrained:" in out
    assert "x the unconstrained step's speed" in out
