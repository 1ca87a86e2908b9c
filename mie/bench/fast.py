"""Micro-benchmarks of the Cython mirrors against the pure-Python reference, as ratios.

Both sides run in the same process on the same inputs, so the ratio is meaningful on any
machine even though the absolute times are not:

* the allocator loop -- one million ``allocate`` / ``decref`` pairs, driven from Python;
* paged-attention decode -- batch 32 at contexts 512 and 2048 with Qwen2-0.5B's head shapes
  (14 query heads over 2 KV heads, head_dim 64, blocks of 16 tokens scattered over the
  arena), ``mie.ops`` (NumPy) against ``mie._fast``. The outputs are compared first, so a
  broken kernel cannot post a good figure.

Each figure is the best of a few repeats (the least disturbed by other processes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mie.backend import select

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2-0.5B


@dataclass
class Comparison:
    name: str
    python_s: float
    fast_s: float

    @property
    def speedup(self) -> float:
        return self.python_s / self.fast_s


def best_time(work: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``work``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def allocator_loop(pool_class: type, pairs: int) -> Callable[[], None]:
    pool = pool_class(1024, 64)

    def work() -> None:
        allocate, decref = pool.allocate, pool.decref
        for _ in range(pairs):
            decref(allocate())

    return work


def decode_inputs(batch: int, context: int, seed: int = 0):
    """paged_attention's arguments for ``batch`` sequences of ``context`` tokens each.

    The caches are one layer's strided views of a two-layer arena laid out like the
    engine's, and every sequence's blocks are scattered at random over it.
    """
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    arena = rng.standard_normal(shape, dtype=np.float32)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    q = rng.standard_normal((batch, NUM_HEADS, HEAD_DIM), dtype=np.float32)
    lens = np.full(batch, context, dtype=np.int32)
    return q, arena[:, 1, 0], arena[:, 1, 1], tables, lens, HEAD_DIM**-0.5


def run(args: argparse.Namespace) -> list[Comparison]:
    """Run every comparison, print a table, return the figures.

    ``args.quick`` (optional, default False) shrinks every size for a smoke test.
    """
    quick = getattr(args, "quick", False)
    python, fast = select("python"), select("fast")
    repeats = 1 if quick else 3
    pairs = 10_000 if quick else 1_000_000
    results = [
        Comparison(
            f"allocator: {pairs:,} allocate/decref pairs",
            best_time(allocator_loop(python.BlockPool, pairs), repeats),
            best_time(allocator_loop(fast.BlockPool, pairs), repeats),
        )
    ]
    batch, contexts = (4, [64]) if quick else (32, [512, 2048])
    for context in contexts:
        inputs = decode_inputs(batch, context)
        expected, actual = python.paged_attention(*inputs), fast.paged_attention(*inputs)
        if np.max(np.abs(actual - expected)) > 1e-5 * np.max(np.abs(expected)):
            raise AssertionError(f"fast paged_attention disagrees at context {context}")
        results.append(
            Comparison(
                f"paged_attention decode: batch {batch}, context {context}",
                best_time(lambda inputs=inputs: python.paged_attention(*inputs), repeats),
                best_time(lambda inputs=inputs: fast.paged_attention(*inputs), repeats),
            )
        )
    import mie._fast

    threads = f"{mie._fast.max_threads()} threads" if mie._fast.OPENMP else "no OpenMP"
    print(f"| benchmark ({threads}) | python | fast | speedup |")
    print("| --- | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r.name} | {r.python_s * 1e3:.1f} ms | {r.fast_s * 1e3:.1f} ms | {r.speedup:.1f}x |"
        )
    return results
