# C-level interface of the matmul mirror, for mie/_fast/forward.pyx to cimport: the kernel path
# of matmul without its Python argument checks (the caller checked them once for the pass).

from libc.stdint cimport int64_t


cdef int gemm_rows(int isa, int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                   int64_t ldw, const void *s, int64_t lds, int64_t N, int64_t K, float *out,
                   int nthreads) noexcept nogil
cdef int weight_format(weight, scales, int64_t *K, int64_t *N=*) except -2
cdef object _blas_min_rows(int fmt)
