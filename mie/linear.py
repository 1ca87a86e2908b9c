"""mie.linear: the reference for matrix products of float32 activations with narrow weights.

bfloat16, float16 and int8 weights; float32 activations, accumulation and results.

This is the specification the Cython kernels (``mie._fast.linear``) are tested against, and
what the pure-Python backend runs: widen or dequantize the weight to float32, then ``@``.
Slow, and obviously right.

**Layout.** A weight is stored ``(N, K)`` row-major: one *output channel* per row, ``K`` the
input dimension, exactly as PyTorch and safetensors keep ``nn.Linear.weight``. The product is
``matmul(x, weight) = x @ widen(weight).T``: ``x`` is ``(M, K)`` float32, the result ``(M, N)``
float32. Why this layout and not the ``(K, N)`` one the float32 model uses: batch-1 decode is a
matrix-vector product bound by memory bandwidth, and with one output channel per row each
output is a dot product that streams one contiguous row of the weight, read once, widened in
registers, never copied. The same rows serve batched decode and prefill: a weight vector,
once loaded and widened, is dotted with several activation rows (register tiles), and a chunk
of rows stays in cache while every activation row passes over it.

**Formats** (``WEIGHT_FORMATS``), told apart by the weight's NumPy dtype:

* ``float32``: the plain product, for completeness.
* ``bfloat16``: ``uint16`` bit patterns (or ``ml_dtypes.bfloat16``, the same bits): the top
  half of a float32, so widening is a 16-bit shift and exact. ``to_bfloat16`` rounds float32
  to nearest, ties to even (what PyTorch and ``ml_dtypes`` do).
* ``float16``: IEEE half precision, ``np.float16``; widening is exact. ``to_float16`` refuses
  finite values that overflow half precision (65504) instead of storing ``inf``.
* ``int8``: weight-only quantization, llama.cpp's Q8_0 scheme with float32 scales: along each
  row, groups of ``GROUP_SIZE = 32`` consecutive inputs share one scale
  ``s = max|w| / 127`` (symmetric: no zero point), ``q = round(w / s)`` in ``[-127, 127]``, and
  the weight is ``q * s``. The scales are a float32 array ``(N, ceil(K / 32))``. Why groups
  of 32 rather than one scale per output channel: a row of Qwen2's down projection has 4,864
  inputs, and a single outlier among them would coarsen the step of all the others; a group
  of 32 bounds the damage to its neighbours (the round-trip error is at most half the
  group's step, ``max|w| / 254``). 32 is also a multiple of every vector width (8 floats for
  AVX2, 16 for AVX-512), so a vector never straddles two groups and needs one broadcast scale;
  and it is what llama.cpp's q8_0 uses, so accuracy compares like with like. Cost: 4 bytes of
  scale per 32 one-byte weights, 9 bits per weight, 3.56x fewer bytes than float32.
  When ``K`` is not a multiple of 32 the last group of each row is shorter (``K % 32``
  inputs) and its scale comes from those inputs only; nothing is padded.

Accumulation is float32 everywhere (activations, scales and sums); only the storage of the
weight is narrow.
"""

from __future__ import annotations

import numpy as np

try:  # the maintained NumPy bfloat16 dtype; optional here, bfloat16 also travels as uint16
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is an install requirement
    ml_dtypes = None

GROUP_SIZE = 32
"""Inputs per int8 scale, along ``K`` (llama.cpp's Q8_0 block size)."""

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8")

FLOAT16_MAX = float(np.finfo(np.float16).max)


def weight_format(weight: np.ndarray) -> str:
    """The format a weight array stores, from its dtype (``WEIGHT_FORMATS``).

    ``uint16`` and ``ml_dtypes.bfloat16`` are both bfloat16 (bit patterns); ``TypeError``
    for any other dtype.
    """
    dtype = np.asarray(weight).dtype
    if dtype == np.float32:
        return "float32"
    if dtype == np.uint16 or (ml_dtypes is not None and dtype == ml_dtypes.bfloat16):
        return "bfloat16"
    if dtype == np.float16:
        return "float16"
    if dtype == np.int8:
        return "int8"
    raise TypeError(
        f"a weight must be float32, bfloat16 (uint16 bits or ml_dtypes.bfloat16), float16 "
        f"or int8 (with scales), got dtype {dtype}"
    )


def num_groups(k: int) -> int:
    """Scales per row of an int8 weight with ``k`` inputs: ``ceil(k / GROUP_SIZE)``."""
    return -(-k // GROUP_SIZE)


# --- conversions -------------------------------------------------------------------------------


def to_bfloat16(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (``uint16``), rounding to nearest, ties to even.

    NaN stays NaN (quiet), infinities stay infinite; finite values above bfloat16's largest
    (~3.39e38) round to infinity, as in every other bfloat16 implementation.
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    bits = w.view(np.uint32)
    # Round to nearest even on the 16 bits dropped: add 0x7FFF plus the kept part's lowest bit.
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> 16).astype(
        np.uint16
    )
    nan = np.isnan(w)
    if nan.any():  # the carry above could turn a NaN's payload into infinity: keep it a NaN
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 (``uint16`` bit patterns or ``ml_dtypes.bfloat16``) -> float32, exactly."""
    bits = np.ascontiguousarray(bits).view(np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_float16(w: np.ndarray) -> np.ndarray:
    """float32 -> float16, refusing finite values that overflow half precision.

    ``ValueError`` when a finite value's magnitude rounds above 65504 (it would become
    ``inf``, silently); values that were already infinite or NaN stay so.
    """
    w = np.asarray(w, dtype=np.float32)
    with np.errstate(over="ignore"):  # overflow is reported below, by name
        half = w.astype(np.float16)
    overflow = np.isinf(half) & np.isfinite(w)
    if overflow.any():
        worst = float(np.max(np.abs(w[overflow])))
        raise ValueError(
            f"{int(overflow.sum())} values overflow float16 (largest magnitude {worst:.6g} > "
            f"{FLOAT16_MAX:g}); use bfloat16 or float32"
        )
    return half


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float weight ``(N, K)`` to int8: ``(q, scales)``, see the module docstring.

    Per row and group of ``GROUP_SIZE`` inputs: ``scale = max|w| / 127`` (float32),
    ``q = round(w / scale)`` (ties to even) in ``[-127, 127]``; a group of zeros gets scale 0
    and ``q = 0``. ``dequantize_int8(q, scales)`` is then within ``scale / 2`` of ``w`` (plus
    float32 rounding of the product). ``ValueError`` for NaN or infinite weights: no scale
    represents them.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_int8 needs a 2-D weight (N, K), got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_int8: the weight holds NaN or infinite values")
    n, k = w.shape
    groups = num_groups(k)
    padded = np.zeros((n, groups * GROUP_SIZE), dtype=np.float32)  # zeros never raise a max
    padded[:, :k] = w
    blocks = padded.reshape(n, groups, GROUP_SIZE)
    scales = (np.max(np.abs(blocks), axis=2) / np.float32(127)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q.reshape(n, -1)[:, :k]), scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int8 weight ``(N, K)`` and its scales ``(N, ceil(K/32))`` -> float32 ``q * scale``."""
    _check_scales(q, scales)
    per_input = np.repeat(scales, GROUP_SIZE, axis=1)[:, : q.shape[1]]
    return q.astype(np.float32) * per_input


def widen(weight: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """Any stored weight -> its float32 values ``(N, K)`` (a copy for 16 and 8 bits)."""
    fmt = _check_widen(weight, scales)
    if fmt == "float32":
        return weight
    if fmt == "bfloat16":
        return bfloat16_to_float32(weight)
    if fmt == "float16":
        return weight.astype(np.float32)
    return dequantize_int8(weight, scales)


def _check_widen(weight: np.ndarray, scales: np.ndarray | None) -> str:
    """Validate a stored weight (2-D, a known dtype, scales iff int8); return its format."""
    if not isinstance(weight, np.ndarray) or weight.ndim != 2:
        raise ValueError(
            f"a weight must be a 2-D array (N, K), got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )
    fmt = weight_format(weight)
    if fmt == "int8":
        _check_scales(weight, scales)
    elif scales is not None:
        raise ValueError(f"scales belong to int8 weights, not {fmt}")
    return fmt


# --- the product -------------------------------------------------------------------------------


def _check_scales(q: np.ndarray, scales: np.ndarray | None) -> None:
    if scales is None:
        raise ValueError("an int8 weight needs its scales (N, ceil(K / 32)) float32")
    if not isinstance(scales, np.ndarray) or scales.dtype != np.float32:
        raise TypeError(
            f"int8 scales must be a float32 array, got {type(scales).__name__} "
            f"{getattr(scales, 'dtype', '')}".rstrip()
        )
    expected = (q.shape[0], num_groups(q.shape[1]))
    if scales.shape != expected:
        raise ValueError(
            f"int8 scales for a weight of shape {q.shape} must have shape {expected} "
            f"(one per {GROUP_SIZE} inputs), got {scales.shape}"
        )


def _check_matmul(
    x: np.ndarray, weight: np.ndarray, scales: np.ndarray | None
) -> tuple[np.ndarray, str]:
    """Validate a product's arguments; return ``x`` as float32 and the weight's format.

    Shared with the Cython mirror, so both refuse the same inputs with the same messages.
    """
    fmt = _check_widen(weight, scales)
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"matmul: x must be 2-D (M, K), got shape {x.shape}")
    if x.dtype.kind not in "fiu":  # floating, signed or unsigned integer
        raise TypeError(f"matmul: x must hold real numbers, got dtype {x.dtype}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"matmul: x has {x.shape[1]} inputs per row but the weight (N, K) = "
            f"{weight.shape} takes {weight.shape[1]}"
        )
    return x.astype(np.float32, copy=False), fmt


def _check_out(out: np.ndarray | None, m: int, n: int) -> None:
    """``out``, when given, must be a C-contiguous float32 array of the result's shape."""
    if out is None:
        return
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise TypeError(f"matmul: out must be a float32 array, got {getattr(out, 'dtype', out)!r}")
    if out.shape != (m, n) or not out.flags.c_contiguous:
        raise ValueError(
            f"matmul: out must be C-contiguous with shape {(m, n)}, got shape {out.shape}"
            f"{'' if out.flags.c_contiguous else ' (not C-contiguous)'}"
        )


def matmul(
    x: np.ndarray,
    weight: np.ndarray,
    scales: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``x (M, K) @ weight (N, K).T -> (M, N)`` float32, for every format of ``weight``.

    The weight's dtype picks the format (``weight_format``); int8 weights need their
    ``scales``. The result goes to ``out`` when given (float32, C-contiguous, ``(M, N)``),
    else to a new array. The reference widens the whole weight, then lets BLAS multiply in
    float32.
    """
    x, _ = _check_matmul(x, weight, scales)
    _check_out(out, x.shape[0], weight.shape[0])
    result = np.ascontiguousarray(x @ widen(weight, scales).T, dtype=np.float32)
    if out is None:
        return result
    out[...] = result
    return out
