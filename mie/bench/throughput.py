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
4. **Per weight format** (``MODES``: float32, bfloat16, float16 and int8 weights, and 16-bit
   KV caches), each in a fresh subprocess so that its peak resident set is its own: weight
   bytes, peak RSS while it computes, prefill tokens/s of one ``PREFILL_LEN``-token prompt,
   decode tokens/s at batch 1, 8 and 32 (context ``PREFILL_LEN``), and each as a ratio to the
   float32 row of the same run; each the best of ``MODE_ROUNDS`` interleaved rounds
   (``best_of``). The decoding sequences' first ``PREFILL_LEN`` positions are taken as
   cached without being computed (the pool's zeros): attention's cost does not depend on the
   values, and prefilling 32 prompts would take longer than the decode steps.

``--dtype``, ``--quantization`` and ``--kv-cache-dtype`` choose what measurements 1-3 run
with (default float32 throughout); the rows of 4 are always all measured.

Runs interleave nothing else; still, the machine may be shared, so ratios of runs made
seconds apart in one process are the figures to trust, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mie import linear
from mie.backend import Backend, select
from mie.bench import hf_baseline
from mie.bench.child import run_json_child
from mie.bench.section import SectionResult
from mie.bench.table import fmt_bytes
from mie.bench.table import table as text_table
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import SamplingParams
from mie.model import Model, ModelConfig, bytes_per_block, kv_view
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
MODES = (  # (label, dtype, quantization, kv_cache_dtype): the rows of the per-format table
    ("float32", "float32", None, "auto"),
    ("bfloat16", "bfloat16", None, "auto"),
    ("float16", "float16", None, "auto"),
    ("int8", "float32", "int8", "auto"),
    ("int4", "float32", "int4", "auto"),
    ("bfloat16, KV bfloat16", "bfloat16", None, "bfloat16"),
    ("int8, KV bfloat16", "float32", "int8", "bfloat16"),
)
MODE_ROUNDS = 2
"""Each mode runs this many times, interleaved with the others, and keeps its best figures
(``best_of``); ``--quick`` runs one round."""
TARGETS = (  # (mode, measurement, at least this ratio to float32): reported, not asserted
    ("bfloat16", "decode_1", 1.7),
    ("int8", "decode_1", 2.8),
    *(
        (mode, key, 0.9)
        for mode in ("bfloat16", "float16", "int8", "int4")
        for key in ("decode_8", "decode_32", "prefill")
    ),
)


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
    model: Model,
    backend: Backend,
    batch: int,
    repeats: int,
    decode_steps: int,
    kv_cache_dtype: str = "auto",
) -> dict:
    """Prefill tokens/s (``batch`` prompts of PREFILL_LEN) and decode tokens/s at that context.

    Each step is what the engine runs: its backend's ``prepare_inputs`` over the step's
    entries, then the forward pass (the scheduler itself is left out: no admission, no
    sampling)."""
    config = model.config
    need = batch * (-(-(PREFILL_LEN + decode_steps * repeats + 1) // BLOCK_SIZE))
    pool = backend.BlockPool(need, bytes_per_block(config, BLOCK_SIZE, kv_cache_dtype))
    kv_cache = kv_view(pool, config, BLOCK_SIZE, kv_cache_dtype)
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, config.vocab_size, (batch, PREFILL_LEN)).tolist()
    sequences = [Sequence(i, p, 1, (), pool.new_table(BLOCK_SIZE)) for i, p in enumerate(prompts)]
    for seq in sequences:
        seq.table.append_tokens(PREFILL_LEN)
    prefill = [BatchEntry(seq, 0, PREFILL_LEN, is_prefill=True) for seq in sequences]
    prefill_s = median_time(
        lambda: model.forward(backend.prepare_inputs(prefill), kv_cache), repeats
    )

    def decode_step() -> None:
        entries = []
        for seq in sequences:
            seq.token_ids.append(int(rng.integers(config.vocab_size)))
            seq.table.append_tokens(1)
            entries.append(BatchEntry(seq, seq.num_tokens - 1, 1, is_prefill=False))
        model.forward(backend.prepare_inputs(entries), kv_cache)

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


def batch1_times(
    model: Model,
    backend: Backend,
    prompt: list[int],
    decode: list[int],
    repeats: int,
    kv_cache_dtype: str = "auto",
) -> tuple[list[float], list[float]]:
    """One sequence, as llama.cpp is measured (``mie.bench.peers``): each repeat prefills
    ``prompt`` in one forward pass (timed), then decodes ``decode`` one token per forward
    pass (each timed). One untimed warm-up repeat first. Returns the prefill times and the
    decode step times, in seconds."""
    config = model.config
    blocks = -(-(len(prompt) + len(decode)) // BLOCK_SIZE)
    pool = backend.BlockPool(blocks, bytes_per_block(config, BLOCK_SIZE, kv_cache_dtype))
    kv_cache = kv_view(pool, config, BLOCK_SIZE, kv_cache_dtype)
    prefill_s: list[float] = []
    step_s: list[float] = []
    for repeat in range(repeats + 1):
        seq = Sequence(0, list(prompt), 1, (), pool.new_table(BLOCK_SIZE))
        seq.table.append_tokens(len(prompt))
        start = time.perf_counter()
        model.forward(
            backend.prepare_inputs([BatchEntry(seq, 0, len(prompt), is_prefill=True)]), kv_cache
        )
        prefill = time.perf_counter() - start
        steps = []
        for token in decode:
            seq.token_ids.append(token)
            seq.table.append_tokens(1)
            entry = BatchEntry(seq, seq.num_tokens - 1, 1, is_prefill=False)
            start = time.perf_counter()
            model.forward(backend.prepare_inputs([entry]), kv_cache)
            steps.append(time.perf_counter() - start)
        seq.table.release()
        if repeat:
            prefill_s.append(prefill)
            step_s.extend(steps)
    return prefill_s, step_s


def decode_step_time(
    model: Model, backend: Backend, batch: int, steps: int, kv_cache_dtype: str
) -> float:
    """Median seconds of a decode step of ``batch`` sequences at a context of ``PREFILL_LEN``
    (their cached positions are the pool's zeros, not computed; see the module docstring),
    after one untimed step."""
    config = model.config
    blocks = batch * -(-(PREFILL_LEN + steps + 1) // BLOCK_SIZE)
    pool = backend.BlockPool(blocks, bytes_per_block(config, BLOCK_SIZE, kv_cache_dtype))
    kv_cache = kv_view(pool, config, BLOCK_SIZE, kv_cache_dtype)
    rng = np.random.default_rng(batch)
    sequences = []
    for i in range(batch):
        seq = Sequence(
            i,
            rng.integers(0, config.vocab_size, PREFILL_LEN).tolist(),
            1,
            (),
            pool.new_table(BLOCK_SIZE),
        )
        seq.table.append_tokens(PREFILL_LEN)
        sequences.append(seq)
    times = []
    for step in range(steps + 1):
        entries = []
        for seq in sequences:
            seq.token_ids.append(int(rng.integers(config.vocab_size)))
            seq.table.append_tokens(1)
            entries.append(BatchEntry(seq, seq.num_tokens - 1, 1, is_prefill=False))
        start = time.perf_counter()
        model.forward(backend.prepare_inputs(entries), kv_cache)
        if step:
            times.append(time.perf_counter() - start)
    for seq in sequences:
        seq.table.release()
    return float(np.median(times))


def rss_kib() -> dict[str, int]:
    """This process's resident set now (``VmRSS``) and its peak (``VmHWM``), in KiB, from
    /proc/self/status; elsewhere both are ``getrusage``'s peak."""
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"now": peak, "peak": peak}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"now": int(fields["VmRSS"].split()[0]), "peak": int(fields["VmHWM"].split()[0])}


def reset_peak_rss() -> bool:
    """Start the peak resident set afresh at the current one (Linux: ``5`` to
    /proc/self/clear_refs), so the peak measured next excludes the model's construction
    (``Model.random`` draws float32 weights before converting them). False where impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
    except OSError:
        return False
    return True


def mode_rates(hf_config: dict, mode: tuple, quick: bool, seed: int, backend: str | None) -> dict:
    """The per-format measurements of one ``MODES`` row, in this process (run it in a fresh
    one: ``measure_mode``)."""
    label, dtype, quantization, kv_cache_dtype = mode
    config = ModelConfig.from_hf(hf_config)
    chosen = select(backend)
    start = time.perf_counter()
    model = Model.random(
        config, seed=seed, kernels=chosen.kernels, dtype=dtype, quantization=quantization
    )
    result = {
        "mode": label,
        "dtype": dtype,
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "backend": chosen.name,
        "weight_bytes": int(model.weights.nbytes),
        "model_init_s": time.perf_counter() - start,
    }
    memory = rss_kib()
    result["rss_after_load_mib"] = memory["now"] / 1024
    result["peak_rss_load_mib"] = memory["peak"] / 1024
    result["peak_rss_reset"] = reset_peak_rss()
    repeats, steps = (1, 2) if quick else (3, 10)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, PREFILL_LEN).tolist()
    prefill_s, _ = batch1_times(model, chosen, prompt, [], repeats, kv_cache_dtype)
    result["prefill"] = PREFILL_LEN / float(np.median(prefill_s))
    for batch in BATCHES:
        seconds = decode_step_time(model, chosen, batch, steps, kv_cache_dtype)
        result[f"decode_{batch}"] = batch / seconds
    result["peak_rss_mib"] = rss_kib()["peak"] / 1024
    result["load_average"] = os.getloadavg()[0]  # the machine's, this run's own threads included
    return result


def measure_mode(hf_config: dict, mode: tuple, quick: bool, seed: int, backend: str) -> dict:
    """``mode_rates`` in a fresh Python process (``python -m mie.bench.throughput``), so its
    peak RSS holds this mode's memory only; the same mie package as this process."""
    request = {
        "hf_config": hf_config,
        "mode": list(mode),
        "quick": quick,
        "seed": seed,
        "backend": backend,
    }
    return run_json_child(
        "mie.bench.throughput",
        ["--child", json.dumps(request)],
        f"measuring {mode[0]} in a subprocess",
        stderr_tail=2000,
    )


def best_of(rounds: list[list[dict]]) -> list[dict]:
    """Per mode, its best figures over the rounds: the most tokens/s (each already a median
    within its round) and the largest peak RSS. Another process on the machine can only slow
    a run down, and a burst of its load lasting a whole mode's run would otherwise decide
    that mode's ratio; the rounds interleave the modes so each gets more than one chance."""
    best = []
    for runs in zip(*rounds, strict=True):
        row = dict(runs[0], rounds=len(runs))
        for key in ("prefill", *(f"decode_{b}" for b in BATCHES)):
            row[key] = max(run[key] for run in runs)
        row["peak_rss_mib"] = max(run["peak_rss_mib"] for run in runs)
        row["load_averages"] = [run.get("load_average") for run in runs]
        best.append(row)
    return best


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's ratios to the float32 row (the first): bytes and RSS as fractions,
    tokens/s as speed-ups."""
    base = rows[0]
    for row in rows:
        row["ratio"] = {
            key: row[key] / base[key]
            for key in (
                "weight_bytes",
                "peak_rss_mib",
                "prefill",
                *(f"decode_{b}" for b in BATCHES),
            )
        }
    return rows


def target_lines(rows: list[dict]) -> list[str]:
    """The narrow formats' speed targets (``TARGETS``), each met or missed (by how much), from
    this run's ratios."""
    by_mode = {row["mode"]: row for row in rows}
    names = {"prefill": "prefill", **{f"decode_{b}": f"batch-{b} decode" for b in BATCHES}}
    lines = []
    for mode, key, goal in TARGETS:
        if mode not in by_mode:
            continue
        got = by_mode[mode]["ratio"][key]
        verdict = "met" if got >= goal else f"MISSED by {goal - got:.2f}x"
        lines.append(f"- {mode} {names[key]}: {got:.2f}x float32, target >= {goal}x: {verdict}")
    return lines


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


def run_mie(
    model: Model,
    backend: Backend,
    prompts,
    output_lens,
    batch_size: int,
    kv_cache_dtype: str = "auto",
) -> dict:
    engine = LLMEngine(
        model,
        backend=backend,
        max_num_seqs=batch_size,
        prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
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
    precision = {
        "dtype": getattr(args, "dtype", "float32"),
        "quantization": getattr(args, "quantization", None),
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
    }
    result = measure(QWEN2_05B, args.quick, args.seed, args.backend, **precision)
    result["model"] = "Qwen2-0.5B-shaped, random weights"
    return SectionResult({"throughput": result}, report(result))


def measure(
    hf_config: dict,
    quick: bool,
    seed: int,
    backend: str | None,
    *,
    dtype: str = "float32",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    modes: tuple = MODES,
) -> dict:
    """Every measurement of this section, for the model ``hf_config`` describes: the forward
    passes and the mixed workload with weights as ``dtype`` / ``quantization`` and the KV
    cache as ``kv_cache_dtype``, then each of ``modes`` (rows of ``MODES``, the first one
    float32), each in its own process."""
    repeats, decode_steps = (1, 2) if quick else (3, 4)
    num_requests, batch_size = (8, 8) if quick else (64, 32)
    config = ModelConfig.from_hf(hf_config)
    result: dict = {"dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    with ProgressBar(
        len(BATCHES) + 3 + len(modes) * (1 if quick else MODE_ROUNDS), "throughput"
    ) as bar:
        start = time.perf_counter()
        chosen = select(backend)
        model = Model.random(
            config, seed=seed, kernels=chosen.kernels, dtype=dtype, quantization=quantization
        )
        result["backend"] = chosen.name
        result["model_init_s"] = time.perf_counter() - start
        result["weight_bytes"] = int(model.weights.nbytes)
        bar.update(1)
        result["gemm_gflops"] = {f"M={m}": gemm_gflops(m) for m in (1, 8, 32, 128)}
        result["forward"] = []
        for batch in BATCHES:
            result["forward"].append(
                forward_rates(model, chosen, batch, repeats, decode_steps, kv_cache_dtype)
            )
            bar.update(1)
        prompts, output_lens = mixed_workload(num_requests, seed, config.vocab_size, quick)
        workload = {
            "requests": num_requests,
            "batch_size": batch_size,
            "prompt_tokens": sum(len(p) for p in prompts),
            "useful_output_tokens": sum(output_lens),
        }
        workload["mie"] = run_mie(model, chosen, prompts, output_lens, batch_size, kv_cache_dtype)
        result["peak_rss_mib_mie"] = peak_rss_mib()
        del model
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
        result["modes"] = measure_modes(hf_config, quick, seed, chosen.name, modes, bar)
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
    headers = [
        "batch",
        "prefill tok/s",
        "prefill GFLOP/s",
        "decode tok/s",
        "decode step ms",
        "decode GFLOP/s",
    ]
    w = result["mixed_workload"]
    kv = "float32" if result["kv_cache_dtype"] == "auto" else result["kv_cache_dtype"]
    weights = result["quantization"] or result["dtype"]
    if result["quantization"] and result["dtype"] != "float32":
        weights += f" from {result['dtype']}"
    lines = [
        f"Throughput: {result['model']}, weights {weights} ({fmt_bytes(result['weight_bytes'])})"
        f", KV cache {kv} (backend {result['backend']})",
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
    if result.get("modes"):
        lines += ["", modes_report(result["modes"])]
    return "\n".join(lines)


def load_note(rows: list[dict]) -> str:
    """``"; load average 1.9-3.2 ..."``: the 1-minute load averages at the end of the runs
    (about 2 is this benchmark's own two threads; more is other work slowing it down)."""
    loads = [load for row in rows for load in row.get("load_averages", []) if load is not None]
    if not loads:
        return ""
    return (
        f"; load average {min(loads):.1f}-{max(loads):.1f} at the runs' ends (2 threads of "
        "its own: more is other work on the machine)"
    )


def modes_report(rows: list[dict]) -> str:
    """The per-format table: each figure with its ratio to float32, then the targets."""

    def cell(row: dict, key: str, text: str) -> str:
        return f"{text} ({row['ratio'][key]:.2f}x)"

    table_rows = [
        [
            row["mode"],
            cell(row, "weight_bytes", fmt_bytes(row["weight_bytes"])),
            cell(row, "peak_rss_mib", f"{row['peak_rss_mib']:,.0f} MiB"),
            cell(row, "prefill", f"{row['prefill']:.1f}"),
            *(cell(row, f"decode_{b}", f"{row[f'decode_{b}']:.1f}") for b in BATCHES),
        ]
        for row in rows
    ]
    headers = [
        "weights",
        "weight bytes",
        "peak RSS",
        "prefill",
        *(f"decode b={b}" for b in BATCHES),
    ]
    return "\n".join(
        [
            "Per weight format, each in a fresh process: tokens/s of one prompt of "
            f"{PREFILL_LEN} (prefill) and of decode steps at batch b, context {PREFILL_LEN}; "
            "peak RSS while computing (after the model was built); best of "
            f"{rows[0].get('rounds', 1)} rounds; ratio to float32 in parentheses" + load_note(rows),
            text_table(headers, table_rows),
            "Targets (at least this ratio to float32):",
            *target_lines(rows),
        ]
    )


READ_PROBE_BYTES = 256 << 20
"""Bytes the roofline probe reads: eight times the bench VM's 32 MiB L3 cache, so that they
come from memory, as a batch-1 step's weights do."""
BREAKDOWN_TARGETS = {"products_of_read": 0.75, "step_over_roofline": 1.3}
"""The batch-1 targets: every format's matrix products read at no less than 75% of the
measured read bandwidth, and the whole step takes no more than 1.3x its roofline."""


def read_bandwidth(backend: Backend, words: np.ndarray, rounds: int = 5) -> float:
    """GB/s at which ``backend``'s kernel threads read memory now: ``stream_read`` over
    ``words`` (``probe_words``), best of ``rounds``. A batch-1 step reads every weight byte once, so
    its roofline is the weights' bytes at this rate; measured in the same minute as the step
    (this shared VM's rate moves by half from one hour to the next: 30-54 GB/s with two
    threads), the step's distance from it is the kernels', not the moment's."""
    if backend.name == "fast":
        from mie._fast.linear import stream_read
    else:
        stream_read = linear.stream_read
    seconds = min(median_time(lambda: stream_read(words), 1) for _ in range(rounds))
    return words.nbytes / seconds / 1e9


def probe_words() -> np.ndarray:
    """``READ_PROBE_BYTES`` for ``read_bandwidth`` to read, every page written (really there)."""
    return np.arange(READ_PROBE_BYTES // 8, dtype=np.uint64)


BREAKDOWN_ROUNDS = 5
"""Rounds of ``decode_breakdown``: odd, so that one round is the median."""


def decode_breakdown(
    model: Model, backend: Backend, steps: int = 15, rounds: int = BREAKDOWN_ROUNDS
) -> dict:
    """Where a batch-1 decode step's time goes: the whole step (median, context
    ``PREFILL_LEN``) against the model's matrix products alone, each kind timed at M = 1 over
    all layers with the model's own weights and kernel, its bytes and the bandwidth it
    reaches, beside the machine's read bandwidth (``read_bandwidth``) and the roofline it
    gives. The rest of the step (norms, RoPE, attention, activation, the Python around them)
    is the difference.

    Measured in ``rounds`` rounds, each of one moment: the read bandwidth, the step (the
    median of its share of ``steps``) and each kind of product once, back to back. This VM's
    read rate moves within the minute; timed apart -- the step first, the products seconds
    later -- the products of one int8 model came out from 2.7 ms under to 2.3 ms over its step
    in four runs seconds apart, and that drift landed in the rest (in rounds, int8's and
    int4's rest is 0.1-0.7 ms; bench/RESULTS.md). The row returned is the round with the
    median step / roofline, every figure of it from that round (so they agree with one
    another), with the range of both ratios and of the read rate over the rounds, and the
    median of the products' ratio (the round with the median step need not hold it)."""
    w = model.weights
    kinds = {
        "qkv": [layer.qkv for layer in w.layers],
        "o": [layer.o for layer in w.layers],
        "gate_up": [layer.gate_up for layer in w.layers],
        "down": [layer.down for layer in w.layers],
        "lm_head": [w.lm_head],
    }
    rng = np.random.default_rng(0)
    inputs = {
        name: rng.standard_normal((1, linear.input_size(matrices[0].weight)), dtype=np.float32)
        for name, matrices in kinds.items()
    }
    nbytes = {name: sum(m.nbytes for m in matrices) for name, matrices in kinds.items()}
    words = probe_words()  # one allocation for every round's read
    measured = []
    for _ in range(rounds):
        read_gb_s = read_bandwidth(backend, words, 3)
        step_ms = decode_step_time(model, backend, 1, max(1, steps // rounds), "auto") * 1e3
        products = {}
        for name, matrices in kinds.items():

            def work(matrices=matrices, x=inputs[name]) -> None:
                for m in matrices:
                    m.product(x, model.kernels.matmul)

            seconds = median_time(work, 1)
            products[name] = {
                "ms": seconds * 1e3,
                "bytes": nbytes[name],
                "gb_s": nbytes[name] / seconds / 1e9,
            }
        measured.append(breakdown_round(w.nbytes, step_ms, read_gb_s, products))
    del words
    measured.sort(key=lambda r: r["step_over_roofline"])
    row = measured[len(measured) // 2]

    def spread(key: str) -> list[float]:
        return [min(r[key] for r in measured), max(r[key] for r in measured)]

    row.update(
        read_range_gb_s=spread("read_gb_s"),
        products_of_read_range=spread("products_of_read"),
        products_of_read_median=float(np.median([r["products_of_read"] for r in measured])),
        step_over_roofline_range=spread("step_over_roofline"),
    )
    return row


def breakdown_round(weight_bytes: int, step_ms: float, read_gb_s: float, products: dict) -> dict:
    """One round of ``decode_breakdown``: its step, read rate and products, and what follows
    from them."""
    matmul_ms = sum(p["ms"] for p in products.values())
    matmul_bytes = sum(p["bytes"] for p in products.values())
    roofline_ms = weight_bytes / read_gb_s / 1e6
    return {
        "step_ms": step_ms,
        "matmul_ms": matmul_ms,
        "matmul_gb_s": matmul_bytes / matmul_ms / 1e6,
        "rest_ms": step_ms - matmul_ms,
        "read_gb_s": read_gb_s,
        "roofline_ms": roofline_ms,
        "products_of_read": matmul_bytes / matmul_ms / 1e6 / read_gb_s,
        "step_over_roofline": step_ms / roofline_ms,
        "products": products,
    }


def low_high(values: list[float], spec: str) -> str:
    """``[low, high]`` as ``low-high`` in ``spec``'s format."""
    return f"{values[0]:{spec}}-{values[1]:{spec}}"


def missed(by: float, spec: str, unit: str = "") -> str:
    """A missed target's verdict: by how much, or "by less than" the last digit shown when
    that rounds to nothing."""
    shown = f"{by:{spec}}"
    if shown == f"{0:{spec}}":
        step = 0.01 if spec == ".0%" else 10.0 ** -int(spec[1:-1])
        return f"MISSED by less than {step:{spec}}{unit}"
    return f"MISSED by {shown}{unit}"


def breakdown_report(rows: dict[str, dict]) -> str:
    """``decode_breakdown`` per mode as a table, then the targets (judged on each row's
    median round)."""
    kinds = list(next(iter(rows.values()))["products"])
    table_rows = [
        [
            mode,
            f"{r['step_ms']:.1f}",
            f"{r['read_gb_s']:.0f} ({low_high(r['read_range_gb_s'], '.0f')})",
            f"{r['roofline_ms']:.1f}",
            f"{r['step_over_roofline']:.2f}x ({low_high(r['step_over_roofline_range'], '.2f')})",
            f"{r['matmul_ms']:.1f}",
            f"{r['matmul_gb_s']:.0f} ({r['products_of_read']:.0%}; "
            f"{low_high(r['products_of_read_range'], '.0%')})",
            f"{r['rest_ms']:.1f}",
            *(f"{r['products'][k]['ms']:.1f} / {r['products'][k]['gb_s']:.0f}" for k in kinds),
        ]
        for mode, r in rows.items()
    ]
    headers = [
        "weights",
        "step ms",
        "read GB/s (range)",
        "roofline ms",
        "step / roofline (range)",
        "products ms",
        "GB/s (of read; range)",
        "rest ms",
        *(f"{k} ms / GB/s" for k in kinds),
    ]
    products_target = BREAKDOWN_TARGETS["products_of_read"]
    step_target = BREAKDOWN_TARGETS["step_over_roofline"]
    targets = []
    for mode, r in rows.items():
        share, over = r["products_of_read_median"], r["step_over_roofline"]
        targets.append(
            f"- {mode}: products at {share:.0%} of the read bandwidth (the rounds' median; "
            f"rounds {low_high(r['products_of_read_range'], '.0%')}), target >= "
            f"{products_target:.0%}: "
            + ("met" if share >= products_target else missed(products_target - share, ".0%"))
            + f"; step {over:.2f}x its roofline (rounds "
            f"{low_high(r['step_over_roofline_range'], '.2f')}x), target <= {step_target}x: "
            + ("met" if over <= step_target else missed(over - step_target, ".2f", "x"))
        )
    return "\n".join(
        [
            "Batch-1 decode, where the time goes: the step against its matrix products timed "
            "alone (all layers, M = 1); read GB/s: the machine's read bandwidth with the "
            f"kernels' threads (stream_read, {READ_PROBE_BYTES >> 20} MiB); roofline = weight "
            f"bytes at that rate. Each row is the round (of {BREAKDOWN_ROUNDS}: the read, the "
            "step and the products back to back) with the median step / roofline; in "
            "parentheses, the ranges over the rounds",
            text_table(headers, table_rows),
            "Targets:",
            *targets,
        ]
    )


def measure_modes(
    hf_config: dict,
    quick: bool,
    seed: int,
    backend: str | None,
    modes: tuple = MODES,
    progress: ProgressBar | None = None,
) -> list[dict]:
    """Every row of ``modes``, each in a fresh process, ``MODE_ROUNDS`` interleaved rounds
    (``--quick``: one), the best of each (``best_of``), with their ratios to the first."""
    rounds: list[list[dict]] = [[] for _ in range(1 if quick else MODE_ROUNDS)]
    for runs in rounds:  # every mode once per round: A B C A B C
        for mode in modes:
            runs.append(measure_mode(hf_config, mode, quick, seed, backend))
            if progress is not None:
                progress.update(1)
    return with_ratios(best_of(rounds)) if modes else []


def main(argv: list[str] | None = None) -> int:
    """``python -m mie.bench.throughput``: the per-format table alone (the ``MODES`` rows of
    the throughput section, a few minutes), to regenerate bench/RESULTS.md's table without the
    rest of the section. ``--child REQUEST`` is ``measure_mode``'s subprocess: one row,
    printed as one line of JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m mie.bench.throughput",
        description="The throughput section's table per weight format, alone (minutes).",
    )
    parser.add_argument("--quick", action="store_true", help="one round, fewer steps")
    parser.add_argument("--seed", type=int, default=0, help="weights seed")
    parser.add_argument("--backend", choices=("python", "fast"), help="default: the best built")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="instead: where batch-1 decode time goes per weight format (about a minute)",
    )
    parser.add_argument("--child", metavar="REQUEST", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        request = json.loads(args.child)
        result = mode_rates(
            request["hf_config"],
            tuple(request["mode"]),
            request["quick"],
            request["seed"],
            request["backend"],
        )
        print(json.dumps(result))
        return 0
    chosen = select(args.backend)
    if args.breakdown:
        config = ModelConfig.from_hf(QWEN2_05B)
        rows = {}
        for label, dtype, quantization, kv_cache_dtype in MODES:
            if kv_cache_dtype == "auto":  # the weights' formats; the cache barely counts here
                model = Model.random(
                    config, args.seed, chosen.kernels, dtype=dtype, quantization=quantization
                )
                rows[label] = (
                    decode_breakdown(model, chosen, 3, rounds=3)
                    if args.quick
                    else decode_breakdown(model, chosen)
                )
                del model
        print(breakdown_report(rows))
        return 0
    rounds = 1 if args.quick else MODE_ROUNDS
    with ProgressBar(len(MODES) * rounds, "per-format throughput") as bar:
        rows = measure_modes(QWEN2_05B, args.quick, args.seed, chosen.name, progress=bar)
    print(
        f"Throughput per weight format: Qwen2-0.5B-shaped, random weights (backend {chosen.name})"
    )
    print(modes_report(rows))
    if args.json:
        args.json.write_text(json.dumps({"modes": rows}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
