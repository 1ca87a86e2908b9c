"""Cython mirrors of mie's hot loops, with the pure-Python reference's API and behaviour.

``mie.memory``, ``mie.scheduler`` and ``mie.ops`` stay the readable specification; this package
holds compiled mirrors of the allocator, the scheduler and the attention kernels, proven
equivalent by the tests in ``tests/test_fast_*.py``. The engine picks a backend through
``mie.backend.select``; importing this package directly works too, and fails with an
ImportError naming the cause and the fix when the extension modules cannot be imported (not
built, or built somewhere the imported ``mie`` hides: see ``mie.backend.explain_missing_build``).
"""

import os

# OpenMP threads that busy-wait after a parallel region steal the cores NumPy's BLAS needs
# next: in a model's decode step, where the attention kernel (OpenMP) and the matrix products
# (BLAS) alternate every layer, spinning made the fast backend's step about 1.5x slower
# (bench/RESULTS.md). Idle threads sleep instead, unless the user chose otherwise; this must
# happen before the OpenMP runtime loads, with the extension modules below.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    from mie._fast.memory import BlockPool, BlockTable
    from mie._fast.ops import (
        OPENMP,
        max_threads,
        paged_attention,
        prefill_attention,
        reshape_and_cache,
    )
    from mie._fast.prefix_cache import PrefixCache
    from mie._fast.scheduler import Batch, BatchEntry, Scheduler, Sequence
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("mie._fast."):
        raise
    from mie.backend import explain_missing_build  # not built, or built but shadowed: which

    raise ImportError(explain_missing_build(exc)) from exc
from mie.memory import INVALID_BLOCK, AllocatorError

__all__ = [
    "INVALID_BLOCK",
    "OPENMP",
    "AllocatorError",
    "Batch",
    "BatchEntry",
    "BlockPool",
    "BlockTable",
    "PrefixCache",
    "Scheduler",
    "Sequence",
    "max_threads",
    "paged_attention",
    "prefill_attention",
    "reshape_and_cache",
]
