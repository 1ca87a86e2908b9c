"""Where a batch-1 decode step's CPU time goes, operation by operation, immune to other load.

    OMP_NUM_THREADS=1 python scripts/decode_cpu_profile.py --quantization int4

The Qwen2-0.5B-shaped model of ``mie.bench.throughput`` (random weights), a 128-token prompt
prefilled, then ``--steps`` decode steps at batch 1 on the fast backend, each kernel and
reference op of the forward pass wrapped to add up the CPU time of this thread
(``time.thread_time``). With one thread every operation runs on this thread, and CPU time
leaves out the time another process takes the core -- which wall-clock figures on a shared
2-core VM do not (``python -m mie.bench.throughput --breakdown`` times wall-clock, two
threads). What it cannot show: the parallel speed-up, and the cost of waking threads.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import time

import numpy as np

from mie import ops
from mie.backend import select
from mie.bench import throughput
from mie.model import Model, ModelConfig
from mie.model import model as model_module
from mie.model.inputs import prepare_inputs
from mie.scheduler import BatchEntry, Sequence

KERNELS = (
    "matmul",
    "paged_attention",
    "reshape_and_cache",
    "prefill_attention",
    "rms_norm",
    "apply_rope",
    "swiglu",
)
OPS = ("rope_cos_sin",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", choices=["int8", "int4"])
    parser.add_argument("--kv-cache-dtype", default="float16")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: run with OMP_NUM_THREADS=1 for CPU times that add up (see the docstring)")
    config = ModelConfig.from_hf(throughput.QWEN2_05B)
    backend = select("fast")
    model = Model.random(
        config, 0, backend.kernels, dtype=args.dtype, quantization=args.quantization
    )
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 128).tolist()
    blocks = -(-(len(prompt) + args.steps + 4) // throughput.BLOCK_SIZE)
    pool = backend.BlockPool(
        blocks, throughput.bytes_per_block(config, throughput.BLOCK_SIZE, args.kv_cache_dtype)
    )
    kv_cache = throughput.kv_view(pool, config, throughput.BLOCK_SIZE, args.kv_cache_dtype)
    seq = Sequence(0, list(prompt), 1, (), pool.new_table(throughput.BLOCK_SIZE))
    seq.table.append_tokens(len(prompt))
    model.forward(prepare_inputs([BatchEntry(seq, 0, len(prompt), is_prefill=True)]), kv_cache)

    spent: collections.Counter = collections.Counter()

    def timed(name, function):
        def wrapper(*a, **k):
            start = time.thread_time()
            try:
                return function(*a, **k)
            finally:
                spent[name] += time.thread_time() - start

        return wrapper

    kernels = model.kernels
    model.kernels = dataclasses.replace(
        kernels, **{name: timed(name, getattr(kernels, name)) for name in KERNELS}
    )
    for name in OPS:
        setattr(model_module.ops, name, timed(name, getattr(ops, name)))
    total = 0.0
    for step in range(args.steps + 3):  # 3 untimed warm-up steps
        if step == 3:
            spent.clear()
            total = 0.0
        seq.token_ids.append(5)
        seq.table.append_tokens(1)
        entry = BatchEntry(seq, seq.num_tokens - 1, 1, is_prefill=False)
        start = time.thread_time()
        model.forward(prepare_inputs([entry]), kv_cache)
        total += time.thread_time() - start
    label = args.quantization or args.dtype
    print(f"{label}: {total / args.steps * 1e3:.2f} ms of CPU a batch-1 decode step")
    for name, seconds in spent.most_common():
        print(f"  {name}: {seconds / args.steps * 1e3:.3f} ms")
    rest = total - sum(spent.values())
    print(f"  the rest (the forward pass's own Python and NumPy): {rest / args.steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
