"""mie's n-gram speculation beside llama.cpp's prompt-lookup decoding, each in its own process.

    LLAMA_CPP_SOURCE=/path/to/llama_cpp_python-X.tar.gz python scripts/prompt_lookup_peers.py

stories260K is converted to a float32 GGUF by llama.cpp's own ``convert_hf_to_gguf.py``
(``scripts/perplexity.py``'s ``convert``), so both engines compute the same weights. Both get
the same prompts as the same token ids (mie's tokenizer: llama.cpp's reading of the GGUF
vocabulary may cut the text otherwise), the input-grounded and free prompts of
``python -m mie.bench --only speculative``, batch 1, greedy, ``MAX_TOKENS`` tokens each.
Four configurations -- mie plain, mie n-gram (``NGRAM``), llama.cpp plain, llama.cpp with
``llama_cpp.llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=K)`` -- each run in a
fresh process per round (2 threads each, as a user runs them), the rounds interleaved, the
median round reported, with the load average before and after. Each engine's speed-up is
against its own plain decoding, and "identical" compares each engine's speculative token ids
with its own plain ones (the two engines need not agree with each other: llama.cpp sums in
another order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from perplexity import convert, llama_cpp_source  # noqa: E402

from mie.bench.speculative import FREE_PROMPTS, GROUNDED_PROMPTS  # noqa: E402

STORIES = ROOT / "models" / "stories260K"
MAX_TOKENS = 128
K = 4
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
CONFIGS = ("mie plain", "mie n-gram", "llama.cpp plain", "llama.cpp prompt lookup")
THREADS = 2


def prompt_ids() -> dict[str, list[list[int]]]:
    from mie.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(STORIES)
    return {
        "input-grounded": [tokenizer.encode(text) for _, text in GROUNDED_PROMPTS],
        "free": [tokenizer.encode(text) for text in FREE_PROMPTS],
    }


def run_mie(speculative: bool, workloads: dict) -> dict:
    from mie import LLM, SamplingParams

    llm = LLM(str(STORIES), speculative_config=NGRAM if speculative else None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    result = {}
    for name, prompts in workloads.items():
        tokens, seconds = [], 0.0
        for ids in prompts:  # batch 1: one prompt at a time
            start = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens.append(out.outputs[0].token_ids)
        result[name] = {"tokens": tokens, "seconds": seconds}
    return result


def run_llama(gguf: str, speculative: bool, workloads: dict) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=K) if speculative else None
    llm = llama_cpp.Llama(
        gguf,
        n_ctx=512,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        draft_model=draft,
        verbose=False,
    )
    eos = llm.token_eos()

    def generate(ids: list[int]) -> list[int]:
        llm.reset()
        out = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if token == eos or len(out) == MAX_TOKENS:
                break
        return out

    generate([1, 2, 3])
    result = {}
    for name, prompts in workloads.items():
        tokens, seconds = [], 0.0
        for ids in prompts:
            start = time.perf_counter()
            tokens.append(generate(ids))
            seconds += time.perf_counter() - start
        result[name] = {"tokens": tokens, "seconds": seconds}
    return result


def worker(config: str, gguf: str) -> None:
    workloads = prompt_ids()
    if config.startswith("mie"):
        result = run_mie(config == "mie n-gram", workloads)
    else:
        result = run_llama(gguf, config == "llama.cpp prompt lookup", workloads)
    print(json.dumps(result))


def run_child(config: str, gguf: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    command = [sys.executable, __file__, "--worker", config, "--gguf", str(gguf)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{config} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp-source", help="llama.cpp tree or llama-cpp-python sdist")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.gguf)
        return
    with tempfile.TemporaryDirectory() as scratch:
        gguf = convert(
            llama_cpp_source(args.llama_cpp_source),
            STORIES,
            "f32",
            Path(scratch) / "stories260K-f32.gguf",
        )
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        for round_index in range(args.rounds):
            order = CONFIGS if round_index % 2 == 0 else CONFIGS[::-1]
            for config in order:
                runs[config].append(run_child(config, gguf))
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"stories260K f32, batch 1, greedy, up to {MAX_TOKENS} tokens, {THREADS} threads each, "
        f"median of {args.rounds} rounds, each configuration in a fresh process per round"
    )
    print(
        f"{'workload':16} {'configuration':26} {'tokens':>6} {'tokens/s':>9} {'speed-up':>9} "
        f"{'identical':>9}"
    )
    for workload in ("input-grounded", "free"):
        rates = {}
        for config in CONFIGS:
            first = runs[config][0][workload]
            count = sum(len(t) for t in first["tokens"])
            rates[config] = statistics.median(
                count / run[workload]["seconds"] for run in runs[config]
            )
            plain = "mie plain" if config.startswith("mie") else "llama.cpp plain"
            same = all(
                run[workload]["tokens"] == runs[plain][0][workload]["tokens"]
                for run in runs[config]
            )
            speedup = rates[config] / rates[plain] if plain in rates else 1.0
            print(
                f"{workload:16} {config:26} {count:6d} {rates[config]:9.0f} "
                f"{speedup:8.2f}x {'yes' if same else 'NO':>9}"
            )


if __name__ == "__main__":
    main()
