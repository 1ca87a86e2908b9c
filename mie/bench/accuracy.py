"""How far each precision mode's logits are from float32's: ``python -m mie.bench.accuracy``.

Every mode -- weights float32, bfloat16, float16, int8 or int4 (quantized from the float32
values), each with a float32, bfloat16 or float16 KV cache -- is compared with the same
model in float32 weights and a float32 cache, on the same backend and the same batches, so
the only difference is the precision:

* **Teacher-forced logits.** Fixed token sequences run through the paged cache in one
  forward pass (every position's logits), then decode steps extend them one token at a
  time, so both the prefill and the decode attention read the narrow cache. Reported: the
  largest ``|logit - float32 logit|`` over every position, that error relative to the
  float32 logits' scale (their largest magnitude: random weights give small logits, so the
  absolute figure alone says little there), and the fraction of positions whose top-1 token
  is float32's.
* **Greedy generation** (stories260K only: a real trained model, whose argmax means
  something). Each mode generates ``GREEDY_TOKENS`` tokens greedily, on its own, from fixed
  story openings; compared with float32's tokens position by position. Reported: the
  fraction of tokens before the first divergence (summed over the prompts), the fraction of
  positions equal overall (after a divergence the two texts usually differ, but may fall
  back into step), and the earliest divergence.

Models: stories260K (``models/stories260K`` in the repository, or ``--stories``:
Karpathy's 260K-parameter Llama trained on TinyStories), and a random
model of Qwen2-0.5B's shape (``mie.bench.throughput.QWEN2_05B``; about 2 GB of float32, so
few short prompts of random token ids).

``BOUNDS`` is the one source of the documented accuracy of each mode on stories260K: the
table in docs/precision.md prints it, and tests/test_precision_accuracy.py holds every mode
to it. The bounds are the measured figures with a margin (see ``BOUNDS``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mie.backend import Backend, select
from mie.bench import STORIES260K
from mie.model import Model, ModelConfig, bytes_per_block, kv_view, prepare_inputs
from mie.scheduler import BatchEntry, Sequence

STORIES = STORIES260K

WEIGHTS = (  # (label, dtype, quantization): int8 and int4 are quantized from float32 values
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", None),
    ("int8", "float32", "int8"),
    ("int4", "float32", "int4"),
)
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16")
BLOCK_SIZE = 16
GREEDY_TOKENS = 256

STORY_TEXTS = (  # teacher-forced: TinyStories-like text, what stories260K was trained on
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friends. One day, she saw a big red ball under a tree.",
    "Tom and his mom went to the store. Tom wanted a toy car, but his mom said no. Tom was "
    "sad. Then his mom gave him a hug and they went home to bake a cake together.",
    "One day, a little bird wanted to fly over the big hill. The bird was scared, but his "
    'friend the cat said, "You can do it!" The bird tried and tried, and then it flew.',
    "Sue had a small dog named Max. Max liked to run and jump in the garden. When it "
    "started to rain, Sue and Max went inside and sat by the warm fire.",
    "The little fish lived in a big blue sea. Every day he swam with his friends. One morning "
    "he found a shiny shell and showed it to his mom. She smiled and said it was very pretty.",
    "Anna wanted to help her dad in the kitchen. She got a bowl and a spoon. Dad let her mix "
    "the flour and the milk. They made pancakes, and Anna said they were the best ever.",
)
TEACHER_FORCED_DECODE = 8
"""Tokens of each text computed by decode steps after the rest is prefilled."""

GREEDY_PROMPTS = (  # story openings for greedy generation
    "Once upon a time",
    "One day, a little boy named Tim",
    "Lily and her friend Ben",
    "The sun was shining and",
    "Once upon a time, there was a big dog",
    'Mom said, "',
    "Sam found a box in the garden.",
    "It was a cold day, and",
)

QWEN_PROMPTS, QWEN_PROMPT_LEN = 4, 32  # random token ids; the last few are decode steps


@dataclass(frozen=True)
class Bound:
    """What a mode is documented (and tested) to achieve on stories260K, against float32.

    From the measurements of ``python -m mie.bench.accuracy`` (docs/precision.md), the same
    on the python backend and on the fast one with each of its instruction sets, with a
    margin so that a change of summation order (another CPU, another kernel) cannot fail
    them while a real loss of precision does:

    * ``max_abs_error``: about twice the measured largest error, rounded up;
    * ``min_top1``: 98% for every narrow mode (measured: 99.5% to 100% of 430 positions)
      but int4, 80% (measured 84.4% to 84.9%: 4 bits are coarse for rows of 64 inputs);
    * ``min_greedy_prefix``: 100% where every one of the 8 x 256 greedy tokens matched;
      elsewhere the measured fraction less 0.10, rounded down to a multiple of 0.05 -- once
      a near-tie flips, the rest of that story differs, so the figure moves in steps of up
      to a whole prompt's remaining tokens.
    """

    max_abs_error: float
    min_top1: float
    min_greedy_prefix: float  # fraction of greedy tokens before the first divergence


BOUNDS: dict[tuple[str, str], Bound] = {  # (weights, KV cache)
    ("float32", "float32"): Bound(0.0, 1.0, 1.0),  # the reference itself: exact
    ("float32", "bfloat16"): Bound(0.7, 0.98, 0.75),  # measured 0.31, 99.5%, 85.4%
    ("float32", "float16"): Bound(0.07, 0.98, 1.0),  # measured 0.031, 100%, 100%
    ("bfloat16", "float32"): Bound(0.3, 0.98, 0.75),  # measured 0.13, 100%, 85.7%
    ("bfloat16", "bfloat16"): Bound(0.4, 0.98, 0.70),  # measured 0.20, 100%, 81.8%
    ("bfloat16", "float16"): Bound(0.4, 0.98, 0.75),  # measured 0.18, 100%, 85.7-88.2%
    ("float16", "float32"): Bound(0.03, 0.98, 1.0),  # measured 0.015, 100%, 100%
    ("float16", "bfloat16"): Bound(0.5, 0.98, 0.70),  # measured 0.21, 99.5%, 82.4%
    ("float16", "float16"): Bound(0.09, 0.98, 1.0),  # measured 0.044, 100%, 100%
    ("int8", "float32"): Bound(1.3, 0.98, 0.10),  # measured 0.61, 98.8%, 22.9%
    ("int8", "bfloat16"): Bound(1.3, 0.98, 0.15),  # measured 0.52, 99.1%, 43.2%
    ("int8", "float16"): Bound(1.4, 0.98, 0.10),  # measured 0.60, 99.3%, 24.1%
    ("int4", "float32"): Bound(15.0, 0.80, 0.0),  # measured 7.2, 87.4%, 3.9% (embedding int6)
    ("int4", "bfloat16"): Bound(14.0, 0.80, 0.0),  # measured 7.3, 88.1%, 3.9%
    ("int4", "float16"): Bound(15.0, 0.80, 0.0),  # measured 7.2, 88.4%, 3.9%
}


# -- running the model --------------------------------------------------------------------------


def _pool(model: Model, backend: Backend, tokens: int, sequences: int, kv_cache_dtype: str):
    blocks = sequences * -(-tokens // BLOCK_SIZE)
    pool = backend.BlockPool(blocks, bytes_per_block(model.config, BLOCK_SIZE, kv_cache_dtype))
    return pool, kv_view(pool, model.config, BLOCK_SIZE, kv_cache_dtype)


def teacher_forced_logits(
    model: Model,
    backend: Backend,
    texts: list[list[int]],
    kv_cache_dtype: str,
    decode: int = TEACHER_FORCED_DECODE,
) -> list[np.ndarray]:
    """Every position's logits ``(len(text), vocab)`` of each token sequence: all but the last
    ``decode`` tokens of every text prefilled in one forward pass, then one decode step per
    remaining token for all texts together."""
    pool, kv_cache = _pool(model, backend, max(map(len, texts)), len(texts), kv_cache_dtype)
    sequences = []
    for i, text in enumerate(texts):
        seq = Sequence(i, list(text[: len(text) - decode]), 1, (), pool.new_table(BLOCK_SIZE))
        seq.table.append_tokens(seq.num_tokens)
        sequences.append(seq)
    entries = [BatchEntry(seq, 0, seq.num_tokens, is_prefill=True) for seq in sequences]
    logits = model.forward(prepare_inputs(entries, all_positions=True), kv_cache)
    bounds = np.cumsum([0] + [seq.num_tokens for seq in sequences])
    rows = [[logits[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    for step in range(decode):
        entries = []
        for seq, text in zip(sequences, texts, strict=True):
            seq.token_ids.append(text[len(text) - decode + step])
            seq.table.append_tokens(1)
            entries.append(BatchEntry(seq, seq.num_tokens - 1, 1, is_prefill=False))
        step_logits = model.forward(prepare_inputs(entries), kv_cache)
        for i, row in enumerate(step_logits):
            rows[i].append(row[None])
    for seq in sequences:
        seq.table.release()
    return [np.concatenate(parts) for parts in rows]


def greedy_tokens(
    model: Model, backend: Backend, prompts: list[list[int]], steps: int, kv_cache_dtype: str
) -> np.ndarray:
    """``(len(prompts), steps)``: each prompt's greedy continuation (argmax, no stop token),
    all prompts decoded together, one forward pass per step."""
    longest = max(map(len, prompts)) + steps
    pool, kv_cache = _pool(model, backend, longest, len(prompts), kv_cache_dtype)
    sequences = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, list(prompt), 1, (), pool.new_table(BLOCK_SIZE))
        seq.table.append_tokens(len(prompt))
        sequences.append(seq)
    entries = [BatchEntry(seq, 0, seq.num_tokens, is_prefill=True) for seq in sequences]
    generated = np.empty((len(prompts), steps), dtype=np.int64)
    for step in range(steps):
        generated[:, step] = model.forward(prepare_inputs(entries), kv_cache).argmax(axis=1)
        entries = []
        for seq, token in zip(sequences, generated[:, step], strict=True):
            seq.token_ids.append(int(token))
            seq.table.append_tokens(1)
            entries.append(BatchEntry(seq, seq.num_tokens - 1, 1, is_prefill=False))
    for seq in sequences:
        seq.table.release()
    return generated


# -- comparing with float32 ---------------------------------------------------------------------


def compare_logits(reference: list[np.ndarray], logits: list[np.ndarray]) -> dict:
    """Largest absolute error, the float32 logits' scale, and top-1 agreement."""
    ref, got = np.concatenate(reference), np.concatenate(logits)
    error = float(np.max(np.abs(got.astype(np.float64) - ref)))
    scale = float(np.max(np.abs(ref)))
    return {
        "positions": len(ref),
        "max_abs_error": error,
        "logit_scale": scale,
        "relative_error": error / scale,
        "top1_agreement": float(np.mean(got.argmax(axis=1) == ref.argmax(axis=1))),
    }


def compare_greedy(reference: np.ndarray, tokens: np.ndarray) -> dict:
    """Agreement of greedy continuations ``(prompts, steps)`` with float32's."""
    equal = tokens == reference
    prefix = [int(row.argmin()) if not row.all() else len(row) for row in equal]
    return {
        "greedy_tokens": equal.shape[1],
        "greedy_prefix": sum(prefix) / equal.size,
        "greedy_overall": float(equal.mean()),
        "first_divergence": min(prefix),
    }


# -- the two models -----------------------------------------------------------------------------


def stories_rows(directory: Path, backend: Backend, greedy_steps: int = GREEDY_TOKENS):
    """One row per mode on stories260K, float32 weights and cache first."""
    from mie.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(directory)
    texts = [tokenizer.encode(text) for text in STORY_TEXTS]
    prompts = [tokenizer.encode(text) for text in GREEDY_PROMPTS]
    reference = None
    rows = []
    for label, dtype, quantization in WEIGHTS:
        model = Model.from_pretrained(
            directory, backend.kernels, dtype=dtype, quantization=quantization
        )
        for kv in KV_CACHE_DTYPES:
            logits = teacher_forced_logits(model, backend, texts, kv)
            tokens = greedy_tokens(model, backend, prompts, greedy_steps, kv)
            if reference is None:
                reference = logits, tokens
            row = {"model": "stories260K", "weights": label, "kv_cache": kv}
            row.update(compare_logits(reference[0], logits))
            row.update(compare_greedy(reference[1], tokens))
            rows.append(row)
    return rows


def qwen_rows(backend: Backend, seed: int, prompts: int, prompt_len: int):
    """One row per mode on a random Qwen2-0.5B-shaped model (weights drawn once per format
    from the same seed: the same float32 values, stored as each format stores them)."""
    from mie.bench.throughput import QWEN2_05B

    config = ModelConfig.from_hf(QWEN2_05B)
    rng = np.random.default_rng(seed)
    texts = rng.integers(0, config.vocab_size, (prompts, prompt_len)).tolist()
    reference = None
    rows = []
    for label, dtype, quantization in WEIGHTS:
        model = Model.random(config, seed, backend.kernels, dtype=dtype, quantization=quantization)
        for kv in KV_CACHE_DTYPES:
            logits = teacher_forced_logits(model, backend, texts, kv)
            if reference is None:
                reference = logits
            row = {"model": "Qwen2-0.5B-shaped, random", "weights": label, "kv_cache": kv}
            row.update(compare_logits(reference, logits))
            rows.append(row)
        del model
    return rows


# -- the report ---------------------------------------------------------------------------------


def _sci(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table; stories260K rows carry their ``BOUNDS`` (the greedy one
    only for ``GREEDY_TOKENS`` tokens: ``--quick`` generates fewer)."""
    headers = [
        "model",
        "weights",
        "KV cache",
        "positions",
        "max abs logit error",
        "relative",
        "top-1 agree",
        "greedy: before 1st divergence",
        "greedy: equal overall",
        "bound: abs error",
        "bound: top-1",
        "bound: greedy",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [row["model"], row["weights"], row["kv_cache"], str(row["positions"])]
        cells += [_sci(row["max_abs_error"]), _sci(row["relative_error"])]
        cells.append(_pct(row["top1_agreement"]))
        greedy = ["", ""]
        if "greedy_prefix" in row:
            greedy = [
                f"{_pct(row['greedy_prefix'])} (first at {row['first_divergence']})",
                _pct(row["greedy_overall"]),
            ]
        bound_cells = ["", "", ""]
        if "greedy_prefix" in row:  # stories260K
            bound = BOUNDS[row["weights"], row["kv_cache"]]
            full = row["greedy_tokens"] == GREEDY_TOKENS
            bound_cells = [
                _sci(bound.max_abs_error),
                _pct(bound.min_top1),
                _pct(bound.min_greedy_prefix) if full else "",
            ]
        lines.append("| " + " | ".join(cells + greedy + bound_cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mie.bench.accuracy", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="64 greedy tokens, and 2 Qwen prompts of 16 tokens"
    )
    parser.add_argument(
        "--backend",
        choices=("python", "fast"),
        default=None,
        help="default: MIE_BACKEND, else fast if built",
    )
    parser.add_argument("--stories", type=Path, default=STORIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-qwen", action="store_true", help="stories260K only")
    args = parser.parse_args(argv)
    backend = select(args.backend)
    start = time.perf_counter()
    rows = stories_rows(args.stories, backend, 64 if args.quick else GREEDY_TOKENS)
    if not args.no_qwen:
        shape = (2, 16) if args.quick else (QWEN_PROMPTS, QWEN_PROMPT_LEN)
        rows += qwen_rows(backend, args.seed, *shape)
    command = " ".join(["python -m mie.bench.accuracy", *(sys.argv[1:] if argv is None else argv)])
    print(markdown(rows))
    print(
        f"\n`{command}`: backend {_backend_name(backend)}, {_cpu_name()}, "
        f"{time.perf_counter() - start:.0f} s"
    )


def _backend_name(backend: Backend) -> str:
    if backend.name != "fast":
        return backend.name
    from mie._fast import linear

    return f"fast ({linear.ISA})"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
