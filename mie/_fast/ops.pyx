# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
# distutils: extra_compile_args = -fno-math-errno -fno-trapping-math -fno-signed-zeros -fassociative-math
"""Cython mirrors of ``mie.ops``'s KV write and attention kernels, and of its RMSNorm, RoPE
and SwiGLU.

What mirrors what (same names and arguments; checks from ``mie.ops``)::

    here                                        reference (mie/ops.py)
    reshape_and_cache                           reshape_and_cache  (check_cache_write_args)
    paged_attention                             paged_attention    (check_paged_attention_args)
    prefill_attention                           prefill_attention  (check_prefill_attention_args)
    rms_norm                                    rms_norm
    apply_rope                                  apply_rope
    swiglu                                      swiglu

Why RMSNorm, RoPE and SwiGLU: at batch 1 each is a few thousand floats, and the reference's
half dozen NumPy operations (each allocating its result) cost 8-15 us a call, 100 calls a
step; one C loop costs one to four.

The engine's attention arguments (float32 C-contiguous queries, caches of a kernel dtype;
decode: int64 block tables and context lengths; a prompt chunk: an int64 block table and an
int start) and KV writes (float32 keys and values, int64 slots) are recognised on the
arrays' C fields (``_ready_decode``, ``_ready_prefill``, ``_ready_cache_write``), which also
check the tables' and slots' contents in C: the reference's checks, in Python, cost more
than the attention itself at batch 1. Anything else takes those checks.

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
* tasks run in parallel (OpenMP) when the extension was built with it and the call has the
  work for it (``MIE_ATTENTION_PARALLEL_WORK``: a small model's decode stays on the calling
  thread); each task's result depends on nothing else, so the output is bit-identical for
  any thread count.

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
from libc.math cimport sqrtf
from libc.stdint cimport int64_t

import ml_dtypes
import numpy as np

cnp.import_array()

from mie._fast.isa import IsaChoice
from mie.ops import apply_rope as _reference_apply_rope
from mie.ops import rms_norm as _reference_rms_norm
from mie.ops import swiglu as _reference_swiglu
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
    int mie_attention_isa_for(int isa, int64_t dim)
    int mie_max_threads()
    void mie_set_threads(int n)
    int mie_openmp()
    int64_t mie_attention_scratch_floats(int64_t group, int64_t block_size, int64_t dim)
    void mie_attention(int isa, int fmt, const float *q, float *out, mie_kv_cache k,
                       mie_kv_cache v, const int64_t *tables, int64_t table_stride,
                       const int64_t *lens, int64_t start, int64_t window, int64_t rows,
                       int64_t num_kv_heads, int64_t group, int64_t block_size, int64_t dim,
                       float scale, float *scratch, int64_t scratch_floats, int nthreads)
    void mie_cache_write(int fmt, const float *src, mie_kv_cache c, const int64_t *slots,
                         int64_t tokens, int64_t num_kv_heads, int64_t dim, int64_t block_size)
    void mie_swiglu(int isa, const float *gate, const float *up, float *out, int64_t n)

OPENMP = bool(mie_openmp())
"""Whether this build runs the kernels in parallel (setup.py found a working ``-fopenmp``)."""


THREADS = mie_max_threads()
"""The threads the kernels were given: OpenMP's limit when this module loaded
(``OMP_NUM_THREADS``), whatever ``set_threads`` sets later."""


def max_threads() -> int:
    """Threads the kernels use: OpenMP's limit (``OMP_NUM_THREADS``, or what ``set_threads``
    set last from this thread), or 1 without OpenMP."""
    return mie_max_threads()


def set_threads(n: int) -> None:
    """Run the kernels this thread calls on ``n`` threads from now on (at least 1; no-op
    without OpenMP)."""
    mie_set_threads(n)


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


def attention_kernel(head_dim: int) -> str:
    """The variant whose kernel attends heads of ``head_dim`` floats under the variant in use:
    the next narrower one where its vectors fill a head exactly and ``ISA``'s would leave a
    partial vector (AVX-512 hands a head_dim of 8 or 24 to the AVX2 kernel), else ``ISA``
    (attention_kernels.h, ``mie_attention_isa_for``, says what was measured)."""
    if type(head_dim) is not int or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return ISAS[mie_attention_isa_for(_choice.index, head_dim)]


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


cdef inline mie_kv_cache _strided_cache(char *data, const int64_t *strides) noexcept nogil:
    """The C view of a cache at ``data`` with these element strides."""
    cdef mie_kv_cache c
    c.data = data
    c.s_block, c.s_offset, c.s_head, c.s_dim = strides[0], strides[1], strides[2], strides[3]
    return c


cdef bint cache_strides(cnp.ndarray cache, int64_t *strides) noexcept:
    """A 4-D cache's (block, offset, head, dim) strides in elements, into ``strides``; False
    when one is not a whole number of elements."""
    cdef int64_t itemsize = cnp.PyArray_ITEMSIZE(cache), axis
    for axis in range(4):
        if cnp.PyArray_STRIDES(cache)[axis] % itemsize:
            return False
        strides[axis] = cnp.PyArray_STRIDES(cache)[axis] // itemsize
    return True


cdef mie_kv_cache _cache_view(cache, str name) except *:
    """The C view of a cache the reference's checks accepted (any strides of whole elements)."""
    cdef cnp.ndarray a = cache
    cdef int64_t strides[4]
    if not cache_strides(a, strides):
        raise ValueError(f"{name}: strides {cache.strides} are not whole {cache.dtype} elements")
    return _strided_cache(<char *>cnp.PyArray_DATA(a), strides)


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


cdef bint _kernel_caches(k_cache, v_cache):
    """``k_cache`` and ``v_cache`` are caches the kernels read: ndarrays, 4-D, alike in shape,
    of one kernel dtype (``_FORMATS``)."""
    if not (isinstance(k_cache, cnp.ndarray) and isinstance(v_cache, cnp.ndarray)):
        return False
    cdef cnp.ndarray kc = k_cache, vc = v_cache
    return not (kc.ndim != 4 or vc.ndim != 4 or kc.dtype != vc.dtype
                or kc.dtype not in _FORMATS
                or kc.shape[0] != vc.shape[0] or kc.shape[1] != vc.shape[1]
                or kc.shape[2] != vc.shape[2] or kc.shape[3] != vc.shape[3])


cdef int64_t _ready_window(q, k_cache, v_cache, sliding_window) except -2:
    """The window (0: none) when float32 C-contiguous queries ``q`` (rows >= 1, heads,
    head_dim) fit caches the kernel reads (``_kernel_caches``, GQA) and the window is None or
    an int the reference takes; else -1."""
    if not (_is_array(q, cnp.NPY_FLOAT32, 3) and _kernel_caches(k_cache, v_cache)):
        return -1
    cdef cnp.ndarray qa = q, kc = k_cache
    if (qa.shape[0] < 1 or kc.shape[3] != qa.shape[2] or kc.shape[2] < 1
            or qa.shape[1] % kc.shape[2]):
        return -1
    if sliding_window is None:
        return 0
    if type(sliding_window) is not int or not 1 <= sliding_window <= 2**62:
        return -1
    return sliding_window


cdef int64_t _ready_decode(q, k_cache, v_cache, block_tables, context_lens,
                           sliding_window) except -2:
    """The window (0: none) when the arguments are what the engine passes and would pass the
    reference's checks (``check_paged_attention_args``: shapes, dtypes, every length within
    its row and every block read inside the cache), else -1 (then the caller runs those
    checks, which say what is wrong)."""
    if not (_is_array(block_tables, cnp.NPY_INT64, 2)
            and _is_array(context_lens, cnp.NPY_INT64, 1)):
        return -1
    cdef int64_t window = _ready_window(q, k_cache, v_cache, sliding_window)
    if window < 0:
        return -1
    cdef cnp.ndarray qa = q, kc = k_cache, ta = block_tables, la = context_lens
    cdef int64_t num_seqs = qa.shape[0], num_blocks = kc.shape[0], block_size = kc.shape[1]
    if ta.shape[0] != num_seqs or la.shape[0] != num_seqs:
        return -1
    cdef const int64_t *tables = <const int64_t *>cnp.PyArray_DATA(ta)
    cdef const int64_t *lens = <const int64_t *>cnp.PyArray_DATA(la)
    cdef int64_t width = ta.shape[1], row, j, length, first, needed, block
    for row in range(num_seqs):
        length = lens[row]
        if length < 1 or length > width * block_size:
            return -1
        first = (length - window if window and length > window else 0) // block_size
        needed = (length + block_size - 1) // block_size
        for j in range(width):
            block = tables[row * width + j]
            if block >= num_blocks or (block < 0 and first <= j < needed):
                return -1
    return window


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None):
    """Decode attention: one query token per sequence over its cached context (the last
    ``sliding_window`` positions of it, when given).

    Mirrors ``mie.ops.paged_attention`` (same arguments, checks and errors). Returns float32
    (num_seqs, num_heads, head_dim).
    """
    cdef int64_t window = _ready_decode(q, k_cache, v_cache, block_tables, context_lens,
                                        sliding_window)
    if window >= 0:
        return _attention(q, k_cache, v_cache, block_tables, context_lens, 0, window,
                          q.shape[1] // k_cache.shape[2], scale)
    num_seqs, num_heads, head_dim = q.shape
    group, tables, lens, window = check_paged_attention_args(
        q, k_cache, v_cache, block_tables, context_lens, sliding_window
    )
    if num_seqs == 0:
        return np.empty((0, num_heads, head_dim), dtype=np.float32)
    return _attention(q, k_cache, v_cache, tables, lens, 0, window, group, scale)


cdef int64_t _ready_prefill(q, k_cache, v_cache, block_table, start, sliding_window) except -2:
    """``_ready_decode`` for one prompt chunk (``check_prefill_attention_args``): the table
    holds a block for every position up to the chunk's last, none of them past the cache, and
    none of those the chunk reads (from its first query's window on) released (-1)."""
    if not (_is_array(block_table, cnp.NPY_INT64, 1) and type(start) is int and start >= 0):
        return -1
    cdef int64_t window = _ready_window(q, k_cache, v_cache, sliding_window)
    if window < 0:
        return -1
    cdef cnp.ndarray kc = k_cache, ta = block_table
    cdef int64_t num_blocks = kc.shape[0], block_size = kc.shape[1], first = start, j, block
    cdef int64_t needed = (first + q.shape[0] + block_size - 1) // block_size
    if ta.shape[0] < needed:
        return -1
    first = (first - window + 1 if window and first >= window else 0) // block_size
    cdef const int64_t *blocks = <const int64_t *>cnp.PyArray_DATA(ta)
    for j in range(needed):
        block = blocks[j]
        if block >= num_blocks or (block < 0 and j >= first):
            return -1
    return window


def prefill_attention(q, k_cache, v_cache, block_table, start, scale, sliding_window=None):
    """Causal attention for positions ``start .. start + n - 1`` of one sequence.

    Mirrors ``mie.ops.prefill_attention``; query ``i`` is a decode-style task over the first
    ``start + i + 1`` positions (the last ``sliding_window`` of them, when given). Returns
    float32 (n, num_heads, head_dim).
    """
    cdef int64_t ready = _ready_prefill(q, k_cache, v_cache, block_table, start, sliding_window)
    if ready >= 0:
        return _attention(q, k_cache, v_cache, block_table, None, start, ready,
                          q.shape[1] // k_cache.shape[2], scale)
    n, num_heads, head_dim = q.shape
    group, blocks, window = check_prefill_attention_args(
        q, k_cache, v_cache, block_table, start, sliding_window
    )
    if n == 0:
        return np.empty((0, num_heads, head_dim), dtype=np.float32)
    return _attention(q, k_cache, v_cache, blocks, None, start, window, group, scale)


cdef bint _ready_cache_write(k, v, k_cache, v_cache, slot_mapping) except -1:
    """True when the arguments are what the engine passes and would pass the reference's
    checks (``check_cache_write_args``): float32 k and v alike (tokens >= 1, kv_heads,
    head_dim; contiguous values: the model's v is a view into the q/k/v product), one int64
    slot per token (C-contiguous), every slot inside caches the kernels read
    (``_kernel_caches``) whose rows are (kv_heads, head_dim). Else False, and the caller runs
    those checks, which say what is wrong."""
    if not (_float32_rows(k, 3, 3) and _float32_rows(v, 3, 3)
            and _is_array(slot_mapping, cnp.NPY_INT64, 1) and _kernel_caches(k_cache, v_cache)):
        return False
    cdef cnp.ndarray ka = k, va = v, sa = slot_mapping, kc = k_cache
    cdef int axis
    for axis in range(3):
        if ka.shape[axis] != va.shape[axis]:
            return False
    if (ka.shape[0] < 1 or sa.shape[0] != ka.shape[0] or ka.shape[1] != kc.shape[2]
            or ka.shape[2] != kc.shape[3]):
        return False
    cdef const int64_t *slots = <const int64_t *>cnp.PyArray_DATA(sa)
    cdef int64_t capacity = kc.shape[0] * kc.shape[1], i
    for i in range(sa.shape[0]):
        if slots[i] < 0 or slots[i] >= capacity:
            return False
    return True


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Write new tokens' keys and values (tokens, kv_heads, head_dim) into their slots, in place.

    Mirrors ``mie.ops.reshape_and_cache`` (same checks, and the same bits in a 16-bit cache;
    a repeated slot keeps the last write).
    """
    if _ready_cache_write(k, v, k_cache, v_cache, slot_mapping):
        slots = slot_mapping
    else:
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


# -- RMSNorm and RoPE ----------------------------------------------------------------------------

cdef inline bint _float32_rows(object x, int min_ndim, int max_ndim):
    """``x`` is a float32 ndarray of that rank whose last axis is contiguous and whose other
    strides are whole, non-negative floats: rows the C loops below read where they lie (the
    model's q and k are views into the q/k/v product, a row apart)."""
    if not (isinstance(x, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT32):
        return False
    cdef cnp.ndarray a = x
    cdef int ndim = cnp.PyArray_NDIM(a), axis
    if not min_ndim <= ndim <= max_ndim or cnp.PyArray_STRIDES(a)[ndim - 1] != 4:
        return False
    for axis in range(ndim - 1):
        if cnp.PyArray_STRIDES(a)[axis] < 0 or cnp.PyArray_STRIDES(a)[axis] % 4:
            return False
    return True


def rms_norm(x, weight, eps):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis: mirrors ``mie.ops.rms_norm``.

    float32 rows (2-D or 3-D ``x``, any strides but a contiguous last axis) whose length is a
    contiguous float32 ``weight``'s (the model's hidden states, and Qwen3's per-head vectors)
    run here, one row at a time; anything else is the reference's. Within float32 rounding of
    it: the float32 squares are summed in another order than NumPy's pairwise one (and
    overflow to infinity as there); each value is then divided and weighted as there.
    """
    if not (_float32_rows(x, 2, 3) and _is_array(weight, cnp.NPY_FLOAT32, 1)
            and x.shape[x.ndim - 1] == weight.shape[0] and weight.shape[0] > 0):
        return _reference_rms_norm(x, weight, eps)
    cdef cnp.ndarray xa = x
    out = np.empty(x.shape, dtype=np.float32)
    cdef int64_t n = weight.shape[0], inner = x.shape[1] if x.ndim == 3 else 1
    cdef int64_t outer_stride = cnp.PyArray_STRIDES(xa)[0] // 4
    cdef int64_t inner_stride = cnp.PyArray_STRIDES(xa)[1] // 4 if x.ndim == 3 else 0
    cdef int64_t rows = x.shape[0] * inner
    cdef const float *xp = <const float *>cnp.PyArray_DATA(xa)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(<cnp.ndarray>weight)
    cdef float *op = <float *>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef float e = eps
    with nogil:
        rms_norm_rows(xp, rows, inner, outer_stride, inner_stride, wp, n, e, op)
    return out


cdef void rms_norm_rows(const float *x, int64_t rows, int64_t inner, int64_t outer_stride,
                        int64_t inner_stride, const float *weight, int64_t n, float eps,
                        float *out) noexcept nogil:
    """rms_norm's loop: ``rows`` rows of ``n`` floats, row ``r`` at
    ``x + (r // inner) * outer_stride + (r % inner) * inner_stride``, into ``out`` (C order)."""
    cdef int64_t r, i
    cdef const float *row
    cdef float denominator, squares
    for r in range(rows):
        row = x + (r // inner) * outer_stride + (r % inner) * inner_stride
        squares = 0.0
        for i in range(n):
            squares = squares + row[i] * row[i]
        denominator = sqrtf(squares / n + eps)
        for i in range(n):
            out[r * n + i] = (row[i] / denominator) * weight[i]


def apply_rope(x, cos, sin):
    """Rotate ``x`` (tokens, heads, head_dim) by ``cos``, ``sin`` (tokens, head_dim):
    mirrors ``mie.ops.apply_rope`` (rotate-half: dimension ``i`` pairs with ``i + half``).

    float32 ``x`` (any strides but a contiguous last axis) and C-contiguous float32 ``cos`` and
    ``sin`` run here, each value ``x * cos + rotated * sin`` as there, without the rotated
    copy; anything else is the reference's.
    """
    if not (_float32_rows(x, 3, 3) and _is_array(cos, cnp.NPY_FLOAT32, 2)
            and _is_array(sin, cnp.NPY_FLOAT32, 2) and x.shape[2] % 2 == 0
            and cos.shape[0] == x.shape[0] and cos.shape[1] == x.shape[2]
            and sin.shape[0] == x.shape[0] and sin.shape[1] == x.shape[2]):
        return _reference_apply_rope(x, cos, sin)
    cdef cnp.ndarray xa = x
    out = np.empty(x.shape, dtype=np.float32)
    cdef int64_t tokens = x.shape[0], heads = x.shape[1], dim = x.shape[2]
    cdef int64_t token_stride = cnp.PyArray_STRIDES(xa)[0] // 4
    cdef int64_t head_stride = cnp.PyArray_STRIDES(xa)[1] // 4
    cdef const float *xp = <const float *>cnp.PyArray_DATA(xa)
    cdef const float *cp = <const float *>cnp.PyArray_DATA(<cnp.ndarray>cos)
    cdef const float *sp = <const float *>cnp.PyArray_DATA(<cnp.ndarray>sin)
    cdef float *op = <float *>cnp.PyArray_DATA(<cnp.ndarray>out)
    with nogil:
        rope_rows(xp, tokens, heads, dim, token_stride, head_stride, cp, sp, op)
    return out


cdef void rope_rows(const float *x, int64_t tokens, int64_t heads, int64_t dim,
                    int64_t token_stride, int64_t head_stride, const float *cos,
                    const float *sin, float *out) noexcept nogil:
    """apply_rope's loop: head ``h`` of token ``t`` at ``x + t * token_stride + h *
    head_stride``, rotated by row ``t`` of ``cos`` and ``sin``, into ``out`` (C order)."""
    cdef int64_t t, h, i, half = dim // 2
    cdef const float *row
    cdef const float *c
    cdef const float *s
    cdef float *o
    cdef float first, second
    for t in range(tokens):
        c, s = cos + t * dim, sin + t * dim
        for h in range(heads):
            row, o = x + t * token_stride + h * head_stride, out + (t * heads + h) * dim
            for i in range(half):
                first, second = row[i] * c[i], -row[i + half] * s[i]
                o[i] = first + second
                first, second = row[i + half] * c[i + half], row[i] * s[i + half]
                o[i + half] = first + second


def swiglu(gate, up):
    """The gated MLP activation ``silu(gate) * up``: mirrors ``mie.ops.swiglu``.

    float32 rows of one shape (2-D, any row stride but contiguous values: the model's two
    halves of the gate/up product) run here, in one pass with the attention's instruction set
    and exponential (``silu_times`` in attention_body.h: only exponentials of non-positive
    values, so none overflows); anything else is the reference's. Within float32 rounding
    of it (the exponential is not NumPy's: tests hold them to 5e-6 relative), except that for
    ``gate`` below -87, where ``silu`` is below 1.5e-36 in size, this one is 0.
    """
    if not (_float32_rows(gate, 2, 2) and _float32_rows(up, 2, 2)
            and gate.shape[0] == up.shape[0] and gate.shape[1] == up.shape[1]):
        return _reference_swiglu(gate, up)
    cdef cnp.ndarray ga = gate, ua = up
    out = np.empty(gate.shape, dtype=np.float32)
    cdef int64_t rows = gate.shape[0], n = gate.shape[1]
    cdef int64_t gate_stride = cnp.PyArray_STRIDES(ga)[0] // 4
    cdef int64_t up_stride = cnp.PyArray_STRIDES(ua)[0] // 4
    cdef const float *gp = <const float *>cnp.PyArray_DATA(ga)
    cdef const float *upp = <const float *>cnp.PyArray_DATA(ua)
    cdef float *op = <float *>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef int isa = _choice.index
    with nogil:
        swiglu_rows(isa, gp, upp, rows, n, gate_stride, up_stride, op)
    return out


cdef void swiglu_rows(int isa, const float *gate, const float *up, int64_t rows, int64_t n,
                      int64_t gate_stride, int64_t up_stride, float *out) noexcept nogil:
    """swiglu's loop: rows of ``gate`` and ``up`` their strides apart (in floats), into
    ``out`` (C order)."""
    cdef int64_t r
    for r in range(rows):
        mie_swiglu(isa, gate + r * gate_stride, up + r * up_stride, out + r * n, n)


cdef void cache_write_rows(int fmt, const float *src, char *cache, const int64_t *strides,
                           const int64_t *slots, int64_t tokens, int64_t num_kv_heads,
                           int64_t dim, int64_t block_size) noexcept nogil:
    """reshape_and_cache's write of one of k and v: a cache at ``cache`` whose (block,
    offset, head, dim) strides, in elements, are ``strides``."""
    mie_cache_write(fmt, src, _strided_cache(cache, strides), slots, tokens, num_kv_heads, dim,
                    block_size)


cdef int64_t attention_scratch_floats(int64_t group, int64_t block_size,
                                      int64_t dim) noexcept nogil:
    """The floats of scratch each thread of ``attention_rows`` needs."""
    return mie_attention_scratch_floats(group, block_size, dim)


cdef void attention_rows(int isa, int fmt, const float *q, float *out, char *k_cache,
                         char *v_cache, const int64_t *strides, const int64_t *tables,
                         int64_t table_stride, const int64_t *lens, int64_t start,
                         int64_t window, int64_t rows, int64_t num_kv_heads, int64_t group,
                         int64_t block_size, int64_t dim, float scale, float *scratch,
                         int64_t scratch_floats, int nthreads) noexcept nogil:
    """``_attention``'s kernel call (decode rows with ``lens``, or a prompt chunk from
    ``start`` with ``lens`` NULL) over caches laid out alike (``strides`` as for
    ``cache_write_rows``)."""
    mie_attention(isa, fmt, q, out, _strided_cache(k_cache, strides),
                  _strided_cache(v_cache, strides), tables, table_stride, lens, start, window,
                  rows, num_kv_heads, group, block_size, dim, scale, scratch, scratch_floats,
                  nthreads)
