"""The Cython attention kernels and KV write against the NumPy reference (``mie.ops``).

Caches are built the way the engine builds them -- per-layer strided views of one arena of
shape (num_blocks, layers, 2, block_size, kv_heads, head_dim) -- with sequences scattered over
shuffled blocks, so the kernels are checked on the memory layout they will really read.
Attention outputs must agree within 1e-5 relative (normwise); the KV write must agree bit for bit;
bad input must raise the same exception with the same message.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import require_fast
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import ops

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fast():
    require_fast()
    import mie._fast

    return mie._fast


def assert_close(actual, expected):
    """Within 1e-5 relative to the output's magnitude (normwise: elements that cancel to
    nearly zero carry an absolute rounding error, which no elementwise bound fits)."""
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    assert np.max(np.abs(actual - expected), initial=0) <= 1e-5 * np.max(np.abs(expected))


def kv_caches(rng, num_blocks, block_size, num_kv_heads, head_dim, num_layers=2, layer=1):
    """K and V views of one layer of a random arena, strided exactly like the engine's."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    arena = rng.standard_normal(shape, dtype=np.float32)
    return arena[:, layer, 0], arena[:, layer, 1]


def scattered_tables(rng, context_lens, block_size, num_blocks, padding):
    """Block tables giving each sequence its own shuffled blocks, padded with -1."""
    needed = [-(-n // block_size) for n in context_lens]
    tables = np.full((len(needed), max(needed) + padding), -1, dtype=np.int32)
    free = iter(rng.permutation(num_blocks))
    for row, count in enumerate(needed):
        tables[row, :count] = [next(free) for _ in range(count)]
    return tables


@st.composite
def decode_cases(draw, max_len=40):
    num_kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([1, 3, 8, 13, 16, 64]))
    block_size = draw(st.integers(1, 8))
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=4))
    num_blocks = sum(-(-n // block_size) for n in lens) + draw(st.integers(0, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k_cache, v_cache = kv_caches(rng, num_blocks, block_size, num_kv_heads, head_dim)
    tables = scattered_tables(rng, lens, block_size, num_blocks, draw(st.integers(0, 2)))
    q = rng.standard_normal((len(lens), num_kv_heads * group, head_dim), dtype=np.float32)
    scale = draw(st.sampled_from([1.0, head_dim**-0.5, 0.05]))
    return q, k_cache, v_cache, tables, np.array(lens, dtype=np.int32), scale


@settings(max_examples=150, deadline=None)
@given(case=decode_cases())
def test_paged_attention_matches_reference(fast, case):
    assert_close(fast.paged_attention(*case), ops.paged_attention(*case))


@settings(max_examples=100, deadline=None)
@given(
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 8, 13, 32]),
    block_size=st.integers(1, 6),
    start=st.integers(0, 30),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_prefill_attention_matches_reference(
    fast, num_kv_heads, group, head_dim, block_size, start, n, seed
):
    rng = np.random.default_rng(seed)
    num_blocks = -(-(start + n) // block_size) + 2
    k_cache, v_cache = kv_caches(rng, num_blocks, block_size, num_kv_heads, head_dim)
    table = list(rng.permutation(num_blocks)[: num_blocks - 1])
    q = rng.standard_normal((n, num_kv_heads * group, head_dim), dtype=np.float32)
    args = q, k_cache, v_cache, table, start, head_dim**-0.5
    assert_close(fast.prefill_attention(*args), ops.prefill_attention(*args))


@settings(max_examples=60, deadline=None)
@given(
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 5, 64]),
    block_size=st.integers(1, 6),
    num_blocks=st.integers(1, 6),
    data=st.data(),
)
def test_reshape_and_cache_writes_the_same_bits(
    fast, num_kv_heads, head_dim, block_size, num_blocks, data
):
    slots = data.draw(st.permutations(range(num_blocks * block_size)))
    slots = slots[: data.draw(st.integers(0, len(slots)))]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    k = rng.standard_normal((len(slots), num_kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((len(slots), num_kv_heads, head_dim))  # float64: cast on write
    arenas = [np.zeros((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), np.float32)]
    arenas.append(arenas[0].copy())
    ops.reshape_and_cache(k, v, arenas[0][:, 1, 0], arenas[0][:, 1, 1], np.array(slots))
    fast.reshape_and_cache(k, v, arenas[1][:, 1, 0], arenas[1][:, 1, 1], np.array(slots))
    assert np.array_equal(arenas[0], arenas[1])


def long_context_inputs():
    """Batch 3 at contexts up to 2048, 14 heads over 2 KV heads, head_dim 64 (Qwen2-0.5B)."""
    rng = np.random.default_rng(0)
    lens = [2048, 1500, 17]
    k_cache, v_cache = kv_caches(rng, 240, 16, 2, 64)
    tables = scattered_tables(rng, lens, 16, 240, padding=1)
    q = rng.standard_normal((3, 14, 64), dtype=np.float32)
    return q, k_cache, v_cache, tables, np.array(lens, dtype=np.int32), 64**-0.5


def test_long_contexts_with_qwen2_head_shapes(fast):
    args = long_context_inputs()
    assert_close(fast.paged_attention(*args), ops.paged_attention(*args))


def test_any_cache_strides_work(fast):
    """A non-contiguous head_dim axis and negative block strides, as well as read-only views."""
    rng = np.random.default_rng(1)
    wide_k, wide_v = kv_caches(rng, 6, 4, 2, 16)
    k_cache, v_cache = wide_k[::-1, :, :, ::2], wide_v[::-1, :, :, ::2]
    k_cache.flags.writeable = v_cache.flags.writeable = False
    tables = np.array([[5, 0, -1], [3, 1, 2]], dtype=np.int32)
    q = np.asfortranarray(rng.standard_normal((2, 4, 8)))  # float64, not C-contiguous
    args = q, k_cache, v_cache, tables, np.array([7, 11]), 0.3
    assert_close(fast.paged_attention(*args), ops.paged_attention(*args).astype(np.float32))


def bad_calls():
    """(name, op, args) for each kind of bad input; a valid call differs in one argument."""
    rng = np.random.default_rng(2)
    k, v = kv_caches(rng, 6, 4, 2, 8)
    q = np.ones((2, 4, 8), np.float32)
    tables, lens = np.array([[0, 1, -1], [2, 3, 4]], np.int32), np.array([5, 9], np.int32)
    new_kv = np.ones((2, 2, 8), np.float32)
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
    ]


@pytest.mark.parametrize("name, op, args", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_bad_input_raises_like_the_reference(fast, name, op, args):
    def raised(implementation):
        with pytest.raises(Exception) as info:
            getattr(implementation, op)(*args)
        return type(info.value), str(info.value)

    assert raised(fast) == raised(ops)


def test_no_sequences_and_no_queries(fast):
    k, v = kv_caches(np.random.default_rng(3), 2, 4, 1, 8)
    empty_q = np.empty((0, 2, 8), np.float32)
    no_tables, no_lens = np.empty((0, 1), np.int32), np.empty(0, np.int32)
    assert fast.paged_attention(empty_q, k, v, no_tables, no_lens, 1.0).shape == (0, 2, 8)
    assert fast.prefill_attention(empty_q, k, v, [0], 3, 1.0).shape == (0, 2, 8)


def test_results_do_not_depend_on_the_thread_count(fast, tmp_path):
    """Bit-identical output from one thread (a fresh process) and from all of them."""
    script = (
        "import sys, numpy as np, mie._fast as fast\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_fast_ops import long_context_inputs\n"
        f"np.save({str(tmp_path / 'one.npy')!r}, fast.paged_attention(*long_context_inputs()))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=ROOT)
    one_thread = np.load(tmp_path / "one.npy")
    assert np.array_equal(one_thread, fast.paged_attention(*long_context_inputs()))
