"""Where a model's matrices live: side by side in a few large regions of memory, each asked of
the kernel as huge pages, instead of one NumPy allocation apiece.

Why: a batch-1 step streams every weight byte once, so how fast memory delivers them sets
the step. With 4 KiB pages each page of a stream costs a TLB miss (a model is far larger than
the TLB reaches) and the CPU's stream prefetcher stops at every page boundary; 2 MiB pages
remove both. NumPy asks for huge pages only for arrays of 4 MiB or more, and only the whole
2 MiB stretches inside them get any: a layer's smaller matrices (Qwen2-0.5B's q/k/v, o and
every int4 scale array) got none, its larger ones a part. Measured on the Intel Xeon VM (2
threads, bench/RESULTS.md): an int4 gate/up product of Qwen2-0.5B's shape read 23.7-24.9
GB/s from 60 separate copies and 29.0-29.2 from copies side by side in one array; the whole
batch-1 step, see ``WeightArena``.

The regions are private anonymous mappings (``mmap``), each starting on a 2 MiB boundary and
advised ``MADV_HUGEPAGE`` where the system has it (Linux; elsewhere they are plain memory).
Nothing is resident until written: the unused end of a region costs address space, and at
most one huge page of memory.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 (and common arm64) transparent huge page: regions start on one."""

REGION_BYTES = 64 << 20
"""Bytes of a region, unless one array needs more (it then gets a region of its own size)."""

ALIGNMENT = 64
"""Each array starts on a cache line: the kernels' vector loads of a row's first bytes then
never straddle two."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def huge_page_region(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed memory as uint8, starting on a ``HUGE_PAGE`` boundary, backed by
    huge pages where the system grants them. Private, not shared: Linux backs shared
    anonymous memory (``mmap``'s default) with huge pages only if shmem is configured to."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    memory = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive
    start = -memory.ctypes.data % HUGE_PAGE
    return memory[start : start + nbytes]


class WeightArena:
    """Places arrays one after another in huge-page regions (``huge_page_region``), each
    ``ALIGNMENT``-aligned; a region is opened when the next array does not fit in the last.
    The model builders place each final matrix (and its scales) as soon as it is made, so
    the temporary arrays it was made from are freed one at a time and loading never holds
    two copies of the model.

    Measured on the Intel Xeon VM (2 threads, alternating fresh processes, the Qwen2-0.5B-
    shaped model): see bench/RESULTS.md, "Weights in huge pages"."""

    def __init__(self) -> None:
        self._region: np.ndarray | None = None
        self._used = 0

    def place(self, array: np.ndarray) -> np.ndarray:
        """A copy of ``array`` (same dtype, shape and values, C-contiguous) in the arena."""
        size = _round_up(array.nbytes, ALIGNMENT)
        if self._region is None or self._used + size > len(self._region):
            self._region = huge_page_region(max(REGION_BYTES, _round_up(size, HUGE_PAGE)))
            self._used = 0
        placed = self._region[self._used : self._used + array.nbytes]
        placed = placed.view(array.dtype).reshape(array.shape)
        placed[...] = array
        self._used += size
        return placed
