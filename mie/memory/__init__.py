"""Paged KV-cache memory: a block pool and per-sequence block tables."""

from mie.memory.pool import INVALID_BLOCK, AllocatorError, BlockPool
from mie.memory.table import BlockTable

__all__ = ["INVALID_BLOCK", "AllocatorError", "BlockPool", "BlockTable"]
