"""What the pool and the block tables say about block ids: the sentinel and the misuse error.

A block is named by its integer id, its index in the pool's arena. The pool hands ids out and
takes them back (``mie.memory.pool``); a table lists the ids a sequence holds
(``mie.memory.table``). Both speak of ids with the two names here, which sit below both so that
imports go one way: the table module needs no pool, and the pool module makes tables.
"""

from __future__ import annotations

INVALID_BLOCK = -1
"""What ``BlockPool.allocate`` returns when no block is free; in a ``BlockTable``, the place of
a block released out of a sliding window."""


class AllocatorError(ValueError):
    """A block id was misused: out of range, or referenced while free."""
