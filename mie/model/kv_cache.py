"""How the KV cache lies in the block pool's arena.

One pool serves every layer. Each block is a float32 array of shape
``(num_layers, 2, block_size, num_kv_heads, head_dim)`` -- index 0 along the second axis is K,
1 is V -- so a block holds everything cached about ``block_size`` tokens, and copying a block
(copy-on-write) copies its K/V for every layer at once. The whole arena, viewed without a
copy, is ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``; layer ``l``'s
caches are ``kv[:, l, 0]`` and ``kv[:, l, 1]``, strided views of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``, which is what ``mie.ops`` takes.
"""

from __future__ import annotations

import numpy as np

from mie.checks import positive_int
from mie.memory import BlockPool
from mie.model.config import ModelConfig

FLOAT32_BYTES = 4


def bytes_per_block(config: ModelConfig, block_size: int) -> int:
    """Bytes of one block: every layer's K and V for ``block_size`` tokens, float32."""
    positive_int(block_size, "block_size", limit=None)
    return config.num_layers * 2 * block_size * config.kv_size * FLOAT32_BYTES


def kv_view(pool: BlockPool, config: ModelConfig, block_size: int) -> np.ndarray:
    """The arena as ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)`` float32.

    A view, not a copy: writing into it writes the pool's blocks.
    """
    expected = bytes_per_block(config, block_size)
    if pool.bytes_per_block != expected:
        raise ValueError(
            f"pool blocks are {pool.bytes_per_block} bytes; this model with block_size "
            f"{block_size} needs {expected}"
        )
    return pool.arena.view(np.float32).reshape(
        pool.num_blocks,
        config.num_layers,
        2,
        block_size,
        config.num_kv_heads,
        config.head_dim,
    )
