"""The reference ops against hand-computed values and against plain dense implementations.

The oracles here are deliberately different formulations: float64 loops over heads, RoPE as
complex multiplication, attention over K/V laid out contiguously instead of through blocks.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import ops

# -- hand-computed cases ---------------------------------------------------------------------


def test_rms_norm_hand_computed():
    x = np.array([[3.0, 4.0]], dtype=np.float32)  # mean square 12.5
    out = ops.rms_norm(x, np.array([1.0, 2.0], dtype=np.float32), eps=0.0)
    expected = np.array([[3.0, 8.0]]) / math.sqrt(12.5)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out.dtype == np.float32


def test_rms_norm_eps_keeps_zero_input_finite():
    out = ops.rms_norm(np.zeros((2, 4), np.float32), np.ones(4, np.float32), eps=1e-6)
    assert np.array_equal(out, np.zeros((2, 4)))


def test_swiglu_hand_computed():
    gate = np.array([0.0, 1.0, -1.0, 30.0, -200.0], dtype=np.float32)
    up = np.array([5.0, 2.0, 1.0, 1.0, 1.0], dtype=np.float32)
    sigmoid = 1.0 / (1.0 + np.exp(-gate.astype(np.float64)))
    np.testing.assert_allclose(ops.swiglu(gate, up), gate * sigmoid * up, rtol=1e-6, atol=1e-30)
    assert ops.swiglu(gate, up)[1] == pytest.approx(2 * 0.7310585786)


def test_rope_head_dim_2_is_a_plane_rotation_by_the_position():
    x = np.array([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]], dtype=np.float32)
    out = ops.rope(x, np.array([0, 1, 2]), theta=10000.0)  # one frequency: theta ** 0 = 1
    expected = [[1.0, 0.0], [math.cos(1), math.sin(1)], [-math.sin(2), math.cos(2)]]
    np.testing.assert_allclose(out[:, 0], expected, atol=1e-6)


def test_attention_with_one_key_returns_its_value():
    k_cache = np.zeros((3, 2, 1, 4), np.float32)
    v_cache = np.zeros((3, 2, 1, 4), np.float32)
    v_cache[2, 0, 0] = [1.0, 2.0, 3.0, 4.0]
    q = np.ones((1, 2, 4), np.float32)  # 2 query heads share the one KV head
    out = ops.paged_attention(q, k_cache, v_cache, np.array([[2, -1]]), np.array([1]), 0.5)
    np.testing.assert_array_equal(out, [[[1, 2, 3, 4], [1, 2, 3, 4]]])


def test_prefill_attention_hand_computed_two_tokens():
    # Keys equal, so token 1 averages the two values; token 0 sees only its own.
    k_cache = np.ones((1, 2, 1, 2), np.float32)
    v_cache = np.array([[[[2.0, 0.0]], [[0.0, 4.0]]]], np.float32)
    out = ops.prefill_attention(np.ones((2, 1, 2), np.float32), k_cache, v_cache, [0], 0, 1.0)
    np.testing.assert_allclose(out[:, 0], [[2.0, 0.0], [1.0, 2.0]])


# -- oracles -----------------------------------------------------------------------------------


def rope_complex(x, positions, theta):
    """RoPE as complex multiplication: pair (i, i + d/2) is one complex number."""
    half = x.shape[-1] // 2
    z = x[..., :half].astype(np.float64) + 1j * x[..., half:]
    freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    z = z * np.exp(1j * np.asarray(positions)[:, None, None] * freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def dense_attention(q, keys, values, query_positions, scale):
    """Float64 loops: query i (at its position) attends keys 0..position, GQA by h // group."""
    num_heads, group = q.shape[1], q.shape[1] // keys.shape[1]
    out = np.zeros(q.shape)
    for i, pos in enumerate(query_positions):
        for h in range(num_heads):
            k = keys[: pos + 1, h // group].astype(np.float64)
            s = k @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ values[: pos + 1, h // group]
    return out


def scatter_into_blocks(rng, contexts, block_size, kv_heads, head_dim, spare_blocks):
    """Lay each context's K/V into randomly chosen physical blocks of a shared cache.

    The caches are a strided per-layer view of a multi-layer arena, as in the model.
    """
    needed = [-(-len(k) // block_size) for k, _ in contexts]
    num_blocks = sum(needed) + spare_blocks
    arena = rng.standard_normal((num_blocks, 3, 2, block_size, kv_heads, head_dim))
    arena = arena.astype(np.float32)  # garbage everywhere a context does not write
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    physical = rng.permutation(num_blocks)
    tables, used = [], 0
    for (keys, values), n in zip(contexts, needed, strict=True):
        table = physical[used : used + n]
        used += n
        for logical, block in enumerate(table):
            rows = slice(logical * block_size, (logical + 1) * block_size)
            k_cache[block, : len(keys[rows])] = keys[rows]
            v_cache[block, : len(values[rows])] = values[rows]
        tables.append(table)
    return k_cache, v_cache, tables


shapes = st.tuples(
    st.sampled_from([1, 2, 3, 8, 16]),  # block_size
    st.sampled_from([1, 2, 3]),  # kv heads
    st.sampled_from([1, 2, 4, 7]),  # query heads per kv head
    st.sampled_from([2, 8, 16]),  # head_dim
)


def lengths():
    """Context lengths: 1, block-boundary neighbours, and anything up to a long-ish 120."""
    return st.one_of(
        st.just(1),
        st.sampled_from([2, 3, 4, 7, 8, 9, 15, 16, 17, 32, 33]),
        st.integers(1, 120),
    )


# -- property tests ------------------------------------------------------------------------------


@settings(deadline=None, max_examples=60)
@given(
    x=st.integers(1, 6).flatmap(
        lambda t: st.tuples(st.just(t), st.integers(1, 3), st.sampled_from([2, 4, 16, 64]))
    ),
    theta=st.sampled_from([10000.0, 1e6, 500.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rope_matches_complex_rotation(x, theta, seed):
    rng = np.random.default_rng(seed)
    tokens, heads, head_dim = x
    values = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    positions = rng.integers(0, 4096, tokens)
    out = ops.rope(values, positions, theta)
    np.testing.assert_allclose(out, rope_complex(values, positions, theta), atol=2e-5)
    assert out.dtype == np.float32


@settings(deadline=None, max_examples=60)
@given(
    shape=shapes,
    context_lens=st.lists(lengths(), min_size=1, max_size=5),
    spare=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_paged_attention_equals_dense_attention(shape, context_lens, spare, seed):
    """Shuffled physical blocks, garbage around them, -1 padding: same as dense attention."""
    block_size, kv_heads, group, head_dim = shape
    rng = np.random.default_rng(seed)
    contexts = [
        (
            rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32),
            rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32),
        )
        for n in context_lens
    ]
    k_cache, v_cache, tables = scatter_into_blocks(
        rng, contexts, block_size, kv_heads, head_dim, spare
    )
    padded = np.full((len(tables), max(map(len, tables)) + spare), -1, np.int32)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    q = rng.standard_normal((len(contexts), kv_heads * group, head_dim)).astype(np.float32)
    scale = head_dim**-0.5
    out = ops.paged_attention(q, k_cache, v_cache, padded, np.array(context_lens), scale)
    assert out.shape == q.shape and out.dtype == np.float32
    for s, (keys, values) in enumerate(contexts):
        expected = dense_attention(q[s : s + 1], keys, values, [len(keys) - 1], scale)
        np.testing.assert_allclose(out[s], expected[0], atol=2e-5)


@settings(deadline=None, max_examples=60)
@given(
    shape=shapes,
    total=lengths(),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_prefill_attention_equals_dense_causal_attention(shape, total, data, seed):
    """A chunk starting after a cached prefix attends the prefix and itself, causally."""
    block_size, kv_heads, group, head_dim = shape
    start = data.draw(st.integers(0, total - 1), label="start")
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((total, kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((total, kv_heads, head_dim)).astype(np.float32)
    k_cache, v_cache, (table,) = scatter_into_blocks(
        rng, [(keys, values)], block_size, kv_heads, head_dim, spare_blocks=2
    )
    n = total - start
    q = rng.standard_normal((n, kv_heads * group, head_dim)).astype(np.float32)
    out = ops.prefill_attention(q, k_cache, v_cache, table, start, 0.3)
    expected = dense_attention(q, keys, values, range(start, total), 0.3)
    np.testing.assert_allclose(out, expected, atol=2e-5)
    assert out.dtype == np.float32


@settings(deadline=None, max_examples=40)
@given(
    block_size=st.sampled_from([1, 3, 4, 16]),
    num_blocks=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_reshape_and_cache_writes_exactly_the_given_slots(block_size, num_blocks, data, seed):
    rng = np.random.default_rng(seed)
    slots = data.draw(
        st.lists(st.integers(0, num_blocks * block_size - 1), unique=True, max_size=20)
    )
    arena = rng.standard_normal((num_blocks, 2, 2, block_size, 2, 4)).astype(np.float32)
    before = arena.copy()
    k = rng.standard_normal((len(slots), 2, 4)).astype(np.float32)
    v = rng.standard_normal((len(slots), 2, 4)).astype(np.float32)
    ops.reshape_and_cache(k, v, arena[:, 1, 0], arena[:, 1, 1], np.array(slots, np.int64))
    expected = before.copy()
    for i, slot in enumerate(slots):
        expected[slot // block_size, 1, 0, slot % block_size] = k[i]
        expected[slot // block_size, 1, 1, slot % block_size] = v[i]
    np.testing.assert_array_equal(arena, expected)


# -- 16-bit KV caches ------------------------------------------------------------------------------

HALF_CACHES = [np.float16, ml_dtypes.bfloat16]


@settings(deadline=None, max_examples=30)
@given(
    dtype=st.sampled_from(HALF_CACHES),
    shape=shapes,
    context_lens=st.lists(lengths(), min_size=1, max_size=4),
    start=st.integers(0, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention_over_a_16_bit_cache_is_attention_over_its_float32_values(
    dtype, shape, context_lens, start, seed
):
    """Reading a 16-bit cache widens it exactly: the results are bit for bit those of a float32
    cache holding the same values."""
    block_size, kv_heads, group, head_dim = shape
    rng = np.random.default_rng(seed)
    longest = max(*context_lens, start + 3)
    num_blocks = len(context_lens) * -(-longest // block_size)
    arena = rng.standard_normal((num_blocks, 2, 2, block_size, kv_heads, head_dim)).astype(dtype)
    wide = arena.astype(np.float32)
    tables = rng.permutation(num_blocks).reshape(len(context_lens), -1)
    q = rng.standard_normal((len(context_lens), kv_heads * group, head_dim)).astype(np.float32)
    lens = np.array(context_lens)
    narrow_out = ops.paged_attention(q, arena[:, 1, 0], arena[:, 1, 1], tables, lens, 0.5)
    wide_out = ops.paged_attention(q, wide[:, 1, 0], wide[:, 1, 1], tables, lens, 0.5)
    assert narrow_out.dtype == np.float32 and np.array_equal(narrow_out, wide_out)
    chunk = q[:3]
    narrow_out = ops.prefill_attention(chunk, arena[:, 0, 0], arena[:, 0, 1], tables[0], start, 1.0)
    wide_out = ops.prefill_attention(chunk, wide[:, 0, 0], wide[:, 0, 1], tables[0], start, 1.0)
    assert narrow_out.dtype == np.float32 and np.array_equal(narrow_out, wide_out)


@pytest.mark.parametrize("dtype", HALF_CACHES)
def test_reshape_and_cache_rounds_to_nearest_even(dtype):
    """In range, the write is NumPy's / ml_dtypes' cast of the float32 value (float64 input is
    made float32 first)."""
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((50, 1, 8)) * 100).astype(np.float32)
    v = rng.standard_normal((50, 1, 8)) * 1e-6  # float64, tiny (float16 subnormals)
    k_cache, v_cache = np.zeros((10, 5, 1, 8), dtype), np.zeros((10, 5, 1, 8), dtype)
    ops.reshape_and_cache(k, v, k_cache, v_cache, np.arange(50))
    assert np.array_equal(
        k_cache.reshape(50, 1, 8).view(np.uint16), k.astype(dtype).view(np.uint16)
    )
    expected_v = v.astype(np.float32).astype(dtype)
    assert np.array_equal(v_cache.reshape(50, 1, 8).view(np.uint16), expected_v.view(np.uint16))


@pytest.mark.parametrize(
    "dtype, largest, over",
    [
        (np.float16, (2 - 2**-10) * 2**15, [65519.0, 65520.0, 1e5, 3e38]),  # 65504
        (ml_dtypes.bfloat16, (2 - 2**-7) * 2**127, [3.39e38, 3.4e38]),
    ],
)
def test_reshape_and_cache_saturates_finite_overflow(dtype, largest, over):
    """A finite value beyond the dtype's range is stored as its largest finite value (with the
    sign), never as infinity; infinities and NaN are stored as they are."""
    values = np.array([*over, *(-x for x in over), np.inf, -np.inf, np.nan], np.float32)
    k = values.reshape(-1, 1, 1)
    k_cache, v_cache = (
        np.zeros((len(values), 1, 1, 1), dtype),
        np.zeros((len(values), 1, 1, 1), dtype),
    )
    ops.reshape_and_cache(k, k, k_cache, v_cache, np.arange(len(values)))
    stored = k_cache.astype(np.float64).ravel()
    n = len(over)
    assert list(stored[:n]) == [largest] * n and list(stored[n : 2 * n]) == [-largest] * n
    assert list(stored[2 * n : 2 * n + 2]) == [np.inf, -np.inf] and np.isnan(stored[-1])
    assert np.array_equal(k_cache.view(np.uint16), v_cache.view(np.uint16))


@pytest.mark.parametrize("op", ["paged_attention", "prefill_attention", "reshape_and_cache"])
@pytest.mark.parametrize(
    "k_dtype, v_dtype",
    [
        (np.float64, np.float64),
        (np.uint16, np.uint16),
        (np.int8, np.int8),
        (np.float16, np.float32),
    ],
)
def test_other_cache_dtypes_are_refused_naming_the_allowed_ones(op, k_dtype, v_dtype):
    k_cache, v_cache = np.zeros((2, 4, 1, 8), k_dtype), np.zeros((2, 4, 1, 8), v_dtype)
    q = np.zeros((1, 1, 8), np.float32)
    args = {
        "paged_attention": (q, k_cache, v_cache, [[0]], [1], 1.0),
        "prefill_attention": (q, k_cache, v_cache, [0], 0, 1.0),
        "reshape_and_cache": (q, q, k_cache, v_cache, [0]),
    }[op]
    message = f"{op}: KV caches must both be float32, float16 or bfloat16"
    with pytest.raises(TypeError, match=message):
        getattr(ops, op)(*args)
    assert not k_cache.any() and not v_cache.any()


# -- bad input -------------------------------------------------------------------------------------


def test_attention_rejects_heads_not_a_multiple_of_kv_heads():
    cache = np.zeros((2, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_attention(np.zeros((1, 3, 8), np.float32), cache, cache, [[0]], [1], 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.prefill_attention(np.zeros((2, 3, 8), np.float32), cache, cache, [0], 0, 1.0)


def test_paged_attention_rejects_padding_inside_the_context():
    cache = np.zeros((4, 2, 1, 8), np.float32)
    q = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.paged_attention(q, cache, cache, np.array([[0, -1]]), np.array([3]), 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        ops.paged_attention(q, cache, cache, np.array([[0, 1]]), np.array([5]), 1.0)


def test_prefill_attention_rejects_a_too_short_block_table():
    cache = np.zeros((4, 2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="need more than"):
        ops.prefill_attention(np.zeros((3, 1, 8), np.float32), cache, cache, [0], 0, 1.0)


def test_reshape_and_cache_rejects_out_of_range_slots_leaving_cache_intact():
    cache = np.zeros((2, 2, 1, 4), np.float32)
    k = np.ones((2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="outside"):
        ops.reshape_and_cache(k, k, cache, cache, np.array([0, 4]))
    assert not cache.any()
