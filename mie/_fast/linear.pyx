# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Cython mirror of ``mie.linear``: float32 activations x float32 / bfloat16 / bfloat16x16 /
float16 / int8 / int8x16 / int4 / int4x16 / int6 / int6x16 weights.

Same arguments, same checks (the reference's ``_check_matmul``, so the same exceptions and
messages), same results within float32 rounding (``tests/test_fast_linear.py`` holds every
element within ``1e-5 * sum_k |x[m, k]| * |w[n, k]|`` of the reference). The kernels are C
(``linear_kernels.h``, ``linear_body.h``); this module validates, picks a path and releases
the GIL. The engine's calls, whose arguments are already what the kernels read, are
recognised on the arrays' C fields (``_ready_format``) and skip the checks written in Python,
which cost more than a small batch-1 product.

Two paths:

* ``"kernel"``: register-tiled dot products that read the weight once, widen it in
  registers and never store a float32 copy. ``M = 1`` is a matrix-vector product bound by
  memory bandwidth, where reading 2 (or ~1.1, ~0.56) bytes per weight instead of 4 is the
  whole gain: int8 and int4 weights multiply the activation rounded to int8 blocks, byte by
  byte, in integer dot products (``VPDPBUSD`` with AVX-512 VNNI), which keep up with memory
  where turning each byte into a float did not. From ``M = 4`` on, tiles of 4 rows of ``x``
  share each widened weight vector, and a chunk of weight rows stays in L2 while every group
  of 4 rows passes over it (the quantized row-grouped formats, 16 rows interleaved, take
  every row of ``x`` through the integer products instead, a group of rows staying in cache;
  bfloat16x16 takes tiles of rows of ``x`` over each group, a row per vector lane). OpenMP
  threads split the output channels. float32 weights take this path too: at batch 1 as fast
  as OpenBLAS on a quiet machine, and from 8 rows up to
  twice as fast with the weight stored ``(N, K)``; and its threads are mie's, which sleep
  when idle, where OpenBLAS's compete with them.
* ``"blas"``: widen the weight into float32 one panel of rows at a time and hand each panel
  to NumPy's BLAS (prefill is compute-bound: the widening is amortized over the rows).

``method="auto"`` picks by ``M`` and the variant in use: ``BLAS_MIN_ROWS``.

Instruction sets: the kernels exist for ``ISAS`` (best first); at import the best one the CPU
supports is chosen, or the one named by the ``MIE_ISA`` environment variable; ``set_isa``
switches at run time (tests and benchmarks force each variant that way). ``ISA`` names the
variant in use.
"""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t

import ml_dtypes
import numpy as np

cnp.import_array()

from mie._fast.isa import IsaChoice
from mie.linear import (
    _check_matmul,
    _check_out,
    _check_widen,
    INT4X16_DTYPE,
    INT8X16_DTYPE,
    INT6X16_DTYPE,
    BF16X16_DTYPE,
    GROUP_ROWS,
    GROUPED_DTYPES,
    INT6_DTYPE,
    _check_words,
    dequantize_activation,
    input_size,
    output_size,
    quantize_activation,
)
from mie.linear import gather_rows as _reference_gather_rows
from mie.linear import widen as _reference_widen

cdef extern from "linear_kernels.h" nogil:
    int MIE_F32
    int MIE_BF16
    int MIE_F16
    int MIE_BF16X16
    int MIE_I8
    int MIE_I4
    int MIE_I6
    int MIE_I4X16
    int MIE_I8X16
    int MIE_I6X16
    int mie_row_grouped(int fmt)
    int mie_isa_count()
    const char *mie_isa_name(int i)
    int mie_isa_supported(int i)
    int mie_max_threads()
    int mie_openmp()
    int mie_gemm(int isa, int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                 int64_t ldw, const void *s, int64_t lds, int64_t N, int64_t K, float *out,
                 int64_t ldo, int nthreads)
    void mie_widen(int isa, int fmt, const void *w, int64_t ldw, const void *s, int64_t lds,
                   int64_t K, float *dst, int64_t ldd, int64_t n_begin, int64_t n_end,
                   int nthreads)
    uint64_t mie_stream_read(const uint64_t *a, int64_t n, int nthreads)

OPENMP = bool(mie_openmp())

ISAS = tuple(mie_isa_name(i).decode() for i in range(mie_isa_count()))
"""Every variant compiled into this build, best first (``generic`` is always there)."""

BLAS_MIN_ROWS = {"avx512vnni": None, "avx512": None, "avx2vnni": 64, "avx2": 64, "generic": 2}
"""Per variant: from this many rows of ``x`` on, ``method="auto"`` widens panels for BLAS;
``None``: never.

Measured (docs/fast.md): the AVX-512 kernels (4 x 4 register tiles, 32 registers) beat the
widened panels + OpenBLAS at every M tried, 8 to 2048, by up to 1.8x; the AVX2 ones (4 x 2
tiles in 16 registers) reach about 70% of the FMA units' peak, level with the panels at
M = 32 and a third slower at M = 128, so from 64 rows the AVX2 variant hands prefill to
BLAS. The generic kernels (baseline SIMD, the fallback for CPUs without AVX2 and for other
architectures) are correct but slow -- 0.2-0.6x float32 BLAS from M = 8 -- where the panels
are 0.7-1.0x, so they only run batch 1. Row-grouped weights may differ:
``ROW_GROUPED_BLAS_MIN_ROWS``; ``blas_min_rows`` gives the threshold of a product."""

ROW_GROUPED_BLAS_MIN_ROWS = {"avx2vnni": None, "avx2": None}
"""Per variant, where the quantized row-grouped weights (int4x16, int8x16, int6x16) differ
from ``BLAS_MIN_ROWS`` (bfloat16x16's tiles are float multiply-adds, as the row formats' are:
it follows ``BLAS_MIN_ROWS``): their kernels
take every row of ``x`` through the integer dot products (no register tiles of floats), which
beat the widened panels + OpenBLAS at prefill sizes on the AVX2 variants too. Measured on the
Intel Xeon VM running the 256-bit variants (2 threads; its OpenBLAS runs AVX-512 kernels, so
the panels were faster there than on a CPU with AVX2 alone), a prefill of the
Qwen2-0.5B-shaped model, 3 rounds alternating: with AVX-VNNI 128 tokens int8 291-327 ms
against 649-729 through the panels, int4 284-325 against 611-643; with ``avx2``'s
VPMADDUBSW, 128 tokens int8 513-530 against 674-753, int4 352-396 against 612-738, 512
tokens int8 2068-2166 against 2354-2645, int4 1543-1707 against 2249-2495. int6x16 (an
LM head, whose products have a row per sequence) follows them, not measured apart."""

PANEL_BYTES = 16 << 20
"""Float32 bytes of one widened panel on the BLAS path: large, because each BLAS call packs
all of ``x`` again (1 MiB panels were 3x slower at M = 512)."""

_FORMATS = {
    "float32": MIE_F32,
    "bfloat16": MIE_BF16,
    "float16": MIE_F16,
    "bfloat16x16": MIE_BF16X16,
    "int8": MIE_I8,
    "int4": MIE_I4,
    "int6": MIE_I6,
    "int4x16": MIE_I4X16,
    "int8x16": MIE_I8X16,
    "int6x16": MIE_I6X16,
}

cdef int _ML_BFLOAT16 = np.dtype(ml_dtypes.bfloat16).num
"""``ml_dtypes.bfloat16``'s type number: the same bits as bfloat16 stored as ``uint16``."""

_choice = IsaChoice(ISAS, [bool(mie_isa_supported(i)) for i in range(len(ISAS))])
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


def max_threads() -> int:
    """Threads the kernels run on: OpenMP's maximum (``OMP_NUM_THREADS``), 1 without OpenMP."""
    return mie_max_threads()


def _operands(weight, scales):
    """The weight (bfloat16 as ``uint16`` bits) and scales, copied only if a row is not
    contiguous: the kernels take any whole-element row stride, negative or zero included."""
    dtype = weight.dtype
    if dtype.kind == "V" and dtype not in (INT6_DTYPE, *GROUPED_DTYPES.values()):  # bfloat16
        weight = weight.view(np.uint16)
    if weight.shape[1] > 1 and weight.strides[1] != weight.itemsize or (
        weight.strides[0] % weight.itemsize
    ):
        weight = np.ascontiguousarray(weight)
    if scales is not None and (
        scales.shape[1] > 1 and scales.strides[1] != scales.itemsize
        or scales.strides[0] % scales.itemsize
    ):
        scales = np.ascontiguousarray(scales)
    return weight, scales


cdef inline bint _overlap(cnp.ndarray a, cnp.ndarray b):
    """Whether two C-contiguous arrays share bytes."""
    cdef char *pa = <char *>cnp.PyArray_DATA(a)
    cdef char *pb = <char *>cnp.PyArray_DATA(b)
    return pa < pb + cnp.PyArray_NBYTES(b) and pb < pa + cnp.PyArray_NBYTES(a)


cdef int weight_format(weight, scales, int64_t *K, int64_t *N=NULL) except -2:
    """The kernel format of a weight the kernels read where it lies -- a C-contiguous 2-D
    ndarray of one of the ten formats (bfloat16 as ``uint16`` or ``ml_dtypes.bfloat16``;
    int4 of whole blocks) with its C-contiguous scales of the right dtype and shape (none for
    float32 and 16-bit weights) -- and its inputs, into ``K`` (its outputs into ``N`` when
    given); -1 for anything else."""
    if type(weight) is not np.ndarray:
        return -1
    cdef cnp.ndarray wa = weight, sa
    if cnp.PyArray_NDIM(wa) != 2 or not cnp.PyArray_IS_C_CONTIGUOUS(wa):
        return -1
    cdef int t = cnp.PyArray_TYPE(wa), fmt, scale_type
    cdef int64_t rows = wa.shape[0], scale_columns
    K[0] = wa.shape[1]
    if t == cnp.NPY_FLOAT32:
        fmt = MIE_F32
    elif t == cnp.NPY_UINT16 or t == _ML_BFLOAT16:
        fmt = MIE_BF16
    elif t == cnp.NPY_FLOAT16:
        fmt = MIE_F16
    elif t == cnp.NPY_INT8:
        fmt, scale_type = MIE_I8, cnp.NPY_FLOAT16
    elif t == cnp.NPY_UINT8:
        fmt, scale_type, K[0] = MIE_I4, cnp.NPY_FLOAT16, 2 * K[0]
        if K[0] % 32:
            return -1
    elif t == cnp.NPY_VOID and cnp.PyArray_ITEMSIZE(wa) == INT6_DTYPE.itemsize:
        fmt, scale_type, K[0] = MIE_I6, cnp.NPY_FLOAT16, 64 * K[0]
    elif t == cnp.NPY_VOID and cnp.PyArray_ITEMSIZE(wa) == INT4X16_DTYPE.itemsize:
        fmt, scale_type, K[0] = MIE_I4X16, cnp.NPY_FLOAT16, 32 * K[0]
    elif t == cnp.NPY_VOID and cnp.PyArray_ITEMSIZE(wa) == INT8X16_DTYPE.itemsize:
        fmt, scale_type, K[0] = MIE_I8X16, cnp.NPY_FLOAT16, 32 * K[0]
    elif t == cnp.NPY_VOID and cnp.PyArray_ITEMSIZE(wa) == INT6X16_DTYPE.itemsize:
        fmt, scale_type, K[0] = MIE_I6X16, cnp.NPY_FLOAT16, 32 * K[0]
    elif t == cnp.NPY_VOID and wa.dtype == BF16X16_DTYPE:  # structured: told by its field
        fmt, K[0] = MIE_BF16X16, 32 * K[0]
    else:
        return -1
    cdef int64_t grouped = GROUP_ROWS if mie_row_grouped(fmt) else 1
    scale_columns = (K[0] + 31) // 32 * grouped
    if N != NULL:
        N[0] = rows * grouped
    if fmt >= MIE_I8:
        if type(scales) is not np.ndarray:
            return -1
        sa = scales
        if (
            cnp.PyArray_NDIM(sa) != 2 or cnp.PyArray_TYPE(sa) != scale_type
            or not cnp.PyArray_IS_C_CONTIGUOUS(sa)
            or sa.shape[0] != rows or sa.shape[1] != scale_columns
        ):
            return -1
    elif scales is not None:
        return -1
    return fmt


def blas_min_rows(fmt: str):
    """From how many rows of ``x`` ``method="auto"`` hands a product with a weight in ``fmt``
    (``mie.linear.WEIGHT_FORMATS``) to the BLAS panels on the variant in use; None: never."""
    return _blas_min_rows(_FORMATS[fmt])


cdef object _blas_min_rows(int fmt):
    """``blas_min_rows`` of a kernel format (``_FORMATS``' values)."""
    if mie_row_grouped(fmt) and fmt >= MIE_I8:
        return ROW_GROUPED_BLAS_MIN_ROWS.get(_choice.name, BLAS_MIN_ROWS.get(_choice.name))
    return BLAS_MIN_ROWS.get(_choice.name)


cdef int _ready_format(x, weight, scales, out, int64_t *N):
    """The kernel format of a product whose arguments are exactly what the kernels read --
    every call the engine makes: C-contiguous float32 ``x``, a weight ``weight_format``
    takes, ``out`` None or a C-contiguous float32 ``(M, N)`` apart from ``x`` -- and the
    weight's outputs, into ``N``. -1 for
    anything else, which then goes through the reference's checks (the same errors, and
    conversions). Checked on the arrays' C fields: the checks written in Python cost ~10 us a
    call, longer than a small batch-1 product."""
    if type(x) is not np.ndarray:
        return -1
    cdef cnp.ndarray xa = x, oa
    if cnp.PyArray_NDIM(xa) != 2:
        return -1
    if cnp.PyArray_TYPE(xa) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(xa):
        return -1
    cdef int64_t K
    cdef int fmt = weight_format(weight, scales, &K, N)
    if fmt < 0 or xa.shape[1] != K:
        return -1
    if out is not None:
        if type(out) is not np.ndarray:
            return -1
        oa = out
        if (
            cnp.PyArray_NDIM(oa) != 2 or cnp.PyArray_TYPE(oa) != cnp.NPY_FLOAT32
            or not cnp.PyArray_IS_C_CONTIGUOUS(oa)
            or oa.shape[0] != xa.shape[0] or oa.shape[1] != N[0]
            or _overlap(oa, xa)
        ):
            return -1
    return fmt


def matmul(x, weight, scales=None, out=None, *, method: str = "auto"):
    """``x (M, K) @ weight (N, K).T -> (M, N)`` float32, as ``mie.linear.matmul``.

    ``out``: as the reference's (C-contiguous float32 ``(M, N)``; the result is written
    there). ``method``: ``"auto"`` (the kernels below ``BLAS_MIN_ROWS`` rows, BLAS panels
    from there), or ``"kernel"`` / ``"blas"`` to force a path (tests, benchmarks).
    """
    cdef int64_t outputs = 0
    cdef int ready = _ready_format(x, weight, scales, out, &outputs) if method == "auto" else -1
    cdef object threshold
    if ready >= 0 and x.shape[0] and outputs:
        threshold = _blas_min_rows(ready)
        if threshold is None or x.shape[0] < threshold:
            if out is None:
                out = np.empty((x.shape[0], outputs), dtype=np.float32)
            _gemm(x, weight, scales, ready, out)
            return out
    x, fmt = _check_matmul(x, weight, scales)
    _check_out(out, x.shape[0], output_size(weight))
    if method not in ("auto", "kernel", "blas"):
        raise ValueError(f"method must be 'auto', 'kernel' or 'blas', got {method!r}")
    x = np.ascontiguousarray(x)
    weight, scales = _operands(weight, scales)
    cdef int64_t M = x.shape[0], K = x.shape[1], N = output_size(weight)
    if out is None:
        out = np.empty((M, N), dtype=np.float32)
    elif np.may_share_memory(out, x):  # the kernels write out while still reading x
        x = x.copy()
    if M == 0 or N == 0:
        return out
    if method == "auto":
        threshold = _blas_min_rows(_FORMATS[fmt])
        method = "blas" if threshold is not None and M >= threshold else "kernel"
    if method == "kernel":
        _gemm(x, weight, scales, _FORMATS[fmt], out)
    else:
        _blas(x, weight, scales, _FORMATS[fmt], out)
    return out


def stream_read(words) -> int:
    """``mie.linear.stream_read``: the same xor, read by the kernels' threads."""
    _check_words(words)
    cdef const uint64_t *a = <const uint64_t *>cnp.PyArray_DATA(words)
    cdef int64_t n = words.shape[0]
    cdef int threads = mie_max_threads()
    cdef uint64_t result
    with nogil:
        result = mie_stream_read(a, n, threads)
    return int(result)


def widen(weight, scales=None):
    """The float32 values ``(N, K)`` of a stored weight, as ``mie.linear.widen``."""
    fmt = _check_widen(weight, scales)
    if fmt == "float32" or weight.size == 0:
        return _reference_widen(weight, scales)
    weight, scales = _operands(weight, scales)
    out = np.empty((output_size(weight), input_size(weight)), dtype=np.float32)
    _widen_rows(weight, scales, _FORMATS[fmt], out, 0, out.shape[0])
    return out


def gather_rows(weight, scales, ids):
    """``mie.linear.gather_rows``: rows ``ids`` of a stored weight as float32 ``(len(ids), K)``,
    the embedding lookup, each row widened where it lies by the kernels' widening (``widen``'s:
    a row of a row-grouped weight from its group's bytes). Why: the reference's dozen NumPy
    calls took ~0.1 ms of a Qwen2-0.5B-shaped int4 batch-1 step (11 ms) on the Intel Xeon VM;
    this takes microseconds. float32 weights (a plain row copy), ids that are not a
    contiguous 1-D int64 array, and any id outside the rows go to the reference, which
    gathers them or raises its own error."""
    fmt = _check_widen(weight, scales)
    if (fmt == "float32" or type(ids) is not np.ndarray or ids.dtype != np.int64
            or ids.ndim != 1 or not ids.flags.c_contiguous or input_size(weight) == 0):
        return _reference_gather_rows(weight, scales, ids)
    cdef int64_t count = ids.shape[0], N = output_size(weight), K = input_size(weight), i
    cdef const int64_t *rows = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>ids)
    for i in range(count):
        if not 0 <= rows[i] < N:
            return _reference_gather_rows(weight, scales, ids)
    weight, scales = _operands(weight, scales)
    out = np.empty((count, K), dtype=np.float32)
    cdef int64_t lds = 0
    cdef const void *s = _scales(scales, &lds)
    cdef const void *w = _data(weight)
    cdef float *d = <float *>cnp.PyArray_DATA(out)
    cdef int64_t ldw = _stride(weight)
    cdef int isa = _choice.index, code = _FORMATS[fmt]
    with nogil:
        for i in range(count):  # one row each: no threads
            mie_widen(isa, code, w, ldw, s, lds, K, d + i * K, K, rows[i], rows[i] + 1, 1)
    return out


cdef inline int64_t _stride(cnp.ndarray a):
    return cnp.PyArray_STRIDE(a, 0) // cnp.PyArray_ITEMSIZE(a)


cdef inline const void *_data(cnp.ndarray a):
    return <const void *>cnp.PyArray_DATA(a)


cdef inline const void *_scales(scales, int64_t *lds):
    """The int8 / int4 / int6 scales' data and row stride (in ``lds``); NULL and 0 for 16-bit
    weights."""
    if scales is None:
        lds[0] = 0
        return NULL
    lds[0] = _stride(scales)
    return _data(scales)


cdef _gemm(cnp.ndarray x, cnp.ndarray weight, scales, int fmt, cnp.ndarray out):
    # Raw pointers, not typed memoryviews or .ctypes: a batch-1 product of a small matrix
    # takes ~50 us, and those cost microseconds per call.
    cdef int64_t lds = 0
    cdef const void *s = _scales(scales, &lds)
    cdef const void *w = _data(weight)
    cdef const float *xp = <const float *>_data(x)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef int64_t ldw = _stride(weight)
    cdef int64_t M = x.shape[0], K = x.shape[1], N = out.shape[1]
    cdef int isa = _choice.index, threads = mie_max_threads(), status
    with nogil:
        status = gemm_rows(isa, fmt, xp, K, M, w, ldw, s, lds, N, K, op, threads)
    if status != 0:
        raise MemoryError(f"matmul: no memory to round the ({M}, {K}) activation to int8 blocks")


cdef int gemm_rows(int isa, int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                   int64_t ldw, const void *s, int64_t lds, int64_t N, int64_t K, float *out,
                   int nthreads) noexcept nogil:
    """``_gemm``'s kernel call, into a C-contiguous ``out`` (M, N); 0, or nonzero when the
    rounded activation found no memory (see ``_gemm``)."""
    return mie_gemm(isa, fmt, x, ldx, M, w, ldw, s, lds, N, K, out, N, nthreads)


cdef _widen_rows(cnp.ndarray weight, scales, int fmt, cnp.ndarray dst, int64_t n0, int64_t n1):
    cdef int64_t lds = 0
    cdef const void *s = _scales(scales, &lds)
    cdef const void *w = _data(weight)
    cdef float *d = <float *>cnp.PyArray_DATA(dst)
    cdef int64_t ldw = _stride(weight), K = input_size(weight), ldd = dst.shape[1]
    cdef int isa = _choice.index, threads = mie_max_threads()
    if K == 0 or n1 <= n0:
        return
    with nogil:
        mie_widen(isa, fmt, w, ldw, s, lds, K, d, ldd, n0, n1, threads)


cdef _blas(x, weight, scales, int fmt, out):
    """Widen panels of ``PANEL_BYTES`` and multiply each with NumPy's BLAS (with int8, int4 and
    int6 weights, the rows of ``x`` rounded to int8 blocks first: the reference's own functions,
    whose O(M K) cost the product's O(M N K) hides)."""
    if fmt >= MIE_I8:
        x = dequantize_activation(*quantize_activation(x))
    if fmt == MIE_F32:  # nothing to widen
        np.matmul(x, weight.T, out=out)
        return
    cdef int64_t K = x.shape[1], N = output_size(weight)
    cdef int64_t rows = max(16, PANEL_BYTES // max(1, 4 * K))
    rows = min(rows, N)
    panel = np.empty((rows, K), dtype=np.float32)
    cdef int64_t n0, n1
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        _widen_rows(weight, scales, fmt, panel, n0, n1)
        np.matmul(x, panel[: n1 - n0].T, out=out[:, n0:n1])
