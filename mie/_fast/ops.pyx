# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Cython mirrors of ``mie.ops``'s KV write and attention kernels.

Same arguments, same checks (the reference's own validation helpers and messages), same
results within float32 rounding (tests hold them to 1e-5 relative). What changes is the
shape of the computation:

* no gathering: the reference copies each sequence's blocks into one padded batch; here every
  (query row, KV head) task walks its block table and reads K/V rows in place;
* online softmax, one block at a time: a running maximum ``m``, normaliser ``l`` and weighted
  sum ``acc`` per query head, rescaled by ``exp(m_old - m_new)`` when the maximum grows, so
  scores are never materialised beyond one block;
* grouped-query attention by task: one task serves the ``num_heads // num_kv_heads`` query
  heads that read the same KV head, so each K/V row is loaded once per group;
* tasks run in parallel (``prange``) when the extension was built with OpenMP; each task's
  result depends on nothing else, so the output is bit-identical for any thread count.

Caches are read through their strides (any float32 view works, including the strided per-layer
views of the block pool's arena; strides need only be whole float32 elements). Queries are
taken as C-contiguous float32 (converted if needed) and results are always float32.
"""

from cython.parallel cimport prange, threadid
from libc.math cimport INFINITY, expf

import numpy as np

from mie.ops import _check_gqa

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define MIE_OPENMP 1
    static int mie_max_threads(void) { return omp_get_max_threads(); }
    #else
    #define MIE_OPENMP 0
    static int mie_max_threads(void) { return 1; }
    #endif
    """
    const int MIE_OPENMP
    int mie_max_threads() nogil

OPENMP = bool(MIE_OPENMP)
"""Whether this build runs the kernels in parallel (setup.py found a working ``-fopenmp``)."""


def max_threads() -> int:
    """Threads the kernels use: OpenMP's limit (``OMP_NUM_THREADS``), or 1 without OpenMP."""
    return mie_max_threads()


cdef struct Cache:
    # Element (block, offset, kv_head, dim) is at data[block*s_block + ... + dim*s_dim];
    # strides are in float32 elements (NumPy's are in bytes).
    float *data
    Py_ssize_t s_block, s_offset, s_head, s_dim


cdef Cache _cache_view(const float[:, :, :, :] cache, str name) except *:
    cdef Cache c
    cdef Py_ssize_t i
    for i in range(4):
        if cache.strides[i] % <Py_ssize_t>sizeof(float):
            raise ValueError(f"{name}: strides {cache.strides} are not whole float32 elements")
    c.data = <float *>&cache[0, 0, 0, 0]  # written only through views checked writable
    c.s_block = cache.strides[0] // <Py_ssize_t>sizeof(float)
    c.s_offset = cache.strides[1] // <Py_ssize_t>sizeof(float)
    c.s_head = cache.strides[2] // <Py_ssize_t>sizeof(float)
    c.s_dim = cache.strides[3] // <Py_ssize_t>sizeof(float)
    return c


cdef inline float *_row(Cache c, Py_ssize_t block, Py_ssize_t offset, Py_ssize_t head) noexcept nogil:
    return c.data + block * c.s_block + offset * c.s_offset + head * c.s_head


cdef inline const float *_contiguous(
    Cache c, Py_ssize_t block, Py_ssize_t offset, Py_ssize_t head, Py_ssize_t dim, float *buffer
) noexcept nogil:
    """The row (block, offset, head) as ``dim`` contiguous floats: in place, or copied."""
    cdef const float *row = _row(c, block, offset, head)
    cdef Py_ssize_t d
    if c.s_dim == 1:
        return row
    for d in range(dim):
        buffer[d] = row[d * c.s_dim]
    return buffer


cdef inline float _dot(const float *a, const float *b, Py_ssize_t n) noexcept nogil:
    """a . b with eight independent partial sums, which the compiler can keep in SIMD lanes."""
    cdef float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0
    cdef Py_ssize_t d = 0
    while d + 8 <= n:
        s0 += a[d] * b[d]
        s1 += a[d + 1] * b[d + 1]
        s2 += a[d + 2] * b[d + 2]
        s3 += a[d + 3] * b[d + 3]
        s4 += a[d + 4] * b[d + 4]
        s5 += a[d + 5] * b[d + 5]
        s6 += a[d + 6] * b[d + 6]
        s7 += a[d + 7] * b[d + 7]
        d += 8
    while d < n:
        s0 += a[d] * b[d]
        d += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


cdef Py_ssize_t _scratch_size(Py_ssize_t group, Py_ssize_t block_size, Py_ssize_t dim) noexcept:
    # scores (group x block_size), acc (group x dim), m and l (group each), K and V row copies
    return group * block_size + group * dim + 2 * group + 2 * dim


cdef void _attend(
    const float *q,
    float *out,
    Cache k,
    Cache v,
    const Py_ssize_t *blocks,
    Py_ssize_t context_len,
    Py_ssize_t kv_head,
    Py_ssize_t group,
    Py_ssize_t block_size,
    Py_ssize_t dim,
    float scale,
    float *scratch,
) noexcept nogil:
    """Attention of ``group`` query heads (rows of ``q``, contiguous) over one KV head.

    Reads the first ``context_len`` positions of the sequence whose blocks are ``blocks`` and
    writes ``group`` rows of ``out``. ``scratch`` holds ``_scratch_size`` floats.
    """
    cdef float *scores = scratch
    cdef float *acc = scores + group * block_size
    cdef float *m = acc + group * dim
    cdef float *l = m + group
    cdef float *k_buffer = l + group
    cdef float *v_buffer = k_buffer + dim
    cdef const float *row
    cdef Py_ssize_t i, t, d, j, filled, block
    cdef float block_max, new_max, correction, p
    for i in range(group):
        m[i] = -INFINITY
        l[i] = 0
        for d in range(dim):
            acc[i * dim + d] = 0
    for j in range((context_len + block_size - 1) // block_size):
        block = blocks[j]
        filled = min(block_size, context_len - j * block_size)
        for t in range(filled):
            row = _contiguous(k, block, t, kv_head, dim, k_buffer)
            for i in range(group):
                scores[i * block_size + t] = _dot(q + i * dim, row, dim) * scale
        # Fold this block into the running softmax: rescale what is there to the new maximum,
        # turn the block's scores into weights, add them to the normaliser.
        for i in range(group):
            block_max = scores[i * block_size]
            for t in range(1, filled):
                block_max = max(block_max, scores[i * block_size + t])
            new_max = max(m[i], block_max)
            correction = expf(m[i] - new_max)  # 0 on the first block (m = -inf)
            m[i] = new_max
            l[i] *= correction
            for d in range(dim):
                acc[i * dim + d] *= correction
            for t in range(filled):
                p = expf(scores[i * block_size + t] - new_max)
                scores[i * block_size + t] = p
                l[i] += p
        for t in range(filled):
            row = _contiguous(v, block, t, kv_head, dim, v_buffer)
            for i in range(group):
                p = scores[i * block_size + t]
                for d in range(dim):
                    acc[i * dim + d] += p * row[d]
    for i in range(group):
        for d in range(dim):
            out[i * dim + d] = acc[i * dim + d] / l[i]


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Decode attention: one query token per sequence over its cached context.

    Mirrors ``mie.ops.paged_attention`` (same arguments, checks and errors). Returns float32
    (num_seqs, num_heads, head_dim).
    """
    num_seqs, num_heads, head_dim = q.shape
    group = _check_gqa(num_heads, k_cache, v_cache, head_dim)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    tables = np.asarray(block_tables)
    lens = np.asarray(context_lens, dtype=np.int64)
    if tables.ndim != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
        raise ValueError(
            f"paged_attention: {num_seqs} queries need block_tables (num_seqs, max_blocks) "
            f"and context_lens (num_seqs,), got {tables.shape} and {lens.shape}"
        )
    if num_seqs == 0:
        return np.empty_like(q)
    in_context = np.arange(tables.shape[1])[None, :] < -(-lens[:, None] // block_size)
    if lens.min() < 1 or lens.max() > tables.shape[1] * block_size:
        raise ValueError(f"paged_attention: context_lens {lens} do not fit the block tables")
    if np.any((tables < 0) & in_context) or np.any(tables >= k_cache.shape[0]):
        raise ValueError("paged_attention: a block table names a block outside the cache")

    cdef Cache k = _cache_view(k_cache, "k_cache")
    cdef Cache v = _cache_view(v_cache, "v_cache")
    cdef const float[:, :, ::1] queries = np.ascontiguousarray(q, dtype=np.float32)
    cdef const Py_ssize_t[:, ::1] table_rows = np.ascontiguousarray(tables, dtype=np.intp)
    cdef const Py_ssize_t[::1] lengths = lens.astype(np.intp)
    result = np.empty((num_seqs, num_heads, head_dim), dtype=np.float32)
    cdef float[:, :, ::1] out = result
    cdef Py_ssize_t size = _scratch_size(group, block_size, head_dim)
    cdef float[:, ::1] scratch = np.empty((mie_max_threads(), size), dtype=np.float32)
    cdef Py_ssize_t task, seq, kv_head, n_kv = num_kv_heads, g = group, bs = block_size
    cdef Py_ssize_t dim = head_dim, n_tasks = num_seqs * num_kv_heads
    cdef float s = scale
    for task in prange(n_tasks, nogil=True, schedule="dynamic"):
        seq = task // n_kv
        kv_head = task % n_kv
        _attend(
            &queries[seq, kv_head * g, 0], &out[seq, kv_head * g, 0], k, v,
            &table_rows[seq, 0], lengths[seq], kv_head, g, bs, dim, s,
            &scratch[threadid(), 0],
        )
    return result


def prefill_attention(q, k_cache, v_cache, block_table, start, scale):
    """Causal attention for positions ``start .. start + n - 1`` of one sequence.

    Mirrors ``mie.ops.prefill_attention``; query ``i`` is a decode-style task over the first
    ``start + i + 1`` positions. Returns float32 (n, num_heads, head_dim).
    """
    n, num_heads, head_dim = q.shape
    group = _check_gqa(num_heads, k_cache, v_cache, head_dim)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    total = start + n
    blocks = np.asarray(block_table, dtype=np.int64)[: -(-total // block_size)]
    if start < 0 or len(blocks) * block_size < total:
        raise ValueError(
            f"prefill_attention: positions {start}..{total - 1} need more than the "
            f"{len(blocks)} blocks of {block_size} in the block table"
        )
    if np.any(blocks < 0) or np.any(blocks >= k_cache.shape[0]):
        raise ValueError("prefill_attention: the block table names a block outside the cache")
    result = np.empty((n, num_heads, head_dim), dtype=np.float32)
    if n == 0:
        return result

    cdef Cache k = _cache_view(k_cache, "k_cache")
    cdef Cache v = _cache_view(v_cache, "v_cache")
    cdef const float[:, :, ::1] queries = np.ascontiguousarray(q, dtype=np.float32)
    cdef const Py_ssize_t[::1] table = blocks.astype(np.intp)
    cdef float[:, :, ::1] out = result
    cdef Py_ssize_t size = _scratch_size(group, block_size, head_dim)
    cdef float[:, ::1] scratch = np.empty((mie_max_threads(), size), dtype=np.float32)
    cdef Py_ssize_t task, i, kv_head, n_kv = num_kv_heads, g = group, bs = block_size
    cdef Py_ssize_t dim = head_dim, first = start, n_tasks = n * num_kv_heads
    cdef float s = scale
    for task in prange(n_tasks, nogil=True, schedule="dynamic"):
        i = task // n_kv
        kv_head = task % n_kv
        _attend(
            &queries[i, kv_head * g, 0], &out[i, kv_head * g, 0], k, v,
            &table[0], first + i + 1, kv_head, g, bs, dim, s,
            &scratch[threadid(), 0],
        )
    return result


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Write new tokens' keys and values (tokens, kv_heads, head_dim) into their slots, in place.

    Mirrors ``mie.ops.reshape_and_cache`` (same checks; a repeated slot keeps the last write).
    """
    block_size = k_cache.shape[1]
    slots = np.asarray(slot_mapping, dtype=np.int64)
    if k.shape != v.shape or k.shape[0] != len(slots) or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"reshape_and_cache: k {k.shape}, v {v.shape} and {len(slots)} slots do not fit "
            f"a cache of blocks {k_cache.shape}"
        )
    if len(slots) and (slots.min() < 0 or slots.max() >= k_cache.shape[0] * block_size):
        raise ValueError(f"reshape_and_cache: a slot lies outside the {k_cache.shape[0]} blocks")
    if len(slots) == 0:
        return
    cdef float[:, :, :, :] k_target = k_cache  # raises if the cache is read-only
    cdef float[:, :, :, :] v_target = v_cache
    cdef Cache kc = _cache_view(k_target, "k_cache")
    cdef Cache vc = _cache_view(v_target, "v_cache")
    cdef const float[:, :, :] keys = np.asarray(k, dtype=np.float32)
    cdef const float[:, :, :] values = np.asarray(v, dtype=np.float32)
    cdef const Py_ssize_t[::1] slot = slots.astype(np.intp)
    cdef Py_ssize_t i, h, d, bs = block_size
    cdef float *k_row
    cdef float *v_row
    with nogil:
        for i in range(slot.shape[0]):
            for h in range(keys.shape[1]):
                k_row = _row(kc, slot[i] // bs, slot[i] % bs, h)
                v_row = _row(vc, slot[i] // bs, slot[i] % bs, h)
                for d in range(keys.shape[2]):
                    k_row[d * kc.s_dim] = keys[i, h, d]
                    v_row[d * vc.s_dim] = values[i, h, d]
