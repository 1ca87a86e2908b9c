"""Cython mirrors of mie's hot loops, with the pure-Python reference's API and behaviour.

``mie.memory``, ``mie.scheduler`` and ``mie.ops`` stay the readable specification; this package
holds compiled mirrors of the allocator, the scheduler and the attention kernels, proven
equivalent by the tests in ``tests/test_fast_*.py``. The engine picks a backend through
``mie.backend.select``; importing this package directly works too, and fails with an
ImportError naming the cause and the fix when the extension modules cannot be imported (not
built, or built somewhere the imported ``mie`` hides: see ``mie.extension.explain_missing_build``).

Importing the package loads only the kernels (``mie._fast.ops``, the lowest layer, and the
one module linked with OpenMP); the allocator and scheduler mirrors load when first used
(``mie._fast.BlockPool`` or ``import mie._fast.memory``), so the model's kernels never pull in
the scheduler.
"""

from __future__ import annotations

import os

from mie import lazy_exports

# OpenMP threads that busy-wait after a parallel region steal the cores NumPy's BLAS needs
# next: in a model's decode step, where the attention kernel (OpenMP) and the matrix products
# (BLAS) alternate every layer, spinning threads slow the step down. So mie's OpenMP runtime
# starts with idle threads sleeping, unless the user chose a policy. The runtime reads
# OMP_WAIT_POLICY once, when it loads -- with the first extension module, below -- so the
# variable is set only for that moment and then restored: the process's environment (and its
# child processes) are left as they were. (If another library loaded the same OpenMP runtime
# earlier, its policy is already fixed.)
_USER_POLICY = os.environ.get("OMP_WAIT_POLICY")
os.environ["OMP_WAIT_POLICY"] = _USER_POLICY or "PASSIVE"
try:
    # The kernels: the one module linked with the OpenMP runtime, so loading it loads the
    # runtime. They sit at the bottom of the layers (array functions importing nothing of mie
    # but the reference's argument checks), so every other mirror may import them.
    import mie._fast.ops  # noqa: F401
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("mie._fast."):
        raise
    from mie.extension import explain_missing_build  # not built, or built but shadowed: which

    raise ImportError(explain_missing_build(exc)) from exc
finally:
    if _USER_POLICY is None:
        del os.environ["OMP_WAIT_POLICY"]

# name -> the extension module that defines it, imported on first use.
_LAZY = {
    "BlockPool": "mie._fast.memory",
    "BlockTable": "mie._fast.memory",
    "PrefixCache": "mie._fast.prefix_cache",
    "Batch": "mie._fast.scheduler",
    "BatchEntry": "mie._fast.scheduler",
    "Scheduler": "mie._fast.scheduler",
    "Sequence": "mie._fast.scheduler",
    "OPENMP": "mie._fast.ops",
    "max_threads": "mie._fast.ops",
    "paged_attention": "mie._fast.ops",
    "prefill_attention": "mie._fast.ops",
    "reshape_and_cache": "mie._fast.ops",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
