"""Which implementation runs the hot loops: the pure-Python reference or the Cython mirrors.

Both backends expose the same things under the same names -- the allocator classes, the
scheduler and the attention kernels -- so the engine takes them from the ``Backend`` it is
given and never imports ``mie.memory``, ``mie.scheduler``, ``mie.ops`` or ``mie._fast`` for
these directly. The choice, first match wins:

1. an explicit name (the engine's ``backend=`` argument): ``"python"`` or ``"fast"``;
2. the ``MIE_BACKEND`` environment variable, same values;
3. ``"fast"`` if the extension modules were built at install time, else ``"python"``.

Asking for ``"fast"`` when it is not built raises ``BackendUnavailableError`` rather than
quietly running the slow path: a benchmark or a test that wants the fast code must get it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mie import memory, ops
from mie.scheduler.scheduler import Scheduler

BACKENDS = ("python", "fast")
ENV_VAR = "MIE_BACKEND"


class BackendUnavailableError(RuntimeError):
    """The fast backend was asked for, but ``mie._fast`` was not built."""


@dataclass(frozen=True)
class Backend:
    """One implementation of the allocator, the scheduler and the attention kernels."""

    name: str
    BlockPool: type
    BlockTable: type
    Scheduler: type  # over this backend's BlockPool
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., np.ndarray]
    prefill_attention: Callable[..., np.ndarray]


PYTHON = Backend(
    name="python",
    BlockPool=memory.BlockPool,
    BlockTable=memory.BlockTable,
    Scheduler=Scheduler,
    reshape_and_cache=ops.reshape_and_cache,
    paged_attention=ops.paged_attention,
    prefill_attention=ops.prefill_attention,
)


def fast_available() -> bool:
    """Whether the Cython extension modules were built and import cleanly."""
    try:
        import mie._fast  # noqa: F401
    except ImportError:
        return False
    return True


def _fast() -> Backend:
    try:
        import mie._fast as fast
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the fast backend was asked for, but {exc}; or choose the pure-Python backend "
            f"with {ENV_VAR}=python"
        ) from exc
    return Backend(
        name="fast",
        BlockPool=fast.BlockPool,
        BlockTable=fast.BlockTable,
        Scheduler=fast.Scheduler,
        reshape_and_cache=fast.reshape_and_cache,
        paged_attention=fast.paged_attention,
        prefill_attention=fast.prefill_attention,
    )


def select(name: str | None = None) -> Backend:
    """The backend called ``name``, else the one ``MIE_BACKEND`` names, else the best built."""
    source = "argument"
    if name is None:
        name, source = os.environ.get(ENV_VAR) or None, ENV_VAR
    if name is None:
        return _fast() if fast_available() else PYTHON
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (from the {source}); choose one of {BACKENDS}")
    return _fast() if name == "fast" else PYTHON
