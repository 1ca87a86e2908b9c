"""The backends section (fast vs python) runs end to end (tiny sizes; no timing asserted)."""

import argparse
import json

from conftest import require_fast

from mie.bench import backends
from mie.bench.__main__ import SECTIONS


def test_quick_section_compares_every_mechanism():
    require_fast()
    result = backends.run(argparse.Namespace(quick=True, seed=0))
    names = [c["name"].split(":")[0] for c in result.data["backends"]["comparisons"]]
    assert names == [
        "simulation",
        "the same, fast scheduler under the Python driver",
        "simulation",
        "simulation",
        "allocator",
        "the same, Python loop (public API)",
        "paged_attention decode",
        "the same, bfloat16 KV cache",
        "decode step",
    ]
    assert all(
        c["python_s"] > 0 and c["fast_s"] > 0 for c in result.data["backends"]["comparisons"]
    )
    assert "speedup" in result.report and "matrix products" in result.report
    json.dumps(result.data)  # goes into --json as it is


def test_registered_as_a_section():
    assert SECTIONS["backends"] is backends.run


def test_without_the_extension_it_is_a_note(monkeypatch):
    monkeypatch.setattr(backends, "fast_available", lambda: False)
    result = backends.run(argparse.Namespace(quick=True, seed=0))
    assert result.data == {"backends": None} and "not built" in result.report
