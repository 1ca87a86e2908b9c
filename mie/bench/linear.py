"""``python -m mie.bench.linear``: the reduced-precision matrix products against float32 BLAS.

Qwen2-0.5B's projections (K = 896: attention output N = 896, fused QKV N = 1152, fused
gate/up N = 9728, LM head N = 151936; the down projection K = 4864, N = 896) at M = 1, 8, 32
and 128 rows, each product timed as:

* ``float32``: NumPy ``x @ w`` with ``w`` stored ``(K, N)``, as the float32 model keeps it;
  (each column cycles through copies of its weight totalling ``COLD_BYTES``, so the weight
  is read from memory, not from the last-level cache, as in a real decode step)
* ``bfloat16`` / ``float16`` / ``int8``: ``mie._fast.linear.matmul`` with the weight stored
  ``(N, K)`` (``mie.linear``), on the instruction set chosen by ``--isa`` (default: the best).

The runs of one shape and M are interleaved (float32, bfloat16, float16, int8, float32, ...)
and each figure is the median of ``--repeats``, so a burst of load from another process
hits every column alike. Each result is checked against the reference before it is timed.
Reported: milliseconds per product, the ratio to float32 (above 1 is faster), and the
hardware figure that bounds that M: at M = 1 GB/s of weight bytes read (the product is a
matrix-vector one, bound by memory bandwidth), at M = 128 GFLOP/s (compute-bound).

Set the thread counts before running (``OMP_NUM_THREADS`` for the kernels,
``OPENBLAS_NUM_THREADS`` for NumPy), e.g. ``OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2``.
Not part of ``python -m mie.bench``'s sections: this measures kernels, not the engine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from mie import linear

SHAPES = (  # (name, K, N)
    ("o_proj", 896, 896),
    ("qkv", 896, 1152),
    ("gate_up", 896, 9728),
    ("down", 4864, 896),
    ("lm_head", 896, 151936),
)
ROWS = (1, 8, 32, 128)
DTYPES = ("float32", "bfloat16", "float16", "int8")
CHECK_ROWS = 4096
"""Output channels checked against the reference before timing (all of them but the LM head's)."""
COLD_BYTES = 96 << 20
"""Weight bytes cycled through per column: more than the L3 cache (32 MiB on the bench VM)."""


def _weights(k: int, n: int, seed: int) -> dict[str, tuple]:
    """One random weight in every format: the callable's extra arguments and its bytes."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02)
    q, scales = linear.quantize_int8(w)
    return {
        "float32": (np.ascontiguousarray(w.T),),  # (K, N): the float32 model's layout
        "bfloat16": (linear.to_bfloat16(w),),
        "float16": (w.astype(np.float16),),
        "int8": (q, scales),
    }


def _cycle(copies: list[tuple], fn: Callable) -> Callable[[], object]:
    """A call of ``fn`` on the next copy of the weight's arrays, round robin."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        return fn(*copies[state["i"]])

    return call


def _median_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run(rows=ROWS, shapes=SHAPES, repeats: int = 5, isa: str | None = None, seed: int = 0):
    """Time every shape, M and dtype; yield one result dict per (shape, M)."""
    from mie._fast import linear as fast

    if isa:
        fast.set_isa(isa)
    for name, k, n in shapes:
        weights = _weights(k, n, seed)
        nbytes = {d: sum(a.nbytes for a in args) for d, args in weights.items()}
        # Distinct copies, used in turn, that together overflow the last-level cache: every
        # product reads its weight from memory, as a model's decode step (~1 GB) does.
        copies = {
            d: [args] + [tuple(a.copy() for a in args) for _ in range(-(-COLD_BYTES // b) - 1)]
            for (d, args), b in zip(weights.items(), nbytes.values(), strict=True)
        }
        for m in rows:
            x = np.random.default_rng(seed + m).standard_normal((m, k), dtype=np.float32)
            fns = {"float32": _cycle(copies["float32"], lambda w, x=x: x @ w)}
            for dtype in DTYPES[1:]:
                fns[dtype] = _cycle(copies[dtype], lambda *a, x=x: fast.matmul(x, *a))
            for dtype in DTYPES[1:]:  # checked first: a broken kernel posts no figure
                part = tuple(a[:CHECK_ROWS] for a in weights[dtype])  # LM head: memory
                got, ref = fast.matmul(x, *part), linear.matmul(x, *part)
                bound = np.abs(x) @ np.abs(linear.widen(*part)).T
                if not np.all(np.abs(got - ref) <= 1e-5 * bound + 1e-30):
                    raise AssertionError(f"{dtype} {name} M={m}: the kernel disagrees")
                del got, ref, bound
            for fn in fns.values():  # warm up (page faults, thread pools)
                fn()
            times: dict[str, list[float]] = {d: [] for d in DTYPES}
            for _ in range(repeats):
                for dtype in DTYPES:
                    times[dtype] += _median_ms(fns[dtype], 1)
            ms = {d: statistics.median(t) for d, t in times.items()}
            yield {
                "shape": name,
                "K": k,
                "N": n,
                "M": m,
                "ms": ms,
                "bytes": nbytes,
                "flops": 2.0 * m * n * k,
            }


def _format(result: dict) -> str:
    ms, m = result["ms"], result["M"]
    cells = []
    for d in DTYPES:
        t = ms[d]
        if m == 1:
            rate = f"{result['bytes'][d] / t / 1e6:6.1f} GB/s"
        else:
            rate = f"{result['flops'] / t / 1e6:6.1f} GFLOP/s"
        ratio = "" if d == "float32" else f" x{ms['float32'] / t:4.2f}"
        cells.append(f"{t:8.3f} ms {rate}{ratio}")
    return (
        f"| {result['shape']:8} | {result['K']:5} | {result['N']:6} | {m:4} | "
        + " | ".join(cells)
        + " |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", help="force an instruction set (mie._fast.linear.ISAS)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    args = parser.parse_args(argv)
    from mie._fast import linear as fast

    shapes = [s for s in SHAPES if s[0] in args.shapes]
    if args.isa:
        fast.set_isa(args.isa)
    print(
        f"# mie.bench.linear: {platform.processor() or platform.machine()}, ISA {fast.ISA} "
        f"(supported: {', '.join(fast.supported_isas())}), OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', '-')} OPENBLAS_NUM_THREADS="
        f"{os.environ.get('OPENBLAS_NUM_THREADS', '-')}, load {os.getloadavg()[0]:.2f}, "
        f"median of {args.repeats}"
    )
    print("| shape | K | N | M | " + " | ".join(DTYPES) + " |")
    print("|---|---|---|---|" + "---|" * len(DTYPES))
    for result in run(args.rows, shapes, args.repeats):
        print(_format(result), flush=True)
    print(f"# load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
