"""Paged KV-cache memory: a block pool and per-sequence block tables."""

from mie.memory.block_ids import INVALID_BLOCK, AllocatorError
from mie.memory.pool import BlockPool
from mie.memory.table import BlockTable

__all__ = ["INVALID_BLOCK", "AllocatorError", "BlockPool", "BlockTable"]
