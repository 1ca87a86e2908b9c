# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Cython mirror of the layer loop of ``mie.model.Model.forward``: a whole step in one call.

Why: at batch 1 a Qwen2-0.5B-shaped step calls about 300 kernels -- per layer two RMSNorms,
four matrix products, the q/k/v bias, two RoPEs, the KV write, the attention, the SwiGLU and
two residual adds -- each through a Python wrapper that checks its arguments and allocates
its result, with the interpreter in between: about 25 us a layer with everything in cache
(a 24-layer model of 64-wide layers steps in 0.98 ms), and more in a real step, whose weights
stream every cache line out between the calls. Here the same kernels run in one C loop over
the layers, with the arguments checked once for the whole step. Steps of decodes and a few
proposed tokens to verify (speculative decoding) are the steps that need it; a prompt chunk
takes the same path, where its products hide the calls' cost.

The same kernels are called in the same order on the same values (the matrix products'
kernel path, ``mie._fast.linear.gemm_rows``; the loops behind ``mie._fast.ops``'s wrappers,
``ops.pxd``), so the hidden states are bit for bit those of the model's loop on the compiled
kernels (``tests/test_fast_forward.py``), which are in turn checked against the references.

``layer_plan(layers, config)`` reads the layers' weights once (formats, pointers, strides;
``Panels`` as their parts) -- or returns None when a matrix or vector is not what the kernels
read as it lies (the loop then converts it, as always). Calling the plan with a step's arrays
writes the hidden states after the last layer into ``x`` and returns True, or returns False,
having written nothing, when the step is not one it takes: rows the products would hand to
BLAS, or any argument the kernels' wrappers would convert or refuse -- the model's loop then
runs, and its kernels say what is wrong.
"""

cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

import numpy as np

cnp.import_array()

from mie._fast cimport linear as clinear
from mie._fast cimport ops as cops

from mie._fast import linear as _linear
from mie._fast import ops as _ops
from mie.linear import input_size

ctypedef struct Part:
    int fmt
    const void *w
    int64_t ldw  # elements between rows
    const void *s  # scales (int8, int4), else NULL
    int64_t lds
    int64_t n  # outputs
    int64_t k  # inputs of this part
    int64_t k0  # its first input in the whole row


ctypedef struct Layer:
    const float *input_norm
    const float *post_norm
    const float *qkv_bias  # NULL: none
    const float *q_norm  # NULL: none (and k_norm too)
    const float *k_norm
    Part qkv, o, gate_up
    int64_t down_first, down_count  # the down projection's parts in LayerPlan.down


cdef bint _part(Part *p, matrix, int64_t n, int64_t k, int64_t k0, list keep) except -1:
    """Fill ``p`` from a ``Linear`` of ``n`` outputs and ``k`` inputs; False when its arrays
    are not what the kernels read as they lie (``mie._fast.linear.weight_format``)."""
    weight, scales = matrix.weight, matrix.scales
    cdef int64_t inputs, outputs
    cdef int fmt = clinear.weight_format(weight, scales, &inputs, &outputs)
    if fmt < 0 or outputs != n or inputs != k:
        return False
    p.fmt, p.w, p.ldw = fmt, cnp.PyArray_DATA(<cnp.ndarray>weight), weight.shape[1]
    p.n, p.k, p.k0, p.s, p.lds = n, k, k0, NULL, 0
    if scales is not None:
        p.s, p.lds = cnp.PyArray_DATA(<cnp.ndarray>scales), scales.shape[1]
    keep.extend((weight, scales))
    return True


cdef const float *_vector(values, int64_t size, list keep) except? NULL:
    """A float32 C-contiguous vector of ``size`` values, else NULL."""
    if (type(values) is not np.ndarray or values.dtype != np.float32 or values.ndim != 1
            or not values.flags.c_contiguous or values.shape[0] != size or size < 1):
        return NULL
    keep.append(values)
    return <const float *>cnp.PyArray_DATA(<cnp.ndarray>values)


cdef inline float *_floats(object a):
    return <float *>cnp.PyArray_DATA(<cnp.ndarray>a)


ctypedef struct Segment:
    int64_t first  # its first row
    int64_t rows
    int64_t start  # the position of its first row
    const int64_t *table  # its block table


cdef class LayerPlan:
    """The layers' weights as the one loop reads them (see the module docstring)."""

    cdef Layer *layers
    cdef Part *down
    cdef int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter
    cdef float eps
    cdef bint qk_norm, panels  # some layer normalizes q and k / has its down in parts
    cdef list keep  # every array the pointers point into
    cdef tuple formats  # the distinct kernel formats of its matrices

    def __cinit__(self):
        self.layers, self.down = NULL, NULL

    def __dealloc__(self):
        free(self.layers)
        free(self.down)

    def __call__(self, x, cos, sin, kv_cache, slot_mapping, decode_rows, block_tables,
                 context_lens, prefills, float scale, sliding_window):
        """Compute every layer of a step into ``x`` (its rows' hidden states, float32
        ``(tokens, hidden)``), as ``Model.forward``'s loop does with these arguments
        (``prefills``: its ``PrefillSegment``s); True, or False (nothing written) for a step
        the loop must take."""
        cdef int64_t M, Md, S, H = self.num_heads, KVH = self.num_kv_heads
        cdef int64_t D = self.head_dim, I = self.inter, hidden = self.hidden
        if not (cops._is_array(x, cnp.NPY_FLOAT32, 2) and x.flags.writeable):
            return False
        M = x.shape[0]
        threshold = _fewest_blas_rows(self.formats)
        if M < 1 or x.shape[1] != hidden or (threshold is not None and M >= threshold):
            return False
        if not (cops._is_array(cos, cnp.NPY_FLOAT32, 2) and cops._is_array(sin, cnp.NPY_FLOAT32, 2)
                and cos.shape[0] == M and cos.shape[1] == D and sin.shape[0] == M
                and sin.shape[1] == D and D % 2 == 0):
            return False
        if not (type(kv_cache) is np.ndarray and kv_cache.ndim == 6
                and kv_cache.shape[1] == self.num_layers and kv_cache.shape[2] == 2
                and kv_cache.flags.writeable):
            return False
        if not cops._is_array(decode_rows, cnp.NPY_INT64, 1):
            return False
        Md, S = decode_rows.shape[0], len(prefills)
        cdef const int64_t *rows = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>decode_rows)
        cdef int64_t r
        cdef bint whole = Md == M  # every row decodes, in order (the loop's slice(None))
        for r in range(Md):
            if not 0 <= rows[r] < M:
                return False
            whole = whole and rows[r] == r
        cdef int64_t gathered = 0 if whole else Md
        # The step's buffers: each kernel's result, as the loop allocates them.
        h = np.empty((M, hidden), dtype=np.float32)
        qkv = np.empty((M, H * D + 2 * KVH * D), dtype=np.float32)
        normed_q = np.empty((M if self.qk_norm else 0, H, D), dtype=np.float32)
        normed_k = np.empty((M if self.qk_norm else 0, KVH, D), dtype=np.float32)
        q = np.empty((M, H, D), dtype=np.float32)
        k = np.empty((M, KVH, D), dtype=np.float32)
        v = np.empty((M, KVH, D), dtype=np.float32)
        attn = np.empty((M, H, D), dtype=np.float32)
        decode_q = np.empty((gathered, H, D), dtype=np.float32)  # the decode rows' q, gathered
        decode_attn = np.empty((gathered, H, D), dtype=np.float32)
        y = np.empty((M, hidden), dtype=np.float32)
        y_part = np.empty((M if self.panels else 0, hidden), dtype=np.float32)
        gate_up = np.empty((M, 2 * I), dtype=np.float32)
        mlp = np.empty((M, I), dtype=np.float32)
        # Layer 0's caches stand for every layer's (same shape, dtype and strides): the
        # wrappers' own checks of the KV write and the attention calls, once for the pass.
        k0, v0 = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
        if not cops._ready_cache_write(k, v, k0, v0, slot_mapping):
            return False
        cdef int64_t window = 0, ready
        if Md:
            window = cops._ready_decode(q if whole else decode_q, k0, v0, block_tables,
                                        context_lens, sliding_window)
            if window < 0:
                return False
        cdef Segment *segments = <Segment *>malloc(max(S, 1) * sizeof(Segment))
        if segments == NULL:
            raise MemoryError("no memory for the step's prompt chunks")
        try:
            for r, segment in enumerate(prefills):
                first, stop, step = segment.rows.start, segment.rows.stop, segment.rows.step
                if (type(first) is not int or type(stop) is not int or step not in (None, 1)
                        or not 0 <= first < stop <= M):
                    return False
                ready = cops._ready_prefill(q[first:stop], k0, v0, segment.block_ids,
                                            segment.start, sliding_window)
                if ready < 0:
                    return False
                window = ready
                segments[r].first, segments[r].rows = first, stop - first
                segments[r].start = segment.start
                segments[r].table = <const int64_t *>cnp.PyArray_DATA(
                    <cnp.ndarray>segment.block_ids
                )
            return self._run(x, cos, sin, kv_cache, k0, slot_mapping, NULL if whole else rows,
                             Md, block_tables, context_lens, segments, S, window, scale, h, qkv,
                             normed_q, normed_k, q, k, v, attn, decode_q, decode_attn, y,
                             y_part, gate_up, mlp)
        finally:
            free(segments)

    cdef bint _run(self, x, cos, sin, kv_cache, k0, slot_mapping, const int64_t *rows,
                   int64_t Md, block_tables, context_lens, const Segment *segments, int64_t S,
                   int64_t window, float scale, h, qkv, normed_q, normed_k, q, k, v, attn,
                   decode_q, decode_attn, y, y_part, gate_up, mlp) except -1:
        """The checked arguments' pointers (``rows`` NULL: every row decodes, in order), and
        the loop without the GIL."""
        cdef int64_t strides[4]  # layer 0's K cache's, every layer's K and V caches'
        if not cops.cache_strides(k0, strides):
            return False
        cdef int64_t layer_stride = kv_cache.strides[1], kv_stride = kv_cache.strides[2]
        cdef int cache_fmt = _ops._FORMATS[kv_cache.dtype]
        cdef int64_t block_size = kv_cache.shape[3], M = x.shape[0]
        cdef int threads = _ops.max_threads()
        cdef int64_t scratch_floats = cops.attention_scratch_floats(
            self.num_heads // self.num_kv_heads, block_size, self.head_dim
        )
        scratch = np.empty((threads, scratch_floats), dtype=np.float32)
        cdef int linear_isa = _linear._choice.index, ops_isa = _ops._choice.index
        cdef float *xp = _floats(x)
        cdef const float *cp = _floats(cos)
        cdef const float *sp = _floats(sin)
        cdef char *cache = <char *>cnp.PyArray_DATA(<cnp.ndarray>kv_cache)
        cdef const int64_t *slots = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>slot_mapping)
        cdef const int64_t *tables = NULL
        cdef const int64_t *lens = NULL
        cdef int64_t table_stride = 0
        if Md:
            tables = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>block_tables)
            lens = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>context_lens)
            table_stride = block_tables.shape[1]
        cdef float *hp = _floats(h)
        cdef float *qkvp = _floats(qkv)
        cdef float *nqp = _floats(normed_q)
        cdef float *nkp = _floats(normed_k)
        cdef float *qp = _floats(q)
        cdef float *kp = _floats(k)
        cdef float *vp = _floats(v)
        cdef float *ap = _floats(attn)
        cdef float *dqp = _floats(decode_q)
        cdef float *dap = _floats(decode_attn)
        cdef float *yp = _floats(y)
        cdef float *ypp = _floats(y_part)
        cdef float *gp = _floats(gate_up)
        cdef float *mp = _floats(mlp)
        cdef float *scp = _floats(scratch)
        cdef int status = 0
        with nogil:
            status = self._layers(
                xp, M, cp, sp, cache, layer_stride, kv_stride, strides, cache_fmt, block_size,
                slots, rows, Md, tables, table_stride, lens, segments, S, window, scale, hp,
                qkvp, nqp, nkp, qp, kp, vp, ap, dqp, dap, yp, ypp, gp, mp, scp, scratch_floats,
                linear_isa, ops_isa, threads)
        if status != 0:
            raise MemoryError(f"matmul: no memory to round the ({M}, ...) activation to int8 "
                              "blocks")
        return True

    cdef int _layers(self, float *x, int64_t M, const float *cos, const float *sin,
                     char *cache, int64_t layer_stride, int64_t kv_stride,
                     const int64_t *strides, int cache_fmt, int64_t block_size,
                     const int64_t *slots, const int64_t *rows, int64_t Md,
                     const int64_t *tables, int64_t table_stride, const int64_t *lens,
                     const Segment *segments, int64_t S, int64_t window, float scale,
                     float *h, float *qkv, float *normed_q, float *normed_k, float *q, float *k,
                     float *v, float *attn, float *decode_q, float *decode_attn, float *y,
                     float *y_part, float *gate_up, float *mlp, float *scratch,
                     int64_t scratch_floats, int linear_isa, int ops_isa,
                     int threads) noexcept nogil:
        """The loop of ``Model.forward`` (mie/model/model.py), layer by layer, step by step;
        0, or the products' nonzero status (no memory)."""
        cdef int64_t H = self.num_heads, KVH = self.num_kv_heads, D = self.head_dim
        cdef int64_t hidden = self.hidden, I = self.inter
        cdef int64_t q_size = H * D, kv_size = KVH * D
        cdef int64_t row = q_size + 2 * kv_size, i, m, j, n = M * hidden
        cdef const float *rope_q
        cdef const float *rope_k
        cdef int64_t q_token_stride, k_token_stride
        cdef char *k_cache
        cdef char *v_cache
        cdef const Layer *layer
        cdef const Part *part
        cdef const Segment *segment
        for i in range(self.num_layers):
            layer = &self.layers[i]
            k_cache = cache + i * layer_stride
            v_cache = k_cache + kv_stride
            # h = rms_norm(x); qkv = h @ W_qkv.T (+ bias)
            cops.rms_norm_rows(x, M, 1, hidden, 0, layer.input_norm, hidden, self.eps, h)
            if _product(&layer.qkv, h, hidden, M, qkv, linear_isa, threads):
                return 1
            if layer.qkv_bias != NULL:
                for m in range(M):
                    for j in range(row):
                        qkv[m * row + j] = qkv[m * row + j] + layer.qkv_bias[j]
            # q, k: views into qkv (Qwen3: each head normalized first), rotated
            rope_q, rope_k, q_token_stride, k_token_stride = qkv, qkv + q_size, row, row
            if layer.q_norm != NULL:
                cops.rms_norm_rows(qkv, M * H, H, row, D, layer.q_norm, D, self.eps, normed_q)
                cops.rms_norm_rows(qkv + q_size, M * KVH, KVH, row, D, layer.k_norm, D,
                                   self.eps, normed_k)
                rope_q, rope_k = normed_q, normed_k
                q_token_stride, k_token_stride = q_size, kv_size
            cops.rope_rows(rope_q, M, H, D, q_token_stride, D, cos, sin, q)
            cops.rope_rows(rope_k, M, KVH, D, k_token_stride, D, cos, sin, k)
            for m in range(M):  # v's rows, contiguous (as the KV write takes them)
                for j in range(kv_size):
                    v[m * kv_size + j] = qkv[m * row + q_size + kv_size + j]
            cops.cache_write_rows(cache_fmt, k, k_cache, strides, slots, M, KVH, D, block_size)
            cops.cache_write_rows(cache_fmt, v, v_cache, strides, slots, M, KVH, D, block_size)
            # attention: the decode rows together (gathered unless they are every row, in
            # order), each prompt chunk on its own
            if Md and rows == NULL:
                cops.attention_rows(ops_isa, cache_fmt, q, attn, k_cache, v_cache, strides,
                                    tables, table_stride, lens, 0, window, Md, KVH, H // KVH,
                                    block_size, D, scale, scratch, scratch_floats, threads)
            elif Md:
                for m in range(Md):
                    for j in range(q_size):
                        decode_q[m * q_size + j] = q[rows[m] * q_size + j]
                cops.attention_rows(ops_isa, cache_fmt, decode_q, decode_attn, k_cache,
                                          v_cache, strides, tables, table_stride, lens, 0,
                                          window, Md, KVH, H // KVH, block_size, D, scale,
                                          scratch, scratch_floats, threads)
                for m in range(Md):
                    for j in range(q_size):
                        attn[rows[m] * q_size + j] = decode_attn[m * q_size + j]
            for j in range(S):
                segment = &segments[j]
                cops.attention_rows(ops_isa, cache_fmt, q + segment.first * q_size,
                                          attn + segment.first * q_size, k_cache, v_cache,
                                          strides, segment.table, 0, NULL, segment.start,
                                          window, segment.rows, KVH, H // KVH, block_size, D,
                                          scale, scratch, scratch_floats, threads)
            # x = x + attn @ W_o.T
            if _product(&layer.o, attn, q_size, M, y, linear_isa, threads):
                return 1
            for j in range(n):
                x[j] = x[j] + y[j]
            # x = x + swiglu(rms_norm(x) @ W_gate_up.T) @ W_down.T (the down parts summed)
            cops.rms_norm_rows(x, M, 1, hidden, 0, layer.post_norm, hidden, self.eps, h)
            if _product(&layer.gate_up, h, hidden, M, gate_up, linear_isa, threads):
                return 1
            cops.swiglu_rows(ops_isa, gate_up, gate_up + I, M, I, 2 * I, 2 * I, mlp)
            for m in range(layer.down_count):
                part = &self.down[layer.down_first + m]
                if _product(part, mlp + part.k0, I, M, y if m == 0 else y_part, linear_isa,
                            threads):
                    return 1
                if m:
                    for j in range(n):
                        y[j] = y[j] + y_part[j]
            for j in range(n):
                x[j] = x[j] + y[j]
        return 0


cdef inline int _product(const Part *p, const float *x, int64_t ldx, int64_t M, float *out,
                         int isa, int threads) noexcept nogil:
    """``out = x @ part.T`` for ``M`` rows of ``x``, ``ldx`` floats apart."""
    return clinear.gemm_rows(isa, p.fmt, x, ldx, M, p.w, p.ldw, p.s, p.lds, p.n, p.k, out,
                             threads)


def layer_plan(layers, config):
    """A ``LayerPlan`` of ``layers`` (``mie.model.weights.LayerWeights``) for a model of
    ``config`` (``mie.model.config.ModelConfig``), or None when one of their arrays is not
    what the kernels read as it lies."""
    cdef LayerPlan plan = LayerPlan()
    cdef int64_t hidden = config.hidden_size, H = config.num_heads
    cdef int64_t KVH = config.num_kv_heads, D = config.head_dim
    cdef int64_t inter = config.intermediate_size, q_size = H * D, kv_size = KVH * D
    cdef int64_t count = len(layers), parts = 0, i, a
    if count < 1 or KVH < 1 or H % KVH:
        return None
    plan.num_layers, plan.hidden, plan.num_heads = count, hidden, H
    plan.num_kv_heads, plan.head_dim, plan.inter = KVH, D, inter
    plan.eps = config.rms_norm_eps
    plan.qk_norm = config.qk_norm
    plan.keep = []
    downs = [getattr(source.down, "parts", (source.down,)) for source in layers]
    plan.panels = any(len(down) > 1 for down in downs)
    plan.layers = <Layer *>malloc(count * sizeof(Layer))
    plan.down = <Part *>malloc(sum(len(d) for d in downs) * sizeof(Part))
    if plan.layers == NULL or plan.down == NULL:
        raise MemoryError("layer_plan: no memory for the layers' pointers")
    cdef Layer *layer
    for i, source in enumerate(layers):
        layer = &plan.layers[i]
        layer.input_norm = _vector(source.input_norm, hidden, plan.keep)
        layer.post_norm = _vector(source.post_norm, hidden, plan.keep)
        layer.qkv_bias = layer.q_norm = layer.k_norm = NULL
        if layer.input_norm == NULL or layer.post_norm == NULL:
            return None
        if source.qkv_bias is not None:
            layer.qkv_bias = _vector(source.qkv_bias, q_size + 2 * kv_size, plan.keep)
            if layer.qkv_bias == NULL:
                return None
        if config.qk_norm:
            layer.q_norm = _vector(source.q_norm, D, plan.keep)
            layer.k_norm = _vector(source.k_norm, D, plan.keep)
            if layer.q_norm == NULL or layer.k_norm == NULL:
                return None
        if not (_part(&layer.qkv, source.qkv, q_size + 2 * kv_size, hidden, 0, plan.keep)
                and _part(&layer.o, source.o, hidden, q_size, 0, plan.keep)
                and _part(&layer.gate_up, source.gate_up, 2 * inter, hidden, 0, plan.keep)):
            return None
        layer.down_first, layer.down_count, a = parts, len(downs[i]), 0
        for matrix in downs[i]:
            width = input_size(matrix.weight)
            if not _part(plan.down + parts, matrix, hidden, width, a, plan.keep):
                return None
            parts, a = parts + 1, a + width
        if a != inter:
            return None
    formats = {plan.down[i].fmt for i in range(parts)}
    for i in range(count):
        formats.update((plan.layers[i].qkv.fmt, plan.layers[i].o.fmt, plan.layers[i].gate_up.fmt))
    plan.formats = tuple(formats)
    return plan


cdef object _fewest_blas_rows(tuple formats):
    """The fewest rows of ``x`` from which a product of one of these kernel formats goes to the
    BLAS panels on the variant in use (``mie._fast.linear.blas_min_rows``), None if none ever
    does: from there the loop takes the step, which hands each product its own path."""
    fewest = None
    for fmt in formats:
        rows = clinear._blas_min_rows(fmt)
        if rows is not None and (fewest is None or rows < fewest):
            fewest = rows
    return fewest
