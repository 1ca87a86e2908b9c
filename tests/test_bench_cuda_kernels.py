"""The GPU benchmark section: one clear line without a GPU, and its whole flow on the emulator."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from cuda_emulator import COMPILER, EmulatorDevice
from test_bench import columns_align

from mie.bench import cuda_kernels as cuda_bench
from mie.cuda import CudaUnavailableError


def test_without_a_gpu_it_exits_with_one_line(monkeypatch):
    def no_gpu():
        raise CudaUnavailableError("no driver")

    monkeypatch.setattr(cuda_bench, "get_device", no_gpu)
    with pytest.raises(SystemExit, match="no CUDA GPU to benchmark") as exit_info:
        cuda_bench.run(argparse.Namespace())
    assert "\n" not in str(exit_info.value.code)


def test_module_entry_point_fails_cleanly_without_gpu_libraries():
    code = "import sys; sys.modules['pycuda'] = sys.modules['cupy'] = None\n"
    code += "import runpy; runpy.run_module('mie.bench.cuda_kernels', run_name='__main__')\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.strip().count("\n") == 0
    assert "no CUDA GPU to benchmark" in result.stderr


@pytest.mark.skipif(COMPILER is None, reason="no g++ to build the emulator")
def test_quick_run_on_the_emulator(monkeypatch, capsys):
    """The table-building, reference check, timing and printing, with tiny shapes on the CPU."""
    monkeypatch.setattr(cuda_bench, "get_device", EmulatorDevice)
    monkeypatch.setattr(cuda_bench, "QUICK_BATCHES", (1, 2))
    monkeypatch.setattr(cuda_bench, "QUICK_CONTEXTS", (40, 70))
    monkeypatch.setattr(cuda_bench, "_torch_with_cuda", lambda: None)
    rows = cuda_bench.run(argparse.Namespace(quick=True))
    assert [(r.batch, r.context) for r in rows] == [(1, 40), (2, 40), (1, 70), (2, 70)]
    assert all(r.mie_ms > 0 and r.torch_ms is None for r in rows)
    assert rows[1].kv_bytes == 2 * 40 * 2 * 2 * 64 * 4
    out = capsys.readouterr().out
    assert "CPU emulator" in out and "|" not in out  # aligned text, like the other sections
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("batch "))
    assert [line.split()[:2] for line in lines[start + 2 :]] == [
        ["1", "40"],
        ["2", "40"],
        ["1", "70"],
        ["2", "70"],
    ]
    assert columns_align(lines[start:])
