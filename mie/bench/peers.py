"""``python -m mie.bench --peers``: llama.cpp on the very same weights, in the same run.

The question this answers: at batch 1, where decoding is bound by reading the weights, is
mie as fast as the engine a CPU user would pick instead? Both run the Qwen2-0.5B-shaped model
of the throughput section, with the *same* random weights (``random_weights(config, seed)``)
and the same number of threads:

* **llama.cpp** through ``llama-cpp-python`` (the ``peers`` extra: ``pip install -e
  ".[peers]"``; it compiles llama.cpp from source, which takes minutes). The weights are
  written as GGUF files with the ``gguf`` package, llama.cpp's own writer, in three of its
  formats: ``f32``, ``f16`` and ``q8_0`` (blocks of 32 int8 with a float16 scale, quantized by
  ``gguf.quants``, bit-exact with llama.cpp's C quantizer).
* **mie** with its weights stored ``float32``, ``bfloat16``, ``float16`` and ``int8``
  (``Model.random(config, seed, dtype=..., quantization=...)``: the same float32 values,
  converted at load).

Measured for each: prefill of one ``PROMPT_LEN``-token prompt (tokens/s), then
``DECODE_TOKENS`` tokens decoded one at a time (batch 1) at a context of 128-160 (tokens/s
from the median step). Token ids are fed directly (the GGUF's vocabulary is a placeholder:
llama.cpp never tokenizes text here). The runs alternate mie and llama.cpp, one format pair
after another, ``ROUNDS`` times over, and each figure is the best of its rounds: on a shared
machine another process can only slow a run down.
Printed ratios (mie / llama.cpp, above 1 means mie is faster): float32 vs f32, bfloat16 vs f16,
float16 vs f16, int8 vs q8_0.

**The GGUF files.** llama.cpp's ``qwen2`` loader needs the architecture's hyperparameters and
a vocabulary; the smallest vocabulary it accepts is ``tokenizer.ggml.model = "no_vocab"`` with
``qwen2.vocab_size``: that many placeholder tokens, so the embedding and the LM head have
their real size and llama.cpp computes every logit, as it would for the real model. Tensors
use llama.cpp's names (``blk.N.attn_q.weight`` ...) and the ``(out, in)`` layout of PyTorch
and mie, which the writer stores reversed, as ggml's ``ne`` wants it. Qwen2's RoPE rotates
halves (NeoX style), which is what llama.cpp applies to ``qwen2``: unlike Llama, no
permutation of q and k.
Tied embeddings: no ``output.weight``, llama.cpp then reads ``token_embd.weight`` for the LM
head. As llama.cpp's own converter does, the vectors (norms, biases) stay float32 in every
format, and every matrix (the embedding included) takes the file's format.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mie.backend import Backend, select
from mie.bench import throughput
from mie.bench.section import SectionResult
from mie.bench.table import fmt_bytes
from mie.bench.table import table as text_table
from mie.model import ModelConfig
from mie.model.weights import ModelWeights, random_weights
from mie.progress import ProgressBar

PROMPT_LEN = throughput.PREFILL_LEN
DECODE_TOKENS = 32
GGUF_TYPES = ("f32", "f16", "q8_0")
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}
"""``general.file_type`` (llama.cpp's ``LLAMA_FTYPE_ALL_F32``, ``MOSTLY_F16``, ``MOSTLY_Q8_0``)."""
MIE_MODES = {  # mode name -> Model.random's dtype and quantization
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "float16": ("float16", None),
    "int8": ("float32", "int8"),
}
PAIRS = (("float32", "f32"), ("bfloat16", "f16"), ("float16", "f16"), ("int8", "q8_0"))
"""Which llama.cpp format each mie mode is compared with, in the order they run."""
ROUNDS = 2
"""Every pair runs this many times (``--quick``: once); each figure is the best of them."""
INSTALL_HINT = 'pip install -e ".[peers]"'


def missing_packages() -> list[str]:
    """The peers extra's packages that are not installed (import names)."""
    return [name for name in ("gguf", "llama_cpp") if importlib.util.find_spec(name) is None]


# -- writing GGUF ---------------------------------------------------------------------------
def gguf_tensors(config: ModelConfig, weights: ModelWeights) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor llama.cpp's ``qwen2`` reads, by its GGUF name: float32 views of mie's
    float32 weights, matrices ``(out, in)`` as mie and PyTorch store them, the fused ones
    (``qkv``, ``gate_up``) split back into their rows."""
    if weights.format != "float32":
        raise ValueError(f"GGUF files are written from float32 weights, got {weights.format}")
    q, kv = config.q_size, config.kv_size
    inter = config.intermediate_size
    yield "token_embd.weight", weights.embed.weight
    for i, layer in enumerate(weights.layers):
        p = f"blk.{i}."
        qkv = layer.qkv.weight
        yield p + "attn_norm.weight", layer.input_norm
        yield p + "attn_q.weight", qkv[:q]
        yield p + "attn_k.weight", qkv[q : q + kv]
        yield p + "attn_v.weight", qkv[q + kv :]
        if layer.qkv_bias is not None:
            yield p + "attn_q.bias", layer.qkv_bias[:q]
            yield p + "attn_k.bias", layer.qkv_bias[q : q + kv]
            yield p + "attn_v.bias", layer.qkv_bias[q + kv :]
        yield p + "attn_output.weight", layer.o.weight
        yield p + "ffn_norm.weight", layer.post_norm
        yield p + "ffn_gate.weight", layer.gate_up.weight[:inter]
        yield p + "ffn_up.weight", layer.gate_up.weight[inter:]
        yield p + "ffn_down.weight", layer.down.weight
    yield "output_norm.weight", weights.final_norm
    if weights.lm_head is not weights.embed:
        yield "output.weight", weights.lm_head.weight


def write_gguf(
    path: str | os.PathLike[str], config: ModelConfig, weights: ModelWeights, file_type: str
) -> Path:
    """Write ``weights`` (float32, as ``random_weights`` or ``load_weights`` make them) as a
    GGUF file llama.cpp loads, its matrices in ``file_type`` (``GGUF_TYPES``).

    Only Qwen2 (the architecture whose RoPE needs no permutation of q and k, see the module
    docstring). q8_0 needs every matrix's input dimension to be a multiple of 32.
    """
    import gguf

    if config.architecture != "qwen2":
        raise ValueError(f"write_gguf writes Qwen2 models only, got {config.architecture!r}")
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {list(FILE_TYPES)}, got {file_type!r}")
    qtype = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[file_type]
    path = Path(path)
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_name(f"mie random Qwen2 ({file_type})")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(FILE_TYPES[file_type])
    writer.add_tokenizer_model("no_vocab")  # placeholder tokens: ids are fed directly
    writer.add_vocab_size(config.vocab_size)

    def encode(name: str, tensor: np.ndarray) -> tuple[np.ndarray, object]:
        if tensor.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            return np.ascontiguousarray(tensor, dtype=np.float32), gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.Q8_0 and tensor.shape[1] % 32:
            raise ValueError(f"{name}: q8_0 needs an input dimension that is a multiple of 32")
        data = gguf.quants.quantize(np.ascontiguousarray(tensor, dtype=np.float32), qtype)
        return data, qtype

    # The header lists every tensor's shape and size before any data, so the shapes are
    # declared first (from the float32 shapes) and each tensor is then encoded and written
    # one at a time: never the whole model in memory twice.
    for name, tensor in gguf_tensors(config, weights):
        kind = gguf.GGMLQuantizationType.F32 if tensor.ndim == 1 else qtype
        shape = tensor.shape
        if kind == gguf.GGMLQuantizationType.Q8_0:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind
            )
        else:
            dtype = np.dtype(np.float16 if kind == gguf.GGMLQuantizationType.F16 else np.float32)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            writer.add_tensor_info(name, shape, dtype, nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, tensor in gguf_tensors(config, weights):
        writer.write_tensor_data(encode(name, tensor)[0])
    writer.close()
    return path


# -- running llama.cpp ----------------------------------------------------------------------
def load_llama(path: Path, threads: int, n_ctx: int) -> object:
    """llama.cpp's model and context for ``path``: ``threads`` for prefill and decode alike,
    one batch big enough for the whole prompt, everything else llama.cpp's defaults (its KV
    cache is float16)."""
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_batch=max(PROMPT_LEN, 32),
        n_ubatch=max(PROMPT_LEN, 32),
        verbose=False,
    )


def llama_cpp_rates(llm, prompt: list[int], decode: list[int], repeats: int) -> dict:
    """Prefill and batch-1 decode tokens/s of a loaded ``Llama``: each repeat clears the
    context, evaluates ``prompt`` in one call (timed), then ``decode`` one token per call (each
    timed). One untimed warm-up first. Figures: the median prefill, the median decode step."""
    prefill_s, step_s = [], []
    for repeat in range(repeats + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        steps = []
        for token in decode:
            start = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - start)
        if repeat:
            prefill_s.append(prefill)
            step_s.extend(steps)
    return rates(len(prompt), prefill_s, step_s)


def mie_rates(model, backend: Backend, prompt, decode, repeats: int, kv_cache_dtype: str):
    """The same measurement as ``llama_cpp_rates``, for a mie ``Model`` (see
    ``throughput.batch1_times``)."""
    prefill_s, step_s = throughput.batch1_times(
        model, backend, prompt, decode, repeats, kv_cache_dtype
    )
    return rates(len(prompt), prefill_s, step_s)


def rates(prompt_len: int, prefill_s: list[float], step_s: list[float]) -> dict:
    prefill, step = float(np.median(prefill_s)), float(np.median(step_s))
    return {
        "prefill_tokens_per_s": prompt_len / prefill,
        "decode_tokens_per_s": 1 / step,
        "decode_step_ms": step * 1e3,
    }


def threads_used(backend: Backend) -> int:
    """The threads mie computes on: its OpenMP threads (fast backend), else the CPUs this
    process may use (NumPy's BLAS takes them all)."""
    if backend.name == "fast":
        import mie._fast

        return int(mie._fast.max_threads())
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# -- the section ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> SectionResult:
    """The ``peers`` section of ``python -m mie.bench`` (opt-in: ``--peers``)."""
    if missing := missing_packages():
        text = (
            f"Peers (llama.cpp): skipped, {' and '.join(missing)} not installed: "
            f"{INSTALL_HINT} (llama-cpp-python compiles llama.cpp from source: minutes)"
        )
        return SectionResult({"peers": {"skipped": text}}, text)
    result = measure(
        throughput.QWEN2_05B,
        args.quick,
        args.seed,
        args.backend,
        getattr(args, "kv_cache_dtype", "auto"),
    )
    result["model"] = "Qwen2-0.5B-shaped, random weights"
    return SectionResult({"peers": result}, report(result))


def measure(
    hf_config: dict,
    quick: bool,
    seed: int,
    backend: str | None,
    kv_cache_dtype: str = "auto",
    directory: str | os.PathLike[str] | None = None,
) -> dict:
    """Write the GGUF files (into ``directory``, default a temporary one removed afterwards),
    then measure each pair of ``PAIRS``, mie first, llama.cpp right after it; ``ROUNDS``
    times over (``--quick``: once), each figure the best of its rounds (``best_rates``)."""
    import llama_cpp

    from mie.model import Model

    config = ModelConfig.from_hf(hf_config)
    chosen = select(backend)
    threads = threads_used(chosen)
    repeats, decode_len, rounds = (1, 4, 1) if quick else (3, DECODE_TOKENS, ROUNDS)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, PROMPT_LEN).tolist()
    decode = rng.integers(0, config.vocab_size, decode_len).tolist()
    n_ctx = PROMPT_LEN + decode_len + 16
    result: dict = {
        "backend": chosen.name,
        "threads": threads,
        "llama_cpp_python": llama_cpp.__version__,
        "kv_cache_dtype": kv_cache_dtype,
        "prompt_tokens": PROMPT_LEN,
        "decode_tokens": decode_len,
        "repeats": repeats,
        "rounds": rounds,
        "load_average": [os.getloadavg()[0]],  # at the start and the end (1 minute)
    }
    with (
        tempfile.TemporaryDirectory(dir=directory) as tmp,
        ProgressBar(len(GGUF_TYPES) + 2 * len(PAIRS) * rounds, "peers") as bar,
    ):
        start = time.perf_counter()
        weights = random_weights(config, seed)
        files = {}
        for file_type in GGUF_TYPES:
            files[file_type] = write_gguf(
                Path(tmp) / f"{file_type}.gguf", config, weights, file_type
            )
            bar.update(1)
        del weights
        result["gguf_write_s"] = time.perf_counter() - start
        result["gguf_bytes"] = {t: files[t].stat().st_size for t in GGUF_TYPES}
        runs: list[tuple[list[dict], list[dict]]] = [([], []) for _ in PAIRS]
        for _ in range(rounds):
            for (mode, file_type), (ours, theirs) in zip(PAIRS, runs, strict=True):
                dtype, quantization = MIE_MODES[mode]
                model = Model.random(
                    config, seed, chosen.kernels, dtype=dtype, quantization=quantization
                )
                rates_mie = mie_rates(model, chosen, prompt, decode, repeats, kv_cache_dtype)
                ours.append(dict(rates_mie, weight_bytes=model.weights.nbytes))
                del model
                gc.collect()
                bar.update(1)
                llm = load_llama(files[file_type], threads, n_ctx)
                theirs.append(llama_cpp_rates(llm, prompt, decode, repeats))
                llm.close()  # unmaps the file and frees the context now, not at collection
                del llm
                gc.collect()
                bar.update(1)
    result["load_average"].append(os.getloadavg()[0])
    result["pairs"] = []
    for (mode, file_type), (ours, theirs) in zip(PAIRS, runs, strict=True):
        mie_best, llama_best = best_rates(ours), best_rates(theirs)
        result["pairs"].append(
            {
                "mie": mode,
                "llama_cpp": file_type,
                "mie_rates": mie_best,
                "llama_cpp_rates": dict(llama_best, weight_bytes=result["gguf_bytes"][file_type]),
                "prefill_ratio": mie_best["prefill_tokens_per_s"]
                / llama_best["prefill_tokens_per_s"],
                "decode_ratio": mie_best["decode_tokens_per_s"] / llama_best["decode_tokens_per_s"],
            }
        )
    return result


def best_rates(runs: list[dict]) -> dict:
    """The best of one engine's rounds, figure by figure: the most tokens/s (each a median
    within its round), the shortest step. Another process on a shared machine can only slow a
    run down; the rounds give each side more than one chance at a quiet moment."""
    best = dict(runs[0])
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        best[key] = max(run[key] for run in runs)
    best["decode_step_ms"] = min(run["decode_step_ms"] for run in runs)
    return best


def report(result: dict) -> str:
    """The section as plain text: one row per engine and format, then the ratios."""
    if "skipped" in result:
        return result["skipped"]
    rows = []
    for pair in result["pairs"]:
        for engine, rates_ in (
            (f"mie {pair['mie']}", pair["mie_rates"]),
            (f"llama.cpp {pair['llama_cpp']}", pair["llama_cpp_rates"]),
        ):
            rows.append(
                [
                    engine,
                    fmt_bytes(rates_["weight_bytes"]),
                    f"{rates_['prefill_tokens_per_s']:.1f}",
                    f"{rates_['decode_tokens_per_s']:.1f}",
                    f"{rates_['decode_step_ms']:.1f}",
                ]
            )
    headers = ["engine, weights", "weight bytes", "prefill tok/s", "decode tok/s", "decode ms"]
    ratio_rows = [
        [
            f"mie {pair['mie']} / llama.cpp {pair['llama_cpp']}",
            f"{pair['prefill_ratio']:.2f}x",
            f"{pair['decode_ratio']:.2f}x",
        ]
        for pair in result["pairs"]
    ]
    kv = result["kv_cache_dtype"]
    lines = [
        f"Peers: {result['model']}, the same weights in mie (backend {result['backend']}, KV "
        f"cache {'float32' if kv == 'auto' else kv}) and llama.cpp (llama-cpp-python "
        f"{result['llama_cpp_python']}, KV cache float16: its default), {result['threads']} "
        "threads each",
        f"Prefill of one {result['prompt_tokens']}-token prompt, then {result['decode_tokens']} "
        f"tokens decoded at batch 1; medians of {result['repeats']} repeats, best of "
        f"{result['rounds']} rounds (mie and llama.cpp alternating); llama.cpp's weight bytes "
        f"are its GGUF file's (written in {result['gguf_write_s']:.0f} s); load average "
        f"{result['load_average'][0]:.1f} at the start, {result['load_average'][1]:.1f} at the "
        "end (2 threads of its own: more is other work on the machine)",
        "",
        text_table(headers, rows),
        "",
        text_table(["mie / llama.cpp (above 1: mie faster)", "prefill", "decode"], ratio_rows),
    ]
    return "\n".join(lines)
