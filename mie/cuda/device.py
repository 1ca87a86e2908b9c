"""Choosing the compute device: CPU unless CUDA is asked for, and then CUDA or a clear error.

One switch selects the path, first match wins:

1. an explicit ``device`` argument (the engine's ``device=``): ``"cpu"`` or ``"cuda"``;
2. the ``MIE_WITH_CUDA`` environment variable: ``1`` means CUDA, ``0`` or unset means CPU;
3. ``"cpu"``.

Asking for CUDA loads the GPU backend at once -- pycuda if it is installed, else CuPy -- so a
machine without a GPU, a driver or either library fails here with ``CudaUnavailableError``
saying which, instead of deep inside the first forward pass. Nothing is imported before that.
"""

from __future__ import annotations

import importlib.util
import os

from mie.cuda.backend import Backend, CupyBackend, PycudaBackend

DEVICES = ("cpu", "cuda")
ENV_SWITCH = "MIE_WITH_CUDA"


class CudaUnavailableError(RuntimeError):
    """CUDA was asked for but cannot be used here; the message says what is missing."""


_backend: Backend | None = None  # loaded once, on the first successful request


def select_device(device: str | None = None) -> str:
    """``"cpu"`` or ``"cuda"``, from ``device``, else ``MIE_WITH_CUDA``; CUDA is checked."""
    source = "argument"
    if device is None:
        switch, source = os.environ.get(ENV_SWITCH, ""), ENV_SWITCH
        if switch not in ("", "0", "1"):
            raise ValueError(f"{ENV_SWITCH} must be 0 or 1, got {switch!r}")
        device = "cuda" if switch == "1" else "cpu"
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (from the {source}); choose one of {DEVICES}")
    if device == "cuda":
        get_backend()
    return device


def get_backend() -> Backend:
    """The GPU backend, loaded on first use; ``CudaUnavailableError`` if there is none."""
    global _backend
    if _backend is None:
        _backend = _load_backend()
    return _backend


def _load_backend() -> Backend:
    if importlib.util.find_spec("pycuda") is not None:
        loader: type[Backend] = PycudaBackend
    elif importlib.util.find_spec("cupy") is not None:
        loader = CupyBackend
    else:
        raise CudaUnavailableError(
            "CUDA was requested but neither pycuda nor CuPy is installed; install the CUDA "
            "extra (python -m pip install '.[cuda]') or run on the CPU (unset MIE_WITH_CUDA)"
        )
    try:
        return loader()
    except Exception as exc:  # no driver (ImportError), no device, no nvcc: all mean no CUDA
        raise CudaUnavailableError(
            f"CUDA was requested but {loader.name} cannot use a GPU here: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
