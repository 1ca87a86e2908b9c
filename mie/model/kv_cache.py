"""How the KV cache lies in the block pool's arena.

One pool serves every layer. Each block is an array of shape
``(num_layers, 2, block_size, num_kv_heads, head_dim)`` -- index 0 along the second axis is K,
1 is V -- so a block holds everything cached about ``block_size`` tokens, and copying a block
(copy-on-write) copies its K/V for every layer at once. The whole arena, viewed without a
copy, is ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``; layer ``l``'s
caches are ``kv[:, l, 0]`` and ``kv[:, l, 1]``, strided views of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``, which is what ``mie.ops`` takes.

The elements are float32 (``kv_cache_dtype="auto"``, exact), or bfloat16 / float16: half the
bytes per token, so the same memory holds twice the tokens (Qwen2-0.5B: 24 layers x 2 x 128
values x 2 bytes = 12,288 bytes per token instead of 24,576). The kernels write rounding to
nearest and read widening to float32 (``mie.ops``).
"""

from __future__ import annotations

import numpy as np

from mie.checks import positive_int
from mie.memory import BlockPool
from mie.model.config import ModelConfig
from mie.model.precision import kv_cache_numpy_dtype


def bytes_per_block(config: ModelConfig, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block: every layer's K and V for ``block_size`` tokens."""
    block_size = positive_int(block_size, "block_size", limit=None)
    itemsize = kv_cache_numpy_dtype(kv_cache_dtype).itemsize
    return config.num_layers * 2 * block_size * config.kv_size * itemsize


def kv_view(
    pool: BlockPool, config: ModelConfig, block_size: int, kv_cache_dtype: str = "auto"
) -> np.ndarray:
    """The arena as ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)`` of
    ``kv_cache_dtype`` (float32 for ``"auto"``; bfloat16 is ``ml_dtypes.bfloat16``).

    A view, not a copy: writing into it writes the pool's blocks.
    """
    expected = bytes_per_block(config, block_size, kv_cache_dtype)
    if pool.bytes_per_block != expected:
        raise ValueError(
            f"pool blocks are {pool.bytes_per_block} bytes; this model with block_size "
            f"{block_size} needs {expected}"
        )
    return pool.arena.view(kv_cache_numpy_dtype(kv_cache_dtype)).reshape(
        pool.num_blocks,
        config.num_layers,
        2,
        block_size,
        config.num_kv_heads,
        config.head_dim,
    )
