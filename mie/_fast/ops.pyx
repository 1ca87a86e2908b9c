# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
# distutils: extra_compile_args = -fno-math-errno -fno-trapping-math -fno-signed-zeros -fassociative-math
"""Cython mirrors of ``mie.ops``'s KV write and attention kernels.

What mirrors what (same names and arguments; checks from ``mie.ops``)::

    here                                        reference (mie/ops.py)
    reshape_and_cache                           reshape_and_cache  (check_cache_write_args)
    paged_attention                             paged_attention    (check_paged_attention_args)
    prefill_attention                           prefill_attention  (check_prefill_attention_args)

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
from libc.math cimport INFINITY

import numpy as np

from mie.ops import (
    check_cache_write_args,
    check_paged_attention_args,
    check_prefill_attention_args,
)

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


cdef extern from *:
    """
    /* exp(x) for x <= 0, in plain arithmetic the compiler can vectorize (libm's expf is a
       call per element). Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-7
       polynomial for exp(r), and 2^n built in the exponent bits; about 1 ulp. Inputs below
       -87 (including -inf) give exp(-87) ~ 1.6e-38, which is 0 next to any weight >= exp(0). */
    static inline float mie_exp_nonpositive(float x) {
        union { float f; int i; } two_n;
        float r, y;
        int n;
        x = x < -87.0f ? -87.0f : x;
        n = (int)(x * 1.44269504088896341f - 0.5f);  /* round(x / ln2): truncation, x <= 0 */
        r = x - (float)n * 0.693359375f + (float)n * 2.12194440e-4f;
        y = 1.9875691500e-4f;
        y = y * r + 1.3981999507e-3f;
        y = y * r + 8.3334519073e-3f;
        y = y * r + 4.1665795894e-2f;
        y = y * r + 1.6666665459e-1f;
        y = y * r + 5.0000001201e-1f;
        y = y * r * r + r + 1.0f;
        two_n.i = (n + 127) << 23;
        return y * two_n.f;
    }
    """
    float mie_exp_nonpositive(float x) noexcept nogil

cdef extern from *:
    """
    /* A hint to start loading p's cache line now (GCC and Clang; a no-op elsewhere). */
    #if defined(__GNUC__) || defined(__clang__)
    #define mie_prefetch(p) __builtin_prefetch(p)
    #else
    #define mie_prefetch(p) ((void)(p))
    #endif
    """
    void mie_prefetch(const void *p) noexcept nogil


cdef inline void _prefetch_rows(
    Cache c, Py_ssize_t block, Py_ssize_t first, Py_ssize_t count, Py_ssize_t kv_head,
    Py_ssize_t dim
) noexcept nogil:
    """Ask for every cache line of rows ``first .. first + count - 1`` of ``block`` (for
    ``kv_head``) ahead of use.

    Blocks are scattered, so the hardware prefetcher cannot guess the next one, and a task
    computes too little per row for out-of-order execution to keep many misses in flight:
    without this the kernel waits on memory at a fraction of its bandwidth.
    """
    cdef Py_ssize_t t, d
    cdef const float *row
    for t in range(first, first + count):
        row = _row(c, block, t, kv_head)
        for d in range(0, dim * c.s_dim, 16):  # 16 floats = one 64-byte line
            mie_prefetch(row + d)


cdef enum:
    ROWS = 4  # K/V rows handled together (see _attend)


cdef Py_ssize_t _scratch_size(Py_ssize_t group, Py_ssize_t block_size, Py_ssize_t dim) noexcept:
    # scaled queries and acc (group x dim each), scores (group x block_size), m and l (group
    # each), copies of ROWS K rows and ROWS V rows (dim each)
    return 2 * group * dim + group * block_size + 2 * group + 2 * ROWS * dim


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

    Each block is three passes -- all scores, then softmax weights, then the weighted sum of
    V -- whose innermost loops run over ``head_dim`` on contiguous rows, which the compiler
    turns into SIMD code (the module's flags let it reorder float sums; see the header).
    K and V rows are taken ``ROWS`` at a time: four dot products share each query load and
    run as independent chains instead of waiting on one another, and each accumulator row is
    loaded and stored once per four V rows instead of once per row.
    """
    cdef float *queries = scratch
    cdef float *acc = queries + group * dim
    cdef float *scores = acc + group * dim
    cdef float *m = scores + group * block_size
    cdef float *l = m + group
    cdef float *k_buffer = l + group
    cdef float *v_buffer = k_buffer + ROWS * dim
    cdef const float *r0
    cdef const float *r1
    cdef const float *r2
    cdef const float *r3
    cdef float *head_scores
    cdef float *head_acc
    cdef const float *head_query
    cdef Py_ssize_t i, t, d, j, filled, block, next_block
    cdef float block_max, new_max, correction, p, total, s0, s1, s2, s3, p0, p1, p2, p3
    for i in range(group):
        m[i] = -INFINITY
        l[i] = 0
        for d in range(dim):
            queries[i * dim + d] = q[i * dim + d] * scale  # scale once, not every score
            acc[i * dim + d] = 0
    for j in range((context_len + block_size - 1) // block_size):
        block = blocks[j]
        filled = min(block_size, context_len - j * block_size)
        # The next block's K and V rows are requested four at a time, spread over this block's
        # scores (all at once, or during the weighted sum too, measured slower).
        next_block = blocks[j + 1] if (j + 1) * block_size < context_len else -1
        # Scores, ROWS positions at a time. Past the block's end the last row stands in; its
        # extra scores are not stored.
        for t in range(0, filled, 4):  # 4 = ROWS (range needs a literal step)
            if next_block >= 0:
                _prefetch_rows(k, next_block, t, min(4, block_size - t), kv_head, dim)
                _prefetch_rows(v, next_block, t, min(4, block_size - t), kv_head, dim)
            r0 = _contiguous(k, block, t, kv_head, dim, k_buffer)
            r1 = _contiguous(k, block, min(t + 1, filled - 1), kv_head, dim, k_buffer + dim)
            r2 = _contiguous(k, block, min(t + 2, filled - 1), kv_head, dim, k_buffer + 2 * dim)
            r3 = _contiguous(k, block, min(t + 3, filled - 1), kv_head, dim, k_buffer + 3 * dim)
            for i in range(group):
                head_query = queries + i * dim
                s0 = s1 = s2 = s3 = 0
                for d in range(dim):
                    s0 = s0 + head_query[d] * r0[d]
                    s1 = s1 + head_query[d] * r1[d]
                    s2 = s2 + head_query[d] * r2[d]
                    s3 = s3 + head_query[d] * r3[d]
                head_scores = scores + i * block_size + t
                head_scores[0] = s0
                if t + 1 < filled:
                    head_scores[1] = s1
                if t + 2 < filled:
                    head_scores[2] = s2
                if t + 3 < filled:
                    head_scores[3] = s3
        # Fold this block into the running softmax: rescale what is there to the new maximum,
        # turn the block's scores into weights, add them to the normaliser.
        for i in range(group):
            head_scores = scores + i * block_size
            block_max = head_scores[0]
            for t in range(1, filled):
                block_max = max(block_max, head_scores[t])
            new_max = max(m[i], block_max)
            correction = mie_exp_nonpositive(m[i] - new_max)  # ~0 on the first block (m = -inf)
            m[i] = new_max
            head_acc = acc + i * dim
            for d in range(dim):
                head_acc[d] = head_acc[d] * correction
            total = 0
            for t in range(filled):
                p = mie_exp_nonpositive(head_scores[t] - new_max)
                head_scores[t] = p
                total = total + p
            l[i] = l[i] * correction + total
        # Weighted sum of V, ROWS positions at a time; past the block's end, weight 0.
        for t in range(0, filled, 4):  # 4 = ROWS (range needs a literal step)
            r0 = _contiguous(v, block, t, kv_head, dim, v_buffer)
            r1 = _contiguous(v, block, min(t + 1, filled - 1), kv_head, dim, v_buffer + dim)
            r2 = _contiguous(v, block, min(t + 2, filled - 1), kv_head, dim, v_buffer + 2 * dim)
            r3 = _contiguous(v, block, min(t + 3, filled - 1), kv_head, dim, v_buffer + 3 * dim)
            for i in range(group):
                head_scores = scores + i * block_size + t
                p0 = head_scores[0]
                p1 = head_scores[1] if t + 1 < filled else 0
                p2 = head_scores[2] if t + 2 < filled else 0
                p3 = head_scores[3] if t + 3 < filled else 0
                head_acc = acc + i * dim
                for d in range(dim):
                    head_acc[d] = head_acc[d] + (p0 * r0[d] + p1 * r1[d]) + (p2 * r2[d] + p3 * r3[d])
    for i in range(group):
        for d in range(dim):
            out[i * dim + d] = acc[i * dim + d] / l[i]


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Decode attention: one query token per sequence over its cached context.

    Mirrors ``mie.ops.paged_attention`` (same arguments, checks and errors). Returns float32
    (num_seqs, num_heads, head_dim).
    """
    num_seqs, num_heads, head_dim = q.shape
    group, tables, lens = check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if num_seqs == 0:
        return np.empty_like(q)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]

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
    group, blocks = check_prefill_attention_args(q, k_cache, v_cache, block_table, start)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
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
    slots = check_cache_write_args(k, v, k_cache, slot_mapping)
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
