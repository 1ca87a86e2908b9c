"""The allocator and scheduler classes the engine builds, the kernels it computes with, and
how a scheduler's batch becomes the model's inputs (``prepare_inputs``).

Both implementations expose the same things under the same names, so the engine takes them
from the ``Backend`` it is given and never imports ``mie.memory``, ``mie.scheduler`` or
``mie._fast`` for these directly. Which one runs is ``mie.extension.backend_name``'s rule:
an explicit name, else ``MIE_BACKEND``, else the fast one if it was built. The model does not
import this module: it only needs ``mie.kernels``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mie import memory
from mie.extension import backend_name
from mie.kernels import Kernels, select_kernels
from mie.model.inputs import ForwardInputs, prepare_inputs
from mie.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class Backend:
    """One implementation of the allocator, the scheduler and the model's kernels."""

    name: str
    BlockPool: type
    BlockTable: type
    Scheduler: type  # over this backend's BlockPool
    kernels: Kernels
    # prepare_inputs(entries, *, all_positions): its scheduler's batch as the model's inputs
    prepare_inputs: Callable[..., ForwardInputs]


PYTHON = Backend(
    name="python",
    BlockPool=memory.BlockPool,
    BlockTable=memory.BlockTable,
    Scheduler=Scheduler,
    kernels=select_kernels("python"),
    prepare_inputs=prepare_inputs,
)


def select(name: str | None = None) -> Backend:
    """The backend called ``name``, else the one ``MIE_BACKEND`` names, else the best built."""
    if backend_name(name) == "python":
        return PYTHON
    from mie._fast.inputs import prepare_inputs as fast_prepare_inputs
    from mie._fast.memory import BlockPool, BlockTable  # backend_name checked that it imports
    from mie._fast.scheduler import Scheduler as FastScheduler

    return Backend(
        name="fast",
        BlockPool=BlockPool,
        BlockTable=BlockTable,
        Scheduler=FastScheduler,
        kernels=select_kernels("fast"),
        prepare_inputs=fast_prepare_inputs,
    )
