"""The kernel sources: the ``.cu`` files of the top-level ``cuda/`` folder, found at run time."""

from __future__ import annotations

from pathlib import Path

KERNEL_FILES = ("paged_attention", "reshape_and_cache", "rms_norm", "rope", "swiglu")
"""The kernel sources, ``<name>.cu`` each."""


def kernel_dir() -> Path:
    """The folder holding the ``.cu`` sources.

    An installed package carries them as ``mie/cuda_kernels`` (setup.py maps the top-level
    ``cuda/`` folder there); an editable install or a bare checkout reads ``cuda/`` itself.
    """
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "cuda_kernels", package.parent / "cuda"):
        if (candidate / "paged_attention.cu").is_file():
            return candidate
    raise FileNotFoundError(f"no CUDA kernel sources next to {package} (looked for cuda_kernels/)")


def kernel_source(name: str) -> str:
    """The text of ``cuda/<name>.cu``."""
    if name not in KERNEL_FILES:
        raise ValueError(f"unknown kernel file {name!r}; the kernels are {KERNEL_FILES}")
    return (kernel_dir() / f"{name}.cu").read_text(encoding="utf-8")
