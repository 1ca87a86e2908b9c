"""mie.linear: the reference for matrix products of float32 activations with narrow weights.

bfloat16, float16, int8, int4 and int6 weights; float32 activations, accumulation and results.

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
* ``int8``: weight-only quantization, llama.cpp's Q8_0 scheme, bit for bit (``quantize_int8``
  gives the codes and scales ``gguf.quants.quantize(w, Q8_0)`` gives, tests/test_int4.py):
  along each row, groups of ``GROUP_SIZE = 32`` consecutive inputs share one scale
  ``d = max|w| / 127`` (symmetric: no zero point), ``q = round(w * (1 / d))`` in
  ``[-127, 127]`` (halves away from zero), and the weight is ``q * d``. The codes are made
  with the float32 ``d``, which is then stored rounded to **float16**, as Q8_0 stores it: the
  scales are a float16 array ``(N, ceil(K / 32))``. Why groups of 32 rather than one scale per
  output channel: a row of Qwen2's down projection has 4,864 inputs, and a single outlier
  among them would coarsen the step of all the others; a group of 32 bounds the damage to its
  neighbours (the round-trip error is at most half the group's step, ``max|w| / 254``, plus
  the scale's rounding, at most 2^-11 of it while ``d`` is a normal float16: a group whose
  largest weight is under 0.0078 keeps fewer bits of its scale, as in llama.cpp). 32 is also
  a multiple of every vector width (8 floats for AVX2, 16 for AVX-512), so a vector never
  straddles two groups and needs one broadcast scale; and it is what llama.cpp's q8_0 uses, so
  a GGUF file's Q8_0 matrices load as they are and accuracy compares like with like. Cost: 2
  bytes of scale per 32 one-byte weights, 8.5 bits per weight, 3.76x fewer bytes than
  float32. When ``K`` is not a multiple of 32 the last group of each row is shorter
  (``K % 32`` inputs) and its scale comes from those inputs only; nothing is padded.
* ``int4``: llama.cpp's Q4_0 scheme, bit for bit (``quantize_int4`` gives the codes and
  scales ``gguf.quants.quantize(w, Q4_0)`` gives, tests/test_int4.py): along each row, blocks
  of ``GROUP_SIZE = 32`` inputs share one **float16** scale ``d = m / -8``, where ``m`` is the
  block's value of largest magnitude *with its sign* (the first one on a tie), and each input
  is the 4-bit code ``c = min(15, trunc(w / d + 8.5))`` in ``[0, 15]``; the weight is
  ``(c - 8) * d``. So ``m`` itself is stored exactly as ``-8 * d`` (code 0), and the other
  side of zero reaches only ``+7 * d``: the asymmetry is llama.cpp's, kept so that a model
  quantized here and one quantized by llama.cpp hold the same numbers. Storage: the codes
  ``uint8 (N, K / 2)``, packed as Q4_0 packs them -- within each block of 32, byte ``j`` holds
  input ``j`` in its low nibble and input ``j + 16`` in its high one -- and the scales
  ``float16 (N, K / 32)``: 16 + 2 bytes per 32 weights, exactly Q4_0's 18 (4.5 bits per
  weight, 7.1x fewer bytes than float32). ``weight_format`` knows int4 by its dtype,
  ``uint8``, and the weight's logical input count is twice the codes' columns
  (``input_size``). ``K`` must be a multiple of 32 (``quantize_int4`` refuses others, as
  llama.cpp does: a Q4_0 row is whole blocks); ``mie.model.weights`` stores such a matrix as
  int8 instead.
* ``int4x16`` and ``int8x16``: int4 and int8 as the kernels read them fastest, the same codes
  and scales with 16 rows interleaved (``group_rows``; llama.cpp repacks Q4_0 alike for its
  CPU kernels, 8 rows at a time). One element (dtype ``INT4X16_DTYPE``, 256 bytes, or
  ``INT8X16_DTYPE``, 512) is one block of 32 inputs of 16 rows, in chunks of 64 bytes: chunk
  ``c`` holds bytes ``4c .. 4c + 3`` of each of the 16 rows' blocks, row after row. So one
  64-byte load gives every row 4 bytes -- int4's 8 inputs or int8's 4, all of one block --
  and one integer multiply-add (``VPDPBUSD``, each 32-bit lane a row) adds them up against
  4 of ``x``'s codes repeated in every lane: no lane ever needs adding to another, and each
  block's integer sums become floats and meet their scales once per 16 rows, where the
  one-row loops do that per block of every row. The scales are ``float16 (N / 16, K / 2)``,
  element ``(g, b)``'s 16 in row order. Codes ``(N / 16, K / 32)``; ``N`` must be a multiple
  of 16 and ``K`` of 32. ``mie.model.weights`` stores int4 and int8 matrices so
  (``in_row_groups``); the bytes are int4's and int8's exactly (``ungroup_rows``).
* ``bfloat16x16``: bfloat16 with 16 rows interleaved (``group_rows``), for the same reason
  as int4x16: a loop over one row per output ends each row with a horizontal sum and reads
  ``x`` again for every row, where here one vector holds inputs of 16 rows, a lane a row, and
  meets those inputs of ``x`` broadcast. An element (``BF16X16_DTYPE``, 1024 bytes: a
  structured dtype with one named field, so that no other 1024-byte format can be taken for
  it) is one block of 32 inputs of 16 rows in chunks of 64 bytes, as int8x16's: chunk ``c``
  holds bytes ``4c .. 4c + 3`` of each row's block, its inputs ``2c`` and ``2c + 1``, so each
  32-bit lane is one row's pair of inputs, the even one in its low half, and a shift and a
  mask widen both (a bfloat16's bits are the top half of its float32's). No scales; the
  weight ``(N / 16, K / 32)``; ``N`` must be a multiple of 16 and ``K`` of 32.
  ``mie.model.weights`` stores bfloat16 matrices so (``in_row_groups``); the values are
  bfloat16's exactly (``ungroup_rows``). float16 stays a row per output: laid out alike
  (an input of 16 rows a 32-byte chunk), its batch-1 products were 0.89x as fast out of
  cache on the Intel Xeon VM (docs/fast.md).
* ``int6``: a format of mie's own, for one matrix: the embedding and LM head of an int4
  model (``mie.model.weights.embedding_quantization``: at batch 1 the LM head is the largest
  single read, and in int8 it held int4 to 1.52x int8's speed; docs/precision.md). Q4_0's rule
  with 6 bits -- blocks of 32 inputs, one **float16** scale ``d = m / -32``, codes
  ``c = min(63, trunc(w / d + 32.5))`` in ``[0, 63]``, the weight ``(c - 32) * d`` -- which at
  5 bits is llama.cpp's Q5_0 rule (``gguf.quants`` checks both ends of that: ``offset_codes``
  at 4 and 5 bits gives Q4_0's and Q5_0's codes and scales). Storage is laid out for the
  kernels' byte products: per *pair* of blocks (64 inputs), 48 bytes -- first the two
  blocks' low 4 bits, packed exactly as Q4_0 packs its codes (32 bytes), then their top 2
  bits, 16 bytes, byte ``p`` holding those of the pair's inputs ``p``, ``32 + p``, ``16 + p``
  and ``48 + p`` in its bits 0-1, 2-3, 4-5 and 6-7 (each 128-bit lane of a vector of top bits
  then serves one block half, shifted, beside the nibbles it completes) -- and the scales
  ``float16 (N, K / 32)``: 26 bytes per 32 weights, 6.5 bits a weight. The codes are one
  element of NumPy dtype ``INT6_DTYPE`` (48 bytes) per pair, ``(N, K / 64)``, so the format
  is told by its dtype too. ``K`` must be a multiple of 64 (``quantize_int6`` refuses
  others); the embedding of such a model stays int8.
* ``int6x16``: int6 with 16 rows interleaved, as int4x16 interleaves int4 (``group_rows``):
  an element (``INT6X16_DTYPE``, 384 bytes) is one block of 32 inputs of 16 rows, first the
  block's low nibbles exactly as int4x16 lays them out (256 bytes), then their top bits
  (128): byte ``256 + 64 h + 4 r + t`` holds row ``r``'s top bits of the nibbles in chunks
  ``2 h`` and ``2 h + 1`` at byte ``4 r + t``, so one 64-byte load of top bits completes two
  chunks of nibbles, each code's top bits a shift and a mask away from bits 4-5
  (``_block_records`` says which bits). Scales as int4x16's. ``mie.model.weights`` keeps an
  int6 embedding / LM head of whole groups of 16 rows so (docs/fast.md has the kernel and
  its figures); the embedding's lookups take each row's bytes back from its group
  (``gather_rows``).

**Activations with int8, int4 and int6 weights.** The activation row is rounded too, as llama.cpp
rounds it for its q8_0 and q4_0 products: ``quantize_activation`` gives each block of 32
inputs of a row of ``x`` an int8 code per input and one scale (``max|x| / 127``, codes
``rint(x / scale)``; the scale then rounded to float16, below). The product is then made of
integer dot products, one per block of 32, each scaled once:
``out[m, n] = sum_b d_w[n, b] * d_x[m, b] * sum_k q_w[n, k] * q_x[m, k]``.
Why: a batch-1 step is bound by reading the weights, and a CPU reads one byte of int8 or
half a byte of int4 faster than it can turn it into a float and multiply it; integer dot
products (``VPDPBUSD``: 64 byte products a cycle, per instruction, where float FMAs take 16)
make the kernels keep up with memory. The price is the activation's rounding, at most half
its block's step (``max|x| / 254``), which llama.cpp pays in every quantized format too; the
perplexity figures in docs/precision.md measure it. The reference computes the same
numbers as ``dequantize(quantize_activation(x)) @ widen(weight).T`` in float32. A block of
``x`` holding NaN or infinity has no int8 scale: its scale is NaN, and so is every output of
its row. Each block's scale is kept rounded to float16 (``half_rounded``), as llama.cpp keeps
it, the codes having been made with the float32 one: a GGUF file's Q8_0 and Q4_0 matrices
then give llama.cpp's products, not just its weights (docs/precision.md, "GGUF files against
llama.cpp").

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

WEIGHT_FORMATS = (
    "float32",
    "bfloat16",
    "bfloat16x16",
    "float16",
    "int8",
    "int8x16",
    "int4",
    "int4x16",
    "int6",
    "int6x16",
)
QUANTIZED_FORMATS = ("int8", "int8x16", "int4", "int4x16", "int6", "int6x16")
"""The formats whose weights need their ``scales``."""

FLOAT16_MAX = float(np.finfo(np.float16).max)

INT6_PAIR = 2 * GROUP_SIZE
"""Inputs per stored int6 element: a pair of blocks (see the module docstring)."""
INT6_DTYPE = np.dtype((np.void, 48))
"""The codes of one int6 pair of blocks: 32 bytes of low nibbles, 16 of top bits."""
GROUP_ROWS = 16
"""Rows one row-grouped element (``int4x16``, ``int8x16``, ``int6x16``, ``bfloat16x16``)
interleaves (the module docstring)."""
INT4X16_DTYPE = np.dtype((np.void, GROUP_ROWS * GROUP_SIZE // 2))
"""The codes of one ``int4x16`` element: a block of 32 inputs of 16 rows, 256 bytes."""
INT8X16_DTYPE = np.dtype((np.void, GROUP_ROWS * GROUP_SIZE))
"""The codes of one ``int8x16`` element: a block of 32 inputs of 16 rows, 512 bytes."""
INT6X16_DTYPE = np.dtype((np.void, GROUP_ROWS * 24))
"""The codes of one ``int6x16`` element: a block of 32 inputs of 16 rows, 384 bytes (each
row's block 24: 16 of nibbles, 8 of top bits)."""
BF16X16_DTYPE = np.dtype([("bfloat16x16", np.void, GROUP_ROWS * GROUP_SIZE * 2)])
"""The weights of one ``bfloat16x16`` element: a block of 32 inputs of 16 rows, 1024 bytes."""
GROUPED = {
    "int4": "int4x16",
    "int8": "int8x16",
    "int6": "int6x16",
    "bfloat16": "bfloat16x16",
}
"""The row-grouped format of each format ``group_rows`` takes."""
UNGROUPED = {grouped: fmt for fmt, grouped in GROUPED.items()}
"""The format each row-grouped one holds, row by row (``ungroup_rows``)."""
GROUPED_DTYPES = {
    "int4x16": INT4X16_DTYPE,
    "int8x16": INT8X16_DTYPE,
    "int6x16": INT6X16_DTYPE,
    "bfloat16x16": BF16X16_DTYPE,
}
WEIGHTS_PER_ELEMENT = {
    "int4": 2,
    "int6": INT6_PAIR,
    **dict.fromkeys(GROUPED_DTYPES, GROUP_ROWS * GROUP_SIZE),
}
"""Weights one stored element holds, for the formats where it is not one."""
ROWS_PER_ELEMENT = dict.fromkeys(GROUPED_DTYPES, GROUP_ROWS)
"""Rows (output channels) one stored element spans, for the formats where it is not one."""


def weight_format(weight: np.ndarray) -> str:
    """The format a weight array stores, from its dtype (``WEIGHT_FORMATS``).

    ``uint16`` and ``ml_dtypes.bfloat16`` are both bfloat16 (bit patterns), ``uint8`` is
    int4 (two packed codes a byte), ``INT4X16_DTYPE`` int4x16, ``INT8X16_DTYPE`` int8x16,
    ``INT6X16_DTYPE`` int6x16 and ``BF16X16_DTYPE`` bfloat16x16 (a block of 16 rows an
    element), ``INT6_DTYPE`` int6 (64 codes an element); ``TypeError`` for any other dtype."""
    dtype = np.asarray(weight).dtype
    if dtype == np.float32:
        return "float32"
    if dtype == np.uint16 or (ml_dtypes is not None and dtype == ml_dtypes.bfloat16):
        return "bfloat16"
    if dtype == np.float16:
        return "float16"
    if dtype == np.int8:
        return "int8"
    if dtype == np.uint8:
        return "int4"
    if dtype == INT6_DTYPE:
        return "int6"
    if dtype == INT4X16_DTYPE:
        return "int4x16"
    if dtype == INT8X16_DTYPE:
        return "int8x16"
    if dtype == INT6X16_DTYPE:
        return "int6x16"
    if dtype == BF16X16_DTYPE:
        return "bfloat16x16"
    raise TypeError(
        f"a weight must be float32, bfloat16 (uint16 bits or ml_dtypes.bfloat16), float16, "
        f"int8 (with scales), int8x16 (INT8X16_DTYPE codes, with scales), int4 (uint8 codes, "
        f"with scales), int4x16 (INT4X16_DTYPE codes, with scales), int6 (INT6_DTYPE codes, "
        f"with scales), int6x16 (INT6X16_DTYPE codes, with scales) or bfloat16x16 "
        f"(BF16X16_DTYPE), got dtype {dtype}"
    )


def input_size(weight: np.ndarray) -> int:
    """``K``, the inputs per row of a stored weight: its columns, twice them for int4 (two
    4-bit codes a byte), 32 times them for the row-grouped formats (a block an element), 64
    times them for int6 (a pair of blocks an element)."""
    fmt = weight_format(weight)
    return weight.shape[1] * WEIGHTS_PER_ELEMENT.get(fmt, 1) // ROWS_PER_ELEMENT.get(fmt, 1)


def output_size(weight: np.ndarray) -> int:
    """``N``, the rows (output channels) of a stored weight: its rows, 16 times them for the
    row-grouped formats."""
    return weight.shape[0] * ROWS_PER_ELEMENT.get(weight_format(weight), 1)


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


def _int8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``w (N, K)`` in blocks of ``GROUP_SIZE`` (the last one padded with zeros,
    which never raise a maximum) and each block's float32 step ``max|w| / 127``."""
    n, k = w.shape
    groups = num_groups(k)
    padded = np.zeros((n, groups * GROUP_SIZE), dtype=np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, groups, GROUP_SIZE)
    return blocks, (np.max(np.abs(blocks), axis=2) / np.float32(127)).astype(np.float32)


def _unblocked(q: np.ndarray, k: int) -> np.ndarray:
    """Codes ``(N, groups, GROUP_SIZE)`` -> ``(N, K)`` int8, the padding cut off."""
    n, groups, size = q.shape
    return np.ascontiguousarray(q.astype(np.int8).reshape(n, groups * size)[:, :k])


def _reciprocal(d: np.ndarray) -> np.ndarray:
    """``1 / d`` in float32, as llama.cpp's Q8_0 and Q4_0 quantizers multiply by it (their
    ``id``), with 0 where ``d`` is 0 (a block of zeros: llama.cpp's ``id = 0``) and where
    ``1 / d`` overflows (|d| under 2.9e-39, where llama.cpp's conversion of infinity to a code
    is undefined): such a block's float16 scale is 0 whatever its codes, so the codes this
    gives (0 for int8, 8 for int4) store the same zeros."""
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.float32(1) / d
    inverse[~np.isfinite(inverse)] = 0
    return inverse


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float weight ``(N, K)`` to int8, llama.cpp's Q8_0: ``(q, scales)``, see the
    module docstring.

    Every step is llama.cpp's reference quantizer (``quantize_row_q8_0_ref``) in the same
    float32 arithmetic: per row and group of ``GROUP_SIZE`` inputs ``d = max|w| / 127``, its
    reciprocal (``_reciprocal``: 0 for a group of zeros or of values too tiny for ``1 / d`` to
    be a float32, whose codes are then 0), ``q = roundf(w * (1 / d))`` (halves away from
    zero), and only then ``d`` rounded to float16 for storage.
    ``dequantize_int8(q, scales)`` is then within ``d / 2`` of ``w``, plus the scale's
    rounding. ``ValueError`` for NaN or infinite weights (no scale represents them) and for a
    group whose scale overflows float16 (``max|w| >= 8,321,040``, where llama.cpp would store
    an infinite scale).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_int8 needs a 2-D weight (N, K), got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_int8: the weight holds NaN or infinite values")
    blocks, d = _int8_blocks(w)
    scaled = blocks * _reciprocal(d)[:, :, None]
    # roundf (halves away from zero), in exact steps: |scaled| + 0.5 could round up in float32
    # (0.49999997 + 0.5 is 1). |scaled| <= 127 after the float32 product, so no clip.
    magnitude = np.abs(scaled)
    whole = np.floor(magnitude)
    q = np.copysign(whole + np.floor(2 * (magnitude - whole)), scaled)
    with np.errstate(over="ignore"):  # reported below, by name
        scales = d.astype(np.float16)
    if np.isinf(scales).any():
        raise ValueError(
            f"quantize_int8: a group's scale overflows float16 (largest magnitude "
            f"{float(np.max(np.abs(w))):.6g} >= {127 * 65520}); use bfloat16 or float32"
        )
    return _unblocked(q, w.shape[1]), np.ascontiguousarray(scales)


def quantize_activation(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round the rows of an activation ``x (M, K)`` to int8 blocks: ``(q, scales)``: per
    block of 32 inputs, scale ``max|x| / 127`` (float32), codes ``rint(x / scale)`` (ties to
    even, as llama.cpp's vectorized ``quantize_row_q8_0`` rounds activations) in
    ``[-127, 127]``, a block of zeros scale 0 and codes 0; the kernels' ``quantize_row``
    mirrors it bit for bit. The scale kept is that float32 scale rounded to float16
    (``half_rounded``), and a block holding NaN or infinity gets scale NaN and codes 0
    instead of an error: the products it enters are NaN (see "Activations with int8, int4 and int6
    weights" above)."""
    x = np.asarray(x, dtype=np.float32)
    finite = np.isfinite(x)
    all_finite = bool(finite.all())
    blocks, scales = _int8_blocks(x if all_finite else np.where(finite, x, np.float32(0)))
    safe = np.where(scales == 0, np.float32(1), scales)
    q = _unblocked(np.clip(np.rint(blocks / safe[:, :, None]), -127, 127), x.shape[1])
    scales = half_rounded(scales)
    if all_finite:
        return q, scales
    broken = ~np.pad(finite, ((0, 0), (0, -x.shape[1] % GROUP_SIZE)), constant_values=True)
    broken = broken.reshape(x.shape[0], -1, GROUP_SIZE).any(axis=2)
    scales[broken] = np.nan
    q[np.repeat(broken, GROUP_SIZE, axis=1)[:, : x.shape[1]]] = 0
    return q, scales


FLOAT16_NORMAL_RANGE = (np.float32(2.0**-14), np.float32(65520))
"""The float32 scales float16 holds as normal numbers, ``[low, high)``: below, a half keeps
fewer bits (and under 2^-24 none), from ``high`` up it is infinite."""


def half_rounded(scales: np.ndarray) -> np.ndarray:
    """Activation block scales rounded to the nearest float16 (ties to even), as float32:
    what llama.cpp stores in each ``block_q8_0`` of the activation (``quantize_row_q8_0``'s
    ``GGML_FP32_TO_FP16(d)``) and multiplies by; the codes were made with the float32 scale,
    as llama.cpp's are. So a product of a Q8_0 or Q4_0 weight is llama.cpp's, bit for bit in
    its inputs; the rounding moves a scale by at most 2^-11 of itself. Only scales in
    float16's normal range (``FLOAT16_NORMAL_RANGE``) are rounded: a tinier one (a block
    whose largest value is under 0.0078) would lose bits, or become 0, and a huger one
    (past 8.3 million) infinity, where llama.cpp's do -- mie keeps those float32."""
    low, high = FLOAT16_NORMAL_RANGE
    rounded = (scales >= low) & (scales < high)
    with np.errstate(over="ignore"):  # the halves of the scales kept float32 are not used
        halves = scales.astype(np.float16).astype(np.float32)
    return np.where(rounded, halves, scales)


def dequantize_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int8 codes ``(N, K)`` and their scales ``(N, ceil(K/32))`` -> float32 ``q * scale``
    (what ``gguf.quants.dequantize`` gives for the same Q8_0 blocks)."""
    _check_scales(q, scales)
    return _dequantize_blocks(q, scales)


def dequantize_activation(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``quantize_activation``'s codes ``(M, K)`` and float32 scales -> float32 ``q * scale``."""
    return _dequantize_blocks(q, scales)


def _dequantize_blocks(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Codes ``(N, K)`` times their block's scale (either width), as float32."""
    per_input = np.repeat(scales.astype(np.float32), GROUP_SIZE, axis=1)[:, : q.shape[1]]
    return q.astype(np.float32) * per_input


INT4_BLOCK_BYTES = GROUP_SIZE // 2
"""Bytes of packed codes per block of 32 int4 weights (plus a 2-byte float16 scale): byte j
holds input j and input j + 16."""


def offset_codes(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0's rule at ``bits`` bits: ``(codes, scales)`` of a float weight ``(N, K)``, ``K``
    a multiple of 32, the codes unpacked ``uint8 (N, K / 32, 32)`` in ``[0, 2^bits - 1]``,
    the scales ``float16 (N, K / 32)``.

    Every step is llama.cpp's reference quantizer (``quantize_row_q4_0_ref``, and at 5 bits
    ``quantize_row_q5_0_ref``) in the same float32 arithmetic, with ``h = 2^(bits - 1)``: per
    block, ``m`` its value of largest magnitude with its sign (the first on a tie), the scale
    ``d = m / -h`` and its reciprocal in float32, the codes ``min(2h - 1, trunc(w * (1 / d) +
    h + 0.5))`` from that float32 ``d`` (only then is ``d`` rounded to float16 for storage); a
    block of zeros gets ``d = 0`` and every code ``h`` (so does a block too small for
    ``1 / d`` to be a float32, whose float16 scale is 0 all the same). The weight is then
    ``(c - h) * d``: ``m`` itself exactly (code 0). ``ValueError`` for NaN or infinite
    weights and for a block whose scale would overflow float16 (``|m| >= h * 65520``).
    """
    n, k = w.shape
    if not np.isfinite(w).all():
        raise ValueError("the weight holds NaN or infinite values")
    half = 1 << (bits - 1)
    blocks = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[:, :, None], axis=2)
    d = largest / np.float32(-half)
    codes = np.trunc(blocks * _reciprocal(d) + np.float32(half + 0.5))
    codes = np.minimum(codes, 2 * half - 1).astype(np.uint8)
    with np.errstate(over="ignore"):  # reported below, by name
        scales = d[:, :, 0].astype(np.float16)
    if np.isinf(scales).any():
        raise ValueError(
            f"a block's scale overflows float16 (largest magnitude "
            f"{float(np.max(np.abs(w))):.6g} >= {half * 65520}); use int8"
        )
    return codes, np.ascontiguousarray(scales)


def _offset_blocks(
    w: np.ndarray, name: str, bits: int, multiple: int, layout: str
) -> tuple[np.ndarray, np.ndarray]:
    """``offset_codes(w, bits)`` of a 2-D weight whose ``K`` is a multiple of ``multiple``,
    every ``ValueError`` naming the quantizer ``name``."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"{name} needs a 2-D weight (N, K), got shape {w.shape}")
    if w.shape[1] % multiple:
        raise ValueError(
            f"{name}: K = {w.shape[1]} inputs per row is not a multiple of {multiple} "
            f"({layout}); store this matrix as int8"
        )
    try:
        return offset_codes(w, bits)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _packed_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``(N, blocks, 32)`` packed as Q4_0 packs them, ``uint8 (N, blocks * 16)``:
    within a block, byte ``j`` holds input ``j`` in its low nibble and ``j + 16`` in its high."""
    low, high = codes[:, :, :INT4_BLOCK_BYTES], codes[:, :, INT4_BLOCK_BYTES:]
    n, blocks, _ = codes.shape
    return (low | (high << np.uint8(4))).reshape(n, blocks * INT4_BLOCK_BYTES)


def quantize_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float weight ``(N, K)`` to int4, llama.cpp's Q4_0: ``(codes, scales)``.

    See the module docstring for the scheme and the layout, and ``offset_codes`` (at 4 bits)
    for the rounding, llama.cpp's ``quantize_row_q4_0_ref``. ``ValueError`` when ``K`` is not
    a multiple of 32, for NaN or infinite weights, and for a block whose scale would
    overflow float16 (``|m| >= 524,160``, where llama.cpp would store an infinite scale).
    """
    codes, scales = _offset_blocks(
        w, "quantize_int4", 4, GROUP_SIZE, "Q4_0 rows are whole blocks of 32"
    )
    return np.ascontiguousarray(_packed_nibbles(codes)), scales


def int4_codes(codes: np.ndarray) -> np.ndarray:
    """Packed int4 codes ``(N, K / 2)`` -> their signed values ``code - 8`` as int8 ``(N, K)``,
    unpacked in input order (a block's 16 low nibbles, then its 16 high ones)."""
    n, width = codes.shape
    blocks = codes.reshape(n, width // INT4_BLOCK_BYTES, INT4_BLOCK_BYTES)
    unpacked = np.concatenate([blocks & np.uint8(0x0F), blocks >> np.uint8(4)], axis=2)
    return (unpacked.astype(np.int8) - np.int8(8)).reshape(n, 2 * width)


def dequantize_int4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int4 codes ``(N, K/2)`` and float16 scales ``(N, K/32)`` -> float32 ``(code - 8) * d``
    ``(N, K)`` (what ``gguf.quants.dequantize`` gives for the same Q4_0 blocks)."""
    _check_scales(codes, scales)
    return _dequantize_blocks(int4_codes(codes), scales)


def group_rows(
    codes: np.ndarray, scales: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """int4 codes ``(N, K / 2)``, int8 codes ``(N, K)`` or int6 codes ``(N, K / 64)``, with
    their scales ``(N, K / 32)``, or a bfloat16 weight ``(N, K)`` (no scales), -> the same
    matrix 16 rows interleaved, int4x16, int8x16, int6x16 or bfloat16x16: codes
    ``(N / 16, K / 32)`` (``GROUPED_DTYPES``), scales float16 ``(N / 16, K / 2)`` (None for
    bfloat16).

    Each row's block is first its *record* (``_block_records``: int4's 16 bytes, int8's 32,
    int6's 24, bfloat16's 64), read as chunks of 4 bytes. Element ``(g, b)`` holds block
    ``b`` of rows ``16 g .. 16 g + 15``: byte ``64 c + 4 r + t`` is byte ``4 c + t`` of row
    ``16 g + r``'s record (int4 and int6: nibble byte ``4 c + t``, inputs ``4 c + t`` and
    ``16 + 4 c + t``, low and high nibble, for ``c < 4``; int8: input ``4 c + t``;
    bfloat16: inputs ``2 c`` and ``2 c + 1``), and the scales' ``16 b + r`` is that block's
    scale. ``ValueError`` unless ``N`` is a multiple of 16 and the rows whole blocks of 32
    inputs."""
    fmt = weight_format(codes)
    if fmt not in GROUPED:
        raise ValueError(
            f"group_rows takes int4 (uint8), int8, int6 or bfloat16 weights, got {codes.dtype}"
        )
    _check_widen(codes, scales)
    n = codes.shape[0]
    if n % GROUP_ROWS:
        raise ValueError(f"{GROUPED[fmt]} groups whole sets of {GROUP_ROWS} rows, got {n} rows")
    if input_size(codes) % GROUP_SIZE:
        raise ValueError(
            f"{GROUPED[fmt]} takes whole blocks of {GROUP_SIZE} inputs, got K = {input_size(codes)}"
        )
    groups, blocks = n // GROUP_ROWS, num_groups(input_size(codes))
    dtype = GROUPED_DTYPES[GROUPED[fmt]]
    records = _block_records(fmt, codes)
    chunks = records.shape[2] // 4  # 4 bytes of each row per 64-byte chunk
    laid = records.reshape(groups, GROUP_ROWS, blocks, chunks, 4).transpose(0, 2, 3, 1, 4)
    grouped = np.ascontiguousarray(laid).reshape(groups, blocks * dtype.itemsize)
    if scales is None:
        return grouped.view(dtype), None
    grouped_scales = scales.reshape(groups, GROUP_ROWS, blocks).transpose(0, 2, 1)
    return (
        grouped.view(dtype),
        np.ascontiguousarray(grouped_scales).reshape(groups, blocks * GROUP_ROWS),
    )


def ungroup_rows(
    codes: np.ndarray, scales: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``group_rows``'s inverse: int4x16, int8x16 or int6x16 codes and scales -> int4 codes
    ``(N, K / 2)``, int8 codes ``(N, K)`` or int6 codes ``(N, K / 64)``, and scales
    ``(N, K / 32)``; a bfloat16x16 weight -> bfloat16 ``(N, K)`` (``uint16`` bits), and
    None."""
    fmt = _check_widen(codes, scales)
    groups, blocks = codes.shape
    laid = _grouped_records(codes).transpose(0, 3, 1, 2, 4)  # (group, row, block, chunk, 4)
    n = groups * GROUP_ROWS
    records = np.ascontiguousarray(laid).reshape(n, blocks, codes.dtype.itemsize // GROUP_ROWS)
    rows = _from_block_records(UNGROUPED[fmt], records)
    if scales is None:
        return rows, None
    row_scales = scales.reshape(groups, blocks, GROUP_ROWS).transpose(0, 2, 1)
    return rows, np.ascontiguousarray(row_scales).reshape(n, blocks)


def _grouped_records(weight: np.ndarray) -> np.ndarray:
    """A row-grouped weight's bytes as ``uint8 (groups, blocks, chunks, 16, 4)``: element
    ``(g, b)``'s chunk ``c``, row ``r``'s 4 bytes (``group_rows``)."""
    groups, blocks = weight.shape
    chunks = weight.dtype.itemsize // (GROUP_ROWS * 4)
    raw = np.ascontiguousarray(weight).view(np.uint8)
    return raw.reshape(groups, blocks, chunks, GROUP_ROWS, 4)


def gather_rows(weight: np.ndarray, scales: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (1-D integers) of a stored weight as float32 ``(len(ids), K)``: the
    embedding lookup. A row-grouped weight gives each row's bytes back from its group (4 of
    every 64), so a lookup costs its own rows whatever the format."""
    ids = np.asarray(ids)
    fmt = weight_format(weight)
    if fmt not in UNGROUPED:
        return widen(weight[ids], None if scales is None else scales[ids])
    _check_widen(weight, scales)
    groups, blocks = weight.shape
    group, row = ids // GROUP_ROWS, ids % GROUP_ROWS
    record = weight.dtype.itemsize // GROUP_ROWS  # each row's bytes of an element
    records = _grouped_records(weight)[group, :, :, row].reshape(len(ids), blocks, record)
    if scales is None:  # bfloat16: the values themselves
        return widen(_from_block_records(UNGROUPED[fmt], records))
    row_scales = scales.reshape(groups, blocks, GROUP_ROWS)[group, :, row]
    if fmt == "int6x16":  # the values straight from the records: half the time of int6's storage
        codes = _int6_record_codes(records).reshape(len(ids), blocks * GROUP_SIZE)
        values = codes.view(np.int8) - np.int8(32)
        return _dequantize_blocks(values, row_scales)
    return widen(_from_block_records(UNGROUPED[fmt], records), np.ascontiguousarray(row_scales))


def _block_records(fmt: str, codes: np.ndarray) -> np.ndarray:
    """Each row's blocks as ``group_rows`` lays them out, ``uint8 (N, K / 32, bytes)``: int4's
    16 packed bytes, int8's 32 codes and bfloat16's 64 bytes as they are; an int6 block as
    24 bytes -- its low nibbles packed as int4 packs them, then 8 bytes of top bits, byte
    ``4 h + t`` holding those of inputs ``8 h + t``, ``16 + 8 h + t``, ``8 h + 4 + t`` and
    ``20 + 8 h + t`` in its bits 0-1, 2-3, 4-5 and 6-7: so the top bits of the nibbles in
    4-byte chunk ``c`` sit at bits ``4 (c % 2)`` (low nibbles) and ``4 (c % 2) + 2`` (high
    ones) of chunk ``4 + c // 2``, the same byte of the row."""
    n, blocks = codes.shape[0], num_groups(input_size(codes))
    if fmt == "bfloat16":
        return np.ascontiguousarray(codes).view(np.uint8).reshape(n, blocks, 2 * GROUP_SIZE)
    if fmt != "int6":
        return codes.view(np.uint8).reshape(n, blocks, GROUP_SIZE // (2 if fmt == "int4" else 1))
    values = (int6_codes(codes) + np.int8(32)).view(np.uint8).reshape(n, blocks, GROUP_SIZE)
    nibbles = _packed_nibbles(values & np.uint8(0x0F)).reshape(n, blocks, INT4_BLOCK_BYTES)
    top = values >> np.uint8(4)
    low = top[:, :, :INT4_BLOCK_BYTES].reshape(n, blocks, 2, 2, 4)  # (h, c % 2, t)
    high = top[:, :, INT4_BLOCK_BYTES:].reshape(n, blocks, 2, 2, 4)
    top_bytes = (
        low[:, :, :, 0] | (high[:, :, :, 0] << 2) | (low[:, :, :, 1] << 4) | (high[:, :, :, 1] << 6)
    )
    return np.concatenate([nibbles, top_bytes.reshape(n, blocks, 8)], axis=2)


def _from_block_records(fmt: str, records: np.ndarray) -> np.ndarray:
    """``_block_records``' inverse: the codes of ``fmt`` (int4, int8 or int6), or the
    bfloat16 weight (``uint16`` bits)."""
    n, blocks, size = records.shape
    if fmt == "bfloat16":
        return np.ascontiguousarray(records).reshape(n, blocks * size).view(np.uint16)
    if fmt == "int4":
        return records.reshape(n, blocks * size)
    if fmt == "int8":
        return records.reshape(n, blocks * size).view(np.int8)
    return _int6_stored(_int6_record_codes(records))


def _int6_record_codes(records: np.ndarray) -> np.ndarray:
    """int6 block records ``(N, K / 32, 24)`` -> their codes ``uint8 (N, K / 32, 32)`` in
    ``[0, 63]``, in input order."""
    n, blocks, _ = records.shape
    nibbles, top_bytes = records[:, :, :INT4_BLOCK_BYTES], records[:, :, INT4_BLOCK_BYTES:]
    top_bytes = top_bytes.reshape(n, blocks, 2, 1, 4)
    low = np.concatenate([(top_bytes >> 0) & 3, (top_bytes >> 4) & 3], axis=3)
    high = np.concatenate([(top_bytes >> 2) & 3, (top_bytes >> 6) & 3], axis=3)
    return np.concatenate(
        [
            (nibbles & np.uint8(0x0F)) | (low.reshape(n, blocks, INT4_BLOCK_BYTES) << np.uint8(4)),
            (nibbles >> np.uint8(4)) | (high.reshape(n, blocks, INT4_BLOCK_BYTES) << np.uint8(4)),
        ],
        axis=2,
    )


def quantize_int6(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float weight ``(N, K)`` to int6, mie's own format: ``(codes, scales)``.

    ``offset_codes`` at 6 bits, stored as the module docstring lays it out: per pair of
    blocks the low nibbles as ``quantize_int4`` packs them, then the top bits. ``ValueError``
    when ``K`` is not a multiple of 64 (whole pairs of blocks), for NaN or infinite weights,
    and for a block whose scale would overflow float16 (``|m| >= 2,096,640``).
    """
    codes, scales = _offset_blocks(
        w, "quantize_int6", 6, INT6_PAIR, "int6 rows are whole pairs of blocks"
    )
    return _int6_stored(codes), scales


def _int6_stored(codes: np.ndarray) -> np.ndarray:
    """6-bit codes ``uint8 (N, K / 32, 32)`` in ``[0, 63]`` -> int6's storage ``(N, K / 64)``
    (``INT6_DTYPE``): per pair of blocks the low nibbles as ``quantize_int4`` packs them, then
    the top bits (the module docstring)."""
    n, pairs = codes.shape[0], codes.shape[1] // 2
    nibbles = _packed_nibbles(codes & np.uint8(0x0F)).reshape(n, pairs, 2 * INT4_BLOCK_BYTES)
    top = (codes >> np.uint8(4)).reshape(n, pairs, INT6_PAIR)  # a pair's in input order
    quarters = [top[:, :, q * INT4_BLOCK_BYTES : (q + 1) * INT4_BLOCK_BYTES] for q in range(4)]
    top_bits = quarters[0] | (quarters[2] << 2) | (quarters[1] << 4) | (quarters[3] << 6)
    stored = np.concatenate([nibbles, top_bits], axis=2)
    return np.ascontiguousarray(stored).view(INT6_DTYPE).reshape(n, pairs)


def int6_codes(codes: np.ndarray) -> np.ndarray:
    """Stored int6 codes ``(N, K / 64)`` -> their signed values ``code - 32`` as int8
    ``(N, K)``, in input order: the nibbles read as int4's, plus 16 times the top bits."""
    n, pairs = codes.shape
    raw = np.ascontiguousarray(codes).view(np.uint8).reshape(n, pairs, 48)
    nibble_bytes = raw[:, :, : 2 * INT4_BLOCK_BYTES].reshape(n, pairs * 2 * INT4_BLOCK_BYTES)
    low = (int4_codes(nibble_bytes) + np.int8(8)).reshape(n, pairs, INT6_PAIR)
    top_bits = raw[:, :, 2 * INT4_BLOCK_BYTES :]  # inputs p, 32 + p, 16 + p, 48 + p from bit 0
    top = np.concatenate([(top_bits >> shift) & np.uint8(3) for shift in (0, 4, 2, 6)], axis=2)
    values = low + (top << np.uint8(4)).astype(np.int8) - np.int8(32)
    return values.reshape(n, pairs * INT6_PAIR)


def dequantize_int6(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """int6 codes ``(N, K / 64)`` and float16 scales ``(N, K / 32)`` -> float32
    ``(code - 32) * d`` ``(N, K)``."""
    _check_scales(codes, scales)
    return _dequantize_blocks(int6_codes(codes), scales)


def widen(weight: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """Any stored weight -> its float32 values ``(N, K)`` (a copy for 16, 8 and 4 bits)."""
    fmt = _check_widen(weight, scales)
    if fmt == "float32":
        return weight
    if fmt == "bfloat16":
        return bfloat16_to_float32(weight)
    if fmt == "float16":
        return weight.astype(np.float32)
    if fmt == "int4":
        return dequantize_int4(weight, scales)
    if fmt == "bfloat16x16":
        return bfloat16_to_float32(ungroup_rows(weight)[0])
    if fmt == "int4x16":
        return dequantize_int4(*ungroup_rows(weight, scales))
    if fmt == "int8x16":
        return dequantize_int8(*ungroup_rows(weight, scales))
    if fmt == "int6x16":
        return dequantize_int6(*ungroup_rows(weight, scales))
    if fmt == "int6":
        return dequantize_int6(weight, scales)
    return dequantize_int8(weight, scales)


def _check_widen(weight: np.ndarray, scales: np.ndarray | None) -> str:
    """Validate a stored weight (2-D, a known dtype, scales iff int8, int4 or int6); return
    its format."""
    if not isinstance(weight, np.ndarray) or weight.ndim != 2:
        raise ValueError(
            f"a weight must be a 2-D array (N, K), got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )
    fmt = weight_format(weight)
    if fmt in QUANTIZED_FORMATS:
        _check_scales(weight, scales)
    elif scales is not None:
        raise ValueError(
            f"scales belong to int8, int8x16, int4, int4x16, int6 and int6x16 weights, not {fmt}"
        )
    return fmt


# --- the product -------------------------------------------------------------------------------


def _check_scales(q: np.ndarray, scales: np.ndarray | None) -> None:
    """int8 weights take float16 scales ``(N, ceil(K / 32))``; int4 codes ``(N, K / 2)`` and
    int6 codes ``(N, K / 64)`` take float16 ones ``(N, K / 32)`` too, and int4's ``K`` must
    be whole blocks; int4x16 and int8x16 codes ``(N / 16, K / 32)`` take ``(N / 16, K / 2)``,
    each element's 16 rows' scales."""
    fmt = weight_format(q)
    if scales is None:
        raise ValueError(f"an {fmt} weight needs its scales (N, ceil(K / 32)) float16")
    if not isinstance(scales, np.ndarray) or scales.dtype != np.float16:
        raise TypeError(
            f"{fmt} scales must be a float16 array, got "
            f"{type(scales).__name__} {getattr(scales, 'dtype', '')}".rstrip()
        )
    if fmt == "int4" and q.shape[1] % INT4_BLOCK_BYTES:
        raise ValueError(
            f"int4 codes (N, K / 2) must hold whole blocks of {INT4_BLOCK_BYTES} bytes "
            f"({GROUP_SIZE} inputs), got shape {q.shape}"
        )
    expected = (q.shape[0], ROWS_PER_ELEMENT.get(fmt, 1) * num_groups(input_size(q)))
    if scales.shape != expected:
        raise ValueError(
            f"{fmt} scales for a weight of shape {q.shape} must have shape {expected} "
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
    k = input_size(weight)
    if x.shape[1] != k:
        raise ValueError(
            f"matmul: x has {x.shape[1]} inputs per row but the weight (N, K) = "
            f"{(output_size(weight), k)} takes {k}"
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

    The weight's dtype picks the format (``weight_format``); int8, int4 and int6 weights need
    their ``scales``, and round ``x`` to int8 blocks first (``quantize_activation``). The
    result goes to ``out`` when given (float32, C-contiguous, ``(M, N)``), else to a new
    array. The reference widens the whole weight, then lets BLAS multiply in float32.
    """
    x, fmt = _check_matmul(x, weight, scales)
    _check_out(out, x.shape[0], output_size(weight))
    if fmt in QUANTIZED_FORMATS:
        x = dequantize_activation(*quantize_activation(x))
    result = np.ascontiguousarray(x @ widen(weight, scales).T, dtype=np.float32)
    if out is None:
        return result
    out[...] = result
    return out


def stream_read(words: np.ndarray) -> int:
    """Read every byte of ``words`` (a C-contiguous 1-D uint64 array) once, front to back, and
    return the xor of its words (0 for none).

    The memory roofline's probe: a batch-1 product reads each weight byte once, in order, as
    this does with next to no arithmetic, so the rate this reads an array larger than the
    caches at is the most such a product can reach (``python -m mie.bench.throughput
    --breakdown`` times it beside the products, at the same moment, rather than trusting a
    figure measured on another day). The xor makes every word count, so no read can be left
    out."""
    _check_words(words)
    return int(np.bitwise_xor.reduce(words)) if words.size else 0


def _check_words(words: np.ndarray) -> None:
    """``stream_read``'s argument: a C-contiguous 1-D uint64 array."""
    if not isinstance(words, np.ndarray) or words.dtype != np.uint64 or words.ndim != 1:
        raise TypeError(
            f"stream_read needs a 1-D uint64 array, got {type(words).__name__} "
            f"{getattr(words, 'dtype', '')} {getattr(words, 'shape', '')}".rstrip()
        )
    if not words.flags.c_contiguous:
        raise ValueError("stream_read needs a C-contiguous array")
