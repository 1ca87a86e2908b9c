"""Wall-clock throughput of the real compute path, next to Hugging Face transformers.

A Qwen2-0.5B-shaped model with random weights is made on the fly (no download); the numbers
depend only on its shapes. Three measurements:

1. **Prefill and decode** tokens/s of the forward pass at batch 1, 8 and 32 (median of a few
   repeats; decode at a context of ``PREFILL_LEN`` tokens), next to the machine's own NumPy
   GEMM rate, so the distance to the hardware limit is visible.
2. **The mixed workload** (fixed seed; prompts 32-256 tokens, outputs 16-128) through mie's
   continuous batching, and through transformers' ``generate`` in static batches of the same
   size (left padding, greedy). Only each request's own output tokens count, for both.
3. **Peak memory** (the process's peak resident set, weights included).

Runs interleave nothing else; still, the machine may be shared, so ratios of runs made
seconds apart in one process are the figures to trust, not absolute times.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import numpy as np

from mie.backend import Backend, select
from mie.bench import hf_baseline
from mie.bench.section import SectionResult
from mie.bench.table import table as text_table
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import SamplingParams
from mie.model import Model, ModelConfig, bytes_per_block, kv_view, prepare_inputs
from mie.progress import ProgressBar
from mie.scheduler import BatchEntry, Sequence

QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
BLOCK_SIZE = 16
PREFILL_LEN = 128
BATCHES = (1, 8, 32)


def median_time(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def gemm_gflops(rows: int, repeats: int = 5) -> float:
    """NumPy float32 ``x @ W`` rate at Qwen2-0.5B's MLP shape (K=896, N=4864)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 896), dtype=np.float32)
    w = rng.standard_normal((896, 4864), dtype=np.float32)
    seconds = median_time(lambda: x @ w, repeats)
    return 2 * rows * 896 * 4864 / seconds / 1e9


def flops_per_token(config: ModelConfig, context: float, lm_head: bool = True) -> float:
    """Matrix-product FLOPs of one token: the layers' weights, attention over ``context``
    positions, and (if its logits are computed) the LM head."""
    h, layers = config.hidden_size, config.num_layers
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    per_layer += 3 * h * config.intermediate_size
    attention = 2 * config.num_heads * config.head_dim * context  # scores and weighted sum
    head = config.vocab_size * h if lm_head else 0
    return 2 * (layers * per_layer + head) + 2 * layers * attention


def prefill_flops(config: ModelConfig, num_tokens: int) -> float:
    """FLOPs of prefilling one prompt: every token through the layers (causal attention sees
    (n + 1) / 2 positions on average), the LM head for the last token only."""
    body = num_tokens * flops_per_token(config, (num_tokens + 1) / 2, lm_head=False)
    return body + 2 * config.vocab_size * config.hidden_size


def forward_rates(
    model: Model, backend: Backend, batch: int, repeats: int, decode_steps: int
) -> dict:
    """Prefill tokens/s (``batch`` prompts of PREFILL_LEN) and decode tokens/s at that context.

    Each step is what the engine runs: ``prepare_inputs`` over the step's entries, then the
    forward pass (the scheduler itself is left out: no admission, no sampling)."""
    config = model.config
    need = batch * (-(-(PREFILL_LEN + decode_steps * repeats + 1) // BLOCK_SIZE))
    pool = backend.BlockPool(need, bytes_per_block(config, BLOCK_SIZE))
    kv_cache = kv_view(pool, config, BLOCK_SIZE)
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, config.vocab_size, (batch, PREFILL_LEN)).tolist()
    sequences = [Sequence(i, p, 1, (), pool.new_table(BLOCK_SIZE)) for i, p in enumerate(prompts)]
    for seq in sequences:
        seq.table.append_tokens(PREFILL_LEN)
    prefill = [BatchEntry(seq, 0, PREFILL_LEN, is_prefill=True) for seq in sequences]
    prefill_s = median_time(lambda: model.forward(prepare_inputs(prefill), kv_cache), repeats)

    def decode_step() -> None:
        entries = []
        for seq in sequences:
            seq.token_ids.append(int(rng.integers(config.vocab_size)))
            seq.table.append_tokens(1)
            entries.append(BatchEntry(seq, seq.num_tokens - 1, 1, is_prefill=False))
        model.forward(prepare_inputs(entries), kv_cache)

    decode_s = median_time(decode_step, repeats * decode_steps) if decode_steps else 0.0
    for seq in sequences:
        seq.table.release()
    return {
        "batch": batch,
        "prefill_tokens_per_s": batch * PREFILL_LEN / prefill_s,
        "decode_tokens_per_s": batch / decode_s,
        "decode_step_ms": decode_s * 1e3,
        "decode_gflops": batch * flops_per_token(config, PREFILL_LEN) / decode_s / 1e9,
        "prefill_gflops": batch * prefill_flops(config, PREFILL_LEN) / prefill_s / 1e9,
    }


def mixed_workload(num_requests: int, seed: int, vocab: int, quick: bool):
    """Prompts 32-256 tokens, outputs 16-128 (quick: 32-64 and 8-16), uniform, fixed seed."""
    rng = np.random.default_rng(seed)
    prompt_range, output_range = ((32, 64), (8, 16)) if quick else ((32, 256), (16, 128))
    prompts = [
        rng.integers(0, vocab, rng.integers(*prompt_range, endpoint=True)).tolist()
        for _ in range(num_requests)
    ]
    outputs = rng.integers(*output_range, endpoint=True, size=num_requests).tolist()
    return prompts, outputs


def run_mie(model: Model, prompts, output_lens, batch_size: int) -> dict:
    engine = LLMEngine(model, max_num_seqs=batch_size, prefix_caching=False)
    start = time.perf_counter()
    for prompt, n in zip(prompts, output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    useful = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                useful += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return {"useful_tokens": useful, "seconds": seconds, "useful_tokens_per_s": useful / seconds}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(args: argparse.Namespace) -> SectionResult:
    """The ``throughput`` section of ``python -m mie.bench``."""
    result = measure(QWEN2_05B, args.quick, args.seed, args.backend)
    result["model"] = "Qwen2-0.5B-shaped, random weights, float32"
    return SectionResult({"throughput": result}, report(result))


def measure(hf_config: dict, quick: bool, seed: int, backend: str | None) -> dict:
    """Every measurement of this section, for the model ``hf_config`` describes."""
    repeats, decode_steps = (1, 2) if quick else (3, 4)
    num_requests, batch_size = (8, 8) if quick else (64, 32)
    config = ModelConfig.from_hf(hf_config)
    result: dict = {}
    with ProgressBar(len(BATCHES) + 3, "throughput") as bar:
        start = time.perf_counter()
        chosen = select(backend)
        model = Model.random(config, seed=seed, kernels=chosen.kernels)
        result["backend"] = chosen.name
        result["model_init_s"] = time.perf_counter() - start
        bar.update(1)
        result["gemm_gflops"] = {f"M={m}": gemm_gflops(m) for m in (1, 8, 32, 128)}
        result["forward"] = []
        for batch in BATCHES:
            result["forward"].append(forward_rates(model, chosen, batch, repeats, decode_steps))
            bar.update(1)
        prompts, output_lens = mixed_workload(num_requests, seed, config.vocab_size, quick)
        workload = {
            "requests": num_requests,
            "batch_size": batch_size,
            "prompt_tokens": sum(len(p) for p in prompts),
            "useful_output_tokens": sum(output_lens),
        }
        workload["mie"] = run_mie(model, prompts, output_lens, batch_size)
        result["peak_rss_mib_mie"] = peak_rss_mib()
        bar.update(1)
        if hf_baseline.available():
            hf_model = hf_baseline.build_model(hf_config, seed)
            static = hf_baseline.generate_static(hf_model, prompts, output_lens, batch_size)
            workload["transformers_static"] = {
                "useful_tokens": static.useful_tokens,
                "generated_tokens": static.generated_tokens,
                "seconds": static.seconds,
                "useful_tokens_per_s": static.useful_tokens_per_s,
            }
            workload["mie_over_transformers"] = (
                workload["mie"]["useful_tokens_per_s"] / static.useful_tokens_per_s
            )
            del hf_model
        else:
            workload["transformers_static"] = None
        bar.update(1)
        result["mixed_workload"] = workload
    return result


def report(result: dict) -> str:
    """The section as plain text, like the others: the forward-pass table, the workload
    comparison, memory."""
    gemm = ", ".join(f"{k}: {v:.0f}" for k, v in result["gemm_gflops"].items())
    rows = [
        [
            row["batch"],
            f"{row['prefill_tokens_per_s']:.1f}",
            f"{row['prefill_gflops']:.0f}",
            f"{row['decode_tokens_per_s']:.1f}",
            f"{row['decode_step_ms']:.1f}",
            f"{row['decode_gflops']:.0f}",
        ]
        for row in result["forward"]
    ]
    headers = ["batch", "prefill tok/s", "prefill GFLOP/s", "decode tok/s", "decode step ms",
               "decode GFLOP/s"]  # fmt: skip
    w = result["mixed_workload"]
    lines = [
        f"Throughput: {result['model']} (backend {result['backend']})",
        f"NumPy GEMM GFLOP/s (K=896, N=4864): {gemm}",
        "",
        text_table(headers, rows),
        "",
        f"Mixed workload: {w['requests']} requests, {w['prompt_tokens']:,} prompt tokens, "
        f"{w['useful_output_tokens']:,} useful output tokens, batch {w['batch_size']}",
        f"- mie (continuous batching): {w['mie']['useful_tokens_per_s']:.1f} useful tok/s "
        f"({w['mie']['seconds']:.1f} s)",
    ]
    hf = w["transformers_static"]
    if hf is None:
        lines.append("- transformers: not installed (pip install '.[bench]'), baseline skipped")
    else:
        lines.append(
            f"- transformers generate (static batches): {hf['useful_tokens_per_s']:.1f} useful "
            f"tok/s ({hf['seconds']:.1f} s; {hf['generated_tokens']:,} tokens generated, "
            f"{hf['generated_tokens'] - hf['useful_tokens']:,} of them past their request's end)"
        )
        lines.append(f"-> ratio mie / transformers: {w['mie_over_transformers']:.2f}x")
    lines.append(f"\nPeak RSS after mie's runs: {result['peak_rss_mib_mie']:.0f} MiB")
    return "\n".join(lines)
