"""``python -m mie.bench --peers``: llama.cpp on the very same weights, each engine alone.

The question this answers: at batch 1, where decoding is bound by reading the weights, is
mie as fast as the engine a CPU user would pick instead? Both run the Qwen2-0.5B-shaped model
of the throughput section, with the *same* random weights (``random_weights(config, seed)``)
and the same number of threads:

* **llama.cpp** through ``llama-cpp-python`` (the ``peers`` extra: ``pip install -e
  ".[peers]"``; it compiles llama.cpp from source, which takes minutes). The weights are
  written as GGUF files with the ``gguf`` package, llama.cpp's own writer, in three of its
  formats: ``f32``, ``f16`` and ``q8_0`` (blocks of 32 int8 with a float16 scale, quantized
  by ``gguf.quants``, bit-exact with llama.cpp's C quantizer). Two more are what llama.cpp's
  own quantizer (``llama-quantize``) makes of the f32 file, as users' 4-bit files are made:
  ``q4_0`` (blocks of 32 4-bit codes with a float16 scale; the output matrix, here the tied
  embedding, kept in 8 bits, as mie's int4 keeps it in int8) and ``q4_k_m`` (``gguf``
  cannot write Q4_K). Q4_K's
  super-blocks are 256 inputs long, so where a matrix's input dimension is not a multiple of
  256 (896 here: every matrix but ``ffn_down``) llama.cpp falls back to other formats; the
  report lists the file's matrix formats.
* **mie** loading the very same GGUF file of its pair (``Model.from_pretrained(path, dtype=...,
  quantization=...)``, ``mie.model.gguf_weights``), so that both engines read exactly the
  same bytes: ``float32`` from f32, ``float16`` from f16 and ``bfloat16`` from f16 (rounded
  at load), ``int8`` from q8_0 (its blocks as they are: int8 codes, the float16 scales
  widened), ``int4`` from llama.cpp's q4_0 (its Q4_0 matrices as they are, the 8-bit output
  matrix as int8) and from its q4_k_m (the K-quant matrices requantized to int4 or int8,
  as mie loads any Q4_K_M file).

**Each run in a fresh process** (``mie.bench.peers_worker``): mie imported normally, llama.cpp
with llama-cpp-python's defaults, as a user would run either alone. In one process the two
share one OpenMP runtime, whose thread wait policy is fixed by whichever loads it first (mie
sets its spin count, ``mie._fast``): that slowed both engines, so figures measured that way
said little about either. This process never imports ``llama_cpp`` (it only checks that it is
installed) and runs no model: it writes the GGUF files, starts the runs and reads their
figures.

Measured for each engine and format, at batch 1 (token ids fed directly: the GGUF's
vocabulary is a placeholder, llama.cpp never tokenizes text here): prefill of a
``CONTEXTS[0]``-token prompt (tokens/s, median of ``repeats``), and decode tokens/s at a
context of about each of ``CONTEXTS`` (a prompt of that length prefilled, in chunks of 512
tokens, then ``DECODE_TOKENS`` steps of one token, the median step). Pairs (``PAIRS``, ratios
mie / llama.cpp, above 1 means mie is faster): float32 vs f32, bfloat16 vs f16, float16 vs
f16, int8 vs q8_0, int4 vs q4_0 and vs q4_k_m. Each pair runs mie and llama.cpp back to
back, alternating which goes first, ``ROUNDS`` times over (``--quick``: once); each figure is
the best of its rounds: another process on a shared machine can only slow a run down.

**Load.** The 1-minute load average is recorded before and after every run. A round whose
load exceeded the benchmark's own threads by more than one (``withheld_reason``) gives no
ratio: the report says it is withheld and why, and the best-of-rounds figures and ratios use
the clean rounds only (``summarize_pair``); with none clean, the ratio is withheld too. The
JSON keeps every round's figures and loads, and which rounds counted. ``--peers-busy N`` runs
the pairs' rounds beside N processes that each keep a core busy (``busy_processes``), the same
comparison on a machine another job shares, and the rule then allows their load too.

**A run that fails** (its process exits non-zero: llama-cpp-python 0.3.36 built for a CPU
with AMX dies with SIGSEGV in ``ggml_backend_amx_mul_mat`` on its first quantized product of
more than one row, on the Xeon this was measured on) costs its own round's ratios, not the
run: the other runs go on, the round says which run failed and how, the report prints the
last line of its stderr, and a pair whose runs failed in every round shows "failed" for
them, its ratio withheld (``timed_run``, ``failed_reason``). Built without AMX
(``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON ..."``, docs/precision.md), llama.cpp runs.

**Prompt-lookup decoding** (``measure_prompt_lookup``): mie's n-gram speculation (``NGRAM``:
k=4, lookup 1-3) beside llama.cpp's ``LlamaPromptLookupDecoding`` (4 tokens proposed,
``LOOKUP_K``), on a real model: stories260K (``models/stories260K``, a trained tiny Llama)
written as an f32 GGUF file by ``write_gguf``, which both engines load. The prompts are the
speculative section's (``GROUNDED_PROMPTS``, ``FREE_PROMPTS``), cut once by mie's tokenizer and
fed to both as token ids; batch 1, greedy, up to ``LOOKUP_MAX_TOKENS`` tokens, both stopping at
the model's end-of-sequence ids (the file has no vocabulary, so llama.cpp knows none of its
own). Four configurations (``LOOKUP_CONFIGS``: each engine plain and speculative), each run in
a fresh process, ``ROUNDS`` rounds in alternating order, the loads and the clean-round rule as
above, each configuration's best tokens/s of the clean rounds; its speed-up is against its own
engine's plain decoding, and "identical" says whether its token ids are that plain decoding's
in every round (the two engines need not agree with each other: they sum in other orders; how
many prompts they continued alike is reported too).

**The GGUF files.** llama.cpp's ``qwen2`` loader needs the architecture's hyperparameters and
a vocabulary; the smallest vocabulary it accepts is ``tokenizer.ggml.model = "no_vocab"`` with
``qwen2.vocab_size``: that many placeholder tokens, so the embedding and the LM head have
their real size and llama.cpp computes every logit, as it would for the real model (the same
for ``llama``). Tensors use llama.cpp's names (``blk.N.attn_q.weight`` ...) and the ``(out,
in)`` layout of PyTorch and mie, which the writer stores reversed, as ggml's ``ne`` wants it.
Qwen2's RoPE rotates halves (NeoX style), which is what llama.cpp applies to ``qwen2``: no
permutation of q and k. For ``llama`` llama.cpp rotates adjacent pairs, so the writer
permutes q's and k's rows as llama.cpp's converter does (``rope_permute``).
Tied embeddings: no ``output.weight``, llama.cpp then reads ``token_embd.weight`` for the LM
head. As llama.cpp's own converter does, the vectors (norms, biases) stay float32 in every
format, and every matrix (the embedding included) takes the file's format (in the files
``gguf`` writes; llama.cpp's quantizer chooses its own per tensor).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from mie.backend import select
from mie.bench import speculative, throughput
from mie.bench.child import run_json_child
from mie.bench.peers_worker import threads_used
from mie.bench.section import SectionResult
from mie.bench.serve import default_model
from mie.bench.table import fmt_bytes
from mie.bench.table import table as text_table
from mie.checkpoint import Checkpoint
from mie.model import ModelConfig
from mie.model.weights import ModelWeights, load_weights, random_weights
from mie.progress import ProgressBar

CONTEXTS = (throughput.PREFILL_LEN, 2048)
"""Batch-1 decode is measured at a context of about each of these (tokens); prefill tokens/s
is the first one's prompt."""
DECODE_TOKENS = 32
GGUF_WRITTEN = ("f32", "f16", "q8_0", "q4_0")
"""The GGUF formats ``write_gguf`` writes (with ``gguf``'s quantizers)."""
WRITTEN_ARCHITECTURES = ("qwen2", "llama")
"""The architectures ``write_gguf`` writes: the random Qwen2 of the pairs, stories260K (a
Llama) of the prompt-lookup comparison."""
GGUF_MEASURED = ("f32", "f16", "q8_0")
"""Those of ``GGUF_WRITTEN`` the section measures: its q4_0 is llama.cpp's own (below)."""
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}
"""``general.file_type`` (llama.cpp's ``LLAMA_FTYPE_ALL_F32``, ``MOSTLY_F16``, ``MOSTLY_Q4_0``,
``MOSTLY_Q8_0``)."""
GGUF_QUANTIZED = {"q4_0": 2, "q4_k_m": 15}
"""The GGUF formats llama.cpp's own quantizer makes from the f32 file, with their
``LLAMA_FTYPE_*`` (2: ``MOSTLY_Q4_0``; 15: ``MOSTLY_Q4_K_M``, ``llama-quantize``'s ``Q4_K_M``).
q4_0 as users' files are made: the quantizer keeps the output matrix (here the tied
embedding) in 8 bits, and mie, loading that file, keeps its Q8_0 blocks as they are (its own
int4 would store that matrix in int6)."""
MIE_MODES = {  # mode name -> Model.from_pretrained's dtype and quantization
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "float16": ("float16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
}
PAIRS = (
    ("float32", "f32"),
    ("bfloat16", "f16"),
    ("float16", "f16"),
    ("int8", "q8_0"),
    ("int4", "q4_0"),
    ("int4", "q4_k_m"),
)
"""Which llama.cpp format each mie mode is compared with, in the order they run."""
ROUNDS = 3
"""Every pair runs this many times (``--quick``: once); each figure is the best of its clean
rounds."""
ENGINES = ("mie", "llama_cpp")
"""A round's runs, by key: mie's and llama.cpp's (ratios are the first over the second)."""
INSTALL_HINT = 'pip install -e ".[peers]"'

LOOKUP_K = 4
"""Tokens proposed per step by both engines' prompt lookup."""
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": LOOKUP_K,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
"""mie's n-gram configuration in the prompt-lookup comparison."""
LOOKUP_CONFIGS = ("mie plain", "mie n-gram", "llama.cpp plain", "llama.cpp prompt lookup")
"""The prompt-lookup comparison's configurations, in a round's order (reversed every other
round)."""
PLAIN = {
    "mie plain": "mie plain",
    "mie n-gram": "mie plain",
    "llama.cpp plain": "llama.cpp plain",
    "llama.cpp prompt lookup": "llama.cpp plain",
}
"""Each configuration's engine's plain decoding: its speed-up and its tokens are against it."""
LOOKUP_MAX_TOKENS = 128
LOOKUP_QUICK_MAX_TOKENS = 24


def missing_packages() -> list[str]:
    """The peers extra's packages that are not installed (import names)."""
    return [name for name in ("gguf", "llama_cpp") if importlib.util.find_spec(name) is None]


# -- writing GGUF ---------------------------------------------------------------------------
def rope_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """A Llama q or k projection's rows in the order llama.cpp's ``llama`` computes RoPE in
    (``LlamaModel.permute`` of its ``convert_hf_to_gguf.py``): within each head, Hugging
    Face's row ``j * head_dim / 2 + i`` (rotate-half pairs) becomes row ``2i + j`` (adjacent
    pairs). ``mie.model.gguf_weights.unpermute`` undoes it when mie loads the file."""
    head_dim = rows.shape[0] // num_heads
    shaped = rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:])
    return np.ascontiguousarray(shaped.swapaxes(1, 2).reshape(rows.shape))


def gguf_tensors(config: ModelConfig, weights: ModelWeights) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor llama.cpp's ``qwen2`` or ``llama`` reads, by its GGUF name: float32 views
    of mie's float32 weights, matrices ``(out, in)`` as mie and PyTorch store them, the fused
    ones (``qkv``, ``gate_up``) split back into their rows, a Llama's q and k rows permuted
    (``rope_permute``)."""
    if weights.format != "float32":
        raise ValueError(f"GGUF files are written from float32 weights, got {weights.format}")
    q, kv = config.q_size, config.kv_size
    inter = config.intermediate_size

    def rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
        return rope_permute(rows, heads) if config.architecture == "llama" else rows

    yield "token_embd.weight", weights.embed.weight
    for i, layer in enumerate(weights.layers):
        p = f"blk.{i}."
        qkv = layer.qkv.weight
        yield p + "attn_norm.weight", layer.input_norm
        yield p + "attn_q.weight", rope_rows(qkv[:q], config.num_heads)
        yield p + "attn_k.weight", rope_rows(qkv[q : q + kv], config.num_kv_heads)
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
    GGUF file llama.cpp loads, its matrices in ``file_type`` (``GGUF_WRITTEN``).

    Qwen2 and Llama (``WRITTEN_ARCHITECTURES``) without RoPE scaling or a sliding window: the
    hyperparameters written are those two architectures' (see the module docstring). q8_0
    and q4_0 need every matrix's input dimension to be a multiple of 32.
    """
    import gguf

    if config.architecture not in WRITTEN_ARCHITECTURES:
        raise ValueError(
            f"write_gguf writes {' and '.join(WRITTEN_ARCHITECTURES)} models only, "
            f"got {config.architecture!r}"
        )
    if config.rope_scaling is not None or config.sliding_window is not None:
        raise ValueError("write_gguf writes no RoPE scaling and no sliding window")
    if file_type not in GGUF_WRITTEN:
        raise ValueError(f"file_type must be one of {list(GGUF_WRITTEN)}, got {file_type!r}")
    G = gguf.GGMLQuantizationType
    qtype = {"f32": G.F32, "f16": G.F16, "q8_0": G.Q8_0, "q4_0": G.Q4_0}[file_type]
    blocked = qtype in (G.Q8_0, G.Q4_0)  # blocks of 32 inputs, stored as bytes
    path = Path(path)
    writer = gguf.GGUFWriter(path, config.architecture)
    writer.add_name(f"mie {config.architecture} ({file_type})")
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
        if tensor.ndim == 1 or qtype == G.F32:
            return np.ascontiguousarray(tensor, dtype=np.float32), G.F32
        if blocked and tensor.shape[1] % 32:
            raise ValueError(
                f"{name}: {file_type} needs an input dimension that is a multiple of 32"
            )
        data = gguf.quants.quantize(np.ascontiguousarray(tensor, dtype=np.float32), qtype)
        return data, qtype

    # The header lists every tensor's shape and size before any data, so the shapes are
    # declared first (from the float32 shapes) and each tensor is then encoded and written
    # one at a time: never the whole model in memory twice.
    for name, tensor in gguf_tensors(config, weights):
        kind = G.F32 if tensor.ndim == 1 else qtype
        shape = tensor.shape
        if kind in (G.Q8_0, G.Q4_0):
            byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind
            )
        else:
            dtype = np.dtype(np.float16 if kind == G.F16 else np.float32)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            writer.add_tensor_info(name, shape, dtype, nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, tensor in gguf_tensors(config, weights):
        writer.write_tensor_data(encode(name, tensor)[0])
    writer.close()
    return path


def gguf_matrix_types(path: Path) -> dict[str, int]:
    """How many of the file's matrices are stored in each GGML type (``{"Q4_K": 24, ...}``):
    what llama.cpp's quantizer chose, tensor by tensor."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if len(tensor.shape) > 1:
            name = tensor.tensor_type.name
            counts[name] = counts.get(name, 0) + 1
    return counts


# -- the runs, each in a fresh process ------------------------------------------------------
BUSY_PROGRAM = "while True: pass"
"""What each of ``--peers-busy``'s processes runs: one core kept busy, as another user's job
would keep it."""


@contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` Python processes spinning ``BUSY_PROGRAM`` while the block runs, stopped
    (killed, and waited for) when it ends, however it ends."""
    started = []
    try:
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", BUSY_PROGRAM]))
        yield started
    finally:
        for process in started:
            process.kill()
        for process in started:
            process.wait()


def load_average() -> float:
    """The machine's 1-minute load average (runnable threads, this benchmark's included)."""
    return os.getloadavg()[0]


def run_worker(request: dict) -> dict:
    """``mie.bench.peers_worker``'s answer to ``request``, run in a fresh Python process (the
    same mie package as this one); raises ``RuntimeError`` with its stderr if it fails."""
    return run_json_child(
        "mie.bench.peers_worker", [json.dumps(request)], f"peers: the {request['run']} run"
    )


def timed_run(request: dict, keep_failure: bool = False) -> dict:
    """``run_worker(request)``'s figures with the load average just before and just after.
    With ``keep_failure``, a run whose process fails (llama.cpp's AMX kernels crash on some
    CPUs) answers why instead of raising -- ``"failed"``, the exit, and ``"error"``, the end
    of its stderr -- with the same loads: one engine's crash costs its own figures, not the
    other pairs' rounds."""
    before = load_average()
    try:
        answer = run_worker(request)
    except RuntimeError as exc:
        if not keep_failure:
            raise
        first, _, rest = str(exc).partition("\n")
        answer = {"failed": first.removeprefix("peers: the ").removesuffix(":"), "error": rest}
    return dict(answer, load_before=before, load_after=load_average())


# -- clean rounds, best figures, ratios ------------------------------------------------------
def withheld_reason(loads: list[float], threads: int) -> str | None:
    """Why a round's ratio is withheld, or None if it counts: withheld when any of its load
    averages exceeded the benchmark's own ``threads`` by more than one, i.e. when another
    process competed for the cores for a good part of the minute before."""
    worst = max(loads)
    if worst > threads + 1:
        return f"withheld: load {worst:.2f} > {threads} threads + 1"
    return None


def clean_rounds(loads: list[list[float]], threads: int) -> tuple[list[str | None], str | None]:
    """Each round's ``withheld_reason`` (``loads``: each round's load averages), and why a
    comparison's figures are withheld as a whole: when no round is clean (None when one is)."""
    reasons = [withheld_reason(round_loads, threads) for round_loads in loads]
    if any(reason is None for reason in reasons):
        return reasons, None
    lowest = min(max(round_loads) for round_loads in loads)
    return (
        reasons,
        f"withheld: load above {threads} threads + 1 in every round (lowest {lowest:.2f})",
    )


def best_rates(runs: list[dict[str, float]]) -> dict[str, float]:
    """The best of one engine's rounds, figure by figure (each figure tokens/s, each a median
    within its round): another process on a shared machine can only slow a run down, the
    rounds give each side more than one chance at a quiet moment."""
    return {key: max(run[key] for run in runs) for key in runs[0]}


def ratios(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, float]:
    """mie / llama.cpp, figure by figure (above 1: mie is faster)."""
    return {key: ours[key] / theirs[key] for key in ours}


def round_loads(round_: dict) -> list[float]:
    """A round's load averages: before and after its mie run and its llama.cpp run."""
    return [round_[engine][when] for engine in ENGINES for when in ("load_before", "load_after")]


def failed_reason(round_: dict) -> str | None:
    """Why a round has no ratios because a run failed (``timed_run``), or None."""
    failed = [round_[engine]["failed"] for engine in ENGINES if "failed" in round_[engine]]
    return "; ".join(failed) if failed else None


def summarize_pair(mode: str, file_type: str, rounds: list[dict], threads: int) -> dict:
    """One pair's rounds (``{"mie": run, "llama_cpp": run}``, each run with its figures and
    its loads, or why it failed) -> every round with its ratios or why they are withheld, the
    rounds that counted (clean, and both runs done), each engine's best figures over them
    and their ratios. With no such round, each engine's best figures are those of all its
    runs that did not fail (None if all did) and the ratios are withheld."""
    load_reasons, withheld = clean_rounds([round_loads(round_) for round_ in rounds], threads)
    failed = [failed_reason(round_) for round_ in rounds]
    reasons = [f or reason for f, reason in zip(failed, load_reasons, strict=True)]
    summarized = []
    for number, (round_, reason) in enumerate(zip(rounds, reasons, strict=True), 1):
        figures = [round_[engine].get("tokens_per_s") for engine in ENGINES]
        summarized.append(
            dict(round_, round=number, withheld=reason, ratios=None if reason else ratios(*figures))
        )
    counted = [r for r in summarized if r["withheld"] is None]
    failures = [f for f in failed if f]
    if not counted and len(failures) == len(rounds):
        withheld = f"failed in every round: {failures[0]}"
    elif not counted and failures:
        withheld = f"withheld: every round failed or ran under load ({failures[0]})"
    done = {
        engine: [r[engine] for r in counted or summarized if "failed" not in r[engine]]
        for engine in ENGINES
    }
    ours, theirs = (
        best_rates([run["tokens_per_s"] for run in done[engine]]) if done[engine] else None
        for engine in ENGINES
    )
    weight_bytes = (done[engine][0]["weight_bytes"] if done[engine] else None for engine in ENGINES)
    return {
        "mie": mode,
        "llama_cpp": file_type,
        "rounds": summarized,
        "counted_rounds": [r["round"] for r in counted],
        "mie_rates": ours,
        "llama_cpp_rates": theirs,
        **dict(zip(("mie_weight_bytes", "llama_cpp_weight_bytes"), weight_bytes, strict=True)),
        "ratios": None if not counted else ratios(ours, theirs),
        "withheld": None if counted else withheld,
    }


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
        busy=getattr(args, "peers_busy", 0),
    )
    result["model"] = "Qwen2-0.5B-shaped, random weights"
    result["prompt_lookup"] = measure_prompt_lookup(args.quick, args.seed, args.backend)
    return SectionResult({"peers": result}, report(result))


def measure(
    hf_config: dict,
    quick: bool,
    seed: int,
    backend: str | None,
    kv_cache_dtype: str = "auto",
    directory: str | os.PathLike[str] | None = None,
    contexts: tuple[int, ...] = CONTEXTS,
    busy: int = 0,
) -> dict:
    """Write the GGUF files (into ``directory``, default a temporary one removed afterwards),
    then run each pair of ``PAIRS``, mie and llama.cpp back to back (mie first in odd rounds,
    llama.cpp in even ones), each run in a fresh process; ``ROUNDS`` times over (``--quick``:
    once), each pair summarized by ``summarize_pair``. With ``busy`` (``--peers-busy``), the
    rounds run beside that many ``busy_processes``, whose load the clean-round rule then
    allows: the same comparison on a machine another job shares."""
    config = ModelConfig.from_hf(hf_config)
    chosen = select(backend)
    threads = threads_used(chosen)
    repeats, decode_len, rounds = (1, 4, 1) if quick else (3, DECODE_TOKENS, ROUNDS)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, max(contexts)).tolist()
    decode = rng.integers(0, config.vocab_size, decode_len).tolist()
    common = {"prompt": prompt, "decode": decode, "contexts": list(contexts), "repeats": repeats}
    result: dict = {
        "backend": chosen.name,
        "threads": threads,
        "busy": busy,
        "load_limit": threads + busy + 1,
        "kv_cache_dtype": kv_cache_dtype,
        "prompt_tokens": contexts[0],
        "contexts": list(contexts),
        "decode_tokens": decode_len,
        "repeats": repeats,
        "rounds": rounds,
    }
    file_types = (*GGUF_MEASURED, *GGUF_QUANTIZED)
    with (
        tempfile.TemporaryDirectory(dir=directory) as tmp,
        ProgressBar(len(file_types) + 2 * len(PAIRS) * rounds, "peers") as bar,
    ):
        start = time.perf_counter()
        weights = random_weights(config, seed)
        files = {}
        for file_type in GGUF_MEASURED:
            bar.update(0, desc=f"peers: writing {file_type}.gguf")
            files[file_type] = write_gguf(
                Path(tmp) / f"{file_type}.gguf", config, weights, file_type
            )
            bar.update(1)
        del weights
        for file_type, ftype in GGUF_QUANTIZED.items():
            bar.update(0, desc=f"peers: llama.cpp quantizing {file_type}.gguf")
            files[file_type] = Path(tmp) / f"{file_type}.gguf"
            run_worker(
                {
                    "run": "quantize",
                    "source": str(files["f32"]),
                    "target": str(files[file_type]),
                    "ftype": ftype,
                    "threads": threads,
                }
            )
            bar.update(1)
        result["gguf_write_s"] = time.perf_counter() - start
        result["gguf_bytes"] = {t: files[t].stat().st_size for t in file_types}
        result["gguf_matrix_types"] = {t: gguf_matrix_types(files[t]) for t in file_types}
        with busy_processes(busy):
            pair_rounds = run_rounds(
                rounds, files, common, chosen.name, kv_cache_dtype, threads, bar
            )
    result["llama_cpp_python"] = next(  # as its runs said (None if every one failed)
        (
            round_["llama_cpp"]["llama_cpp_python"]
            for runs in pair_rounds
            for round_ in runs
            if "failed" not in round_["llama_cpp"]
        ),
        None,
    )
    result["pairs"] = [
        summarize_pair(mode, file_type, runs, threads + busy)
        for (mode, file_type), runs in zip(PAIRS, pair_rounds, strict=True)
    ]
    return result


def run_rounds(
    rounds: int,
    files: dict[str, Path],
    common: dict,
    backend: str,
    kv_cache_dtype: str,
    threads: int,
    bar: ProgressBar,
) -> list[list[dict]]:
    """``rounds`` rounds of every pair of ``PAIRS``, mie and llama.cpp back to back (mie first
    in odd rounds, llama.cpp in even ones), each run in a fresh process: per pair, its rounds
    (``{"mie": run, "llama_cpp": run}``)."""
    pair_rounds: list[list[dict]] = [[] for _ in PAIRS]
    for round_index in range(rounds):
        for (mode, file_type), runs in zip(PAIRS, pair_rounds, strict=True):
            dtype, quantization = MIE_MODES[mode]
            requests = {
                "mie": dict(
                    common,
                    run="mie",
                    path=str(files[file_type]),
                    backend=backend,
                    dtype=dtype,
                    quantization=quantization,
                    kv_cache_dtype=kv_cache_dtype,
                ),
                "llama_cpp": dict(
                    common, run="llama.cpp", path=str(files[file_type]), threads=threads
                ),
            }
            order = ENGINES if round_index % 2 == 0 else ENGINES[::-1]
            round_ = {}
            for engine in order:
                label = f"mie {mode}" if engine == "mie" else f"llama.cpp {file_type}"
                bar.update(0, desc=f"peers round {round_index + 1}: {label}")
                round_[engine] = timed_run(requests[engine], keep_failure=True)
                bar.update(1)
            runs.append(round_)
    return pair_rounds


# -- prompt-lookup decoding: mie's n-gram speculation against llama.cpp's ------------------
def lookup_workloads(model_dir: Path, quick: bool) -> dict[str, list[list[int]]]:
    """The speculative section's prompts as mie's tokenizer of ``model_dir`` cuts them (one
    tokenization, fed as ids to both engines: llama.cpp never reads text here):
    ``GROUNDED_PROMPTS`` and ``FREE_PROMPTS`` (``--quick``: the first two of each)."""
    from mie.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    grounded = [text for _, text in speculative.GROUNDED_PROMPTS]
    free = list(speculative.FREE_PROMPTS)
    if quick:
        grounded, free = grounded[:2], free[:2]
    return {
        "input-grounded": [tokenizer.encode(text) for text in grounded],
        "free": [tokenizer.encode(text) for text in free],
    }


def lookup_requests(common: dict, backend: str, threads: int) -> dict[str, dict]:
    """The worker request of each of ``LOOKUP_CONFIGS``: ``common`` (the GGUF file, the
    prompts, the stop rule) and the engine's own settings."""
    mie = dict(common, run="mie generate", backend=backend)
    llama = dict(common, run="llama.cpp generate", threads=threads)
    return {
        "mie plain": dict(mie, speculative_config=None),
        "mie n-gram": dict(mie, speculative_config=NGRAM),
        "llama.cpp plain": dict(llama, num_pred_tokens=None),
        "llama.cpp prompt lookup": dict(llama, num_pred_tokens=LOOKUP_K),
    }


def lookup_round_loads(round_: dict[str, dict]) -> list[float]:
    """A prompt-lookup round's load averages: before and after each configuration's run."""
    return [run[when] for run in round_.values() for when in ("load_before", "load_after")]


def generated(run: dict) -> int:
    """The tokens a run generated over one workload's prompts."""
    return sum(len(ids) for ids in run["tokens"])


def summarize_prompt_lookup(rounds: list[dict[str, dict]], threads: int) -> dict:
    """The comparison's rounds (``{configuration: run}``, each run's ``workloads`` with their
    token ids, seconds and mie's steps, and its loads) -> per workload and configuration: the
    tokens, the tokens per engine step (mie's; None for llama.cpp, which does not count
    them), the best tokens/s of the clean rounds (``withheld_reason`` over the four runs'
    loads), the speed-up against the engine's own plain decoding (``PLAIN``), and whether its
    token ids are its plain decoding's in every round. With no clean round the figures are
    the best of all rounds and the speed-ups are withheld. Also, per workload, on how many
    prompts mie's and llama.cpp's plain decoding gave the same tokens (the same weights,
    summed in other orders)."""
    reasons, withheld = clean_rounds([lookup_round_loads(round_) for round_ in rounds], threads)
    counted = [i for i, reason in enumerate(reasons) if reason is None]
    chosen = counted or range(len(rounds))
    first = rounds[0]
    workloads: dict[str, dict] = {}
    for name in first[LOOKUP_CONFIGS[0]]["workloads"]:
        runs = {
            config: [round_[config]["workloads"][name] for round_ in rounds]
            for config in LOOKUP_CONFIGS
        }
        best = {
            config: max(generated(runs[config][i]) / runs[config][i]["seconds"] for i in chosen)
            for config in LOOKUP_CONFIGS
        }
        rows = {}
        for config in LOOKUP_CONFIGS:
            run, plain = runs[config][0], runs[PLAIN[config]][0]
            rows[config] = {
                "tokens": generated(run),
                "tokens_per_step": generated(run) / run["steps"] if "steps" in run else None,
                "tokens_per_s": best[config],
                "speedup": None if withheld else best[config] / best[PLAIN[config]],
                "identical": all(r["tokens"] == plain["tokens"] for r in runs[config]),
            }
        workloads[name] = rows
    return {
        "rounds": [
            {
                "round": number,
                "withheld": reason,
                **{
                    config: {
                        "load_before": run["load_before"],
                        "load_after": run["load_after"],
                        "seconds": {
                            w: figures["seconds"] for w, figures in run["workloads"].items()
                        },
                    }
                    for config, run in round_.items()
                },
            }
            for number, (round_, reason) in enumerate(zip(rounds, reasons, strict=True), 1)
        ],
        "counted_rounds": [i + 1 for i in counted],
        "withheld": withheld,
        "workloads": workloads,
        "prompts": {
            name: len(run["tokens"]) for name, run in first["mie plain"]["workloads"].items()
        },
        "plain_tokens_agree": {
            name: sum(
                ours == theirs
                for ours, theirs in zip(
                    first["mie plain"]["workloads"][name]["tokens"],
                    first["llama.cpp plain"]["workloads"][name]["tokens"],
                    strict=True,
                )
            )
            for name in workloads
        },
    }


def measure_prompt_lookup(
    quick: bool,
    seed: int,
    backend: str | None,
    directory: str | os.PathLike[str] | None = None,
    max_tokens: int | None = None,
    rounds: int | None = None,
) -> dict:
    """stories260K written as an f32 GGUF file (``write_gguf``, into ``directory``, default a
    temporary one removed afterwards), then ``LOOKUP_CONFIGS`` on it, each run in a fresh
    process, ``ROUNDS`` rounds (``--quick``: one) in alternating order, summarized by
    ``summarize_prompt_lookup``. ``max_tokens`` and ``rounds`` (tests): instead of
    ``LOOKUP_MAX_TOKENS`` (``--quick``: ``LOOKUP_QUICK_MAX_TOKENS``) and ``ROUNDS``."""
    model_dir = default_model()
    config = ModelConfig.from_pretrained(model_dir)
    chosen = select(backend)
    threads = threads_used(chosen)
    if max_tokens is None:
        max_tokens = LOOKUP_QUICK_MAX_TOKENS if quick else LOOKUP_MAX_TOKENS
    if rounds is None:
        rounds = 1 if quick else ROUNDS
    workloads = lookup_workloads(model_dir, quick)
    runs: list[dict[str, dict]] = []
    with (
        tempfile.TemporaryDirectory(dir=directory) as tmp,
        ProgressBar(1 + len(LOOKUP_CONFIGS) * rounds, "peers: prompt lookup") as bar,
    ):
        weights = load_weights(Checkpoint(model_dir), config, dtype="float32")
        path = write_gguf(Path(tmp) / "stories260K-f32.gguf", config, weights, "f32")
        del weights
        bar.update(1)
        common = {
            "path": str(path),
            "workloads": workloads,
            "warm_up": np.random.default_rng(seed).integers(0, config.vocab_size, 8).tolist(),
            "max_tokens": max_tokens,
            "stop_token_ids": list(config.eos_token_ids),
            "n_ctx": config.max_position_embeddings,
        }
        requests = lookup_requests(common, chosen.name, threads)
        for round_index in range(rounds):
            order = LOOKUP_CONFIGS if round_index % 2 == 0 else LOOKUP_CONFIGS[::-1]
            round_ = {}
            for name in order:
                bar.update(0, desc=f"peers prompt lookup round {round_index + 1}: {name}")
                round_[name] = timed_run(requests[name])
                bar.update(1)
            runs.append(round_)
    return {
        "model": model_dir.name,
        "gguf": "f32",
        "backend": chosen.name,
        "threads": threads,
        "load_limit": threads + 1,
        "llama_cpp_python": runs[0]["llama.cpp plain"]["llama_cpp_python"],
        "max_tokens": max_tokens,
        "stop_token_ids": list(config.eos_token_ids),
        "ngram": NGRAM,
        "num_pred_tokens": LOOKUP_K,
        "rounds_run": rounds,
        **summarize_prompt_lookup(runs, threads),
    }


def prompt_lookup_report(lookup: dict) -> str:
    """The comparison as plain text: per workload and configuration its tokens, tokens per
    step (mie), best tokens/s of the clean rounds, speed-up against its engine's plain
    decoding, and whether its tokens are that plain decoding's; then every round's loads."""
    rows = []
    for name, configs in lookup["workloads"].items():
        for config, row in configs.items():
            speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
            rows.append(
                [
                    name,
                    config,
                    row["tokens"],
                    "-" if row["tokens_per_step"] is None else f"{row['tokens_per_step']:.2f}",
                    f"{row['tokens_per_s']:.0f}",
                    speedup,
                    "yes" if row["identical"] else "NO",
                ]
            )
    prompts = lookup["prompts"]
    agree = ", ".join(
        f"{lookup['plain_tokens_agree'][name]} of {count} {name}" for name, count in prompts.items()
    )
    counted = lookup["counted_rounds"]
    ngram = lookup["ngram"]
    round_rows = [
        [
            round_["round"],
            *(
                f"{round_[config]['load_before']:.2f}-{round_[config]['load_after']:.2f}"
                for config in LOOKUP_CONFIGS
            ),
            round_["withheld"] or "counted",
        ]
        for round_ in lookup["rounds"]
    ]
    lines = [
        f"Prompt-lookup decoding: {lookup['model']} as an {lookup['gguf']} GGUF file, the same "
        f"file in mie (backend {lookup['backend']}) and llama.cpp (llama-cpp-python "
        f"{lookup['llama_cpp_python']}), {lookup['threads']} threads each, otherwise each "
        "engine's defaults (KV cache: float32 in mie, float16 in llama.cpp), batch 1, greedy, up "
        f"to {lookup['max_tokens']} tokens (stopping at token "
        f"{' or '.join(map(str, lookup['stop_token_ids']))}), the speculative section's prompts "
        f"as the same token ids; mie n-gram: k={ngram['num_speculative_tokens']}, lookup "
        f"{ngram['prompt_lookup_min']}-{ngram['prompt_lookup_max']}; llama.cpp: "
        f"LlamaPromptLookupDecoding(num_pred_tokens={lookup['num_pred_tokens']})",
        f"Every configuration a fresh process per round, {lookup['rounds_run']} round(s) "
        f"alternating the order, best of the {len(counted)} clean one(s) (load at most "
        f"{lookup['load_limit']}); speed-up against the engine's own plain decoding, "
        "'identical': its token ids are its plain decoding's in every round",
        *([f"Speed-ups {lookup['withheld']}"] if lookup["withheld"] else []),
        f"mie plain and llama.cpp plain continued identically: {agree} prompts",
        "",
        text_table(
            [
                "workload",
                "configuration",
                "tokens",
                "tokens/step",
                "tokens/s",
                "speed-up",
                "identical",
            ],
            rows,
        ),
        "",
        text_table(["each round", *(f"load {c}" for c in LOOKUP_CONFIGS), ""], round_rows),
    ]
    return "\n".join(lines)


# -- the report -----------------------------------------------------------------------------
def figure_names(result: dict) -> list[str]:
    """The figures in report order: prefill, then decode at each context."""
    return ["prefill", *(f"decode@{context}" for context in result["contexts"])]


def loads_text(run: dict) -> str:
    return f"{run['load_before']:.2f}-{run['load_after']:.2f}"


def busy_named(busy: int) -> str:
    """``"1 busy process"``, ``"2 busy processes"``."""
    return f"{busy} busy process{'es' if busy > 1 else ''}"


def busy_text(result: dict) -> str:
    """``"1 busy process + "`` in the clean-round rule when the pairs ran beside some."""
    busy = result.get("busy", 0)
    return f"{busy_named(busy)} + " if busy else ""


def busy_lines(result: dict) -> list[str]:
    """The report's line saying the pairs ran beside busy processes (none without)."""
    busy = result.get("busy", 0)
    if not busy:
        return []
    return [
        f"Beside {busy_named(busy)} (python -c '{BUSY_PROGRAM}', "
        "one core each), started before the pairs' rounds and stopped after them "
        "(--peers-busy): the comparison on a machine another job shares"
    ]


def report(result: dict) -> str:
    """The section as plain text: the best figures per engine and format, the ratios of the
    clean rounds, then every round with its loads and its ratios or why they are withheld."""
    if "skipped" in result:
        return result["skipped"]
    names = figure_names(result)
    threads, pairs = result["threads"], result["pairs"]
    rows = []
    for pair in pairs:
        counted = f"{len(pair['counted_rounds'])} of {len(pair['rounds'])}"
        for engine, rates_, nbytes in (
            (f"mie {pair['mie']}", pair["mie_rates"], pair["mie_weight_bytes"]),
            (
                f"llama.cpp {pair['llama_cpp']}",
                pair["llama_cpp_rates"],
                pair["llama_cpp_weight_bytes"],
            ),
        ):
            rates_text = (f"{rates_[n]:.1f}" for n in names) if rates_ else ["failed"] * len(names)
            nbytes_text = fmt_bytes(nbytes) if nbytes is not None else "-"
            rows.append([engine, nbytes_text, *rates_text, counted])
    headers = ["engine, weights", "weight bytes", *(f"{n} tok/s" for n in names), "clean rounds"]

    def ratio_cells(values: dict | None) -> list[str]:
        return [f"{values[n]:.2f}x" for n in names] if values else ["-"] * len(names)

    ratio_rows = [
        [
            f"mie {pair['mie']} / llama.cpp {pair['llama_cpp']}",
            *ratio_cells(pair["ratios"]),
            pair["withheld"] or f"best of {len(pair['counted_rounds'])} clean rounds",
        ]
        for pair in pairs
    ]
    round_rows = [
        [
            f"mie {pair['mie']} / llama.cpp {pair['llama_cpp']}",
            round_["round"],
            loads_text(round_["mie"]),
            loads_text(round_["llama_cpp"]),
            *ratio_cells(round_["ratios"]),
            round_["withheld"] or "counted",
        ]
        for pair in pairs
        for round_ in pair["rounds"]
    ]
    failures = [
        f"round {round_['round']} of mie {pair['mie']} / llama.cpp {pair['llama_cpp']}: "
        f"{round_[engine]['failed']}: "
        + (round_[engine]["error"].strip().splitlines() or ["(no output)"])[-1]
        for pair in pairs
        for round_ in pair["rounds"]
        for engine in ENGINES
        if "failed" in round_[engine]
    ]
    mixed = [
        f"{file_type}: " + ", ".join(f"{kind} x{count}" for kind, count in kinds.items())
        for file_type, kinds in result["gguf_matrix_types"].items()
        if len(kinds) > 1
    ]
    kv = result["kv_cache_dtype"]
    contexts = " and ".join(str(c) for c in result["contexts"])
    lines = [
        f"Peers: {result['model']}, the same weights in mie (backend {result['backend']}, KV "
        f"cache {'float32' if kv == 'auto' else kv}) and llama.cpp (llama-cpp-python "
        f"{result['llama_cpp_python']}, its defaults: KV cache float16, flash attention off), "
        f"{threads} threads each, every run in a fresh process",
        f"Batch 1: prefill of a {result['prompt_tokens']}-token prompt (median of "
        f"{result['repeats']}), then {result['decode_tokens']} tokens decoded at a context of "
        f"{contexts} (the long prompt prefilled in chunks of 512; median step); mie and "
        f"llama.cpp back to back, alternating which goes first, {result['rounds']} round(s), "
        f"best of the clean ones; llama.cpp's weight bytes are its GGUF file's (files made in "
        f"{result['gguf_write_s']:.0f} s)",
        *busy_lines(result),
        f"A round is clean if the 1-minute load average stayed at most {threads} threads + "
        f"{busy_text(result)}1 = {result['load_limit']} before and after both runs; otherwise "
        "its ratios are withheld (more load is other work on the machine)",
        *(f"GGUF matrices by llama.cpp's quantizer: {line}" for line in mixed),
        "",
        text_table(headers, rows),
        "",
        text_table(["mie / llama.cpp (above 1: mie faster)", *names, "from"], ratio_rows),
        "",
        text_table(
            ["each round", "round", "load mie", "load llama.cpp", *names, "ratios"], round_rows
        ),
    ]
    if failures:
        lines += ["", "Failed runs (what failed, the last line of its stderr):", *failures]
    if "prompt_lookup" in result:
        lines += ["", prompt_lookup_report(result["prompt_lookup"])]
    return "\n".join(lines)
