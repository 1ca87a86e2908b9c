"""The fast-vs-python micro-benchmark runs end to end (tiny sizes; no timing is asserted)."""

import argparse

from conftest import require_fast

from mie.bench import fast


def test_quick_run_compares_allocator_and_decode(capsys):
    require_fast()
    results = fast.run(argparse.Namespace(quick=True))
    assert [r.name.split(":")[0] for r in results] == ["allocator", "paged_attention decode"]
    assert all(r.python_s > 0 and r.fast_s > 0 for r in results)
    assert "speedup" in capsys.readouterr().out
