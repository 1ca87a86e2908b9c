"""The CUDA kernels against the NumPy references of ``mie.ops``, on random shapes.

Each test runs twice: on a real GPU (skipped where there is none) and on the CPU emulator of
``cuda_emulator.py``, which executes the same ``.cu`` files on CPU threads so CI checks the
kernels' indexing and the wrappers' launches without a GPU. Inputs are drawn by hypothesis
(shapes, lengths at and around block/tile/partition boundaries, GQA ratios, block sizes,
shuffled block tables in a multi-layer arena) and generated from a drawn seed, so every
example is reproducible.

Tolerances: the kernels sum in a different order than NumPy/BLAS and the GPU fuses
multiply-adds, so results agree to float32 rounding, not bit for bit. Elementwise ops
(rms_norm, rope, swiglu): rtol 1e-5, atol 1e-6. Attention, whose outputs are convex
combinations of V rows of order 1 reached through softmax sums over up to thousands of
tokens: rtol 1e-4, atol 2e-5. reshape_and_cache only copies: exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emulator import COMPILER, EmulatorDevice
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import ops
from mie.cuda import CudaUnavailableError, get_device
from mie.cuda import ops as cuda_ops


def _gpu_probe():
    try:
        return get_device(), ""
    except CudaUnavailableError as exc:
        return None, str(exc)


GPU, NO_GPU_REASON = _gpu_probe()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            "emulator",
            marks=pytest.mark.skipif(COMPILER is None, reason="no g++ to build the emulator"),
        ),
        pytest.param(
            "gpu", marks=pytest.mark.skipif(GPU is None, reason=f"no CUDA GPU: {NO_GPU_REASON}")
        ),
    ],
)
def device(request):
    return GPU if request.param == "gpu" else EmulatorDevice()


def _upload(device, arrays, on_device):
    """The arrays as the op's caller would hold them: NumPy, or already on the device."""
    return [device.to_device(a) if on_device else a for a in arrays]


def _host(device, a):
    return device.to_host(a) if device.is_device_array(a) else a


def _check_close(actual, expected, rtol, atol):
    assert isinstance(actual, np.ndarray) and actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


seeds = st.integers(0, 2**32 - 1)


@settings(max_examples=20, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    hidden=st.integers(1, 300),
    eps=st.sampled_from([1e-6, 1e-5]),
    on_device=st.booleans(),
    seed=seeds,
)
def test_rms_norm_matches_reference(device, lead, hidden, eps, on_device, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*lead, hidden)) * rng.uniform(0.01, 10)).astype(np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    out = cuda_ops.rms_norm(*_upload(device, [x, weight], on_device), eps, device=device)
    _check_close(_host(device, out), ops.rms_norm(x, weight, eps), rtol=1e-5, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(1, 8),
    heads=st.integers(1, 6),
    half=st.integers(1, 64),
    max_position=st.sampled_from([16, 4096, 131072]),
    theta=st.sampled_from([10000.0, 1000000.0]),
    on_device=st.booleans(),
    seed=seeds,
)
def test_rope_matches_reference(device, tokens, heads, half, max_position, theta, on_device, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, heads, 2 * half)).astype(np.float32)
    positions = rng.integers(0, max_position, tokens)
    out = cuda_ops.rope(*_upload(device, [x, positions], on_device), theta, device=device)
    _check_close(_host(device, out), ops.rope(x, positions, theta), rtol=1e-5, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    scale=st.sampled_from([1.0, 30.0, 200.0]),  # 200: exp(-gate) overflows, silu -> -0
    on_device=st.booleans(),
    seed=seeds,
)
def test_swiglu_matches_reference(device, shape, scale, on_device, seed):
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal(shape) * scale).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    out = cuda_ops.swiglu(*_upload(device, [gate, up], on_device), device=device)
    _check_close(_host(device, out), ops.swiglu(gate, up), rtol=1e-5, atol=1e-6)


def _arena(rng, num_blocks, num_layers, block_size, num_kv_heads, head_dim):
    """A random KV arena in mie's layout (num_blocks, layers, K/V, block_size, kvh, hd)."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return rng.standard_normal(shape).astype(np.float32)


@settings(max_examples=20, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 8, 16, 32]),
    num_kv_heads=st.integers(1, 4),
    head_dim=st.sampled_from([4, 8, 12, 64, 128]),
    num_tokens=st.integers(1, 40),
    on_device=st.booleans(),
    data=st.data(),
)
def test_reshape_and_cache_writes_exactly_the_slots(
    device, num_layers, block_size, num_kv_heads, head_dim, num_tokens, on_device, data
):
    rng = np.random.default_rng(data.draw(seeds, label="seed"))
    num_blocks = -(-num_tokens // block_size) + data.draw(st.integers(0, 3), label="spare")
    layer = data.draw(st.integers(0, num_layers - 1), label="layer")
    arena = _arena(rng, num_blocks, num_layers, block_size, num_kv_heads, head_dim)
    k, v = rng.standard_normal((2, num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens]
    expected = arena.copy()
    ops.reshape_and_cache(k, v, expected[:, layer, 0], expected[:, layer, 1], slots)

    if on_device:  # caches are views into one device arena, as in the engine
        device_arena = device.to_device(arena)
        k_in, v_in, slots_in = _upload(device, [k, v, slots], True)
        caches = device_arena[:, layer, 0], device_arena[:, layer, 1]
        cuda_ops.reshape_and_cache(k_in, v_in, *caches, slots_in, device=device)
        arena = device.to_host(device_arena)
    else:
        cuda_ops.reshape_and_cache(
            k, v, arena[:, layer, 0], arena[:, layer, 1], slots, device=device
        )
    np.testing.assert_array_equal(arena, expected)  # the slots, and nothing else


def _context_lengths(max_len, block_size, partition):
    """Lengths from 1 to max_len, biased to the edges of blocks, tiles and partitions."""
    edges = {1, max_len}
    for unit in (block_size, cuda_ops.TILE_TOKENS, partition or 0):
        for multiple in (unit, 2 * unit, 3 * unit):
            edges |= {multiple - 1, multiple, multiple + 1}
    edges = sorted(e for e in edges if 1 <= e <= max_len)
    return st.one_of(st.sampled_from(edges), st.integers(1, max_len))


@settings(max_examples=25, deadline=None)
@given(
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 7, 8]),
    head_dim=st.sampled_from([4, 8, 16, 64, 128]),
    block_size=st.sampled_from([1, 4, 16, 32]),
    num_layers=st.integers(1, 2),
    num_seqs=st.integers(1, 4),
    partition_size=st.sampled_from([None, 32, 64, 100, 256]),
    on_device=st.booleans(),
    data=st.data(),
)
def test_paged_attention_matches_reference(
    device,
    num_kv_heads,
    group,
    head_dim,
    block_size,
    num_layers,
    num_seqs,
    partition_size,
    on_device,
    data,
):
    max_len = 300 if device.name == "emulator" else 3000
    lengths = _context_lengths(max_len, block_size, partition_size)
    lens = np.array(data.draw(st.lists(lengths, min_size=num_seqs, max_size=num_seqs)), np.int32)
    rng = np.random.default_rng(data.draw(seeds, label="seed"))
    blocks_per_seq = -(-lens // block_size)
    spare = data.draw(st.integers(0, 4), label="spare blocks")
    num_blocks = int(blocks_per_seq.sum()) + spare
    arena = _arena(rng, num_blocks, num_layers, block_size, num_kv_heads, head_dim)
    layer = data.draw(st.integers(0, num_layers - 1), label="layer")
    # Shuffled physical blocks; rows padded with -1 past each sequence's last block.
    width = int(blocks_per_seq.max()) + data.draw(st.integers(0, 2), label="padding")
    tables = np.full((num_seqs, width), -1, np.int32)
    physical = iter(rng.permutation(num_blocks))
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = [next(physical) for _ in range(n)]
    q = rng.standard_normal((num_seqs, num_kv_heads * group, head_dim)).astype(np.float32)
    scale = float(head_dim**-0.5)
    expected = ops.paged_attention(q, arena[:, layer, 0], arena[:, layer, 1], tables, lens, scale)

    if on_device:
        device_arena = device.to_device(arena)
        caches = device_arena[:, layer, 0], device_arena[:, layer, 1]
        q_in, tables_in, lens_in = _upload(device, [q, tables, lens], True)
    else:
        caches = arena[:, layer, 0], arena[:, layer, 1]
        q_in, tables_in, lens_in = q, tables, lens
    out = cuda_ops.paged_attention(
        q_in, *caches, tables_in, lens_in, scale, partition_size=partition_size, device=device
    )
    _check_close(_host(device, out), expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("context_len", [511, 4097])
def test_paged_attention_long_context_qwen_shapes(device, context_len):
    """Qwen2-0.5B's heads (14 query, 2 KV, dim 64), one long sequence split into partitions."""
    rng = np.random.default_rng(context_len)
    block_size, num_blocks = 16, 300
    arena = _arena(rng, num_blocks, 1, block_size, 2, 64)
    tables = rng.permutation(num_blocks)[None, : -(-context_len // block_size)].astype(np.int32)
    lens = np.array([context_len], np.int32)
    q = rng.standard_normal((1, 14, 64)).astype(np.float32)
    expected = ops.paged_attention(q, arena[:, 0, 0], arena[:, 0, 1], tables, lens, 0.125)
    out = cuda_ops.paged_attention(
        q, arena[:, 0, 0], arena[:, 0, 1], tables, lens, 0.125, device=device
    )
    _check_close(out, expected, rtol=1e-4, atol=2e-5)


def test_bad_inputs_raise_before_any_launch(device):
    rng = np.random.default_rng(0)
    arena = device.to_device(_arena(rng, 4, 1, 4, 4, 8))
    k_cache, v_cache = arena[:, 0, 0], arena[:, 0, 1]
    q = device.to_device(rng.standard_normal((1, 8, 8)).astype(np.float32))
    tables, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)

    def attention(**change):
        args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables}
        args |= {"context_lens": lens, "scale": 0.5, **change}
        return cuda_ops.paged_attention(**args, device=device)

    for change, message in [
        ({"q": q[0]}, "num_seqs, num_heads, head_dim"),
        ({"q": device.to_device(np.zeros((1, 6, 8), np.float32))}, "multiple of num_kv_heads"),
        ({"q": device.to_device(np.zeros((1, 8, 8)))}, "float32"),
        ({"context_lens": np.array([0], np.int32)}, "do not fit the block tables"),
        ({"context_lens": np.array([9], np.int32)}, "do not fit the block tables"),
        ({"block_tables": np.array([[0, 4]], np.int32)}, "outside the cache"),
        ({"block_tables": np.array([[-1, 1]], np.int32)}, "outside the cache"),
        ({"block_tables": tables[0]}, "block_tables"),
        ({"k_cache": k_cache.transpose(0, 2, 1, 3)}, "contiguous .* slab"),
        ({"v_cache": arena[:, 0, 0, :, :1]}, "must match"),
    ]:
        with pytest.raises(ValueError, match=message):
            attention(**change)

    wide = device.to_device(np.zeros((1, 1, 1, 2, 256), np.float32))  # 16 heads x dim 256
    with pytest.raises(ValueError, match="shared memory"):
        cuda_ops.paged_attention(
            np.zeros((1, 16, 256), np.float32),
            wide[:, 0],
            wide[:, 0],
            tables[:, :1],
            [1],
            1.0,
            device=device,
        )
    odd = device.to_device(np.zeros((2, 1, 1, 2, 6), np.float32))
    with pytest.raises(ValueError, match="head_dim % 4"):
        cuda_ops.paged_attention(
            np.zeros((1, 2, 6), np.float32),
            odd[:, 0],
            odd[:, 0],
            tables[:, :1],
            [1],
            1.0,
            device=device,
        )

    before = device.to_host(arena)
    k = np.zeros((1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="outside"):
        cuda_ops.reshape_and_cache(k, k, k_cache, v_cache, [16], device=device)
    with pytest.raises(ValueError, match="do not fit"):
        cuda_ops.reshape_and_cache(k, k[:, :2], k_cache, v_cache, [3], device=device)
    np.testing.assert_array_equal(device.to_host(arena), before)  # nothing was written

    with pytest.raises(ValueError, match="at most 65535 partitions"):
        cuda_ops.paged_attention(
            q,
            k_cache,
            v_cache,
            np.zeros((1, 20000), np.int32),
            [70000],
            0.5,
            partition_size=1,
            device=device,
        )
    misaligned = device.to_device(np.zeros(1 + 4 * 8, np.float32))[1:]
    with pytest.raises(ValueError, match="16-byte boundary"):
        cuda_ops.reshape_and_cache(
            misaligned.reshape(1, 4, 8), k, k_cache, v_cache, [3], device=device
        )

    with pytest.raises(ValueError, match="even head_dim"):
        cuda_ops.rope(np.zeros((1, 1, 3), np.float32), [0], 10000.0, device=device)
    with pytest.raises(ValueError, match="one position per token"):
        cuda_ops.rope(np.zeros((2, 1, 4), np.float32), [0], 10000.0, device=device)
    with pytest.raises(ValueError, match="one shape"):
        cuda_ops.swiglu(np.zeros(3, np.float32), np.zeros(4, np.float32), device=device)
    with pytest.raises(ValueError, match="weight"):
        cuda_ops.rms_norm(
            np.zeros((2, 3), np.float32), np.zeros(4, np.float32), 1e-6, device=device
        )
