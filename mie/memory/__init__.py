"""Paged KV-cache memory: a block pool and per-sequence block tables."""

from mie.memory.pool import INVALID_BLOCK, AllocatorError, BlockPool
from mie.memory.table import MAX_TOKEN_COUNT, BlockTable

__all__ = ["INVALID_BLOCK", "MAX_TOKEN_COUNT", "AllocatorError", "BlockPool", "BlockTable"]
