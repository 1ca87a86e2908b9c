"""The Cython matrix-product kernels (mie._fast.linear) against the NumPy reference (mie.linear).

Every kernel -- each weight format, each path (the register-tiled kernels and the widened
panels for BLAS), each instruction set this CPU runs, forced with ``set_isa`` -- on random
shapes that include the awkward ones: M = 1, M not a multiple of the row tile (4), odd K and
N, K not a multiple of the vector width (8, 16) or of the int8 group (32), K = 0. int4
weights are whole blocks of 32 inputs and int6 weights whole pairs of them, so their K is
rounded down to a multiple of 32 or 64 (``whole_blocks``); their codes are any bytes, their
float16 scales any values.

Tolerance: every element within ``1e-5 * sum_k |x[m, k]| * |w[n, k]|`` of the reference, with
``w`` the widened weight. Both sides accumulate in float32, in different orders; the error of
a float32 dot product is at most ``K * 2^-24`` of that sum in the worst case and about
``sqrt(K) * 2^-24`` in practice (observed: below 3e-7 here), so 1e-5 holds for any K the
engine uses while still catching a single wrong or missing term (at least ~1/K of the sum).
"""

import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie import linear
from tests.conftest import LINEAR_ISAS, compiled_kernel_variants, force_isa, require_fast
from tests.test_int4 import bad_int4_arguments
from tests.test_linear import bad_matmul_arguments, bad_outs

FORMATS = linear.WEIGHT_FORMATS
METHODS = ("kernel", "blas")


@pytest.fixture(scope="module")
def fast():
    """``mie._fast.linear``; skipped without the build, except under CI (a failure there)."""
    require_fast()
    try:
        from mie._fast import linear as module
    except ImportError as exc:  # an older build without this module
        if os.environ.get("CI"):
            pytest.fail(f"CI must test mie._fast.linear, but it does not import: {exc}")
        pytest.skip(f"mie._fast.linear is not built: {exc}")
    return module


@pytest.fixture(params=LINEAR_ISAS)
def isa(request, fast):
    """Each instruction set in turn, forced; skipped where this build or CPU lacks it."""
    yield from force_isa(fast, request.param)


def whole_blocks(fmt: str, k: int) -> int:
    """``k`` inputs, rounded down to whole blocks of 32 for int4 and the row-grouped formats
    and to whole pairs of them for int6 (which have no others)."""
    size = {
        **dict.fromkeys(("int6", "int6x16"), linear.INT6_PAIR),
        **dict.fromkeys(("int4", "int4x16", "int8x16", "bfloat16x16"), 32),
    }
    size = size.get(fmt, 1)
    return k - k % size


def random_weight(fmt: str, n: int, k: int, rng: np.random.Generator, scale: float) -> tuple:
    """A weight in ``fmt`` with arbitrary stored values (not only what quantization makes);
    for int4, int6 and the row-grouped formats, ``k`` must be whole blocks (``whole_blocks``);
    a row-grouped format's ``n`` is rounded up to whole groups of 16 rows."""
    if fmt in linear.UNGROUPED:
        rows = -(-n // linear.GROUP_ROWS) * linear.GROUP_ROWS
        return linear.group_rows(*random_weight(linear.UNGROUPED[fmt], rows, k, rng, scale))
    if fmt == "float32":
        return (rng.standard_normal((n, k), dtype=np.float32) * np.float32(scale),)
    if fmt == "bfloat16":
        return (linear.to_bfloat16(rng.standard_normal((n, k), dtype=np.float32) * scale),)
    if fmt == "float16":
        return ((rng.standard_normal((n, k)) * min(scale, 1e3)).astype(np.float16),)
    if fmt in ("int4", "int6"):  # any byte is a valid code byte
        width = k // 2 if fmt == "int4" else k // linear.INT6_PAIR * linear.INT6_DTYPE.itemsize
        codes = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
        scales = (rng.standard_normal((n, k // linear.GROUP_SIZE)) * min(scale, 1e4)).astype(
            np.float16
        )
        scales[rng.random(scales.shape) < 0.1] = 0  # all-zero blocks
        return (codes if fmt == "int4" else codes.view(linear.INT6_DTYPE)), scales
    q = rng.integers(-128, 128, size=(n, k), dtype=np.int8)  # -128 too: any int8 is valid
    scales = (rng.random((n, linear.num_groups(k))) * min(scale, 1e4)).astype(np.float16)
    scales[rng.random(scales.shape) < 0.1] = 0  # all-zero groups
    return q, scales


def poisoned_matmul(fast, x: np.ndarray, args: tuple, method: str) -> np.ndarray:
    """``fast.matmul`` into an ``out`` full of NaN: an element the kernel forgets shows."""
    out = np.full((x.shape[0], linear.output_size(args[0])), np.nan, dtype=np.float32)
    assert fast.matmul(x, *args, out=out, method=method) is out
    return out


def assert_close(got: np.ndarray, x: np.ndarray, args: tuple) -> None:
    expected = linear.matmul(x, *args)
    assert got.dtype == np.float32 and got.shape == expected.shape and got.flags.c_contiguous
    bound = np.abs(x) @ np.abs(linear.widen(*args)).T
    error = np.abs(got.astype(np.float64) - expected)
    worst = np.unravel_index(np.argmax(error - 1e-5 * bound), error.shape) if error.size else ()
    assert (error <= 1e-5 * bound).all(), (
        f"at {worst}: got {got[worst]}, reference {expected[worst]}, bound {1e-5 * bound[worst]}"
    )


# The ``isa`` fixture only forces the variant: it holds no state an example could change.
@settings(
    max_examples=100,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fmt=st.sampled_from(FORMATS),
    method=st.sampled_from(METHODS),
    m=st.one_of(st.just(1), st.integers(1, 13), st.integers(14, 70)),
    n=st.integers(1, 37),
    k=st.one_of(st.integers(0, 40), st.integers(41, 300)),
    seed=st.integers(0, 2**32 - 1),
    x_scale=st.sampled_from([1.0, 1e-20, 1e15]),
    w_scale=st.sampled_from([1.0, 1e-3, 1e10]),
)
def test_kernels_match_the_reference(fast, isa, fmt, method, m, n, k, seed, x_scale, w_scale):
    k = whole_blocks(fmt, k)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32) * np.float32(x_scale)
    args = random_weight(fmt, n, k, rng, w_scale)
    assert_close(poisoned_matmul(fast, x, args, method), x, args)


def half_of(value: float) -> float:
    """The nearest IEEE half, by Python's own ``struct`` (ties to even)."""
    return struct.unpack("<e", struct.pack("<e", value))[0]


SCALE_EDGES = [
    2.0**-14,  # the smallest normal half
    np.nextafter(np.float32(2.0**-14), np.float32(0)),  # below it: kept float32
    65504.0,  # the largest half
    np.nextafter(np.float32(65520), np.float32(0)),  # still rounds to 65504
    65520.0,  # would round to infinity: kept float32
    1.0 + 2.0**-11,  # a tie between two halves: to the even one, 1.0
    1.0 + 3 * 2.0**-11,  # a tie: to the even one, 1 + 2^-9
    1.0 + 2.0**-11 + 2.0**-23,  # just past a tie: up
]


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    scale=st.one_of(
        st.sampled_from(SCALE_EDGES),
        st.floats(2.0**-20, 2.0**20, width=32),
        st.floats(2.0**-100, 2.0**100, width=32),
    )
)
def test_the_activation_scale_is_rounded_to_float16_as_llama_cpp_keeps_it(fast, isa, scale):
    """A block whose largest value is 127 times ``scale`` rounds to the codes (127, 0, ...);
    the product with a weight of codes 1 and scale 1 is then 127 times the scale kept: the
    nearest half where a half holds it as a normal number, the float32 scale elsewhere."""
    scale = np.float32(scale)
    x = np.zeros((1, 32), dtype=np.float32)
    with np.errstate(over="ignore", under="ignore"):
        x[0, 0] = scale * np.float32(127)
    if not np.isfinite(x[0, 0]) or x[0, 0] == 0:
        return
    scale = x[0, 0] / np.float32(127)  # the float32 scale quantize_activation computes
    weight = (np.ones((1, 32), dtype=np.int8), np.ones((1, 1), dtype=np.float16))
    kept = half_of(float(scale)) if 2.0**-14 <= scale < 65520 else float(scale)
    expected = np.float32(127 * kept)
    assert linear.matmul(x, *weight)[0, 0] == expected
    assert fast.matmul(x, *weight)[0, 0] == expected


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, k, n", [(1, 896, 1152), (33, 896, 136), (1, 4864, 40), (6, 4864, 9)])
def test_qwen2_shapes(fast, isa, fmt, m, k, n):
    """Qwen2-0.5B's inputs (896, 4864): long dot products, every group full, M = 1 and not
    (the row-grouped formats: the rows rounded up to whole groups of 16)."""
    rng = np.random.default_rng(m * n)
    if fmt in linear.UNGROUPED:
        n = -(-n // linear.GROUP_ROWS) * linear.GROUP_ROWS
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02)
    args = (
        {
            "float32": (w,),
            "bfloat16": (linear.to_bfloat16(w),),
            "float16": (w.astype(np.float16),),
            "int8": linear.quantize_int8(w),
            "int4": linear.quantize_int4(w),
            "int6": linear.quantize_int6(w),
        }[fmt]
        if fmt not in linear.UNGROUPED
        else {
            "int4x16": grouped_int4,
            "int8x16": grouped_int8,
            "int6x16": grouped_int6,
            "bfloat16x16": grouped_bfloat16,
        }[fmt](w)
    )
    for method in METHODS:
        assert_close(poisoned_matmul(fast, x, args, method), x, args)


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_picks_blas_from_blas_min_rows(fast, isa, fmt, monkeypatch):
    """``method="auto"`` switches paths at ``BLAS_MIN_ROWS`` (when set); both sides are right."""
    monkeypatch.setattr(fast, "BLAS_MIN_ROWS", {fast.ISA: 5})
    monkeypatch.setattr(fast, "PANEL_BYTES", 64)  # several panels, the last one partial
    rng = np.random.default_rng(1)
    k = {
        **dict.fromkeys(("int4", "int4x16", "int8x16", "bfloat16x16"), 64),
        **dict.fromkeys(("int6", "int6x16"), 128),
    }.get(fmt, 45)
    args = random_weight(fmt, 9, k, rng, 1.0)
    for m in (4, 5):
        x = rng.standard_normal((m, k), dtype=np.float32)
        assert_close(poisoned_matmul(fast, x, args, "auto"), x, args)


@pytest.mark.parametrize("variant", ["avx2vnni", "avx2"])
def test_row_grouped_weights_stay_on_the_kernels_on_avx2(fast, variant):
    """On the AVX2 variants quantized row-grouped products never go to BLAS
    (``ROW_GROUPED_BLAS_MIN_ROWS``), the other formats (bfloat16x16 included) from
    ``BLAS_MIN_ROWS`` rows on: ``method="auto"`` at 64 rows gives the kernels' numbers bit
    for bit, or the panels'."""
    quantized_grouped = [fmt for fmt in linear.UNGROUPED if fmt in linear.QUANTIZED_FORMATS]
    for _ in force_isa(fast, variant):
        assert all(fast.blas_min_rows(fmt) is None for fmt in quantized_grouped)
        assert fast.blas_min_rows("int8") == fast.blas_min_rows("float32") == 64
        assert fast.blas_min_rows("bfloat16x16") == 64
        rng = np.random.default_rng(3)
        x = rng.standard_normal((64, 64), dtype=np.float32)
        # (not bfloat16x16: its tiles add each row's products in input order, one multiply-add
        # at a time, as OpenBLAS does here, so the two paths give the same bits)
        for fmt in ("int8x16", "int4x16", "int6x16", "int8", "int4", "float32"):
            args = random_weight(fmt, 32, 64, rng, 1.0)
            kernel = fast.matmul(x, *args, method="kernel")
            panels = fast.matmul(x, *args, method="blas")
            assert not np.array_equal(kernel, panels)  # the two paths tell apart
            want = kernel if fmt in quantized_grouped else panels
            np.testing.assert_array_equal(fast.matmul(x, *args), want, err_msg=fmt)


def test_widen_matches_the_reference_bit_for_bit(fast, isa):
    rng = np.random.default_rng(2)
    for fmt in FORMATS:
        for k in sorted({whole_blocks(fmt, k) for k in (1, 7, 31, 32, 33, 100)}):
            args = random_weight(fmt, 5, k, rng, 1.0)
            np.testing.assert_array_equal(fast.widen(*args), linear.widen(*args))


# The ``isa`` fixture only forces the variant: it holds no state an example could change.
@settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fmt=st.sampled_from(FORMATS),
    n=st.integers(1, 40),
    k=st.integers(1, 200),
    picks=st.lists(st.integers(0, 2**16), max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_rows_matches_the_reference_bit_for_bit(fast, isa, fmt, n, k, picks, seed):
    """The embedding lookup: any rows (repeats, none, a row-grouped weight's last group
    included) are the reference's, bit for bit."""
    k = whole_blocks(fmt, k) or whole_blocks(fmt, 200)
    weight, scales = (*random_weight(fmt, n, k, np.random.default_rng(seed), 1.0), None)[:2]
    rows = linear.output_size(weight)
    ids = np.array([pick % rows for pick in picks], dtype=np.int64)
    got = fast.gather_rows(weight, scales, ids)
    want = linear.gather_rows(weight, scales, ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), k)
    np.testing.assert_array_equal(got, want)


def test_gather_rows_hands_what_it_does_not_take_to_the_reference(fast):
    """ids that are a list, another dtype, strided or outside the rows: the reference's rows,
    or its error."""
    rng = np.random.default_rng(4)
    codes, scales = random_weight("int4x16", 32, 64, rng, 1.0)
    want = linear.gather_rows(codes, scales, np.array([3, 31, 3]))
    for ids in ([3, 31, 3], np.array([3, 31, 3], dtype=np.int32), np.array([3, 0, 31, 0, 3])[::2]):
        np.testing.assert_array_equal(fast.gather_rows(codes, scales, ids), want)
    for bad in (np.array([32]), np.array([-33])):
        with pytest.raises(IndexError):
            linear.gather_rows(codes, scales, bad)
        with pytest.raises(IndexError):
            fast.gather_rows(codes, scales, bad)
    with pytest.raises(ValueError, match="scales"):
        fast.gather_rows(codes, None, np.array([0]))


def test_every_float16_value_widens_exactly(fast, isa):
    """All 65,536 half bit patterns (subnormals, inf, NaN) against NumPy's conversion."""
    bits = np.arange(2**16, dtype=np.uint16).reshape(64, 1024)
    ours = fast.widen(bits.view(np.float16)).view(np.uint32)
    theirs = bits.view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(bits.view(np.float16))
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(ours[nan].view(np.float32)).all()
    # Through the product too (the scalar tail, K = 1, and the vector loop, K = 32).
    for k in (1, 32):
        w = bits.reshape(-1, k)[:2048].view(np.float16)
        finite = np.isfinite(w.astype(np.float32)).all(axis=1)
        x = np.ones((1, k), np.float32)
        got = poisoned_matmul(fast, x, (w[finite],), "kernel")
        assert_close(got, x, (w[finite],))


def test_strided_and_typed_operands(fast, isa):
    """Row-strided weights and scales, ml_dtypes bfloat16, Fortran-order and float64 x."""
    rng = np.random.default_rng(3)
    x = np.asfortranarray(rng.standard_normal((5, 70)))  # float64, converted like the reference
    bf = linear.to_bfloat16(rng.standard_normal((12, 70), dtype=np.float32))
    cases = [
        (bf[::2],),
        (bf.view(ml_dtypes.bfloat16)[1::3],),
        (bf.view(np.float16)[::-1],),
        (np.ascontiguousarray(bf.T).T,),  # column-major: copied
    ]
    q, s = linear.quantize_int8(rng.standard_normal((12, 70), dtype=np.float32))
    cases.append((q[::2], s[::2]))
    cases.append((q, np.asfortranarray(s)))
    for args in cases:
        for method in METHODS:
            got = poisoned_matmul(fast, x, args, method)
            assert_close(got, x.astype(np.float32), args)
    # a C-contiguous ml_dtypes bfloat16 weight is read where it lies: its uint16 bits' product
    rows = np.ascontiguousarray(x, dtype=np.float32)
    for m in (1, 5):
        np.testing.assert_array_equal(
            fast.matmul(rows[:m], bf.view(ml_dtypes.bfloat16)), fast.matmul(rows[:m], bf)
        )
    x = x[:, :64]
    for quantize in (
        linear.quantize_int4,
        linear.quantize_int6,
        grouped_int4,
        grouped_int8,
        grouped_int6,
    ):
        codes, s = quantize(rng.standard_normal((48, 64), dtype=np.float32))
        for args in [(codes[::2], s[::2]), (codes[::-1], s[::-1]), (codes, np.asfortranarray(s))]:
            for method in METHODS:
                got = poisoned_matmul(fast, x, args, method)
                assert_close(got, x.astype(np.float32), args)
    (grouped,) = grouped_bfloat16(rng.standard_normal((48, 64), dtype=np.float32))
    for args in [(grouped[::2],), (grouped[::-1],)]:
        for method in METHODS:
            got = poisoned_matmul(fast, x, args, method)
            assert_close(got, x.astype(np.float32), args)


def grouped_int4(w: np.ndarray) -> tuple:
    """``w`` quantized to int4, in int4x16."""
    return linear.group_rows(*linear.quantize_int4(w))


def grouped_int8(w: np.ndarray) -> tuple:
    """``w`` quantized to int8, in int8x16."""
    return linear.group_rows(*linear.quantize_int8(w))


def grouped_int6(w: np.ndarray) -> tuple:
    """``w`` quantized to int6, in int6x16."""
    return linear.group_rows(*linear.quantize_int6(w))


def grouped_bfloat16(w: np.ndarray) -> tuple:
    """``w`` rounded to bfloat16, in bfloat16x16."""
    return linear.group_rows(linear.to_bfloat16(w))[:1]


def test_empty_and_degenerate_shapes(fast, isa):
    for fmt in FORMATS:
        rng = np.random.default_rng(4)
        for m, n, k in [(0, 3, 5), (3, 0, 5), (3, 4, 0), (1, 1, 1)]:
            k = whole_blocks(fmt, k)
            x = rng.standard_normal((m, k), dtype=np.float32)
            args = random_weight(fmt, n, k, rng, 1.0)
            for method in METHODS:
                got = poisoned_matmul(fast, x, args, method)
                if k and fmt in linear.QUANTIZED_FORMATS:  # scales multiplied in another order
                    assert_close(got, x, args)
                else:
                    np.testing.assert_array_equal(got, linear.matmul(x, *args))


def test_non_finite_values_propagate_like_the_reference(fast, isa):
    """NaN and inf in x or in the weight: the same non-finite outputs (their pattern in a sum
    does not depend on the order of the terms)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 40), dtype=np.float32)
    x[1, 3] = np.nan
    x[2, 39] = np.inf
    w = rng.standard_normal((7, 40), dtype=np.float32)
    w[4, 0] = -np.inf
    w[5, 33] = np.nan
    for args in [(linear.to_bfloat16(w),), (w.astype(np.float16),)]:
        for method in METHODS:
            with np.errstate(invalid="ignore"):  # inf - inf: the NaN is the point
                got, expected = fast.matmul(x, *args, method=method), linear.matmul(x, *args)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
            np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
            finite = np.isfinite(expected)
            np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


def test_out_may_alias_x(fast):
    """``out`` sharing memory with ``x`` (a square product in place) gives the product of the
    ``x`` that was passed, as the reference does."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((32, 32), dtype=np.float32)
    for args in [(linear.to_bfloat16(w),), linear.quantize_int8(w), linear.quantize_int4(w)]:
        x = rng.standard_normal((5, 32), dtype=np.float32)
        expected = linear.matmul(x, *args)
        assert fast.matmul(x, *args, out=x) is x
        np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)


def test_results_do_not_depend_on_the_call(fast, isa):
    """Each output is one thread's fixed-order sum: two calls give the same bits."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, 300), dtype=np.float32)
    for args in [
        random_weight("int8", 1000, 300, rng, 1.0),
        random_weight("int4", 1000, 288, rng, 1.0),
        random_weight("int4x16", 1000, 288, rng, 1.0),
        random_weight("int8x16", 1000, 288, rng, 1.0),
        random_weight("int6", 1000, 256, rng, 1.0),
        random_weight("int6x16", 1000, 256, rng, 1.0),
        random_weight("bfloat16x16", 1000, 288, rng, 1.0),
    ]:
        xk = x[:, : linear.input_size(args[0])]
        np.testing.assert_array_equal(fast.matmul(xk, *args), fast.matmul(xk, *args))


THREADS_PROGRAM = """
import hashlib, numpy as np
from mie import linear
from mie._fast import linear as fast
rng = np.random.default_rng(7)
x = rng.standard_normal((22, 333), dtype=np.float32)
w = rng.standard_normal((2000, 333), dtype=np.float32)
outs = [fast.matmul(x[:m], *a) for m in (1, 9) for a in
        [(linear.to_bfloat16(w),), (w.astype(np.float16),), linear.quantize_int8(w)]]
# 22 rows: the 16-bit rows widened once (gemm_decoded)
outs += [fast.matmul(x, *a) for a in [(linear.to_bfloat16(w),), (w.astype(np.float16),)]]
outs += [fast.matmul(x[:m, :320], *linear.quantize_int4(w[:, :320])) for m in (1, 9)]
outs += [fast.matmul(x[:m, :320], *linear.quantize_int6(w[:, :320])) for m in (1, 9)]
for quantize in (linear.quantize_int4, linear.quantize_int8, linear.quantize_int6):
    grouped = linear.group_rows(*quantize(w[:, :320]))
    outs += [fast.matmul(x[:m, :320], *grouped) for m in (1, 9)]
grouped = linear.group_rows(linear.to_bfloat16(w[:, :320]))[0]
outs += [fast.matmul(x[:m, :320], grouped) for m in (1, 9)]
print(fast.max_threads(), hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest())
"""


def test_results_do_not_depend_on_the_thread_count(fast):
    """Each output is one thread's fixed-order sum: 1 and 2 OpenMP threads, the same bits."""
    if not fast.OPENMP:
        pytest.skip("built without OpenMP")
    runs = []
    for threads in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        done = subprocess.run(
            [sys.executable, "-c", THREADS_PROGRAM], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        runs.append(done.stdout.split())
    assert [r[0] for r in runs] == ["1", "2"]
    assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize(
    "x, weight, scales, error, message", bad_matmul_arguments() + bad_int4_arguments()
)
def test_bad_arguments_are_refused_like_the_reference(fast, x, weight, scales, error, message):
    with pytest.raises(error, match=message) as ours:
        fast.matmul(x, weight, scales)
    with pytest.raises(error) as theirs:
        linear.matmul(x, weight, scales)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("out, error, message", bad_outs())
def test_bad_out_is_refused_like_the_reference(fast, out, error, message):
    with pytest.raises(error, match=message):
        fast.matmul(np.ones((2, 4), np.float32), np.zeros((3, 4), np.float16), out=out)


def test_bad_method_and_widen_arguments(fast):
    x, bf = np.ones((1, 4), np.float32), np.zeros((2, 4), np.uint16)
    with pytest.raises(ValueError, match="method must be 'auto', 'kernel' or 'blas'"):
        fast.matmul(x, bf, method="gpu")
    with pytest.raises(ValueError, match="needs its scales"):
        fast.widen(np.zeros((2, 2), np.int8))
    with pytest.raises(ValueError, match=r"2-D array \(N, K\)"):
        fast.widen(np.zeros(4, np.uint16))


# --- the C header alone (the ISA dispatch: tests/test_fast_isa.py) --------------------------

C_PROGRAM = r"""
#include <stdio.h>
#include "linear_kernels.h"
int main(void) {
    float x[2 * 64], out[2 * 3], out16[2 * 16];
    uint16_t w[3 * 40], s4[3 * 2], s16[32];
    uint8_t w4[3 * 32], w6[3 * 48], w16[2 * 256], w8[2 * 512], w616[2 * 384];
    uint16_t wb16[2 * 512];
    for (int i = 0; i < 128; i++) x[i] = 0.49609375f; /* 127/256: int8 scale 1/256, a half */
    for (int i = 0; i < 120; i++) w[i] = 0x3f80; /* bfloat16 1.0 */
    for (int i = 0; i < 96; i++) w4[i] = 0x7a;   /* int4 codes 10 and 7: 2 and -1 */
    for (int i = 0; i < 6; i++) s4[i] = 0x3c00;  /* float16 1.0 */
    for (int i = 0; i < 512; i++) w16[i] = i % 64 < 32 ? 0x7a : 0x99; /* int4x16: rows 0-7, 8-15 */
    for (int i = 0; i < 32; i++) s16[i] = 0x3c00;
    for (int i = 0; i < 1024; i++) w8[i] = i % 64 < 32 ? 0xfd : 0x02; /* int8x16: -3 and 2 */
    for (int i = 0; i < 144; i++) w6[i] = i % 48 < 32 ? 0x7a : 0x55; /* int6: tops 1, -6 and -9 */
    for (int i = 0; i < 768; i++) /* int6x16: int4x16's nibbles, every top 1 */
        w616[i] = i % 384 >= 256 ? 0x55 : i % 64 < 32 ? 0x7a : 0x99;
    for (int i = 0; i < 1024; i++) wb16[i] = i % 32 < 16 ? 0x3f80 : 0xc000; /* bfloat16x16: 1, -2 */
    for (int v = 0; v < mie_isa_count(); v++) {
        if (!mie_isa_supported(v)) continue;
        mie_gemm(v, MIE_BF16, x, 40, 2, w, 40, NULL, 0, 3, 40, out, 3, 1);
        for (int i = 0; i < 6; i++) if (out[i] != 19.84375f) return 1;
        mie_gemm(v, MIE_I4, x, 64, 2, w4, 32, s4, 2, 3, 64, out, 3, 1);
        for (int i = 0; i < 6; i++) if (out[i] != 15.875f) return 2; /* x * 32 * (2 - 1) */
        mie_gemm(v, MIE_I6, x, 64, 2, w6, 1, s4, 2, 3, 64, out, 3, 1);
        for (int i = 0; i < 6; i++) if (out[i] != -238.125f) return 3; /* x * 32 * (-6 - 9) */
        mie_gemm(v, MIE_I4X16, x, 64, 2, w16, 2, s16, 32, 16, 64, out16, 16, 1);
        for (int i = 0; i < 32; i++) /* rows 0-7: x * 32 * (2 - 1); 8-15: x * 32 * (1 + 1) */
            if (out16[i] != (i % 16 < 8 ? 15.875f : 31.75f)) return 4;
        mie_gemm(v, MIE_I8X16, x, 64, 2, w8, 2, s16, 32, 16, 64, out16, 16, 1);
        for (int i = 0; i < 32; i++) /* rows 0-7: x * 64 * -3; rows 8-15: x * 64 * 2 */
            if (out16[i] != (i % 16 < 8 ? -95.25f : 63.5f)) return 5;
        mie_gemm(v, MIE_I6X16, x, 64, 2, w616, 2, s16, 32, 16, 64, out16, 16, 1);
        for (int i = 0; i < 32; i++) /* rows 0-7: x * 32 * (-6 - 9); rows 8-15: x * 64 * -7 */
            if (out16[i] != (i % 16 < 8 ? -238.125f : -222.25f)) return 6;
        for (int m = 1; m <= 2; m++) { /* a group alone (batch 1) and a tile of rows */
            mie_gemm(v, MIE_BF16X16, x, 64, m, wb16, 2, NULL, 0, 16, 64, out16, 16, 1);
            for (int i = 0; i < 16 * m; i++) /* rows 0-7: x * 64 * 1; rows 8-15: x * 64 * -2 */
                if (out16[i] != (i % 16 < 8 ? 31.75f : -63.5f)) return 7;
        }
        printf("%s ", mie_isa_name(v));
    }
    return 0;
}
"""


@pytest.mark.parametrize("generic_only", [False, True])
def test_header_compiles_cleanly_and_without_x86_kernels(tmp_path, generic_only):
    """The kernels build warning-free, and with ``MIE_GENERIC_ONLY`` -- what a non-x86
    machine compiles: no intrinsics, no target attributes -- still compute correctly."""
    variants = compiled_kernel_variants(tmp_path, C_PROGRAM, generic_only)
    assert variants[-1] == "generic"
    if generic_only:
        assert variants == ["generic"]


# -- the memory roofline's probe ------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    size=st.sampled_from([0, 1, 7, 4096, 32768, 32769, 100_003]),  # from 32768 on: threaded
    seed=st.integers(0, 2**32 - 1),
)
def test_stream_read_is_the_references_xor(fast, size, seed):
    """Every word counts: the xor of the threads' shares equals NumPy's over the whole array,
    and changing any one word changes it."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**64, size=size, dtype=np.uint64)
    assert fast.stream_read(words) == linear.stream_read(words)
    if size:
        at = int(rng.integers(size))
        before = fast.stream_read(words)
        words[at] ^= np.uint64(1) << np.uint64(int(rng.integers(64)))
        assert fast.stream_read(words) != before
        assert fast.stream_read(words) == linear.stream_read(words)


@pytest.mark.parametrize(
    "words, error, message",
    [
        (np.zeros(4, dtype=np.int64), TypeError, "1-D uint64 array"),
        (np.zeros((2, 2), dtype=np.uint64), TypeError, "1-D uint64 array"),
        ([1, 2, 3], TypeError, "got list"),
        (np.zeros(8, dtype=np.uint64)[::2], ValueError, "C-contiguous"),
    ],
)
def test_stream_read_refuses_like_the_reference(fast, words, error, message):
    for stream_read in (linear.stream_read, fast.stream_read):
        with pytest.raises(error, match=message):
            stream_read(words)
