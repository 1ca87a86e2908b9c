"""Cython mirrors of mie's hot loops, with the pure-Python reference's API and behaviour.

``mie.memory``, ``mie.scheduler`` and ``mie.ops`` stay the readable specification; this package
holds compiled mirrors of the allocator, the scheduler, the step's input preparation
(``mie.model.inputs``) and the kernels, proven
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

# How mie's OpenMP threads wait between parallel regions. A batch-1 decode step opens about a
# hundred of them (every matrix product, every attention call), a few to a few hundred
# microseconds apart: threads put to sleep after each (OMP_WAIT_POLICY=PASSIVE) must be woken
# by the kernel for the next, and on this project's 2-core VMs that cost a third of an int4
# step; threads that spin for good (ACTIVE) hold their core while another process wants it,
# and the step then waits on a thread the scheduler has put aside (int4: 3 tok/s instead of
# 30 with one busy process beside). So mie's threads spin a short while, then sleep:
# GNU OpenMP's GOMP_SPINCOUNT, SPIN_COUNT busy-wait iterations (tens of microseconds). Measured
# on a 2-core EPYC, Qwen2-0.5B-shaped int4, batch-1 decode tok/s quiet / beside one busy
# process: PASSIVE 31-37 / 30; 1,000 44 / 26; 3,000 50 / 20; 10,000 37-54 / 11; 100,000 50-53 /
# 3 (docs/fast.md, "Threads"). mie's kernels no longer share the cores with OpenBLAS's threads
# during decode (float32 products are mie's own too), which is what made any spinning cost
# float32 steps before. The runtime reads these variables once, when it loads -- with the first
# extension module, below -- so they are set only for that moment and then restored: the
# process's environment (and its child processes) are left as they were. A user's
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. (If another library loaded the same OpenMP runtime
# earlier, its policy is already fixed.)
SPIN_COUNT = 3000
_USER_SET = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
if not _USER_SET:
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
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
    if not _USER_SET:
        del os.environ["GOMP_SPINCOUNT"]

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
    "rms_norm": "mie._fast.ops",
    "apply_rope": "mie._fast.ops",
    "swiglu": "mie._fast.ops",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
