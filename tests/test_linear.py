"""The reference for reduced-precision matrix products (mie.linear), against independent oracles.

bfloat16 rounding against ``ml_dtypes`` (its own implementation), widening against
``ml_dtypes`` / NumPy's float16, the product against a float64 computation, int8 quantization
against its defining bounds (round-trip error at most half a step, the largest |q| of every
group 127, each group's scale from that group alone), and every bad argument's exception.
"""

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import linear

# --- bfloat16 and float16 conversions --------------------------------------------------------


@settings(max_examples=200)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_to_bfloat16_matches_ml_dtypes_on_any_float32(bit_patterns):
    """Every float32 class (subnormal, huge, inf, NaN, ties) rounds as ml_dtypes rounds it."""
    w = np.array(bit_patterns, dtype=np.uint32).view(np.float32)
    ours = linear.to_bfloat16(w)
    theirs = w.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(w)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(linear.bfloat16_to_float32(ours[nan])).all()  # a NaN stays a NaN


def test_to_bfloat16_rounds_ties_to_even():
    # 1 + 2^-8 lies halfway between bfloat16 1 and 1 + 2^-7: the even one (1) wins;
    # 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: the even one (1 + 2^-6) wins.
    w = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=np.float32)
    widened = linear.bfloat16_to_float32(linear.to_bfloat16(w))
    np.testing.assert_array_equal(widened, np.array([1, 1 + 2**-6, -1], dtype=np.float32))


def test_nan_with_full_payload_stays_nan():
    """0xFFFFFFFF plus the rounding increment would wrap to zero without the NaN guard."""
    w = np.array([0xFFFFFFFF, 0x7FFFFFFF, 0x7F800001], dtype=np.uint32).view(np.float32)
    assert np.isnan(linear.bfloat16_to_float32(linear.to_bfloat16(w))).all()


@settings(max_examples=100)
@given(st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=64))
def test_bfloat16_widening_is_exact(bits):
    """Widening any bit pattern gives ml_dtypes' value, and rounding it back gives the bits."""
    bits = np.array(bits, dtype=np.uint16)
    widened = linear.bfloat16_to_float32(bits)
    theirs = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(widened.view(np.uint32), theirs.view(np.uint32))
    finite = ~np.isnan(widened)
    np.testing.assert_array_equal(linear.to_bfloat16(widened)[finite], bits[finite])


def test_to_float16_refuses_overflow_and_keeps_what_fits():
    assert linear.to_float16(np.array([65504.0, -65504.0, 1e-8], np.float32)).dtype == np.float16
    with pytest.raises(ValueError, match=r"1 values overflow float16 \(largest magnitude 70000"):
        linear.to_float16(np.array([1.0, -70000.0], np.float32))
    with pytest.raises(ValueError, match="overflow float16"):
        linear.to_float16(np.array([65520.0], np.float32))  # rounds up to inf
    kept = linear.to_float16(np.array([np.inf, -np.inf, np.nan], np.float32))
    assert np.isinf(kept[:2]).all() and np.isnan(kept[2])  # already non-finite: not an overflow


# --- int8 quantization -----------------------------------------------------------------------


def test_quantize_int8_example_rounds_halves_away_from_zero():
    """A row whose largest magnitude is 127 has scale 1: q is w rounded, halves away from zero
    (llama.cpp's roundf)."""
    w = np.array([[127.0, -63.5, 0.5, 1.5, 2.5, -2.5]], dtype=np.float32)
    q, scales = linear.quantize_int8(w)
    np.testing.assert_array_equal(q, [[127, -64, 1, 2, 3, -3]])
    np.testing.assert_array_equal(scales, [[1.0]])
    assert scales.dtype == np.float16
    np.testing.assert_array_equal(linear.dequantize_int8(q, scales), [[127, -64, 1, 2, 3, -3]])


def test_quantize_int8_just_below_a_half_rounds_down():
    """0.49999997 (the float32 below 0.5) is code 0: adding 0.5 in float32 would give 1."""
    w = np.array([[127.0, np.nextafter(np.float32(0.5), np.float32(0))]], np.float32)
    q, _ = linear.quantize_int8(w)
    np.testing.assert_array_equal(q, [[127, 0]])


weights_2d = st.tuples(st.integers(1, 6), st.integers(1, 100), st.integers(0, 2**32 - 1)).map(
    lambda t: (
        np.random.default_rng(t[2]).standard_normal(t[:2], dtype=np.float32)
        * np.float32(10.0 ** np.random.default_rng(t[2]).integers(-40, 4))
    )
)


@settings(max_examples=100)
@given(weights_2d, st.data())
def test_quantize_int8_round_trip_bounds(w, data):
    # Some groups all zeros, some with a single outlier: both are edge cases of the scale.
    n, k = w.shape
    if data.draw(st.booleans()):
        w[:, : min(k, linear.GROUP_SIZE)] = 0
    if data.draw(st.booleans()):
        w[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, k - 1))] *= 1000
    q, scales = linear.quantize_int8(w)
    groups = linear.num_groups(k)
    assert q.dtype == np.int8 and q.shape == w.shape and q.flags.c_contiguous
    assert scales.dtype == np.float16 and scales.shape == (n, groups)
    assert q.min() >= -127
    # each group's step max|w| / 127, from its own inputs only, computed here in float64
    padded = np.zeros((n, groups * linear.GROUP_SIZE))
    padded[:, :k] = np.abs(w)
    step = padded.reshape(n, groups, linear.GROUP_SIZE).max(axis=2) / 127
    np.testing.assert_allclose(scales.astype(np.float64), step, rtol=2**-11, atol=2**-25)
    step_in = np.repeat(step, linear.GROUP_SIZE, axis=1)[:, :k]
    kept_in = np.repeat(scales.astype(np.float64), linear.GROUP_SIZE, axis=1)[:, :k]
    error = np.abs(linear.dequantize_int8(q, scales).astype(np.float64) - w)
    # Half a step from rounding (plus float32 rounding of w / d), then the stored scale's
    # rounding times the code, then float32 rounding of q * scale.
    bound = step_in * (0.5 + 2**-20) + np.abs(q) * np.abs(kept_in - step_in)
    # where 1 / d is no float32 the codes are 0: the error is |w| itself, at most 127 d
    reciprocal = step * np.finfo(np.float32).max
    tiny_in = np.repeat(reciprocal <= 2, linear.GROUP_SIZE, axis=1)[:, :k]
    bound = np.where(tiny_in, 127 * step_in, bound)
    assert (error <= bound * (1 + 2**-22) + 1e-45).all()
    blocked = np.zeros((n, groups * linear.GROUP_SIZE), np.int8)
    blocked[:, :k] = q
    largest = np.abs(blocked.reshape(n, groups, linear.GROUP_SIZE).astype(int)).max(axis=2)
    # the largest value is code +-127 where 1 / d is a float32; 0 where d is 0 or 1 / d is not
    assert (largest[reciprocal > 2] == 127).all()
    assert (largest[reciprocal < 0.5] == 0).all()


def test_quantize_int8_short_last_group():
    """K = 40: the second group holds 8 inputs and its scale comes from those 8 alone."""
    w = np.zeros((1, 40), np.float32)
    w[0, :32] = 100.0
    w[0, 32:] = np.linspace(-1.27, 0.5, 8, dtype=np.float32)
    q, scales = linear.quantize_int8(w)
    assert scales.shape == (1, 2)
    np.testing.assert_allclose(scales[0].astype(np.float64), [100 / 127, 0.01], rtol=2**-11)
    assert q[0, 32] == -127


@pytest.mark.parametrize(
    "w, error, message",
    [
        (np.ones(4, np.float32), ValueError, "2-D weight"),
        (np.array([[1.0, np.nan]], np.float32), ValueError, "NaN or infinite"),
        (np.array([[1.0, -np.inf]], np.float32), ValueError, "NaN or infinite"),
        (np.array([[1.0, 8.4e6]], np.float32), ValueError, "scale overflows float16"),
    ],
)
def test_quantize_int8_refuses(w, error, message):
    with pytest.raises(error, match=message):
        linear.quantize_int8(w)


# --- the product -----------------------------------------------------------------------------


def stored(fmt: str, w: np.ndarray) -> tuple:
    """``w`` (N, K) float32 in format ``fmt``: the weight arguments of ``matmul``."""
    if fmt == "float32":
        return (w,)
    if fmt == "bfloat16":
        return (linear.to_bfloat16(w),)
    if fmt == "bfloat16x16":
        return linear.group_rows(linear.to_bfloat16(w))
    if fmt == "float16":
        return (w.astype(np.float16),)
    if fmt == "int4":
        return linear.quantize_int4(w)
    if fmt == "int4x16":
        return linear.group_rows(*linear.quantize_int4(w))
    if fmt == "int8x16":
        return linear.group_rows(*linear.quantize_int8(w))
    if fmt == "int6":
        return linear.quantize_int6(w)
    if fmt == "int6x16":
        return linear.group_rows(*linear.quantize_int6(w))
    return linear.quantize_int8(w)


def rounded_activation(x: np.ndarray) -> np.ndarray:
    """``x`` as the int8 and int4 products see it, computed here element by element: per row
    and block of 32 inputs, scale ``s = max|x| / 127`` (float32), each input ``round(x / s)``
    (Python's round: ties to even) times ``s`` -- rounded to a half by Python's own
    ``struct`` where a half holds it as a normal number, [2^-14, 65520) -- in float64."""
    rows = []
    for row in x:
        values = []
        for start in range(0, len(row), 32):
            block = [np.float32(v) for v in row[start : start + 32]]
            scale = np.float32(max(abs(v) for v in block) / np.float32(127))
            kept = float(scale)
            if 2.0**-14 <= kept < 65520:
                kept = struct.unpack("<e", struct.pack("<e", kept))[0]
            values += [round(float(v / scale)) * kept if scale else 0.0 for v in block]
        rows.append(values)
    return np.array(rows, dtype=np.float64).reshape(x.shape)


def test_activation_rounding_example():
    """One block by hand: max |x| = 2.54, so the scale is 0.02; 0.03 / 0.02 = 1.5 rounds to
    2 (ties to even), -0.05 / 0.02 = -2.5 to -2, 0.0099 to 0; the scale kept is 0.02 as a
    float16 holds it (0.0200042724609375), llama.cpp's; a NaN block scale NaN."""
    x = np.zeros((2, 32), dtype=np.float32)
    x[0, :4] = [2.54, 0.03, -0.05, 0.0099]
    x[1, 5] = np.nan
    q, scales = linear.quantize_activation(x)
    assert np.float32(np.float32(2.54) / np.float32(127)) != np.float32(0.0200042724609375)
    assert scales[0, 0] == np.float32(0.0200042724609375)
    assert q[0, :4].tolist() == [127, 2, -2, 0] and not q[0, 4:].any()
    assert np.isnan(scales[1, 0]) and not q[1].any()
    out = linear.matmul(x, *linear.quantize_int8(np.ones((3, 32), dtype=np.float32)))
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()


@settings(max_examples=100)
@given(
    st.sampled_from(linear.WEIGHT_FORMATS),
    st.integers(1, 9),
    st.integers(1, 9),
    st.integers(0, 80),
    st.integers(0, 2**32 - 1),
)
def test_matmul_is_the_float64_product_of_the_widened_weight(fmt, m, n, k, seed):
    rng = np.random.default_rng(seed)
    if fmt in ("int4", "int4x16", "int8x16", "bfloat16x16"):
        k -= k % 32  # whole blocks
    if fmt in ("int4x16", "int8x16", "int6x16", "bfloat16x16"):
        n = 16 * (1 + n % 2)  # whole groups of 16 rows
    if fmt in ("int6", "int6x16"):
        k = 64 * (k % 3)  # whole pairs of blocks: 0, 64 or 128
    x = rng.standard_normal((m, k), dtype=np.float32)
    args = stored(fmt, rng.standard_normal((n, k), dtype=np.float32))
    # Independent widening: ml_dtypes for bfloat16, NumPy for float16, q * s for int8, and
    # for int4 each code unpacked by hand (low nibble of byte j: input j of its block;
    # high nibble: input j + 16), for int6 too (a pair's 48 bytes: the two blocks' nibbles
    # as int4's, then byte 32 + p holds the top bits of inputs p, 32 + p, 16 + p, 48 + p), and
    # for int4x16 (block b of rows 16 g .. 16 g + 15 is one 256-byte element: its byte
    # 64 c + 4 r + t holds row 16 g + r's inputs 4 c + t and 16 + 4 c + t), and for int6x16
    # (a 384-byte element: int4x16's nibbles, then byte 256 + 64 h + 4 r + t holds the top bits
    # of inputs 8 h + t, 16 + 8 h + t, 8 h + 4 + t, 20 + 8 h + t in bits 0-1, 2-3, 4-5, 6-7),
    # and for bfloat16x16 (a 1024-byte element: its 16-bit word 32 c + 2 r + t holds row
    # 16 g + r's input 2 c + t).
    if fmt == "bfloat16":
        wide = args[0].view(ml_dtypes.bfloat16).astype(np.float64)
    elif fmt == "bfloat16x16":
        words = args[0].view(np.uint16)  # (groups, blocks * 512)
        wide = np.array(
            [
                [
                    words[i // 16, j // 32 * 512 + 32 * (j % 32 // 2) + 2 * (i % 16) + j % 2]
                    for j in range(k)
                ]
                for i in range(n)
            ],
            dtype=np.uint16,
        ).reshape(n, k)
        wide = wide.view(ml_dtypes.bfloat16).astype(np.float64)
    elif fmt == "int4":
        codes, s = args
        wide = np.array(
            [
                [
                    ((int(codes[i, j // 32 * 16 + j % 16]) >> (4 * (j % 32 >= 16))) % 16 - 8)
                    * np.float64(s[i, j // 32])
                    for j in range(k)
                ]
                for i in range(n)
            ]
        ).reshape(n, k)
    elif fmt == "int4x16":
        codes, s = args
        raw = codes.view(np.uint8)

        def int4x16(i: int, j: int) -> int:
            g, r, b, u = i // 16, i % 16, j // 32, j % 32
            byte = int(raw[g, b * 256 + 64 * (u % 16 // 4) + 4 * r + u % 4])
            return (byte >> (4 * (u >= 16))) % 16 - 8

        wide = np.array(
            [
                [int4x16(i, j) * np.float64(s[i // 16, j // 32 * 16 + i % 16]) for j in range(k)]
                for i in range(n)
            ]
        ).reshape(n, k)
    elif fmt == "int6x16":
        codes, s = args
        raw = codes.view(np.uint8)

        def int6x16(i: int, j: int) -> int:
            g, r, b, u = i // 16, i % 16, j // 32, j % 32
            element = raw[g, b * 384 : b * 384 + 384]
            nibble = (int(element[64 * (u % 16 // 4) + 4 * r + u % 4]) >> (4 * (u >= 16))) % 16
            h, field = u % 16 // 8, {0: 0, 16: 1, 4: 2, 20: 3}[u - u % 16 // 8 * 8 - u % 4]
            top = (int(element[256 + 64 * h + 4 * r + u % 4]) >> (2 * field)) % 4
            return nibble + 16 * top - 32

        wide = np.array(
            [
                [int6x16(i, j) * np.float64(s[i // 16, j // 32 * 16 + i % 16]) for j in range(k)]
                for i in range(n)
            ]
        ).reshape(n, k)
    elif fmt == "int8x16":  # element (g, b), byte 64 c + 4 r + t: row 16 g + r's input 4 c + t
        codes, s = args
        raw = codes.view(np.int8)
        wide = np.array(
            [
                [
                    int(raw[i // 16, j // 32 * 512 + 64 * (j % 32 // 4) + 4 * (i % 16) + j % 4])
                    * np.float64(s[i // 16, j // 32 * 16 + i % 16])
                    for j in range(k)
                ]
                for i in range(n)
            ]
        ).reshape(n, k)
    elif fmt == "int6":
        codes, s = args
        raw = codes.view(np.uint8)

        def int6(i: int, j: int) -> int:
            pair, u = raw[i, j // 64 * 48 : j // 64 * 48 + 48], j % 64
            nibble = (int(pair[u // 32 * 16 + u % 16]) >> (4 * (u % 32 >= 16))) % 16
            top = (int(pair[32 + u % 16]) >> {0: 0, 32: 2, 16: 4, 48: 6}[u - u % 16]) % 4
            return nibble + 16 * top - 32

        wide = np.array(
            [[int6(i, j) * np.float64(s[i, j // 32]) for j in range(k)] for i in range(n)]
        ).reshape(n, k)
    elif fmt == "int8":
        q, s = args
        wide = np.array(
            [[q[i, j] * np.float64(s[i, j // 32]) for j in range(k)] for i in range(n)]
        ).reshape(n, k)
    else:
        wide = args[0].astype(np.float64)
    # int8 and int4 weights multiply the activation rounded to int8 blocks
    seen = rounded_activation(x) if fmt in linear.QUANTIZED_FORMATS else x.astype(np.float64)
    exact = seen @ wide.T
    got = linear.matmul(x, *args)
    assert got.dtype == np.float32 and got.shape == (m, n) and got.flags.c_contiguous
    bound = np.abs(seen) @ np.abs(wide).T
    assert (np.abs(got - exact) <= 1e-5 * bound).all()


def test_ml_dtypes_bfloat16_and_uint16_bits_are_the_same_weight():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 40), dtype=np.float32)
    bits = linear.to_bfloat16(rng.standard_normal((5, 40), dtype=np.float32))
    np.testing.assert_array_equal(
        linear.matmul(x, bits), linear.matmul(x, bits.view(ml_dtypes.bfloat16))
    )
    assert linear.weight_format(bits.view(ml_dtypes.bfloat16)) == "bfloat16"


def bad_matmul_arguments():
    """(x, weight, scales, exception, message): every kind of bad argument ``matmul`` refuses.

    Also used by tests/test_fast_linear.py: the mirror must refuse them alike.
    """
    x = np.ones((2, 40), np.float32)
    bf = np.zeros((3, 40), np.uint16)
    q = np.zeros((3, 40), np.int8)
    s = np.ones((3, 2), np.float16)
    return [
        (x, np.zeros((3, 40), np.float64), None, TypeError, "dtype float64"),
        (x, np.zeros((3, 40), np.int32), None, TypeError, "dtype int32"),
        (x, np.zeros(40, np.uint16), None, ValueError, r"2-D array \(N, K\)"),
        (x, [[1, 2]], None, ValueError, r"2-D array \(N, K\)"),
        (np.ones(40, np.float32), bf, None, ValueError, r"x must be 2-D \(M, K\)"),
        (np.ones((2, 39), np.float32), bf, None, ValueError, "x has 39 inputs per row"),
        (x.astype(np.complex64), bf, None, TypeError, "real numbers"),
        (x.astype(object), bf, None, TypeError, "real numbers"),
        (x, q, None, ValueError, "needs its scales"),
        (x, q, np.ones((3, 1), np.float16), ValueError, r"must have shape \(3, 2\)"),
        (x, q, np.ones((2, 2), np.float16), ValueError, r"must have shape \(3, 2\)"),
        (x, q, s.astype(np.float32), TypeError, "float16 array, got ndarray float32"),
        (x, q, s.astype(np.float64), TypeError, "float16 array"),
        (x, q, [[1.0, 1.0]] * 3, TypeError, "float16 array"),
        (
            x,
            bf,
            s,
            ValueError,
            "scales belong to int8, int8x16, int4, int4x16, int6 and int6x16 weights, not bfloat16",
        ),
        (x, bf.view(np.float16), s, ValueError, "not float16"),
    ]


def bad_outs():
    """(out, exception, message) for a product of shape (2, 3)."""
    return [
        (np.zeros((2, 3), np.float64), TypeError, "out must be a float32 array"),
        ([[0.0] * 3] * 2, TypeError, "out must be a float32 array"),
        (np.zeros((3, 2), np.float32), ValueError, r"shape \(2, 3\), got shape \(3, 2\)"),
        (np.zeros((3, 2), np.float32).T, ValueError, "not C-contiguous"),
    ]


@pytest.mark.parametrize("x, weight, scales, error, message", bad_matmul_arguments())
def test_matmul_refuses_bad_arguments(x, weight, scales, error, message):
    with pytest.raises(error, match=message):
        linear.matmul(x, weight, scales)


@pytest.mark.parametrize("out, error, message", bad_outs())
def test_matmul_refuses_bad_out(out, error, message):
    with pytest.raises(error, match=message):
        linear.matmul(np.ones((2, 4), np.float32), np.zeros((3, 4), np.float16), out=out)


def test_matmul_writes_out():
    out = np.full((2, 3), np.nan, np.float32)
    w = np.arange(12, dtype=np.float16).reshape(3, 4)
    assert linear.matmul(np.ones((2, 4), np.float32), w, out=out) is out
    np.testing.assert_array_equal(out, [[6, 22, 38], [6, 22, 38]])


def test_widen_refuses_like_matmul():
    with pytest.raises(ValueError, match="needs its scales"):
        linear.widen(np.zeros((2, 2), np.int8))
    with pytest.raises(ValueError, match="scales belong to int8"):
        linear.widen(np.zeros((2, 2), np.float16), np.ones((2, 1), np.float32))


def test_empty_shapes():
    q, s = linear.quantize_int8(np.zeros((4, 0), np.float32))
    assert q.shape == (4, 0) and s.shape == (4, 0)
    np.testing.assert_array_equal(
        linear.matmul(np.ones((3, 0), np.float32), q, s), np.zeros((3, 4))
    )
    assert linear.matmul(np.ones((0, 5), np.float32), np.zeros((2, 5), np.uint16)).shape == (0, 2)
