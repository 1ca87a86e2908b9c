"""The CUDA ops: ``mie.ops`` on the GPU, same arguments, same results (float32).

Each function mirrors its NumPy reference in ``mie.ops`` and launches the kernel of the same
name in ``cuda/``, on ``device`` (default: ``get_device()``). Arrays may be host NumPy arrays
or arrays of the library that device uses (pycuda ``GPUArray`` or CuPy ``ndarray``): host
inputs are copied to the device, and the result comes back as a NumPy array when the first
(activation) argument was one, else it stays on the device. ``reshape_and_cache`` writes its
caches in place either way.

KV caches are the per-layer views of the KV arena (``mie.model.kv_cache``): each block a
contiguous (block_size, num_kv_heads, head_dim) slab, consecutive blocks any fixed number of
floats apart -- the kernels take the base address and that block stride.

Bad shapes raise ``ValueError`` as the references do. KV caches must be float32: a float16 or
bfloat16 cache (which the CPU kernels take) is refused with ``TypeError`` before any GPU call.
Index *values* (block tables, context lengths, slots) are checked when they are host arrays;
device-resident ones are trusted, since checking them would cost a device-to-host copy per
call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mie.checks import (
    check_block_tables,
    check_cache_write,
    check_paged_attention_shapes,
    check_sliding_window,
    check_slots,
)
from mie.cuda.device import CudaDevice, get_device

ATTENTION_THREADS = 128  # NUM_THREADS of paged_attention.cu
TILE_TOKENS = 32  # TILE_TOKENS of paged_attention.cu
ROW_PADDING = 4  # ROW_PADDING of paged_attention.cu
MAX_SHARED_BYTES = 48 * 1024  # dynamic shared memory every CUDA device grants without opt-in
MAX_GRID_Z = 65535  # CUDA's limit on gridDim.z, the number of partitions
MIN_PARTITION = 128  # tokens: below this, splitting a context costs more than it gains
BLOCKS_PER_MULTIPROCESSOR = 4  # enough resident thread blocks to keep loads in flight


def rms_norm(x: Any, weight: Any, eps: float, *, device: CudaDevice | None = None) -> Any:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis (hidden)."""
    device = device or get_device()
    x, weight = _array(device, x), _array(device, weight)
    hidden = x.shape[-1] if x.ndim else 0
    if x.ndim < 1 or weight.shape != (hidden,):
        raise ValueError(
            f"rms_norm: x {x.shape} needs a weight of shape (hidden,), got {weight.shape}"
        )
    out = device.empty(x.shape, np.float32)
    rows = x.size // hidden if hidden else 0
    if rows:
        device.launch(
            "rms_norm",
            "rms_norm",
            (rows, 1, 1),
            (128, 1, 1),
            [
                out,
                _device(device, x, "x"),
                _device(device, weight, "weight"),
                np.int32(hidden),
                np.float32(eps),
            ],
        )
    return _result(device, out, x)


def rope(x: Any, positions: Any, theta: float, *, device: CudaDevice | None = None) -> Any:
    """Rotary position embedding of ``x`` (tokens, heads, head_dim) at ``positions`` (tokens,)."""
    device = device or get_device()
    x, positions = _array(device, x), _array(device, positions)
    if x.ndim != 3 or positions.shape != (x.shape[0],):
        raise ValueError(
            f"rope needs x (tokens, heads, head_dim) and one position per token, got x "
            f"{x.shape} and positions {positions.shape}"
        )
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    out = device.empty(x.shape, np.float32)
    if x.size:
        device.launch(
            "rope",
            "rope",
            (num_tokens, 1, 1),
            (128, 1, 1),
            [
                out,
                _device(device, x, "x"),
                _device(device, positions, "positions", np.int64),
                np.int32(num_heads),
                np.int32(head_dim),
                np.float64(theta),
            ],
            shared_bytes=head_dim * 4,
        )
    return _result(device, out, x)


def swiglu(gate: Any, up: Any, *, device: CudaDevice | None = None) -> Any:
    """The gated MLP activation: ``silu(gate) * up``."""
    device = device or get_device()
    gate, up = _array(device, gate), _array(device, up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} must have one shape")
    out = device.empty(gate.shape, np.float32)
    threads = 256  # NUM_THREADS of swiglu.cu
    if gate.size:
        blocks = min(-(-gate.size // threads), 32 * device.multiprocessor_count)
        device.launch(
            "swiglu",
            "swiglu",
            (blocks, 1, 1),
            (threads, 1, 1),
            [out, _device(device, gate, "gate"), _device(device, up, "up"), np.int64(gate.size)],
        )
    return _result(device, out, gate)


def reshape_and_cache(
    k: Any,
    v: Any,
    k_cache: Any,
    v_cache: Any,
    slot_mapping: Any,
    *,
    device: CudaDevice | None = None,
) -> None:
    """Write new tokens' keys and values (tokens, kv_heads, head_dim) into their slots, in place.

    ``slot_mapping[i]`` is token ``i``'s slot (``block * block_size + offset``). Slots must be
    distinct: two tokens writing one slot is a race on the GPU.
    """
    _check_float32_caches("reshape_and_cache", k_cache, v_cache)
    device = device or get_device()
    k, v, slots = _array(device, k), _array(device, v), _array(device, slot_mapping)
    check_cache_write(k.shape, v.shape, slots.shape, k_cache.shape, v_cache.shape)
    num_blocks, block_size = k_cache.shape[:2]
    if isinstance(slots, np.ndarray):
        check_slots(slots, num_blocks, block_size)
    row_len = k.shape[1] * k.shape[2]
    if row_len % 4:
        raise ValueError(f"the CUDA kernels need num_kv_heads * head_dim % 4 == 0, got {row_len}")
    on_host = not device.is_device_array(k_cache)
    if on_host != (not device.is_device_array(v_cache)):
        raise ValueError("reshape_and_cache: k_cache and v_cache must both be host or both device")
    if not slots.size:
        return
    k_dev, v_dev = (
        (_device(device, c, "cache") for c in (k_cache, v_cache)) if on_host else (k_cache, v_cache)
    )
    device.launch(
        "reshape_and_cache",
        "reshape_and_cache",
        (slots.shape[0], 1, 1),
        (128, 1, 1),
        [
            k_dev,
            v_dev,
            _aligned(device, _device(device, k, "k"), "k"),
            _aligned(device, _device(device, v, "v"), "v"),
            _device(device, slots, "slot_mapping", np.int64),
            np.int32(row_len),
            np.int32(block_size),
            np.int64(_block_stride(device, k_dev, v_dev)),
        ],
    )
    if on_host:
        k_cache[...] = device.to_host(k_dev)
        v_cache[...] = device.to_host(v_dev)


def paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    context_lens: Any,
    scale: float,
    sliding_window: int | None = None,
    *,
    partition_size: int | None = None,
    device: CudaDevice | None = None,
) -> Any:
    """Decode attention: one query token per sequence over its cached context (its last
    ``sliding_window`` positions when given; blocks before them may be -1).

    Arguments as ``mie.ops.paged_attention``. ``partition_size`` (tokens per thread block,
    default: chosen from the batch shape and the GPU) only changes how the work is split:
    partitions cut each sequence's attended positions, from the first one in its window.
    """
    _check_float32_caches("paged_attention", k_cache, v_cache)
    # 0 for full attention; a window past int32 (the kernels' context lengths) covers all.
    window = min(check_sliding_window("paged_attention", sliding_window), 2**31 - 1)
    device = device or get_device()
    q = _array(device, q)
    tables, lens = _array(device, block_tables), _array(device, context_lens)
    group = check_paged_attention_shapes(
        q.shape, k_cache.shape, v_cache.shape, tables.shape, lens.shape
    )
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if head_dim % 4:
        raise ValueError(f"the CUDA kernels need head_dim % 4 == 0, got {head_dim}")
    shared_bytes = attention_shared_bytes(head_dim, group)
    if shared_bytes > MAX_SHARED_BYTES:
        raise ValueError(
            f"paged_attention: head_dim {head_dim} with {group} query heads per KV head needs "
            f"{shared_bytes} bytes of shared memory, over the {MAX_SHARED_BYTES} available"
        )
    max_blocks = tables.shape[1]
    if isinstance(tables, np.ndarray) and isinstance(lens, np.ndarray) and num_seqs:
        check_block_tables(tables, lens.astype(np.int64), block_size, num_blocks, window)
        longest = int(lens.max())
    else:
        longest = max_blocks * block_size  # an upper bound; shorter sequences exit early
    if window:
        longest = min(longest, window)  # positions attended, what partitions cut
    if partition_size is None:
        partition_size = _partition_size(num_seqs * num_kv_heads, longest, device)
    num_partitions = max(1, -(-longest // max(partition_size, 1)))
    if partition_size < 1 or num_partitions > MAX_GRID_Z:
        raise ValueError(
            f"partition_size {partition_size} must be positive and cut {longest} tokens into "
            f"at most {MAX_GRID_Z} partitions"
        )

    out = device.empty(q.shape, np.float32)
    if num_seqs == 0:
        return _result(device, out, q)
    on_host = not device.is_device_array(k_cache)
    k_dev, v_dev = (
        (_device(device, c, "cache") for c in (k_cache, v_cache)) if on_host else (k_cache, v_cache)
    )
    lens_dev = _device(device, lens, "context_lens", np.int32)
    if num_partitions == 1:
        partial_max = partial_sum = partial_acc = out  # not touched by a single partition
    else:
        partial_max = device.empty((num_seqs, num_heads, num_partitions), np.float32)
        partial_sum = device.empty((num_seqs, num_heads, num_partitions), np.float32)
        partial_acc = device.empty((num_seqs, num_heads, num_partitions, head_dim), np.float32)
    device.launch(
        "paged_attention",
        "paged_attention_partition",
        (num_seqs, num_kv_heads, num_partitions),
        (ATTENTION_THREADS, 1, 1),
        [
            out,
            partial_max,
            partial_sum,
            partial_acc,
            _device(device, q, "q"),
            k_dev,
            v_dev,
            _device(device, tables, "block_tables", np.int32),
            lens_dev,
            np.float32(scale),
            np.int32(group),
            np.int32(head_dim),
            np.int32(block_size),
            np.int64(_block_stride(device, k_dev, v_dev)),
            np.int32(max_blocks),
            np.int32(partition_size),
            np.int32(window),
        ],
        shared_bytes=shared_bytes,
    )
    if num_partitions > 1:
        device.launch(
            "paged_attention",
            "paged_attention_reduce",
            (num_seqs, num_heads, 1),
            (ATTENTION_THREADS, 1, 1),
            [
                out,
                partial_max,
                partial_sum,
                partial_acc,
                lens_dev,
                np.int32(head_dim),
                np.int32(num_partitions),
                np.int32(partition_size),
                np.int32(window),
            ],
        )
    return _result(device, out, q)


def attention_shared_bytes(head_dim: int, group: int) -> int:
    """Dynamic shared memory of one paged-attention thread block (see paged_attention.cu)."""
    tiles = 2 * TILE_TOKENS * (head_dim + ROW_PADDING)
    per_head = 2 * head_dim + TILE_TOKENS + 3
    return 4 * (tiles + group * per_head)


def _partition_size(base_blocks: int, longest: int, device: CudaDevice) -> int:
    """Tokens per thread block: split contexts only as far as filling the GPU needs.

    ``base_blocks`` (sequences x KV heads) thread blocks exist anyway; contexts are cut into
    enough partitions for BLOCKS_PER_MULTIPROCESSOR blocks per multiprocessor, but never into
    pieces shorter than MIN_PARTITION tokens. Rounded up to whole tiles.
    """
    wanted = BLOCKS_PER_MULTIPROCESSOR * device.multiprocessor_count
    splits = max(1, min(-(-wanted // max(base_blocks, 1)), -(-longest // MIN_PARTITION)))
    per_split = -(-longest // splits)
    return -(-per_split // TILE_TOKENS) * TILE_TOKENS


def _check_float32_caches(op: str, k_cache: Any, v_cache: Any) -> None:
    """Refuse caches that are not float32, before any GPU call: the CUDA kernels read float32
    only, where ``mie.ops`` and ``mie._fast`` also take float16 and bfloat16 caches."""
    dtypes = [
        np.dtype(c.dtype if hasattr(c, "dtype") else np.asarray(c).dtype)
        for c in (k_cache, v_cache)
    ]
    if any(dtype != np.float32 for dtype in dtypes):
        raise TypeError(
            f"{op}: the CUDA kernels take float32 KV caches only, got k_cache {dtypes[0]} and "
            f"v_cache {dtypes[1]} (float16 and bfloat16 caches run on the CPU kernels: mie.ops, "
            "mie._fast)"
        )


def _block_stride(device: CudaDevice, k_cache: Any, v_cache: Any) -> int:
    """Floats between consecutive blocks of both caches, after checking the in-block layout."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    inner = (num_kv_heads * head_dim * 4, head_dim * 4, 4)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != np.float32:
            raise ValueError(f"{name} must be float32, got {cache.dtype}")
        strides = zip(cache.shape[1:], cache.strides[1:], inner, strict=True)
        if any(n > 1 and s != want for n, s, want in strides):
            raise ValueError(
                f"{name}: each block must be a contiguous (block_size, num_kv_heads, head_dim) "
                f"slab, got strides {cache.strides} for shape {cache.shape}"
            )
        _aligned(device, cache, name)
    if k_cache.strides[0] != v_cache.strides[0] or k_cache.strides[0] % 16:
        raise ValueError(
            f"k_cache and v_cache need one block stride, a multiple of 16 bytes; got "
            f"{k_cache.strides[0]} and {v_cache.strides[0]}"
        )
    return k_cache.strides[0] // 4


def _aligned(device: CudaDevice, a: Any, name: str) -> Any:
    """``a``, after checking it starts on a 16-byte boundary (kernels read it as float4)."""
    if device.pointer(a) % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (it is read as float4)")
    return a


def _array(device: CudaDevice, a: Any) -> Any:
    """``a`` itself if it is a device array, else as a NumPy array."""
    return a if device.is_device_array(a) else np.asarray(a)


def _device(device: CudaDevice, a: Any, name: str, dtype: Any = np.float32) -> Any:
    """``a`` on the device, C-contiguous, of ``dtype``: host data is copied up; device data
    must already be so (converting it would hide a copy per call)."""
    if not device.is_device_array(a):
        return device.to_device(np.ascontiguousarray(a, dtype=dtype))
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(
            f"{name} must be a C-contiguous {np.dtype(dtype).name} device array, got "
            f"{a.dtype} with strides {a.strides}"
        )
    return a


def _result(device: CudaDevice, out: Any, first_input: Any) -> Any:
    """The output on the side its first input came from."""
    return out if device.is_device_array(first_input) else device.to_host(out)
