"""mie: a miniature LLM inference serving engine -- a scheduler looping over a paged pool."""

from mie.memory import INVALID_BLOCK, AllocatorError, BlockPool, BlockTable

__version__ = "0.1.0"

__all__ = ["INVALID_BLOCK", "AllocatorError", "BlockPool", "BlockTable", "__version__"]
