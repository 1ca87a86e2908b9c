"""The Cython attention kernels and KV write against the NumPy reference (``mie.ops``).

Caches are built the way the engine builds them -- per-layer strided views of one arena of
shape (num_blocks, layers, 2, block_size, kv_heads, head_dim) -- with sequences scattered over
shuffled blocks, so the kernels are checked on the memory layout they will really read. Every
property runs for each cache dtype (float32, float16, bfloat16) and each instruction set this
CPU runs (forced with ``set_isa``), on shapes that include the awkward ones: block_size 1,
head_dim not a multiple of any vector width (1, 3, 6, 10, 13), GQA groups, contexts ending
mid-block, one sequence.

Tolerance: attention outputs agree within 1e-5 of the larger of the output's and the values'
magnitudes (normwise). Both sides widen a 16-bit cache exactly, so whatever the dtype the only
difference is float32 rounding -- of sums over up to a few thousand terms taken in different
orders, and of the kernel's polynomial ``exp`` (about 1 ulp); measured errors are below 3e-6
of the values' magnitude. An output is an average of V rows, and its rounding error is a
fraction of those rows' size, not of its own: where the average cancels (one head of width 1,
values near 1, an output of 1e-3) an error of 3e-8 is 3e-5 of the output. Hence the values'
magnitude in the bound; a wrong or missing term still moves an output by about its weight
times a value, far above it. The KV write must agree bit for bit, for every dtype; bad input
must raise the same exception with the same message.
"""

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import compiled_kernel_variants
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mie import ops

ROOT = Path(__file__).resolve().parent.parent
DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)
DTYPE_IDS = ("float32", "float16", "bfloat16")
# The ``isa`` fixture only forces the variant: it holds no state an example could change.
FIXTURES_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def assert_close(actual, expected, v_cache):
    """Within 1e-5 of the larger of the output's and the values' magnitudes (normwise: an
    output that cancels to nearly zero still carries the rounding error of the values it
    averages, which no bound relative to itself fits)."""
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    magnitude = max(np.max(np.abs(expected), initial=0), np.max(np.abs(v_cache), initial=0))
    assert np.max(np.abs(actual - expected), initial=0) <= 1e-5 * magnitude


def kv_caches(rng, num_blocks, block_size, num_kv_heads, head_dim, dtype=np.float32, layer=1):
    """K and V views of one layer of a random arena, strided exactly like the engine's."""
    shape = (num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    arena = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return arena[:, layer, 0], arena[:, layer, 1]


def scattered_tables(rng, context_lens, block_size, num_blocks, padding, dtype=np.int32):
    """Block tables giving each sequence its own shuffled blocks, padded with -1."""
    needed = [-(-n // block_size) for n in context_lens]
    tables = np.full((len(needed), max(needed) + padding), -1, dtype=dtype)
    free = iter(rng.permutation(num_blocks))
    for row, count in enumerate(needed):
        tables[row, :count] = [next(free) for _ in range(count)]
    return tables


head_dims = st.sampled_from([1, 3, 4, 6, 8, 10, 12, 13, 16, 24, 64, 80])


@st.composite
def decode_cases(draw, max_len=40):
    num_kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    head_dim = draw(head_dims)
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 17]))
    dtype = draw(st.sampled_from(DTYPES))
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=4))
    num_blocks = sum(-(-n // block_size) for n in lens) + draw(st.integers(0, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k_cache, v_cache = kv_caches(rng, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    # int64: the engine's, which the kernel takes without the reference's checks in Python
    index = draw(st.sampled_from([np.int32, np.int64]))
    tables = scattered_tables(rng, lens, block_size, num_blocks, draw(st.integers(0, 2)), index)
    q = rng.standard_normal((len(lens), num_kv_heads * group, head_dim), dtype=np.float32)
    scale = draw(st.sampled_from([1.0, head_dim**-0.5, 0.05]))
    return q, k_cache, v_cache, tables, np.array(lens, dtype=index), scale


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURES_OK)
@given(case=decode_cases())
def test_paged_attention_matches_reference(fast, isa, case):
    assert_close(fast.paged_attention(*case), ops.paged_attention(*case), case[2])


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURES_OK)
@given(
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=head_dims,
    block_size=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    start=st.integers(0, 30),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_prefill_attention_matches_reference(
    fast, isa, num_kv_heads, group, head_dim, block_size, dtype, start, n, seed
):
    rng = np.random.default_rng(seed)
    num_blocks = -(-(start + n) // block_size) + 2
    k_cache, v_cache = kv_caches(rng, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    table = list(rng.permutation(num_blocks)[: num_blocks - 1])
    q = rng.standard_normal((n, num_kv_heads * group, head_dim), dtype=np.float32)
    args = q, k_cache, v_cache, table, start, head_dim**-0.5
    assert_close(fast.prefill_attention(*args), ops.prefill_attention(*args), v_cache)


def test_a_head_that_narrower_vectors_fill_goes_to_the_narrower_kernel(fast, isa):
    """A partial vector costs more than the next narrower variant's whole ones (AVX-512 at a
    head_dim of 8 took 1.2x AVX2's time, attention_kernels.h): such heads go to that variant,
    the others stay. The properties above check each variant's results at most of these sizes."""
    expected = {
        "avx512": {8: "avx2", 24: "avx2", 40: "avx2", 6: "avx512", 10: "avx512", 64: "avx512"},
        "avx2": {4: "generic", 12: "generic", 6: "avx2", 8: "avx2", 24: "avx2", 64: "avx2"},
        "generic": {4: "generic", 6: "generic", 8: "generic", 64: "generic"},
    }[isa]
    kernels = sys.modules["mie._fast.ops"]
    assert {dim: kernels.attention_kernel(dim) for dim in expected} == expected
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        kernels.attention_kernel(0)


def arbitrary_floats(rng, shape):
    """float32 values of every kind: ordinary ones, and random bit patterns (NaN of any
    payload, infinities, subnormals, values beyond float16's range)."""
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(rng.choice([1e-6, 1, 1e5]))
    bits = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
    return np.where(rng.random(shape) < 0.3, bits.view(np.float32), values)


def same_bits(a, b):
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@settings(max_examples=60, deadline=None)
@given(
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 5, 64]),
    block_size=st.integers(1, 6),
    num_blocks=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_reshape_and_cache_writes_the_same_bits(
    fast, num_kv_heads, head_dim, block_size, num_blocks, dtype, data
):
    slots = data.draw(st.permutations(range(num_blocks * block_size)))
    slots = slots[: data.draw(st.integers(0, len(slots)))]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    k = arbitrary_floats(rng, (len(slots), num_kv_heads, head_dim))
    v = rng.standard_normal((len(slots), num_kv_heads, head_dim))  # float64: cast on write
    arenas = [np.zeros((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), dtype)]
    arenas.append(arenas[0].copy())
    with np.errstate(invalid="ignore", over="ignore"):
        ops.reshape_and_cache(k, v, arenas[0][:, 1, 0], arenas[0][:, 1, 1], np.array(slots))
    fast.reshape_and_cache(k, v, arenas[1][:, 1, 0], arenas[1][:, 1, 1], np.array(slots))
    assert same_bits(arenas[0], arenas[1])


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=DTYPE_IDS[1:])
def test_reshape_and_cache_rounds_every_tie_like_the_reference(fast, dtype):
    """Around every float16 value (a sample of bfloat16's): the value, the midpoints to its
    neighbours (ties, rounded to even), and the floats just either side of them."""
    if dtype == np.float16:
        grid = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    else:
        bits = np.random.default_rng(5).integers(0, 2**16, 2**14, dtype=np.uint64)
        grid = bits.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = (grid[:-1].astype(np.float64) + grid[1:]) / 2
    mids = mids.astype(np.float32)  # exact: a 16-bit midpoint has at most 17 significant bits
    values = np.concatenate(
        [
            grid,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(-np.inf)),
        ]
    )
    values = np.concatenate([values, [np.inf, -np.inf, np.nan, 7e4, -7e4, 3.4e38, -3.4e38]])
    values = np.resize(values.astype(np.float32), (-(-len(values) // 64), 1, 64))
    caches = [np.zeros((len(values), 1, 1, 64), dtype) for _ in range(4)]
    slots = np.arange(len(values))
    ops.reshape_and_cache(values, values, caches[0], caches[1], slots)
    fast.reshape_and_cache(values, values, caches[2], caches[3], slots)
    assert same_bits(caches[0], caches[2]) and same_bits(caches[1], caches[3])


def long_context_inputs(dtype=np.float32):
    """Batch 3 at contexts up to 2048, 14 heads over 2 KV heads, head_dim 64 (Qwen2-0.5B)."""
    rng = np.random.default_rng(0)
    lens = [2048, 1500, 17]
    k_cache, v_cache = kv_caches(rng, 240, 16, 2, 64, dtype)
    tables = scattered_tables(rng, lens, 16, 240, padding=1)
    q = rng.standard_normal((3, 14, 64), dtype=np.float32)
    return q, k_cache, v_cache, tables, np.array(lens, dtype=np.int32), 64**-0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_long_contexts_with_qwen2_head_shapes(fast, isa, dtype):
    args = long_context_inputs(dtype)
    assert_close(fast.paged_attention(*args), ops.paged_attention(*args), args[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_nan_in_the_context_spreads_like_the_reference(fast, isa, dtype):
    """A NaN key makes every query head reading it NaN; a NaN value, that dimension."""
    q, k_cache, v_cache, tables, lens, scale = long_context_inputs(dtype)
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    k_cache[tables[1, 3], 5, 1, 7] = np.nan  # sequence 1, KV head 1, position 53
    v_cache[tables[0, 127], 15, 0, 3] = np.nan  # sequence 0, KV head 0, its last position
    args = q, k_cache, v_cache, tables, lens, scale
    expected, actual = ops.paged_attention(*args), fast.paged_attention(*args)
    assert np.isnan(expected[1, 7:]).all() and np.isnan(expected[0, :7, 3]).all()
    assert np.array_equal(np.isnan(actual), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert np.max(np.abs(actual[finite] - expected[finite])) <= 1e-5 * np.max(
        np.abs(expected[finite])
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_any_cache_strides_work(fast, isa, dtype):
    """A non-contiguous head_dim axis and negative block strides, as well as read-only views."""
    rng = np.random.default_rng(1)
    wide_k, wide_v = kv_caches(rng, 6, 4, 2, 16, dtype)
    k_cache, v_cache = wide_k[::-1, :, :, ::2], wide_v[::-1, :, :, ::2]
    k_cache.flags.writeable = v_cache.flags.writeable = False
    tables = np.array([[5, 0, -1], [3, 1, 2]], dtype=np.int32)
    q = np.asfortranarray(rng.standard_normal((2, 4, 8)))  # float64, not C-contiguous
    args = q, k_cache, v_cache, tables, np.array([7, 11]), 0.3
    assert_close(
        fast.paged_attention(*args), ops.paged_attention(*args).astype(np.float32), v_cache
    )
    chunk = args[0][:, :2]  # 2 query rows (tokens) of 4 heads
    prefill = chunk, k_cache, v_cache, [3, 1, 2], 5, 0.3
    assert_close(
        fast.prefill_attention(*prefill),
        ops.prefill_attention(*prefill).astype(np.float32),
        v_cache,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_strided_16_bit_writes(fast, dtype):
    """The KV write through a reversed, strided view: the same bits as the reference."""
    arenas = [np.zeros((4, 5, 2, 16), dtype) for _ in range(2)]
    rng = np.random.default_rng(4)
    k, v = rng.standard_normal((2, 7, 2, 8), dtype=np.float32) * 1e3
    slots = np.array([0, 19, 7, 8, 3, 12, 1])
    ops.reshape_and_cache(k, v, arenas[0][::-1, :, :, ::2], arenas[0][:, ::-1, :, 1::2], slots)
    fast.reshape_and_cache(k, v, arenas[1][::-1, :, :, ::2], arenas[1][:, ::-1, :, 1::2], slots)
    assert same_bits(arenas[0], arenas[1]) and arenas[0].any()


def bad_calls():
    """(name, op, args) for each kind of bad input; a valid call differs in one argument."""
    rng = np.random.default_rng(2)
    k, v = kv_caches(rng, 6, 4, 2, 8)
    q = np.ones((2, 4, 8), np.float32)
    tables, lens = np.array([[0, 1, -1], [2, 3, 4]], np.int32), np.array([5, 9], np.int32)
    new_kv = np.ones((2, 2, 8), np.float32)
    read_only = v.copy()
    read_only.flags.writeable = False
    wrong_dtype_caches = {
        "float64": (k.astype(np.float64), v.astype(np.float64)),
        "uint16": (k.astype(np.uint16), v.astype(np.uint16)),
        "mixed": (k.astype(np.float16), v),
        "mixed_16": (k.astype(np.float16), v.astype(ml_dtypes.bfloat16)),
    }
    return [
        ("gqa", "paged_attention", (np.ones((2, 3, 8)), k, v, tables, lens, 1.0)),
        ("head_dim", "paged_attention", (np.ones((2, 4, 4)), k, v, tables, lens, 1.0)),
        ("caches", "paged_attention", (q, k, v[:3], tables, lens, 1.0)),
        ("tables_1d", "paged_attention", (q, k, v, tables[0], lens, 1.0)),
        ("lens_count", "paged_attention", (q, k, v, tables, lens[:1], 1.0)),
        ("empty_context", "paged_attention", (q, k, v, tables, np.array([0, 9]), 1.0)),
        ("long_context", "paged_attention", (q, k, v, tables, np.array([5, 13]), 1.0)),
        ("hole", "paged_attention", (q, k, v, np.array([[0, -1, -1], [2, 3, 4]]), lens, 1.0)),
        ("beyond", "paged_attention", (q, k, v, np.array([[0, 1, 6], [2, 3, 4]]), lens, 1.0)),
        ("start", "prefill_attention", (q, k, v, [0, 1, 2], -1, 1.0)),
        ("short_table", "prefill_attention", (q, k, v, [0], 3, 1.0)),
        ("bad_block", "prefill_attention", (q, k, v, [0, 7], 3, 1.0)),
        ("kv_shape", "reshape_and_cache", (new_kv, new_kv[:1], k, v, [0, 1])),
        ("slots", "reshape_and_cache", (new_kv, new_kv, k, v, [0])),
        ("slot_range", "reshape_and_cache", (new_kv, new_kv, k, v, [0, 24])),
        ("slot_negative", "reshape_and_cache", (new_kv, new_kv, k, v, [-1, 0])),
        ("read_only", "reshape_and_cache", (new_kv, new_kv, k, read_only, [0, 1])),
    ] + [
        (f"{op}_{name}", op, args)
        for name, (k_cache, v_cache) in wrong_dtype_caches.items()
        for op, args in (
            ("paged_attention", (q, k_cache, v_cache, tables, lens, 1.0)),
            ("prefill_attention", (q, k_cache, v_cache, [0, 1, 2], 3, 1.0)),
            ("reshape_and_cache", (new_kv, new_kv, k_cache, v_cache, [0, 1])),
        )
    ]


@pytest.mark.parametrize("name, op, args", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_bad_input_raises_like_the_reference(fast, name, op, args):
    assert outcome(fast, op, args) == outcome(ops, op, args)


def outcome(implementation, op, args):
    """The exception's type and message, or the result."""
    try:
        return getattr(implementation, op)(*args)
    except Exception as error:  # noqa: BLE001 -- compared, whatever it is
        return type(error), str(error)


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURES_OK)
@given(
    block_size=st.integers(1, 5),
    width=st.integers(1, 4),
    lens=st.lists(st.integers(-1, 22), min_size=1, max_size=3),
    window=st.one_of(st.none(), st.integers(1, 9)),
    seed=st.integers(0, 2**32 - 1),
)
def test_engine_arguments_are_checked_as_the_reference_checks_them(
    fast, block_size, width, lens, window, seed
):
    """int64 tables and lengths (the engine's) skip the reference's checks in Python for a
    check of their contents in C: it must refuse exactly what they refuse -- lengths that do
    not fit the row, a hole (-1) among the blocks a query reads, a block past the cache
    anywhere in the row -- and compute the same where they accept."""
    rng = np.random.default_rng(seed)
    num_blocks = 6
    k, v = kv_caches(rng, num_blocks, block_size, 1, 4)
    tables = rng.integers(-1, num_blocks + 1, (len(lens), width)).astype(np.int64)
    tables[rng.random(tables.shape) < 0.6] = rng.integers(0, num_blocks)  # mostly valid
    args = (rng.standard_normal((len(lens), 2, 4), dtype=np.float32), k, v, tables)
    args += (np.array(lens, np.int64), 0.5, window)
    got, expected = outcome(fast, "paged_attention", args), outcome(ops, "paged_attention", args)
    if isinstance(expected, tuple):
        assert got == expected
    else:
        assert_close(got, expected, v)


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.integers(1, 4),
    num_blocks=st.integers(1, 4),
    slots=st.lists(st.integers(-2, 17), min_size=0, max_size=4),
    layout=st.sampled_from(("contiguous", "rows apart", "heads apart")),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
@example(2, 2, [0, -1], "rows apart", np.float32, 0)  # each edge of the range, always tried
@example(2, 2, [3, 4], "rows apart", np.float16, 0)
@example(2, 2, [3, 0], "rows apart", np.float16, 0)
def test_engine_cache_writes_are_checked_as_the_reference_checks_them(
    fast, block_size, num_blocks, slots, layout, dtype, seed
):
    """The engine's KV writes (float32 keys and values, the model's v a view a row apart;
    int64 slots) skip the reference's checks in Python for a check of the slots in C: it must
    refuse exactly what they refuse -- a slot below 0 or past the cache -- and write the same
    bits where they accept."""
    rng = np.random.default_rng(seed)
    k = laid_out(rng.standard_normal((len(slots), 2, 4), dtype=np.float32), layout)
    v = laid_out(rng.standard_normal((len(slots), 2, 4), dtype=np.float32), layout)
    arenas = [np.zeros((num_blocks, 2, 2, block_size, 2, 4), dtype) for _ in range(2)]
    outcomes = [
        outcome(implementation, "reshape_and_cache", (k, v, a[:, 1, 0], a[:, 1, 1], s))
        for implementation, a, s in (
            (ops, arenas[0], np.array(slots, np.int64)),
            (fast, arenas[1], np.array(slots, np.int64)),
        )
    ]
    assert outcomes[0] == outcomes[1]
    assert same_bits(arenas[0], arenas[1])


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURES_OK)
@given(
    block_size=st.integers(1, 5),
    width=st.integers(0, 5),
    start=st.integers(0, 14),
    n=st.integers(1, 6),
    window=st.one_of(st.none(), st.integers(1, 9)),
    seed=st.integers(0, 2**32 - 1),
)
def test_engine_prefill_arguments_are_checked_as_the_reference_checks_them(
    fast, block_size, width, start, n, window, seed
):
    """The same for a prompt chunk (int64 block table, int start): a table too short for the
    chunk's last position, a block past the cache among those, a hole among the blocks it
    reads (from its first query's window on)."""
    rng = np.random.default_rng(seed)
    num_blocks = 6
    k, v = kv_caches(rng, num_blocks, block_size, 1, 4)
    table = rng.integers(-1, num_blocks + 1, width).astype(np.int64)
    table[rng.random(width) < 0.6] = rng.integers(0, num_blocks)  # mostly valid
    q = rng.standard_normal((n, 2, 4), dtype=np.float32)
    args = (q, k, v, table, start, 0.5, window)
    got, expected = (
        outcome(fast, "prefill_attention", args),
        outcome(ops, "prefill_attention", args),
    )
    if isinstance(expected, tuple):
        assert got == expected
    else:
        assert_close(got, expected, v)


# -- RMSNorm and RoPE: the engine's float32 arrays in C, anything else the reference's --------

LAYOUTS = ("contiguous", "rows apart", "heads apart", "float64", "every other value")


def laid_out(x, layout):
    """``x``'s values laid out as ``layout`` says: C-contiguous; rows (the first axis) apart,
    as the model's q and k are views into the q/k/v product; the middle axis apart too;
    float64; every other value of a longer last axis (the last two: the reference's)."""
    if layout == "rows apart":
        return np.stack([x, x], axis=1)[:, 0]
    if layout == "heads apart":
        return np.concatenate([x, x], axis=-1)[..., : x.shape[-1]]
    if layout == "float64":
        return x.astype(np.float64)
    if layout == "every other value":
        return np.repeat(x, 2, axis=-1)[..., ::2]
    return x


@settings(max_examples=200, deadline=None)
@given(
    shape=st.sampled_from([(1, 1), (1, 896), (3, 37), (2, 4, 16), (5, 64), (0, 8)]),
    layout=st.sampled_from(LAYOUTS),
    eps=st.sampled_from([1e-6, 1e-5, 0.5]),
    x_scale=st.sampled_from([1.0, 1e-20, 1e18]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rms_norm_matches_the_reference(fast, shape, layout, eps, x_scale, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(x_scale)
    x = laid_out(x, layout)
    weight = rng.standard_normal(shape[-1], dtype=np.float32)
    got, expected = fast.rms_norm(x, weight, eps), ops.rms_norm(x, weight, eps)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # each value divided by the same denominator, up to its rounding: 1e-6 relative
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


def test_rms_norm_spreads_non_finite_values_like_the_reference(fast):
    x = np.array([[1.0, np.nan, 2.0], [np.inf, 1.0, 0.0], [1.0, 2.0, 3.0]], np.float32)
    weight = np.ones(3, np.float32)
    np.testing.assert_array_equal(fast.rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(1, 4),
    heads=st.integers(1, 5),
    head_dim=st.sampled_from([2, 6, 16, 64, 128]),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**32 - 1),
)
def test_apply_rope_matches_the_reference(fast, tokens, heads, head_dim, layout, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, heads, head_dim), dtype=np.float32)
    x = laid_out(x, layout)
    cos, sin = ops.rope_cos_sin(rng.integers(0, 40_000, tokens), head_dim, 10_000.0)
    got, expected = fast.apply_rope(x, cos, sin), ops.apply_rope(x, cos, sin)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # two products and a sum each, as there; only a fused multiply-add could differ
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURES_OK)
@given(
    rows=st.integers(0, 3),
    width=st.sampled_from([1, 3, 4, 15, 16, 17, 33, 4864]),
    layout=st.sampled_from(LAYOUTS),
    scale=st.sampled_from([1.0, 10.0, 100.0, 1e-20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_swiglu_matches_the_reference(fast, isa, rows, width, layout, scale, seed):
    """Each instruction set's SwiGLU, on the model's layout (the gate and up halves of one
    product, rows apart) and others, widths around every vector width, gates far into both
    tails: within 5e-6 relative of the reference (its exponential is NumPy's; the generic
    variant's, without fused multiply-adds, is some tens of units in the last place off near
    -70), except that below -87, where ``silu`` is below 1.5e-36 in size, the kernel's
    exponential is 0 (so is the result), and that a subnormal result (tiny gates and ups) has
    only a few bits to be relative about: within 1e-44 of it."""
    rng = np.random.default_rng(seed)
    gate_up = rng.standard_normal((rows, 2 * width), dtype=np.float32) * np.float32(scale)
    gate, up = laid_out(gate_up[:, :width], layout), laid_out(gate_up[:, width:], layout)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = ops.swiglu(gate, up)
    got = fast.swiglu(gate, up)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tiny = 1.5e-36 * np.abs(up.astype(np.float64)) + 1e-44
    assert np.all(np.abs(got - expected) <= 5e-6 * np.abs(expected) + tiny)


def test_swiglu_non_finite_values_like_the_reference(fast, isa):
    """NaN stays NaN, infinity stays infinity, -infinity gives NaN (-inf / inf), a huge
    negative gate gives zero, as the reference's ``gate / (1 + exp(-gate)) * up``."""
    gate = np.array([[np.nan, np.inf, -np.inf, -1e30, 1e30, 0.0, -0.0, 88.0, -88.0]], np.float32)
    up = np.full_like(gate, 2.0)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = ops.swiglu(gate, up)
    np.testing.assert_allclose(fast.swiglu(gate, up), expected, rtol=5e-6, atol=3e-36)


@pytest.mark.parametrize(
    "op, args",
    [
        ("rms_norm", (np.ones((2, 4), np.float32), np.ones(3, np.float32), 1e-6)),
        ("apply_rope", (np.ones((2, 1, 4), np.float32), *ops.rope_cos_sin(np.arange(3), 4, 1e4))),
        ("swiglu", (np.ones((2, 4), np.float32), np.ones((2, 3), np.float32))),
        ("swiglu", (np.ones((2, 4), np.float32), np.ones((3, 4), np.float32))),
    ],
)
def test_rms_norm_rope_and_swiglu_refuse_what_the_reference_refuses(fast, op, args):
    assert outcome(fast, op, args) == outcome(ops, op, args)


def test_no_sequences_and_no_queries(fast):
    k, v = kv_caches(np.random.default_rng(3), 2, 4, 1, 8)
    empty_q = np.empty((0, 2, 8), np.float32)
    no_tables, no_lens = np.empty((0, 1), np.int32), np.empty(0, np.int32)
    assert fast.paged_attention(empty_q, k, v, no_tables, no_lens, 1.0).shape == (0, 2, 8)
    assert fast.prefill_attention(empty_q, k, v, [0], 3, 1.0).shape == (0, 2, 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_results_do_not_depend_on_the_thread_count(fast, dtype, tmp_path):
    """Bit-identical output from one thread (a fresh process) and from all of them."""
    name = np.dtype(dtype).name
    script = (
        "import sys, ml_dtypes, numpy as np, mie._fast as fast\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_fast_ops import long_context_inputs\n"
        f"args = long_context_inputs(np.dtype({name!r}))\n"
        f"np.save({str(tmp_path / 'one.npy')!r}, fast.paged_attention(*args))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=ROOT)
    one_thread = np.load(tmp_path / "one.npy")
    assert np.array_equal(one_thread, fast.paged_attention(*long_context_inputs(dtype)))


# --- dispatch ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels(fast):
    return sys.modules["mie._fast.ops"]


def test_each_variant_really_runs(kernels):
    """Forcing a variant changes the code that runs: the variants sum in different orders, so
    on a long context their float32 results differ in the last bits (if two were the same
    function, they would agree exactly)."""
    args = long_context_inputs()
    before, results = kernels.ISA, {}
    try:
        for name in kernels.supported_isas():
            kernels.set_isa(name)
            results[name] = kernels.paged_attention(*args)
    finally:
        kernels.set_isa(before)
    names = list(results)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not np.array_equal(results[a], results[b]), (a, b)


# --- the C header alone ------------------------------------------------------------------------

C_PROGRAM = r"""
#include <stdio.h>
#include "attention_kernels.h"
/* Two positions of one KV head, keys equal: every query head gets the mean of the two values,
 * from each cache format, each variant; the write's rounding on a tie and on overflow. */
int main(void) {
    float q[2 * 12], out[2 * 12], k32[2 * 12], v32[2 * 12], scratch[4096];
    uint16_t k16[2 * 12], v16[2 * 12];
    int64_t table[1] = {0};
    for (int i = 0; i < 24; i++) { q[i] = 0.5f; k32[i] = 1.0f; v32[i] = i < 12 ? 1.0f : 3.0f; }
    if (mie_attention_scratch_floats(2, 2, 12) > 4096) return 2;
    if (mie_float_to_f16(1.0f + 0x1p-11f) != 0x3c00 || mie_float_to_f16(1e5f) != 0x7bff) return 3;
    if (mie_float_to_bf16(1.0f + 0x1p-8f) != 0x3f80) return 4;
    if (mie_float_to_bf16(-3.4e38f) != 0xff7f) return 5;
    for (int fmt = 0; fmt < 3; fmt++) {
        for (int i = 0; i < 24; i++) {
            k16[i] = fmt == MIE_KV_F16 ? mie_float_to_f16(k32[i]) : mie_float_to_bf16(k32[i]);
            v16[i] = fmt == MIE_KV_F16 ? mie_float_to_f16(v32[i]) : mie_float_to_bf16(v32[i]);
        }
        mie_kv_cache k = {fmt ? (char *)k16 : (char *)k32, 24, 12, 12, 1};
        mie_kv_cache v = {fmt ? (char *)v16 : (char *)v32, 24, 12, 12, 1};
        for (int isa = 0; isa < mie_attention_isa_count(); isa++) {
            if (!mie_attention_isa_supported(isa)) continue;
            mie_attention(isa, fmt, q, out, k, v, table, 0, NULL, 1, 0, 1, 1, 2, 2, 12, 1.0f,
                          scratch, 4096, 1);
            for (int i = 0; i < 24; i++) if (out[i] < 1.99999f || out[i] > 2.00001f) return 1;
            if (fmt == 0) printf("%s ", mie_attention_isa_name(isa));
        }
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
