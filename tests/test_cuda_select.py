"""Choosing CPU or CUDA: CPU by default, CUDA only when asked, and then a GPU or a clear error.

The failure paths are simulated by hiding or faking the GPU libraries in ``sys.modules``, so
they run the same on machines with and without a GPU.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types

import pytest

from mie.cuda import ENV_SWITCH, CudaUnavailableError, device, select_device
from mie.cuda.backend import KERNEL_FILES, kernel_dir, kernel_source


@pytest.fixture
def no_loaded_backend(monkeypatch):
    """Forget any backend a previous test loaded, so the next request loads afresh."""
    monkeypatch.setattr(device, "_backend", None)


@pytest.fixture
def no_gpu_libraries(monkeypatch, no_loaded_backend):
    """As if neither pycuda nor CuPy were installed (a None entry makes the import fail)."""
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "cupy", None)


@pytest.fixture
def pycuda_without_driver(monkeypatch, no_loaded_backend):
    """As if pycuda were installed but its driver module could not load (no libcuda)."""
    fake = types.ModuleType("pycuda")
    fake.__spec__ = importlib.machinery.ModuleSpec("pycuda", None, is_package=True)
    monkeypatch.setitem(sys.modules, "pycuda", fake)
    monkeypatch.setitem(sys.modules, "pycuda.autoprimaryctx", None)


@pytest.mark.parametrize("switch", [None, "", "0"])
def test_cpu_is_the_default(monkeypatch, no_gpu_libraries, switch):
    if switch is None:
        monkeypatch.delenv(ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(ENV_SWITCH, switch)
    assert select_device() == "cpu"
    assert device._backend is None  # nothing was loaded


def test_explicit_cpu_wins_over_the_environment(monkeypatch, no_gpu_libraries):
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert select_device("cpu") == "cpu"


def test_env_switch_without_gpu_libraries_is_a_clear_error(monkeypatch, no_gpu_libraries):
    monkeypatch.setenv(ENV_SWITCH, "1")
    with pytest.raises(CudaUnavailableError, match="neither pycuda nor CuPy is installed"):
        select_device()


def test_device_argument_without_gpu_libraries_is_a_clear_error(monkeypatch, no_gpu_libraries):
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    with pytest.raises(CudaUnavailableError, match=r"mie\[cuda\]|\.\[cuda\]"):
        select_device("cuda")


def test_pycuda_without_a_driver_is_a_clear_error(pycuda_without_driver):
    with pytest.raises(CudaUnavailableError, match="pycuda cannot use a GPU here"):
        select_device("cuda")
    assert device._backend is None  # a failed load is not cached


def test_cuda_request_on_this_machine_gives_a_gpu_or_the_clear_error(no_loaded_backend):
    """The real, un-faked request: where there is no GPU, it must be CudaUnavailableError."""
    try:
        chosen = select_device("cuda")
    except CudaUnavailableError as exc:
        assert "CUDA was requested but" in str(exc)
    else:
        assert chosen == "cuda" and device._backend is not None


@pytest.mark.parametrize(
    ("switch", "choice", "message"),
    [("yes", None, "MIE_WITH_CUDA must be 0 or 1"), ("", "gpu", "unknown device 'gpu'")],
)
def test_bad_switch_values_are_rejected(monkeypatch, switch, choice, message):
    monkeypatch.setenv(ENV_SWITCH, switch)
    with pytest.raises(ValueError, match=message):
        select_device(choice)


def test_importing_mie_needs_no_gpu_library():
    """``import mie`` (and the CUDA package itself) must not import pycuda or CuPy, even with
    the switch set: only an actual request for the device loads them."""
    code = (
        "import sys, mie, mie.cuda, mie.cuda.ops\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('pycuda', 'cupy')]\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, ENV_SWITCH: "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_kernel_source_is_found():
    found = sorted(p.stem for p in kernel_dir().glob("*.cu"))
    assert found == sorted(KERNEL_FILES)
    for name in KERNEL_FILES:
        assert 'extern "C" __global__' in kernel_source(name)
    with pytest.raises(ValueError, match="unknown kernel file"):
        kernel_source("missing")
