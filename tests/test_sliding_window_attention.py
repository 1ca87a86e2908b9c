"""Sliding-window attention in every kernel (NumPy reference, Cython for each instruction set,
CUDA through its CPU emulator) against a dense NumPy oracle written from the definition.

The oracle knows nothing of blocks: each sequence's keys and values are one dense
(positions, kv_heads, head_dim) array, and a query at position ``p`` is masked to positions
``max(0, p - w + 1) .. p`` (transformers' Mistral rule, ``kv_idx > q_idx - sliding_window``,
checked directly against transformers' mask below). The kernels read the same values through
shuffled block tables whose blocks wholly before every query's window are *released*: -1 in
the table, and the physical block they used to name is given to someone else and filled with
huge values, so reading it would show.
"""

import inspect

import numpy as np
import pytest
from conftest import require_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie import ops

FIXTURES_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
GARBAGE = 1e4  # what released blocks hold once reused: far from any real key or value


def dense_attention(q, keys, values, positions, window, scale):
    """q (n, heads, dim) at ``positions`` over keys/values (T, kv_heads, dim), float64."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = np.empty((n, heads, dim))
    for i, p in enumerate(positions):
        first = 0 if window is None else max(0, p - window + 1)
        for h in range(heads):
            k = keys[first : p + 1, h // group].astype(np.float64)
            v = values[first : p + 1, h // group].astype(np.float64)
            s = k @ q[i, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[i, h] = w @ v / w.sum()
    return out


def paged_layout(rng, contexts, block_size, window, num_kv_heads, head_dim, first_positions):
    """Caches holding each sequence's dense K/V in shuffled blocks, and their block tables.

    ``first_positions[s]`` is the first position sequence ``s``'s queries read: its blocks
    wholly before it are released (-1), and their physical blocks, reused, hold GARBAGE.
    """
    needed = [-(-len(k) // block_size) for k, _ in contexts]
    num_blocks = sum(needed) + 1
    k_cache = np.full((num_blocks, block_size, num_kv_heads, head_dim), GARBAGE, np.float32)
    v_cache = k_cache.copy()
    tables = np.full((len(contexts), max(needed) + 1), -1, dtype=np.int32)
    free = iter(rng.permutation(num_blocks))
    for s, ((keys, values), count) in enumerate(zip(contexts, needed, strict=True)):
        released = first_positions[s] // block_size if window is not None else 0
        for j in range(count):
            block = next(free)
            rows = slice(j * block_size, min((j + 1) * block_size, len(keys)))
            filled = rows.stop - rows.start
            if j >= released:  # released blocks keep GARBAGE: someone else's now
                k_cache[block, :filled] = keys[rows]
                v_cache[block, :filled] = values[rows]
                tables[s, j] = block
    return k_cache, v_cache, tables


@st.composite
def decode_cases(draw, head_dims=(1, 4, 8, 13, 16)):
    num_kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from(head_dims))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    lens = draw(st.lists(st.integers(1, 60), min_size=1, max_size=4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    contexts = [
        tuple(rng.standard_normal((n, num_kv_heads, head_dim), dtype=np.float32) for _ in "kv")
        for n in lens
    ]
    firsts = [0 if window is None else max(0, n - window) for n in lens]
    k_cache, v_cache, tables = paged_layout(
        rng, contexts, block_size, window, num_kv_heads, head_dim, firsts
    )
    q = rng.standard_normal((len(lens), num_kv_heads * group, head_dim), dtype=np.float32)
    scale = head_dim**-0.5
    expected = np.concatenate(
        [
            dense_attention(q[s : s + 1], keys, values, [n - 1], window, scale)
            for s, ((keys, values), n) in enumerate(zip(contexts, lens, strict=True))
        ]
    )
    args = (q, k_cache, v_cache, tables, np.array(lens, dtype=np.int32), scale, window)
    return args, expected


@st.composite
def prefill_cases(draw):
    num_kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([1, 4, 8, 13]))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    window = draw(st.one_of(st.none(), st.integers(1, 30)))
    start, n = draw(st.integers(0, 40)), draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    keys, values = (
        rng.standard_normal((start + n, num_kv_heads, head_dim), dtype=np.float32) for _ in "kv"
    )
    first = 0 if window is None else max(0, start - window + 1)
    k_cache, v_cache, tables = paged_layout(
        rng, [(keys, values)], block_size, window, num_kv_heads, head_dim, [first]
    )
    q = rng.standard_normal((n, num_kv_heads * group, head_dim), dtype=np.float32)
    scale = head_dim**-0.5
    expected = dense_attention(q, keys, values, range(start, start + n), window, scale)
    return (q, k_cache, v_cache, tables[0], start, scale, window), expected


def assert_close(actual, expected):
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=2e-5)


# -- the rule itself, against transformers ----------------------------------------------------


def test_the_window_rule_is_transformers_mistral_mask():
    """transformers' sliding-window causal mask for Mistral allows exactly what
    ``ops.first_attended`` says: positions ``max(0, p - w + 1) .. p``."""
    torch = require_module("torch")
    transformers = require_module("transformers")
    from transformers.masking_utils import create_sliding_window_causal_mask

    parameters = inspect.signature(create_sliding_window_causal_mask).parameters
    no_cache = {"cache" if "cache" in parameters else "past_key_values": None}
    for window in (1, 2, 3, 5):
        config = transformers.MistralConfig(
            sliding_window=window, hidden_size=8, num_attention_heads=2, num_key_value_heads=1
        )
        config._attn_implementation = "eager"
        n = 12
        mask = create_sliding_window_causal_mask(
            config=config,
            inputs_embeds=torch.zeros(1, n, 8),
            attention_mask=torch.ones(1, n, dtype=torch.long),
            **no_cache,
            position_ids=torch.arange(n)[None],
        )
        allowed = (mask[0, 0] == 0).numpy()  # eager masks are additive: 0 = attend
        for p in range(n):
            first = int(ops.first_attended(p, window))
            assert allowed[p].tolist() == [first <= t <= p for t in range(n)], (window, p)


# -- reference ---------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(case=decode_cases())
def test_reference_paged_attention_matches_dense_windowed_attention(case):
    args, expected = case
    assert_close(ops.paged_attention(*args), expected)


@settings(max_examples=120, deadline=None)
@given(case=prefill_cases())
def test_reference_prefill_attention_matches_dense_windowed_attention(case):
    args, expected = case
    assert_close(ops.prefill_attention(*args), expected)


def test_a_released_block_inside_the_window_is_refused():
    """-1 is accepted only before the window; inside it the kernels refuse the table."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((4, 2, 1, 4), dtype=np.float32)
    q = rng.standard_normal((1, 1, 4), dtype=np.float32)
    tables = np.array([[-1, 1, 2]], dtype=np.int32)  # context 6, blocks of 2: block 0 released
    ops.paged_attention(q, k, k, tables, np.array([6]), 1.0, sliding_window=4)  # reads 2..5
    with pytest.raises(ValueError, match="outside the cache"):
        ops.paged_attention(q, k, k, tables, np.array([6]), 1.0, sliding_window=5)  # reads 1
    with pytest.raises(ValueError, match="outside the cache"):
        ops.paged_attention(q, k, k, tables, np.array([6]), 1.0)
    ops.prefill_attention(q, k, k, tables[0], 5, 1.0, sliding_window=4)  # query 5 reads 2..5
    with pytest.raises(ValueError, match="outside the cache"):
        ops.prefill_attention(q, k, k, tables[0], 5, 1.0, sliding_window=5)


@pytest.mark.parametrize("window", [0, -1, 2.0, True, "4"])
def test_bad_windows_are_refused(window):
    q = np.zeros((1, 1, 4), dtype=np.float32)
    k = np.zeros((2, 2, 1, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        ops.paged_attention(q, k, k, np.array([[0]]), np.array([1]), 1.0, window)
    with pytest.raises(ValueError, match="sliding_window"):
        ops.prefill_attention(q, k, k, [0], 0, 1.0, window)


# -- Cython, every instruction set ------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES_OK)
@given(case=decode_cases())
def test_fast_paged_attention_matches_dense_windowed_attention(fast, isa, case):
    args, expected = case
    assert_close(fast.paged_attention(*args), expected)


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES_OK)
@given(case=prefill_cases())
def test_fast_prefill_attention_matches_dense_windowed_attention(fast, isa, case):
    args, expected = case
    assert_close(fast.prefill_attention(*args), expected)


def test_fast_refuses_what_the_reference_refuses(fast):
    q = np.zeros((1, 1, 4), dtype=np.float32)
    k = np.zeros((4, 2, 1, 4), dtype=np.float32)
    tables = np.array([[-1, 1, 2]], dtype=np.int32)
    with pytest.raises(ValueError, match="outside the cache"):
        fast.paged_attention(q, k, k, tables, np.array([6]), 1.0, sliding_window=5)
    with pytest.raises(ValueError, match="sliding_window"):
        fast.prefill_attention(q, k, k, [0], 0, 1.0, 0)


# -- CUDA, on the emulator (and a GPU where there is one) ------------------------------------


@pytest.fixture(scope="module")
def cuda_device():
    from cuda_emulator import COMPILER, EmulatorDevice

    if COMPILER is None:
        pytest.skip("no g++ to build the CUDA emulator")
    return EmulatorDevice()


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURES_OK)
@given(case=decode_cases(head_dims=(4, 8, 16)), partition_size=st.sampled_from([None, 32]))
def test_cuda_paged_attention_matches_dense_windowed_attention(cuda_device, case, partition_size):
    """Partitions start at each sequence's window, so a small partition_size splits the
    window itself (the reduce merges exactly the partitions that ran)."""
    from mie.cuda import ops as cuda_ops

    (q, k_cache, v_cache, tables, lens, scale, window), expected = case
    out = cuda_ops.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        scale,
        window,
        partition_size=partition_size,
        device=cuda_device,
    )
    assert_close(out, expected)


def test_cuda_window_wider_than_int32_is_full_attention(cuda_device):
    """The kernels take the window as an int32: a wider one (the reference takes up to 2**62)
    covers every context, as full attention does, instead of overflowing."""
    from mie.cuda import ops as cuda_ops

    rng = np.random.default_rng(3)
    k = rng.standard_normal((3, 4, 1, 8), dtype=np.float32)
    v = rng.standard_normal((3, 4, 1, 8), dtype=np.float32)
    q = rng.standard_normal((1, 2, 8), dtype=np.float32)
    args = (q, k, v, np.array([[2, 0, 1]], dtype=np.int32), np.array([11]), 0.3)
    wide = cuda_ops.paged_attention(*args, 2**40, device=cuda_device)
    assert_close(wide, ops.paged_attention(*args).astype(np.float64))
