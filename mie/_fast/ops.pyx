# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
# distutils: extra_compile_args = -fno-math-errno -fno-trapping-math -fno-signed-zeros -fassociative-math
"""Cython mirrors of ``mie.ops``'s KV write and attention kernels.

What mirrors what (same names and arguments; checks from ``mie.ops``)::

    here                                        reference (mie/ops.py)
    reshape_and_cache                           reshape_and_cache  (check_cache_write_args)
    paged_attention                             paged_attention    (check_paged_attention_args)
    prefill_attention                           prefill_attention  (check_prefill_attention_args)

Same arguments, same checks (the reference's own validation helpers and messages), same
results within float32 rounding (tests hold them to 1e-5 relative), for every cache dtype the
reference takes (``mie.ops.KV_CACHE_DTYPES``: float32, float16, bfloat16). The kernels are C
(``attention_kernels.h``, ``attention_body.h``); this module validates, views the arrays and
releases the GIL. What changes from the reference is the shape of the computation:

* no gathering: the reference copies each sequence's blocks into one padded batch (and widens
  a 16-bit cache to float32); here every (query row, KV head) task walks its block table and
  reads K/V rows in place, widening 16-bit values in registers;
* online softmax, one block at a time: a running maximum ``m``, normaliser ``l`` and weighted
  sum ``acc`` per query head, rescaled by ``exp(m_old - m_new)`` when the maximum grows, so
  scores are never materialised beyond one block;
* grouped-query attention by task: one task serves the ``num_heads // num_kv_heads`` query
  heads that read the same KV head, so each K/V row is loaded once per group;
* tasks run in parallel (OpenMP) when the extension was built with it; each task's result
  depends on nothing else, so the output is bit-identical for any thread count.

The KV write rounds to the cache's dtype exactly as the reference (same bits, saturation
included: see ``mie.ops``), in scalar integer code shared by every instruction set.

Instruction sets: the attention kernel exists for ``ISAS`` (best first); at import the best
one the CPU supports is chosen, or the one named by the ``MIE_ISA`` environment variable (as
``mie._fast.linear``, which reads the same variable); ``set_isa`` switches at run time (tests
and benchmarks force each variant that way). ``ISA`` names the variant in use.

Caches are read through their strides (any view works, including the strided per-layer views
of the block pool's arena; strides need only be whole elements). Queries are taken as
C-contiguous float32 (converted if needed) and results are always float32.
"""

cimport numpy as cnp
from libc.stdint cimport int64_t

import ml_dtypes
import numpy as np

cnp.import_array()

from mie._fast.isa import IsaChoice
from mie.ops import (
    check_cache_write_args,
    check_paged_attention_args,
    check_prefill_attention_args,
)

cdef extern from "attention_kernels.h" nogil:
    ctypedef struct mie_kv_cache:
        char *data
        int64_t s_block, s_offset, s_head, s_dim
    int MIE_KV_F32
    int MIE_KV_F16
    int MIE_KV_BF16
    int mie_attention_isa_count()
    const char *mie_attention_isa_name(int i)
    int mie_attention_isa_supported(int i)
    int mie_max_threads()
    int mie_openmp()
    int64_t mie_attention_scratch_floats(int64_t group, int64_t block_size, int64_t dim)
    void mie_attention(int isa, int fmt, const float *q, float *out, mie_kv_cache k,
                       mie_kv_cache v, const int64_t *tables, int64_t table_stride,
                       const int64_t *lens, int64_t start, int64_t window, int64_t rows,
                       int64_t num_kv_heads, int64_t group, int64_t block_size, int64_t dim,
                       float scale, float *scratch, int64_t scratch_floats, int nthreads)
    void mie_cache_write(int fmt, const float *src, mie_kv_cache c, const int64_t *slots,
                         int64_t tokens, int64_t num_kv_heads, int64_t dim, int64_t block_size)

OPENMP = bool(mie_openmp())
"""Whether this build runs the kernels in parallel (setup.py found a working ``-fopenmp``)."""


def max_threads() -> int:
    """Threads the kernels use: OpenMP's limit (``OMP_NUM_THREADS``), or 1 without OpenMP."""
    return mie_max_threads()


# -- instruction sets (as mie._fast.linear) --------------------------------------------------

ISAS = tuple(mie_attention_isa_name(i).decode() for i in range(mie_attention_isa_count()))
"""Every variant of the attention kernel compiled into this build, best first (``generic``
is always there)."""

_choice = IsaChoice(ISAS, [bool(mie_attention_isa_supported(i)) for i in range(len(ISAS))])
ISA = _choice.name
"""The variant in use (``set_isa`` changes it)."""


def supported_isas() -> tuple:
    """The variants this CPU runs, best first."""
    return _choice.supported()


def set_isa(name: str) -> None:
    """Use variant ``name`` from now on (all threads); ``ValueError`` if unknown or unsupported."""
    global ISA
    _choice.set(name)
    ISA = _choice.name


def get_isa() -> str:
    """The variant in use (also the module attribute ``ISA``)."""
    return _choice.name


def _mask_isas(names) -> None:
    """Tests only: treat ``names`` as unsupported (a smaller CPU); falls back to the best left."""
    global ISA
    _choice.mask(names)
    ISA = _choice.name


# -- the kernels -------------------------------------------------------------------------------

_FORMATS = {
    np.dtype(np.float32): MIE_KV_F32,
    np.dtype(np.float16): MIE_KV_F16,
    np.dtype(ml_dtypes.bfloat16): MIE_KV_BF16,
}


cdef mie_kv_cache _cache_view(cache, str name) except *:
    """The C view of a cache the reference's checks accepted (any strides of whole elements)."""
    cdef mie_kv_cache c
    itemsize, strides = cache.itemsize, cache.strides
    if any(stride % itemsize for stride in strides):
        raise ValueError(f"{name}: strides {strides} are not whole {cache.dtype} elements")
    c.data = <char *>cnp.PyArray_DATA(<cnp.ndarray>cache)
    c.s_block, c.s_offset, c.s_head, c.s_dim = [stride // itemsize for stride in strides]
    return c


cdef _attention(q, k_cache, v_cache, tables, lens, int64_t start, int64_t window, int64_t group,
                float scale):
    """The result (rows, num_heads, head_dim) of the checked arguments; ``tables`` is one
    block table per row (decode, with ``lens``) or one shared table (prefill, ``lens=None``);
    ``window`` is the sliding window, 0 for full attention."""
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    cdef mie_kv_cache k = _cache_view(k_cache, "k_cache")
    cdef mie_kv_cache v = _cache_view(v_cache, "v_cache")
    cdef int fmt = _FORMATS[k_cache.dtype]
    cdef cnp.ndarray queries = np.ascontiguousarray(q, dtype=np.float32)
    cdef cnp.ndarray table_rows = np.ascontiguousarray(tables, dtype=np.int64)
    cdef cnp.ndarray lengths = None if lens is None else np.ascontiguousarray(lens, dtype=np.int64)
    cdef int64_t rows = queries.shape[0], dim = queries.shape[2]
    cdef int64_t num_kv_heads = k_cache.shape[2], block_size = k_cache.shape[1]
    cdef int64_t table_stride = table_rows.shape[1] if table_rows.ndim == 2 else 0
    result = np.empty((rows, queries.shape[1], dim), dtype=np.float32)
    cdef int threads = mie_max_threads()
    cdef int64_t size = mie_attention_scratch_floats(group, block_size, dim)
    cdef cnp.ndarray scratch = np.empty((threads, size), dtype=np.float32)
    cdef const float *qp = <const float *>cnp.PyArray_DATA(queries)
    cdef float *out = <float *>cnp.PyArray_DATA(result)
    cdef const int64_t *tp = <const int64_t *>cnp.PyArray_DATA(table_rows)
    cdef const int64_t *lp = NULL
    if lengths is not None:
        lp = <const int64_t *>cnp.PyArray_DATA(lengths)
    cdef float *sp = <float *>cnp.PyArray_DATA(scratch)
    cdef int isa = _choice.index
    with nogil:
        mie_attention(isa, fmt, qp, out, k, v, tp, table_stride, lp, start, window, rows,
                      num_kv_heads, group, block_size, dim, scale, sp, size, threads)
    return result


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None):
    """Decode attention: one query token per sequence over its cached context (the last
    ``sliding_window`` positions of it, when given).

    Mirrors ``mie.ops.paged_attention`` (same arguments, checks and errors). Returns float32
    (num_seqs, num_heads, head_dim).
    """
    num_seqs, num_heads, head_dim = q.shape
    group, tables, lens, window = check_paged_attention_args(
        q, k_cache, v_cache, block_tables, context_lens, sliding_window
    )
    if num_seqs == 0:
        return np.empty((0, num_heads, head_dim), dtype=np.float32)
    return _attention(q, k_cache, v_cache, tables, lens, 0, window, group, scale)


def prefill_attention(q, k_cache, v_cache, block_table, start, scale, sliding_window=None):
    """Causal attention for positions ``start .. start + n - 1`` of one sequence.

    Mirrors ``mie.ops.prefill_attention``; query ``i`` is a decode-style task over the first
    ``start + i + 1`` positions (the last ``sliding_window`` of them, when given). Returns
    float32 (n, num_heads, head_dim).
    """
    n, num_heads, head_dim = q.shape
    group, blocks, window = check_prefill_attention_args(
        q, k_cache, v_cache, block_table, start, sliding_window
    )
    if n == 0:
        return np.empty((0, num_heads, head_dim), dtype=np.float32)
    return _attention(q, k_cache, v_cache, blocks, None, start, window, group, scale)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Write new tokens' keys and values (tokens, kv_heads, head_dim) into their slots, in place.

    Mirrors ``mie.ops.reshape_and_cache`` (same checks, and the same bits in a 16-bit cache;
    a repeated slot keeps the last write).
    """
    slots = check_cache_write_args(k, v, k_cache, v_cache, slot_mapping)
    if len(slots) == 0:
        return
    for cache in (k_cache, v_cache):
        if not cache.flags.writeable:
            raise ValueError("assignment destination is read-only")  # NumPy's words
    cdef int fmt = _FORMATS[k_cache.dtype]
    cdef int64_t tokens = k.shape[0], num_kv_heads = k.shape[1], dim = k.shape[2]
    cdef int64_t block_size = k_cache.shape[1]
    cdef cnp.ndarray slot = np.ascontiguousarray(slots, dtype=np.int64)
    cdef cnp.ndarray keys = np.ascontiguousarray(k, dtype=np.float32)
    cdef cnp.ndarray values = np.ascontiguousarray(v, dtype=np.float32)
    cdef mie_kv_cache kc = _cache_view(k_cache, "k_cache")  # both checked before any write
    cdef mie_kv_cache vc = _cache_view(v_cache, "v_cache")
    cdef const int64_t *sp = <const int64_t *>cnp.PyArray_DATA(slot)
    cdef const float *kp = <const float *>cnp.PyArray_DATA(keys)
    cdef const float *vp = <const float *>cnp.PyArray_DATA(values)
    with nogil:
        mie_cache_write(fmt, kp, kc, sp, tokens, num_kv_heads, dim, block_size)
        mie_cache_write(fmt, vp, vc, sp, tokens, num_kv_heads, dim, block_size)
