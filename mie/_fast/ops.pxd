# C-level interface of the ops mirror, for mie/_fast/forward.pyx to cimport: the loops behind
# rms_norm, apply_rope, swiglu, reshape_and_cache and the attention, without the Python
# wrappers' argument checks (the caller has checked them once for the whole pass).

cimport numpy as cnp
from libc.stdint cimport int64_t


cdef inline bint _is_array(object a, int type_num, int ndim):
    """``a`` is a C-contiguous ndarray of that type and rank."""
    return (isinstance(a, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray>a) == type_num
            and cnp.PyArray_NDIM(<cnp.ndarray>a) == ndim
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a))


cdef void rms_norm_rows(const float *x, int64_t rows, int64_t inner, int64_t outer_stride,
                        int64_t inner_stride, const float *weight, int64_t n, float eps,
                        float *out) noexcept nogil
cdef void rope_rows(const float *x, int64_t tokens, int64_t heads, int64_t dim,
                    int64_t token_stride, int64_t head_stride, const float *cos,
                    const float *sin, float *out) noexcept nogil
cdef void swiglu_rows(int isa, const float *gate, const float *up, int64_t rows, int64_t n,
                      int64_t gate_stride, int64_t up_stride, float *out) noexcept nogil
cdef void cache_write_rows(int fmt, const float *src, char *cache, const int64_t *strides,
                           const int64_t *slots, int64_t tokens, int64_t num_kv_heads,
                           int64_t dim, int64_t block_size) noexcept nogil
cdef void attention_rows(int isa, int fmt, const float *q, float *out, char *k_cache,
                         char *v_cache, const int64_t *strides, const int64_t *tables,
                         int64_t table_stride, const int64_t *lens, int64_t start,
                         int64_t window, int64_t rows, int64_t num_kv_heads, int64_t group,
                         int64_t block_size, int64_t dim, float scale, float *scratch,
                         int64_t scratch_floats, int nthreads) noexcept nogil
cdef bint cache_strides(cnp.ndarray cache, int64_t *strides) noexcept
cdef int64_t attention_scratch_floats(int64_t group, int64_t block_size,
                                      int64_t dim) noexcept nogil

# The wrappers' checks of the engine's arguments (see ops.pyx).
cdef int64_t _ready_decode(q, k_cache, v_cache, block_tables, context_lens,
                           sliding_window) except -2
cdef int64_t _ready_prefill(q, k_cache, v_cache, block_table, start,
                            sliding_window) except -2
cdef bint _ready_cache_write(k, v, k_cache, v_cache, slot_mapping) except -1
