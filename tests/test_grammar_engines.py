"""``scripts/grammar_engines.py`` without the engines: its data and its own arithmetic.

llguidance and xgrammar are not mie dependencies (the script's figures are a documented
command, bench/RESULTS.md "Grammar engines: llguidance and xgrammar"). What can rot without
them is tested here: the vendored corpora it reads (as tests/data/structured/README.md
describes them), the decoding of the engines' shared bitmask layout, and the walk's choice of
tokens.
"""

from pathlib import Path

import numpy as np
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_vendored_corpora_are_as_their_readme_says():
    script = load_script("grammar_engines")
    suite = script.suite_entries()
    assert len(suite) == 387
    assert sum(len(tests) for _, tests in suite) == 2010
    bench = script.bench_entries()
    assert len(bench) == 60
    tests = [t for _, instances in bench for t in instances]
    assert (len(tests), sum(t["valid"] for t in tests)) == (245, 87)
    for _, instances in bench:  # drawn with at least one valid and one invalid instance each
        assert {t["valid"] for t in instances} == {True, False}


def test_allowed_reads_bit_i_mod_32_of_word_i_div_32():
    tokens = [0, 5, 31, 32, 63, 70]
    words = np.zeros(3, dtype=np.uint32)
    for token in tokens:
        words[token // 32] |= np.uint32(1) << np.uint32(token % 32)
    allowed = load_script("grammar_engines").allowed(words.view(np.int32), vocab_size=71)
    assert allowed.shape == (71,)
    assert np.flatnonzero(allowed).tolist() == tokens


def test_pick_takes_only_allowed_tokens_and_sometimes_a_closing_one():
    script = load_script("grammar_engines")
    ok = np.zeros(100, dtype=bool)
    ok[[3, 10, 20, 30, 40, 50]] = True
    closes = np.zeros(100, dtype=bool)
    closes[[10, 11]] = True  # 11 closes but is not allowed
    rng = np.random.default_rng(0)
    picks = [script.pick(rng, ok, closes) for _ in range(300)]
    assert set(picks) <= {3, 10, 20, 30, 40, 50}
    # uniform alone would give token 10 about 1/6 of the time; the closing bias about 4/9
    assert 0.3 < picks.count(10) / len(picks) < 0.6


def test_a_choice_list_is_an_alternation_of_literals():
    assert load_script("grammar_engines").choice_regex(["a.b", "c|d", "e"]) == r"(a\.b|c\|d|e)"
