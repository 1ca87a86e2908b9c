"""The kernels the forward pass calls: matrix products, KV writes and attention, reference
or Cython.

Eight kernels: ``matmul`` (float32 activations times a weight stored as float32, bfloat16,
float16, int8 or int4; ``mie.linear``) and ``gather_rows`` (the embedding lookup: rows of
such a weight as float32), three that touch the paged KV cache --
``reshape_and_cache`` (write the new tokens' K/V into their slots), ``paged_attention``
(decode: one query row per sequence over its blocks) and ``prefill_attention`` (a causal chunk
over its blocks) -- and ``rms_norm``, ``apply_rope`` and ``swiglu`` (``mie.ops``), whose
NumPy references cost more in calls and temporaries than in arithmetic at batch 1. The
references are the specification; ``mie._fast.linear`` and ``mie._fast.ops`` mirror them in
Cython. The compiled kernels also say how many threads they run on and take a new count
(``set_threads``), which ``mie.kernels_threads.ThreadPolicy`` lowers while another process
holds a core. This module
sits just above the two and below the model, so the model gets its kernels without importing
the allocator or the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mie import linear, ops
from mie.extension import backend_name


@dataclass(frozen=True)
class Kernels:
    """One implementation of the kernels (same signatures as in ``mie.linear`` and ``mie.ops``)."""

    name: str
    matmul: Callable[..., np.ndarray]
    gather_rows: Callable[..., np.ndarray]
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., np.ndarray]
    prefill_attention: Callable[..., np.ndarray]
    rms_norm: Callable[..., np.ndarray]
    apply_rope: Callable[..., np.ndarray]
    swiglu: Callable[..., np.ndarray]
    threads: int  # the threads they were given (OMP_NUM_THREADS when they loaded)
    set_threads: Callable[[int], None] | None  # run the next calls on n (None: no say)
    # layer_plan(layers, config): the model's layer loop in one compiled call
    # (mie._fast.forward); None: the model's own loop always runs
    layer_plan: Callable[..., object] | None = None


REFERENCE = Kernels(
    name="python",
    matmul=linear.matmul,
    gather_rows=linear.gather_rows,
    reshape_and_cache=ops.reshape_and_cache,
    paged_attention=ops.paged_attention,
    prefill_attention=ops.prefill_attention,
    rms_norm=ops.rms_norm,
    apply_rope=ops.apply_rope,
    swiglu=ops.swiglu,
    threads=1,  # NumPy's BLAS has threads of its own, which are not the kernels' to set
    set_threads=None,
)


def select_kernels(name: str | None = None) -> Kernels:
    """The kernels of backend ``name`` (``mie.extension.backend_name``'s rule when None)."""
    if backend_name(name) == "python":
        return REFERENCE
    from mie._fast import forward as fast_forward  # backend_name checked that they import
    from mie._fast import linear as fast_linear
    from mie._fast import ops as fast_ops

    return Kernels(
        name="fast",
        matmul=fast_linear.matmul,
        gather_rows=fast_linear.gather_rows,
        reshape_and_cache=fast_ops.reshape_and_cache,
        paged_attention=fast_ops.paged_attention,
        prefill_attention=fast_ops.prefill_attention,
        rms_norm=fast_ops.rms_norm,
        apply_rope=fast_ops.apply_rope,
        swiglu=fast_ops.swiglu,
        threads=fast_ops.THREADS,
        set_threads=fast_ops.set_threads,
        layer_plan=fast_forward.layer_plan,
    )
