"""One engine, one weight format, in a process of its own: ``python -m mie.bench.peers_worker``.

``python -m mie.bench --peers`` (``mie.bench.peers``) runs every measurement of mie and of
llama.cpp in a fresh process of this module, so that each engine runs as a user would run it
alone: mie imported normally (its OpenMP runtime starts with the wait policy mie sets,
``mie._fast``), llama.cpp with llama-cpp-python's defaults and its own OpenMP runtime,
untouched by mie's. Loaded into one process, the two shared one OpenMP runtime whose wait
policy the first to load it fixed, and both ran slower than they do alone.

The request is one argument of JSON; the answer one line of JSON on stdout (anything the
engines log goes to stderr). ``request["run"]`` says what to do:

* ``"mie"``: ``Model.from_pretrained(path, dtype=..., quantization=...)`` -- the same GGUF
  file the llama.cpp run loads -- on the chosen backend, then ``timed_figures``. Answers the
  figures, the backend, its threads and the weights' bytes (``model.weights.nbytes``).
* ``"llama.cpp"``: ``Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=...)``,
  everything else llama-cpp-python's defaults (its KV cache is float16, its batch 512
  tokens, flash attention off), then ``timed_figures``. Answers the figures, the GGUF file's
  bytes and llama-cpp-python's version.
* ``"mie generate"`` and ``"llama.cpp generate"``: the prompt-lookup comparison's runs
  (``timed_generations``): ``LLM(path, speculative_config=...)`` (``None``: plain
  decoding), or ``Llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))``
  (``k`` None: plain), generating greedily from each prompt's token ids, one prompt at a
  time. Answers each workload's token ids and seconds (mie's also its engine steps).
* ``"quantize"``: llama.cpp's own quantizer (``llama_model_quantize``, what its
  ``llama-quantize`` tool runs) from one GGUF file to another, for the formats ``gguf``'s
  Python quantizers cannot write (Q4_K). Answers the file's bytes.

Nothing of mie is imported at the top of this module, and the llama.cpp runs import none of
it: their process never loads mie's OpenMP runtime (tested).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

PREFILL_CHUNK = 512
"""Tokens per forward pass when mie prefills a long prompt: llama-cpp-python's default batch
(``n_batch``), in which llama.cpp splits the same prompt."""


class Engine(Protocol):
    """One sequence of an engine: ``feed`` computes tokens appended to it (a prompt, or one
    decode step), ``reset`` empties it."""

    def reset(self) -> None: ...

    def feed(self, tokens: Sequence[int]) -> object: ...


def seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def timed_figures(
    engine: Engine, prompt: list[int], decode: list[int], contexts: list[int], repeats: int
) -> dict[str, float]:
    """Tokens/s of batch-1 ``engine``: ``"prefill"`` of the first ``contexts[0]`` tokens of
    ``prompt`` (median of ``repeats``), and ``"decode@C"`` for each context ``C``: the median
    of ``decode``'s steps, one token each, after a prefill of ``prompt[:C]`` (at the first
    context, the steps of all ``repeats``; at the others, of one pass: their prefill is long).
    One untimed warm-up pass at the first context first (it also pages in the weights)."""
    first, *longer = contexts
    prefill_s: list[float] = []
    step_s: list[float] = []
    for repeat in range(repeats + 1):
        engine.reset()
        prefill = seconds(lambda: engine.feed(prompt[:first]))
        steps = [seconds(lambda token=token: engine.feed([token])) for token in decode]
        if repeat:
            prefill_s.append(prefill)
            step_s.extend(steps)
    figures = {
        "prefill": first / float(np.median(prefill_s)),
        f"decode@{first}": 1 / float(np.median(step_s)),
    }
    for context in longer:
        engine.reset()
        engine.feed(prompt[:context])
        steps = [seconds(lambda token=token: engine.feed([token])) for token in decode]
        figures[f"decode@{context}"] = 1 / float(np.median(steps))
    return figures


def capacity(request: dict) -> int:
    """The most tokens the sequence holds: the longest context and its decode steps."""
    return max(request["contexts"]) + len(request["decode"])


# -- mie ------------------------------------------------------------------------------------
def threads_used(backend) -> int:
    """The threads mie computes on: its OpenMP threads (fast backend; the most its
    ``ThreadPolicy`` runs on), else the CPUs this process may use (NumPy's BLAS takes them
    all)."""
    if backend.name == "fast":
        return int(backend.kernels.threads)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class MieSequence:
    """A mie ``Model``'s one sequence in a KV pool of its own (``kv_cache_dtype``), prompts
    computed in forward passes of at most ``PREFILL_CHUNK`` tokens, each under the engine's
    ``ThreadPolicy`` (fewer threads while another process crowds the machine), as
    ``LLMEngine.step`` runs them."""

    def __init__(self, model, backend, capacity: int, kv_cache_dtype: str) -> None:
        from mie.bench.throughput import BLOCK_SIZE
        from mie.kernels_threads import ThreadPolicy
        from mie.model import bytes_per_block, kv_view

        self.model = model
        self.prepare_inputs = backend.prepare_inputs  # the engine's: the fast one, if built
        self.thread_policy = ThreadPolicy(backend.kernels.threads, backend.kernels.set_threads)
        blocks = -(-capacity // BLOCK_SIZE)
        self.pool = backend.BlockPool(
            blocks, bytes_per_block(model.config, BLOCK_SIZE, kv_cache_dtype)
        )
        self.kv_cache = kv_view(self.pool, model.config, BLOCK_SIZE, kv_cache_dtype)
        self.block_size = BLOCK_SIZE
        self.seq = None

    def reset(self) -> None:
        from mie.scheduler import Sequence as MieSeq

        if self.seq is not None:
            self.seq.table.release()
        self.seq = MieSeq(0, [], 1, (), self.pool.new_table(self.block_size))

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Compute ``tokens`` after the sequence's; returns the last one's logits."""
        from mie.scheduler import BatchEntry

        seq = self.seq
        for i in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[i : i + PREFILL_CHUNK]
            start = len(seq.token_ids)
            seq.token_ids.extend(chunk)
            seq.table.append_tokens(len(chunk))
            entry = BatchEntry(seq, start, len(chunk), is_prefill=len(chunk) > 1)
            with self.thread_policy.step():
                logits = self.model.forward(self.prepare_inputs([entry]), self.kv_cache)
        return logits[-1]


def mie_run(request: dict) -> dict:
    from mie.backend import select
    from mie.model import Model

    backend = select(request["backend"])
    model = Model.from_pretrained(  # the very GGUF file llama.cpp runs
        request["path"],
        backend.kernels,
        dtype=request["dtype"],
        quantization=request["quantization"],
    )
    engine = MieSequence(model, backend, capacity(request), request["kv_cache_dtype"])
    figures = timed_figures(
        engine, request["prompt"], request["decode"], request["contexts"], request["repeats"]
    )
    return {
        "engine": "mie",
        "backend": backend.name,
        "threads": threads_used(backend),
        "weight_bytes": int(model.weights.nbytes),
        "tokens_per_s": figures,
    }


# -- llama.cpp ------------------------------------------------------------------------------
class LlamaSequence:
    """llama-cpp-python's ``Llama``: one sequence already (``eval`` computes tokens after the
    ones it holds, splitting a prompt into batches of ``n_batch``)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def reset(self) -> None:
        self.llm.reset()

    def feed(self, tokens: Sequence[int]) -> None:
        self.llm.eval(tokens)


def llama_cpp_run(request: dict) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=request["path"],
        n_threads=request["threads"],
        n_threads_batch=request["threads"],
        n_ctx=capacity(request),
        verbose=False,
    )
    figures = timed_figures(
        LlamaSequence(llm),
        request["prompt"],
        request["decode"],
        request["contexts"],
        request["repeats"],
    )
    llm.close()
    return {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "threads": request["threads"],
        "weight_bytes": os.path.getsize(request["path"]),
        "tokens_per_s": figures,
    }


# -- generation, plain or with prompt lookup ------------------------------------------------
def timed_generations(
    generate: Callable[[list[int]], list[int]],
    request: dict,
    steps: Callable[[], int] | None = None,
) -> dict[str, dict]:
    """``generate`` (a prompt's token ids -> the generated ones) over each of
    ``request["workloads"]``'s prompts, one at a time (batch 1), after one untimed warm-up
    generation from ``request["warm_up"]`` (a prompt of none of them, so that mie's prefix
    cache holds none of theirs): per workload, every prompt's generated ids and the seconds
    the generations took together; with ``steps`` (the engine's count of steps so far), the
    steps they took."""
    generate(request["warm_up"])
    result = {}
    for name, prompts in request["workloads"].items():
        tokens, total = [], 0.0
        steps_before = steps() if steps else 0
        for ids in prompts:
            start = time.perf_counter()
            tokens.append(generate(ids))
            total += time.perf_counter() - start
        result[name] = {"tokens": tokens, "seconds": total}
        if steps:
            result[name]["steps"] = steps() - steps_before
    return result


def mie_generate(request: dict) -> dict:
    """``LLM.generate`` on the GGUF file, greedy, ``request["speculative_config"]`` (None:
    plain decoding), stopping at ``max_tokens`` or at one of ``stop_token_ids``."""
    from mie import LLM, SamplingParams

    llm = LLM(
        request["path"],
        backend=request["backend"],
        speculative_config=request["speculative_config"],
    )
    params = SamplingParams(
        max_tokens=request["max_tokens"],
        temperature=0.0,
        stop_token_ids=request["stop_token_ids"],
    )

    def generate(ids: list[int]) -> list[int]:
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    workloads = timed_generations(generate, request, steps=lambda: llm.engine.stats.steps)
    backend = llm.engine.backend
    return {
        "engine": "mie",
        "backend": backend.name,
        "threads": threads_used(backend),
        "workloads": workloads,
    }


def llama_cpp_generate(request: dict) -> dict:
    """llama-cpp-python's ``Llama.generate`` on the GGUF file, greedy, with
    ``LlamaPromptLookupDecoding(num_pred_tokens=k)`` as its draft model (``k`` None: plain
    decoding), stopping as ``mie_generate`` does: the GGUF has no vocabulary, so llama.cpp
    knows no end-of-text token of its own (the stop token is kept, as mie keeps it)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    k = request["num_pred_tokens"]
    llm = llama_cpp.Llama(
        model_path=request["path"],
        n_threads=request["threads"],
        n_threads_batch=request["threads"],
        n_ctx=request["n_ctx"],
        draft_model=None if k is None else LlamaPromptLookupDecoding(num_pred_tokens=k),
        verbose=False,
    )
    stops = set(request["stop_token_ids"])

    def generate(ids: list[int]) -> list[int]:
        llm.reset()  # from an empty context
        out: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if token in stops or len(out) == request["max_tokens"]:
                break
        return out

    workloads = timed_generations(generate, request)
    llm.close()
    return {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "threads": request["threads"],
        "workloads": workloads,
    }


def quantize(request: dict) -> dict:
    """``request["source"]`` quantized by llama.cpp into ``request["target"]`` as file type
    ``request["ftype"]`` (a ``LLAMA_FTYPE_*``), on ``request["threads"]`` threads."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = request["ftype"]
    params.nthread = request["threads"]
    status = llama_cpp.llama_model_quantize(
        request["source"].encode(), request["target"].encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed with status {status}")
    return {"path": request["target"], "bytes": os.path.getsize(request["target"])}


RUNS = {
    "mie": mie_run,
    "llama.cpp": llama_cpp_run,
    "mie generate": mie_generate,
    "llama.cpp generate": llama_cpp_generate,
    "quantize": quantize,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m mie.bench.peers_worker REQUEST``: print ``RUNS[request["run"]]``'s answer
    as one line of JSON."""
    request = json.loads((sys.argv[1:] if argv is None else argv)[0])
    print(json.dumps(RUNS[request["run"]](request)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
