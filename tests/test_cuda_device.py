"""Loading the CUDA device: a GPU, or a clear error naming what is missing; no GPU import
before that.

The failure paths are simulated by hiding or faking the GPU libraries in ``sys.modules``, so
they run the same on machines with and without a GPU.
"""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import mie.cuda.device
from mie.cuda import CudaUnavailableError, get_device
from mie.cuda import ops as cuda_ops
from mie.cuda.sources import KERNEL_FILES, kernel_dir, kernel_source

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_loaded_device(monkeypatch):
    """Forget any device a previous test loaded, so the next call loads afresh."""
    monkeypatch.setattr(mie.cuda.device, "_device", None)


@pytest.fixture
def no_gpu_libraries(monkeypatch, no_loaded_device):
    """As if neither pycuda nor CuPy were installed (a None entry makes the import fail)."""
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "cupy", None)


@pytest.fixture
def pycuda_without_driver(monkeypatch, no_loaded_device):
    """As if pycuda were installed but its driver module could not load (no libcuda)."""
    fake = types.ModuleType("pycuda")
    fake.__spec__ = importlib.machinery.ModuleSpec("pycuda", None, is_package=True)
    monkeypatch.setitem(sys.modules, "pycuda", fake)
    monkeypatch.setitem(sys.modules, "pycuda.autoprimaryctx", None)


def test_without_gpu_libraries_the_error_says_what_to_install(no_gpu_libraries):
    with pytest.raises(CudaUnavailableError) as error:
        get_device()
    assert str(error.value) == (
        "neither pycuda nor CuPy is installed (python -m pip install '.[cuda]' adds pycuda)"
    )
    assert mie.cuda.device._device is None


def test_pycuda_without_a_driver_is_a_clear_error(pycuda_without_driver):
    with pytest.raises(CudaUnavailableError, match="^pycuda cannot use a GPU here: "):
        get_device()
    assert mie.cuda.device._device is None  # a failed load is not cached


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_caches_other_than_float32_are_refused_before_any_gpu_call(no_gpu_libraries, dtype):
    """The CUDA kernels read float32 caches only; a 16-bit one (which the CPU kernels take) is
    a TypeError naming float32, raised before looking for a device (so here, without GPU
    libraries, it is that error and not CudaUnavailableError)."""
    q = np.zeros((1, 2, 8), np.float32)
    cache = np.zeros((2, 4, 2, 8), dtype)
    message = r"the CUDA kernels take float32 KV caches only, got k_cache \w+ and v_cache float32"
    with pytest.raises(TypeError, match="paged_attention: " + message):
        cuda_ops.paged_attention(q, cache, cache.astype(np.float32), [[0]], [1], 1.0)
    with pytest.raises(TypeError, match="reshape_and_cache: " + message):
        cuda_ops.reshape_and_cache(q[:, :1], q[:, :1], cache, cache.astype(np.float32), [0])
    assert not cache.any()


def test_the_real_request_on_this_machine_gives_a_device_or_the_clear_error(no_loaded_device):
    """Un-faked: where there is no GPU, it must be CudaUnavailableError, and its message (the
    GPU tests' skip reason) must not blame a switch the user never set."""
    try:
        device = get_device()
    except CudaUnavailableError as exc:
        assert "MIE_WITH_CUDA" not in str(exc) and "requested" not in str(exc)
    else:
        assert device is get_device() and device.name in ("pycuda", "cupy")


def test_importing_mie_needs_no_gpu_library():
    """``import mie`` and the CUDA package itself import neither pycuda nor CuPy: only
    ``get_device()`` loads them."""
    code = (
        "import sys, mie, mie.cuda, mie.cuda.ops, mie.bench.cuda_kernels\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('pycuda', 'cupy')]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_switch_claims_to_move_the_engine_to_the_gpu():
    """Nothing selects a GPU engine path (none exists), so neither the docs nor the
    code may offer ``MIE_WITH_CUDA`` or ``device="cuda"`` for the engine."""
    texts = [ROOT / "README.md", ROOT / "docs" / "cuda.md", *sorted((ROOT / "mie").rglob("*.py"))]
    for path in texts:
        text = path.read_text(encoding="utf-8")
        assert "MIE_WITH_CUDA" not in text, path
        assert "select_device" not in text, path
        assert "keeps its arena and activations on the device" not in text, path


def test_every_kernel_source_is_found():
    found = sorted(p.stem for p in kernel_dir().glob("*.cu"))
    assert found == sorted(KERNEL_FILES)
    for name in KERNEL_FILES:
        assert 'extern "C" __global__' in kernel_source(name)
    with pytest.raises(ValueError, match="unknown kernel file"):
        kernel_source("missing")
