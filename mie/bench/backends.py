"""``python -m mie.bench --only backends``: the Cython mirrors against the pure-Python reference.

Both sides run in one process on the same inputs, alternately (python, fast, python, fast,
...), so a burst of load from elsewhere hits both and the ratios hold on any machine; each
figure is the best of a few repeats, the least disturbed. Every comparison first checks that
both sides give the same result, so a broken mirror cannot post a good figure.

* **The mechanism simulation**: ``mie.bench.mechanisms``' 256-request workload through
  continuous batching with benchmark 1's limits, answered by the null model. Pure: the
  reference ``Scheduler`` driven by ``mie.bench.simulate.simulate``; fast: ``mie._fast``'s
  ``Scheduler`` driven by the compiled mirror of that loop, ``mie.bench.compiled.simulate``. The
  two ``RunResult`` s (every trace row, latency, rejection) must be equal. Three more rows:
  the fast scheduler under the Python driver (what the driver's own per-entry work costs),
  and benchmarks 3 and 4's prefix-cache and memory-pressure runs.
* **The allocator loop**: one million ``allocate`` / ``decref`` pairs. The reference is driven
  from Python, as its scheduler drives it; the mirror twice: from a Python loop through its
  public API (where the interpreter's loop and calls cost more than the allocator), and from
  compiled code through its C interface, as the fast scheduler drives it.
* **Paged-attention decode**: batch 32 at contexts 512 and 2048 with Qwen2-0.5B's heads
  (14 query heads over 2 KV heads, head_dim 64, blocks scattered over the arena), with a
  float32 KV cache and again with a bfloat16 one.
* **One decode step** of a Qwen2-0.5B-shaped model (random float32 weights, shared by both
  backends) at batch 32, context 512; the logits must agree. The step's matrix products --
  NumPy/BLAS on both backends -- are also timed alone, to show what the mirrors cannot touch.

Without the extension built, the section is a one-line note saying why (not built, or shadowed).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mie.backend import Backend, select
from mie.bench import mechanisms
from mie.bench.section import SectionResult
from mie.bench.simulate import simulate
from mie.bench.table import table
from mie.bench.throughput import QWEN2_05B
from mie.bench.workload import blocks_for, mixed_requests, with_system_prompt
from mie.extension import fast_available, fast_unavailable_reason
from mie.model import Model, ModelConfig, bytes_per_block, kv_view, prepare_inputs
from mie.model.weights import ModelWeights, random_weights
from mie.progress import ProgressBar
from mie.scheduler import BatchEntry, Sequence

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2-0.5B
DECODE_BATCH, DECODE_CONTEXT = 32, 512
# --quick: a two-layer model of the same head shapes, small enough for a smoke test.
QUICK_MODEL = {
    **QWEN2_05B,
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@dataclass
class Comparison:
    name: str
    python_s: float
    fast_s: float
    target: float | None = None  # the speedup aimed for, if any

    @property
    def speedup(self) -> float:
        return self.python_s / self.fast_s


def seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def alternate(
    python_work: Callable[[], object], fast_work: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of each side, the runs interleaved."""
    times = [(seconds(python_work), seconds(fast_work)) for _ in range(repeats)]
    return min(t[0] for t in times), min(t[1] for t in times)


# -- the mechanism simulation ----------------------------------------------------------------
def simulation_work(
    backend: Backend, driver, requests, num_blocks: int, max_num_seqs: int, options: dict
) -> Callable[[], object]:
    """A fresh scheduler of ``backend`` over a 1-byte-block pool, run to the end by ``driver``
    (as ``mie.bench.mechanisms`` does)."""

    def work():
        pool = backend.BlockPool(num_blocks, 1)
        sched = backend.Scheduler(
            pool, BLOCK_SIZE, max_num_seqs, mechanisms.MAX_NUM_BATCHED_TOKENS, **options
        )
        return driver(sched, requests)

    return work


def simulations(seed: int, quick: bool, repeats: int) -> list[Comparison]:
    from mie.bench.compiled import simulate as compiled_simulate

    python, fast = select("python"), select("fast")
    cfg = mechanisms.Config.for_args(quick)
    requests = mixed_requests(seed, cfg.num_requests)
    shared = with_system_prompt(requests, seed, mechanisms.SYSTEM_PROMPT_TOKENS)
    floor = max(blocks_for(r.max_kv_tokens) for r in requests)
    shared_floor = max(blocks_for(r.max_kv_tokens) for r in shared)
    n = len(requests)
    cases = [  # name, workload, pool blocks, scheduler options, fast driver, target
        (
            f"simulation: {n} requests, continuous batching (mechanisms 1)",
            requests,
            cfg.max_num_seqs * floor,
            {},
            compiled_simulate,
            20.0,
        ),
        (
            "  the same, fast scheduler under the Python driver",
            requests,
            cfg.max_num_seqs * floor,
            {},
            simulate,
            None,
        ),
        (
            f"simulation: {n} requests + system prompt, prefix cache (mechanisms 3)",
            shared,
            cfg.max_num_seqs * shared_floor,
            {"prefix_caching": True},
            compiled_simulate,
            None,
        ),
        (
            f"simulation: {n} requests, pool at 2x the floor, preemption (mechanisms 4)",
            requests,
            2 * floor,
            {},
            compiled_simulate,
            None,
        ),
    ]
    results = []
    for name, workload, num_blocks, options, fast_driver, target in cases:
        args = (workload, num_blocks, cfg.max_num_seqs, options)
        python_work = simulation_work(python, simulate, *args)
        fast_work = simulation_work(fast, fast_driver, *args)
        if python_work() != fast_work():
            raise AssertionError(f"the fast scheduler's simulation differs: {name}")
        results.append(Comparison(name, *alternate(python_work, fast_work, repeats), target))
    return results


# -- the allocator and the attention kernel ---------------------------------------------------
def allocator_loop(pool_class: type, pairs: int) -> Callable[[], None]:
    pool = pool_class(1024, 64)

    def work() -> None:
        allocate, decref = pool.allocate, pool.decref
        for _ in range(pairs):
            decref(allocate())

    return work


def decode_inputs(batch: int, context: int, seed: int = 0, cache_dtype=np.float32):
    """paged_attention's arguments for ``batch`` sequences of ``context`` tokens each.

    The caches are one layer's strided views of a two-layer arena laid out like the
    engine's, and every sequence's blocks are scattered at random over it. ``cache_dtype``:
    one of ``mie.ops.KV_CACHE_DTYPES``.
    """
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    arena = rng.standard_normal(shape, dtype=np.float32).astype(cache_dtype)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    q = rng.standard_normal((batch, NUM_HEADS, HEAD_DIM), dtype=np.float32)
    lens = np.full(batch, context, dtype=np.int32)
    return q, arena[:, 1, 0], arena[:, 1, 1], tables, lens, HEAD_DIM**-0.5


def kernels(quick: bool, repeats: int) -> list[Comparison]:
    from mie.bench.compiled import allocate_decref_loop

    python, fast = select("python"), select("fast")
    pairs = 10_000 if quick else 1_000_000
    compiled_pool = fast.BlockPool(1024, 64)
    results = [
        Comparison(
            f"allocator: {pairs:,} allocate/decref pairs, compiled loop (C interface)",
            *alternate(
                allocator_loop(python.BlockPool, pairs),
                lambda: allocate_decref_loop(compiled_pool, pairs),
                repeats,
            ),
            20.0,
        ),
        Comparison(
            "  the same, Python loop (public API)",
            *alternate(
                allocator_loop(python.BlockPool, pairs),
                allocator_loop(fast.BlockPool, pairs),
                repeats,
            ),
        ),
    ]
    batch, contexts = (4, [64]) if quick else (32, [512, 2048])
    # float32 KV (the target), then the same with a bfloat16 cache (half the bytes to read)
    for context, cache_dtype in itertools.product(contexts, [np.float32, ml_dtypes.bfloat16]):
        inputs = decode_inputs(batch, context, cache_dtype=cache_dtype)
        expected = python.kernels.paged_attention(*inputs)
        actual = fast.kernels.paged_attention(*inputs)
        if np.max(np.abs(actual - expected)) > 1e-5 * np.max(np.abs(expected)):
            raise AssertionError(f"fast paged_attention disagrees at context {context}")
        python_s, fast_s = alternate(
            lambda inputs=inputs: python.kernels.paged_attention(*inputs),
            lambda inputs=inputs: fast.kernels.paged_attention(*inputs),
            repeats,
        )
        if cache_dtype == np.float32:
            name = f"paged_attention decode: batch {batch}, context {context}"
            results.append(Comparison(name, python_s, fast_s, 5.0))
        else:
            results.append(Comparison("  the same, bfloat16 KV cache", python_s, fast_s))
    return results


# -- one decode step of the model --------------------------------------------------------------
def decode_step_work(
    model: Model, backend: Backend, batch: int, context: int, kv_values: np.ndarray
):
    """One decode step of ``batch`` sequences at ``context``: every sequence's next token, its
    K/V cache filled with ``kv_values`` (the same on both backends). The inputs are prepared
    once; the work timed is the forward pass."""
    config = model.config
    pool = backend.BlockPool(batch * blocks_for(context + 1), bytes_per_block(config, BLOCK_SIZE))
    pool.arena.view(np.float32)[:] = kv_values
    rng = np.random.default_rng(1)
    entries = []
    for i in range(batch):
        tokens = rng.integers(0, config.vocab_size, context + 1).tolist()
        seq = Sequence(i, tokens, 1, (), pool.new_table(BLOCK_SIZE))
        seq.table.append_tokens(context + 1)
        entries.append(BatchEntry(seq, context, 1, is_prefill=False))
    inputs, kv_cache = prepare_inputs(entries), kv_view(pool, config, BLOCK_SIZE)
    return lambda: model.forward(inputs, kv_cache)


def matmul_work(weights: ModelWeights, batch: int) -> Callable[[], None]:
    """The matrix products of one decode step of ``batch`` tokens, alone (random inputs)."""
    rng = np.random.default_rng(2)
    layer = weights.layers[0]
    inputs = {
        "qkv": rng.random((batch, layer.qkv.weight.shape[1]), dtype=np.float32),
        "o": rng.random((batch, layer.o.weight.shape[1]), dtype=np.float32),
        "down": rng.random((batch, layer.down.weight.shape[1]), dtype=np.float32),
    }

    def work() -> None:  # float32 weights (N, K): each product is x @ W.T
        for layer in weights.layers:
            layer_input = inputs["qkv"]
            layer_input @ layer.qkv.weight.T
            inputs["o"] @ layer.o.weight.T
            layer_input @ layer.gate_up.weight.T
            inputs["down"] @ layer.down.weight.T
        inputs["qkv"] @ weights.lm_head.weight.T

    return work


def decode_step(quick: bool, repeats: int) -> tuple[Comparison, float]:
    """The python-vs-fast decode step, and the seconds its matrix products take alone."""
    config = ModelConfig.from_hf(QUICK_MODEL if quick else QWEN2_05B)
    weights = random_weights(config, seed=0)
    batch, context = (4, 32) if quick else (DECODE_BATCH, DECODE_CONTEXT)
    num_floats = batch * blocks_for(context + 1) * bytes_per_block(config, BLOCK_SIZE) // 4
    kv_values = np.random.default_rng(0).random(num_floats, dtype=np.float32) - np.float32(0.5)
    python_step, fast_step = (
        decode_step_work(
            Model(config, weights, backend.kernels), backend, batch, context, kv_values
        )
        for backend in (select("python"), select("fast"))
    )
    del kv_values
    expected, actual = python_step(), fast_step()
    if np.max(np.abs(actual - expected)) > 1e-4 * np.max(np.abs(expected)):
        raise AssertionError("the fast backend's decode-step logits disagree")
    name = f"decode step: Qwen2-0.5B-shaped, batch {batch}, context {context}"
    if quick:
        name = f"decode step: 2-layer model, batch {batch}, context {context}"
    comparison = Comparison(name, *alternate(python_step, fast_step, repeats))
    matmuls = min(seconds(matmul_work(weights, batch)) for _ in range(repeats))
    return comparison, matmuls


# -- the section -------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> SectionResult:
    """The ``fast`` section of ``python -m mie.bench``; ``args.quick`` shrinks every size."""
    if not fast_available():
        reason = fast_unavailable_reason() or "mie._fast is not built"
        return SectionResult(
            {"backends": None}, f"Fast backend (Cython): section skipped: {reason}."
        )
    import mie._fast

    quick = getattr(args, "quick", False)
    repeats = 1 if quick else 3
    with ProgressBar(3, "backends") as progress:
        progress.update(0, desc="backends: mechanism simulation")
        results = simulations(getattr(args, "seed", 0), quick, repeats)
        progress.update(1, desc="backends: allocator and attention")
        results += kernels(quick, repeats)
        progress.update(1, desc="backends: decode step")
        step, matmul_s = decode_step(quick, repeats)
        results.append(step)
        progress.update(1, desc="backends")
    threads = f"{mie._fast.max_threads()} threads" if mie._fast.OPENMP else "no OpenMP"
    rows = [
        [
            r.name,
            f"{r.python_s * 1e3:.1f} ms",
            f"{r.fast_s * 1e3:.1f} ms",
            f"{r.speedup:.1f}x",
            f">= {r.target:.0f}x" if r.target else "",
        ]
        for r in results
    ]
    report = "\n".join(
        [
            f"Fast backend (Cython) against the pure-Python reference ({threads}); best of "
            f"{repeats}, runs interleaved",
            table(["", "python", "fast", "speedup", "target"], rows),
            f"-> of the decode step, the matrix products alone (NumPy/BLAS on both backends) "
            f"take {matmul_s * 1e3:.1f} ms ({matmul_s / step.python_s:.0%} of the python step).",
        ]
    )
    data = {
        "openmp_threads": mie._fast.max_threads() if mie._fast.OPENMP else 0,
        "repeats": repeats,
        "comparisons": [
            {
                "name": r.name.strip(),
                "python_s": r.python_s,
                "fast_s": r.fast_s,
                "speedup": r.speedup,
                "target": r.target,
            }
            for r in results
        ],
        "decode_step_matmul_s": matmul_s,
    }
    return SectionResult({"backends": data}, report)
