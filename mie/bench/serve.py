"""Serving benchmark (``python -m mie.bench --serve``): concurrent streaming clients over HTTP.

The server is ``python -m mie serve`` in its own process, on a free loopback port, so the
load generator does not share its interpreter (or its GIL). ``NUM_CLIENTS`` clients each
take the next request of a fixed-seed mixed workload, send it with ``stream: true`` and read
the server-sent events until every request is done (a closed loop: at most one request per
client in flight). Every request is greedy with ``ignore_eos``, so it generates exactly its
``max_tokens`` and the token counts do not depend on the model's text.

Beside the served run, offline ``LLM.generate`` runs the same requests in this process with
the same engine settings (``max_num_seqs`` = the number of clients); the ratio of the two
throughputs is what HTTP, JSON, the event loop and one-by-one arrival cost. The machine may be
shared, so the two alternate for ``ROUNDS`` rounds (fresh prompt tokens of the same lengths
each round, so the prefix cache finds nothing) and each keeps its best round.

Reported: requests/s and output tokens/s; percentiles over requests of the time to first
token (send -> first text event) and of the inter-token latency (a request's first to last
text event over its tokens - 1; events may arrive several to a read, so single gaps would
measure the client's reads more than the server's pace).

Then the long-prompt scenario (``run_long_prompts``): streaming clients decode on a random
76M-parameter Llama while 2,000-token prompts arrive, on two servers, whole and chunked
prefill; there every gap between two tokens of a stream counts, since a prefill stall is one
long gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mie.backend import select
from mie.bench import STORIES260K
from mie.bench.section import SectionResult
from mie.bench.table import table
from mie.engine.llm import LLM
from mie.engine.sampling import SamplingParams
from mie.progress import ProgressBar

NUM_CLIENTS, NUM_REQUESTS = 16, 128
NUM_CLIENTS_QUICK, NUM_REQUESTS_QUICK = 4, 8
NUM_BLOCKS = 2048  # 32 Ki tokens of KV for stories260K: no preemption at these sizes
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 300.0
PERCENTILES = (50, 90, 99)
ROUNDS = 2


def default_model() -> Path:
    """stories260K, as the repository ships it (models/stories260K)."""
    if STORIES260K.is_dir():
        return STORIES260K
    raise FileNotFoundError(f"stories260K not found at {STORIES260K} (run from a clone)")


def mixed_requests(
    seed: int, n: int, vocab: int, quick: bool, round_: int = 0
) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens): prompts 8-128 tokens, outputs 16-128 (quick: less).

    The lengths depend on ``seed`` only; the prompt tokens also on ``round_``, so repeated
    rounds do the same work without hitting the prefix cache.
    """
    rng = np.random.default_rng(seed)
    prompt_range, output_range = ((8, 32), (8, 16)) if quick else ((8, 128), (16, 128))
    prompt_lens = rng.integers(*prompt_range, endpoint=True, size=n)
    output_lens = rng.integers(*output_range, endpoint=True, size=n)
    tokens = np.random.default_rng([seed, round_])
    return [
        (tokens.integers(3, vocab, length).tolist(), int(max_tokens))
        for length, max_tokens in zip(prompt_lens, output_lens, strict=True)
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(
    model: Path,
    backend: str | None,
    max_num_seqs: int,
    num_blocks: int = NUM_BLOCKS,
    extra: tuple[str, ...] = (),
):
    """``python -m mie serve`` on a free loopback port, until the block ends; yields its URL.

    ``extra``: more flags (``--replicas 2 --router prefix``); the server counts as started
    once ``/health`` answers 200 and, with replicas, says that all of them are up."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "mie", "serve", "--model", str(model), "--port", str(port)]
    command += ["--num-blocks", str(num_blocks), "--max-num-seqs", str(max_num_seqs), *extra]
    if backend:
        command += ["--backend", backend]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the server did not start:\n{log.read()[-2000:]}")
                try:
                    health = httpx.get(url + "/health", timeout=1.0)
                    replicas = health.json().get("replicas", {})
                    if health.status_code == 200 and replicas.get("up") == replicas.get("total"):
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


async def stream_completion(
    client, model: str, prompt: list[int], max_tokens: int, on_text=None
) -> tuple[float, list[float], int]:
    """One greedy streaming completion (``ignore_eos``: exactly ``max_tokens``): when it was
    sent, when each text event arrived, and the completion tokens the usage chunk counts.
    ``on_text()`` is called at each text event."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, times, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
                if on_text is not None:
                    on_text()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return sent, times, tokens


async def drive(url: str, model: str, requests, num_clients: int, bar: ProgressBar) -> list[dict]:
    """Send every request from ``num_clients`` concurrent streaming clients; time each."""
    import httpx

    todo = list(enumerate(requests))
    records: list[dict] = [{} for _ in requests]

    async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
        sent, times, tokens = await stream_completion(client, model, prompt, max_tokens)
        done = time.perf_counter()
        # Events can arrive several to a read, so the gaps between them say more about the
        # client's reads than the server's pace: the pace is the mean gap, first to last.
        itl = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
        return {"ttft": times[0] - sent, "itl": itl, "tokens": tokens, "latency": done - sent}

    async def client_loop(client: httpx.AsyncClient) -> None:
        while todo:
            index, (prompt, max_tokens) = todo.pop(0)
            records[index] = await one(client, prompt, max_tokens)
            bar.update(1)

    limits = httpx.Limits(max_connections=num_clients)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as c:
        await asyncio.gather(*(client_loop(c) for _ in range(num_clients)))
    return records


def warm_up(url: str, model: str) -> None:
    """One small request first, so one-time costs (imports, first connection) are not timed."""
    import httpx

    body = {"model": model, "prompt": [1, 5], "max_tokens": 2}
    httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S).raise_for_status()


def server_metrics(url: str) -> dict[str, float]:
    import httpx

    samples = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def percentiles_ms(values: list[float]) -> dict[str, float]:
    return {f"p{p}": float(np.percentile(values, p)) * 1e3 for p in PERCENTILES}


def run_offline(llm: LLM, requests) -> dict:
    steps_before = llm.engine.stats.steps
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests],
        use_tqdm=False,
    )
    return {"seconds": time.perf_counter() - start, "steps": llm.engine.stats.steps - steps_before}


def run_served(url: str, model: str, requests, num_clients: int, bar: ProgressBar) -> dict:
    steps_before = server_metrics(url)["mie_engine_steps_total"]
    start = time.perf_counter()
    records = asyncio.run(drive(url, model, requests, num_clients, bar))
    seconds = time.perf_counter() - start
    steps = server_metrics(url)["mie_engine_steps_total"] - steps_before
    return {"seconds": seconds, "records": records, "steps": int(steps)}


def run(args: argparse.Namespace) -> SectionResult:
    """The ``serve`` section of ``python -m mie.bench`` (opt-in: ``--serve``): the mixed
    workload, then the long-prompt scenario (``run_long_prompts``); with ``--replicas N``, the
    routing comparison (``run_routing``) instead."""
    if getattr(args, "replicas", None):
        return run_routing(args)
    mixed = run_mixed(args)
    long_prompts = run_long_prompts(args)
    return SectionResult(
        {**mixed.data, **long_prompts.data}, mixed.report + "\n\n" + long_prompts.report
    )


def run_mixed(args: argparse.Namespace) -> SectionResult:
    """Served against offline throughput on the mixed workload (stories260K)."""
    quick, seed = getattr(args, "quick", False), getattr(args, "seed", 0)
    backend = getattr(args, "backend", None)
    num_clients, num_requests = (
        (NUM_CLIENTS_QUICK, NUM_REQUESTS_QUICK) if quick else (NUM_CLIENTS, NUM_REQUESTS)
    )
    model = default_model()
    llm = LLM(model, backend=backend, num_blocks=NUM_BLOCKS, max_num_seqs=num_clients)
    vocab = llm.engine.model.config.vocab_size
    offline, served = [], []
    # The machine may be shared: alternate the two, and keep each one's best round.
    with server_process(model, backend, num_clients) as url:
        warm_up(url, model.name)
        with ProgressBar(ROUNDS * (num_requests + 1), "serve") as bar:
            for round_ in range(ROUNDS):
                requests = mixed_requests(seed, num_requests, vocab, quick, round_)
                offline.append(run_offline(llm, requests))
                bar.update(1)
                served.append(run_served(url, model.name, requests, num_clients, bar))
    best = min(served, key=lambda r: r["seconds"])
    best_offline = min(offline, key=lambda r: r["seconds"])
    records, offline_s = best["records"], best_offline["seconds"]
    output_tokens = sum(n for _, n in requests)
    result = {
        "model": model.name,
        "backend": llm.engine.backend.name,
        "clients": num_clients,
        "requests": num_requests,
        "rounds": ROUNDS,
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": output_tokens,
        "all_complete": all(
            sum(r["tokens"] for r in s["records"]) == output_tokens for s in served
        ),
        "served": {
            "seconds": best["seconds"],
            "seconds_all_rounds": [s["seconds"] for s in served],
            "requests_per_s": num_requests / best["seconds"],
            "output_tokens_per_s": output_tokens / best["seconds"],
            "ttft_ms": percentiles_ms([r["ttft"] for r in records]),
            "itl_ms": percentiles_ms([r["itl"] for r in records if r["itl"] is not None]),
            "latency_ms_mean": float(np.mean([r["latency"] for r in records])) * 1e3,
            "engine_steps": best["steps"],
        },
        "offline": {
            "seconds": offline_s,
            "seconds_all_rounds": [r["seconds"] for r in offline],
            "requests_per_s": num_requests / offline_s,
            "output_tokens_per_s": output_tokens / offline_s,
            "engine_steps": best_offline["steps"],
        },
    }
    result["offline_over_served"] = (
        result["offline"]["output_tokens_per_s"] / result["served"]["output_tokens_per_s"]
    )
    return SectionResult({"serve": result}, report(result))


def report(r: dict) -> str:
    served, offline = r["served"], r["offline"]
    rows = [
        [
            "served (HTTP, streaming)",
            served["seconds"],
            served["requests_per_s"],
            served["output_tokens_per_s"],
            served["engine_steps"],
        ],
        [
            "offline LLM.generate",
            offline["seconds"],
            offline["requests_per_s"],
            offline["output_tokens_per_s"],
            offline["engine_steps"],
        ],
    ]
    latency = [
        ["time to first token", *served["ttft_ms"].values()],
        ["inter-token latency", *served["itl_ms"].values()],
    ]
    return "\n".join(
        [
            f"Serving: {r['model']} (backend {r['backend']}), {r['clients']} concurrent streaming "
            f"clients, {r['requests']} requests ({r['prompt_tokens']:,} prompt tokens, "
            f"{r['output_tokens']:,} output tokens), greedy, ignore_eos; the server in its own "
            f"process; best of {r['rounds']} alternating rounds",
            table(["", "seconds", "requests/s", "output tok/s", "engine steps"], rows),
            "",
            table(["ms", *(f"p{p}" for p in PERCENTILES)], latency),
            f"-> every request complete: {r['all_complete']}; offline is "
            f"{r['offline_over_served']:.2f}x the served throughput.",
        ]
    )


# -- long prompts while streams decode: chunked vs whole prefill ------------------------------
# Streaming clients decode while a client sends long prompts one after another. With whole
# prefill, the step that admits a long prompt computes all of it, and every stream waits that
# long for its next token; with chunked prefill, no step computes more than the token budget.
# The model is a random Llama big enough that a 2,000-token prefill takes seconds here (its
# checkpoint is written to a temporary directory, with a word-level tokenizer whose every
# token is visible text, so each decode step is one server-sent event per stream). Two
# servers, one per mode, run the same requests; the rounds alternate the order.
@dataclass(frozen=True)
class LongPromptSetup:
    """Sizes of the long-prompt scenario (``--quick``: a tiny model and workload, for tests)."""

    model: dict  # config.json fields of the random Llama
    streams: int  # streaming clients ...
    stream_requests: int  # ... each sending this many requests in turn ...
    stream_tokens: int  # ... of this many output tokens (prompts of 16 tokens)
    long_prompts: int  # then, one after another, this many prompts ...
    long_prompt_tokens: int  # ... this long ...
    long_output_tokens: int  # ... asking for this many tokens
    chunk_budget: int | None  # --max-num-batched-tokens with chunking (None: the default)
    num_blocks: int
    rounds: int


LONG_SETUP = LongPromptSetup(
    model={
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
    },
    streams=8,
    stream_requests=2,
    stream_tokens=128,
    long_prompts=6,
    long_prompt_tokens=2000,
    long_output_tokens=16,
    chunk_budget=None,
    num_blocks=1024,
    rounds=2,
)
LONG_SETUP_QUICK = LongPromptSetup(
    model={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
    },
    streams=2,
    stream_requests=1,
    stream_tokens=24,
    long_prompts=2,
    long_prompt_tokens=300,
    long_output_tokens=4,
    chunk_budget=64,
    num_blocks=256,
    rounds=1,
)
STREAM_PROMPT_TOKENS = 16
MODES = {"whole": ("--no-enable-chunked-prefill",), "chunked": ("--enable-chunked-prefill",)}


def write_random_checkpoint(directory: Path, model: dict, seed: int = 0) -> Path:
    """A Llama checkpoint of shape ``model`` with random float32 weights (uniform, standard
    deviation 0.02; unit norms), tied embeddings, and a word-level tokenizer of one word per
    token id (``t0``, ``t1``, ...): every token decodes to visible text on its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **model,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    vocab = {f"t{i}": i for i in range(model["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))

    hidden, inter = model["hidden_size"], model["intermediate_size"]
    q_size = model["num_attention_heads"] * model["head_dim"]
    kv_size = model["num_key_value_heads"] * model["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (model["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(model["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape))
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    rng = np.random.default_rng(seed)
    half_width = np.float32(0.02 * np.sqrt(3.0))
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for shape in shapes.values():  # one tensor at a time: no copy of the whole model
            if len(shape) == 1:
                values = np.ones(shape, dtype=np.float32)
            else:
                values = (rng.random(shape, dtype=np.float32) - np.float32(0.5)) * (2 * half_width)
            f.write(values.astype("<f4").tobytes())
    return directory


def long_prompt_workload(setup: LongPromptSetup, seed: int, round_: int):
    """(streams, long prompts): per stream client, its requests in turn; the long prompts in
    the order sent. Each request is (prompt token ids, max_tokens); fresh tokens per round."""
    rng = np.random.default_rng([seed, round_, 14])
    vocab = setup.model["vocab_size"]

    def prompt(length: int) -> list[int]:
        return rng.integers(3, vocab, length).tolist()

    streams = [
        [(prompt(STREAM_PROMPT_TOKENS), setup.stream_tokens) for _ in range(setup.stream_requests)]
        for _ in range(setup.streams)
    ]
    longs = [
        (prompt(setup.long_prompt_tokens), setup.long_output_tokens)
        for _ in range(setup.long_prompts)
    ]
    return streams, longs


async def drive_long_prompts(url: str, model: str, streams, longs, bar: ProgressBar) -> dict:
    """Run every stream client and, once the streams are decoding, the long prompts one after
    another; every request streams, and each text event's arrival time is recorded."""
    import httpx

    decoding = asyncio.Event()

    async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
        sent, times, tokens = await stream_completion(
            client, model, prompt, max_tokens, on_text=decoding.set
        )
        bar.update(1)
        return {"sent": sent, "times": times, "tokens": tokens, "max_tokens": max_tokens}

    async def stream_client(client, requests) -> list[dict]:
        return [await one(client, prompt, n) for prompt, n in requests]

    async def long_client(client) -> list[dict]:
        await decoding.wait()
        return [await one(client, prompt, n) for prompt, n in longs]

    limits = httpx.Limits(max_connections=len(streams) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as c:
        start = time.perf_counter()
        *stream_records, long_records = await asyncio.gather(
            *(stream_client(c, requests) for requests in streams), long_client(c)
        )
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "streams": [r for rs in stream_records for r in rs],
        "longs": long_records,
    }


def summarize_long_prompts(run_: dict, prompt_tokens: int) -> dict:
    """One run's figures: the streams' inter-token gaps (every gap between two consecutive
    text events of a request: a stall is one long gap, which a per-request mean would hide),
    the long prompts' time to first token, and throughput over the whole run."""
    gaps = np.concatenate([np.diff(r["times"]) for r in run_["streams"]])
    records = run_["streams"] + run_["longs"]
    output_tokens = sum(r["tokens"] for r in records)
    long_ttft = [r["times"][0] - r["sent"] for r in run_["longs"]]
    return {
        "seconds": run_["seconds"],
        "itl_ms": {
            "p50": float(np.percentile(gaps, 50)) * 1e3,
            "p99": float(np.percentile(gaps, 99)) * 1e3,
            "max": float(gaps.max()) * 1e3,
        },
        "num_gaps": len(gaps),
        "long_ttft_ms": {
            "p50": float(np.percentile(long_ttft, 50)) * 1e3,
            "max": float(np.max(long_ttft)) * 1e3,
        },
        "output_tokens_per_s": output_tokens / run_["seconds"],
        "tokens_per_s": (output_tokens + prompt_tokens) / run_["seconds"],
        "complete": all(r["tokens"] == r["max_tokens"] for r in records),
    }


def time_prefill(url: str, model: str, prompt: list[int]) -> float:
    """Seconds one long prompt takes alone (prefill and one token), on an idle server."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S).raise_for_status()
    return time.perf_counter() - start


def run_long_prompts(args: argparse.Namespace) -> SectionResult:
    """Whole vs chunked prefill, served: ``LONG_SETUP`` (``--quick``: ``LONG_SETUP_QUICK``)."""
    quick, seed = getattr(args, "quick", False), getattr(args, "seed", 0)
    backend = getattr(args, "backend", None)
    setup = LONG_SETUP_QUICK if quick else LONG_SETUP
    max_num_seqs = setup.streams + 1
    per_round = setup.streams * setup.stream_requests + setup.long_prompts
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as servers:
        model = write_random_checkpoint(Path(tmp) / "random-llama", setup.model, seed)
        urls = {}
        for mode, flags in MODES.items():
            extra = flags
            if mode == "chunked" and setup.chunk_budget:
                extra += ("--max-num-batched-tokens", str(setup.chunk_budget))
            urls[mode] = servers.enter_context(
                server_process(model, backend, max_num_seqs, setup.num_blocks, extra)
            )
            warm_up(urls[mode], model.name)
        # A round not run gives the probe prompts; the first one also touches the KV pool's
        # memory for the first time, so the faster of two is what a prefill takes.
        _, probe = long_prompt_workload(setup, seed, round_=setup.rounds)
        prefill_s = min(time_prefill(urls["whole"], model.name, p) for p, _ in probe[:2])
        with ProgressBar(setup.rounds * len(MODES) * per_round, "serve: long prompts") as bar:
            for round_ in range(setup.rounds):
                streams, longs = long_prompt_workload(setup, seed, round_)
                prompt_tokens = sum(len(p) for rs in streams for p, _ in rs)
                prompt_tokens += sum(len(p) for p, _ in longs)
                order = list(MODES) if round_ % 2 == 0 else list(MODES)[::-1]
                for mode in order:
                    run_ = asyncio.run(
                        drive_long_prompts(urls[mode], model.name, streams, longs, bar)
                    )
                    runs[mode].append(summarize_long_prompts(run_, prompt_tokens))
    modes = {}
    for mode, rounds in runs.items():
        best = min(rounds, key=lambda r: r["seconds"])
        modes[mode] = {
            **best,
            "seconds_all_rounds": [r["seconds"] for r in rounds],
            "itl_p99_ms_all_rounds": [r["itl_ms"]["p99"] for r in rounds],
            "complete": all(r["complete"] for r in rounds),
        }
    params = _num_params(setup.model)
    result = {
        "model": f"random Llama, {params / 1e6:.3g}M parameters",
        "model_config": setup.model,
        "backend": select(backend).name,  # what the servers run: the same choice
        "prefill_seconds": prefill_s,
        "prefill_tokens": setup.long_prompt_tokens,
        **{k: v for k, v in setup.__dict__.items() if k not in ("model", "num_blocks")},
        **modes,
        "itl_p99_ratio": modes["whole"]["itl_ms"]["p99"] / modes["chunked"]["itl_ms"]["p99"],
        "throughput_ratio": modes["chunked"]["tokens_per_s"] / modes["whole"]["tokens_per_s"],
    }
    return SectionResult({"serve_long_prompts": result}, long_prompts_report(result))


def _num_params(model: dict) -> int:
    hidden, inter, head = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    q, kv = model["num_attention_heads"] * head, model["num_key_value_heads"] * head
    layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inter + 2 * hidden
    return model["num_hidden_layers"] * layer + model["vocab_size"] * hidden + hidden


def long_prompts_report(r: dict) -> str:
    rows = []
    for mode in MODES:
        m = r[mode]
        rows.append(
            [
                mode,
                m["seconds"],
                m["output_tokens_per_s"],
                m["tokens_per_s"],
                *m["itl_ms"].values(),
                *m["long_ttft_ms"].values(),
            ]
        )
    budget = r["chunk_budget"] or "default"
    return "\n".join(
        [
            f"Long prompts while streams decode: {r['model']} (backend {r['backend']}; a "
            f"{r['prefill_tokens']:,}-token prompt alone took {r['prefill_seconds']:.2f} s), "
            f"{r['streams']} streaming clients x {r['stream_requests']} requests of "
            f"{r['stream_tokens']} tokens, while {r['long_prompts']} prompts of "
            f"{r['long_prompt_tokens']:,} tokens ({r['long_output_tokens']} tokens out) arrive one "
            f"after another; whole prefill vs chunked (budget {budget}), one server each, best of "
            f"{r['rounds']} alternating rounds. ITL: every gap between two tokens of a stream",
            table(
                [
                    "",
                    "seconds",
                    "output tok/s",
                    "all tok/s",
                    "ITL p50 ms",
                    "ITL p99 ms",
                    "ITL max ms",
                    "long TTFT p50 ms",
                    "long TTFT max ms",
                ],
                rows,
            ),
            f"-> chunking cuts the streams' ITL p99 {r['itl_p99_ratio']:.2f}x at "
            f"{r['throughput_ratio']:.2f}x the throughput; every request complete: "
            f"{r['whole']['complete'] and r['chunked']['complete']}.",
        ]
    )


# -- routing across replicas (--serve --replicas N) ---------------------------------------------
# Many requests share a handful of long system prompts. Each replica's KV pool holds about
# half of the prompts' blocks: a router that keeps each prompt on one replica lets every
# replica cache its share; one that spreads every prompt over every replica makes each
# replica cycle all of them through too small a pool, and its prefix cache keeps losing them.
# The single engine gets the replicas' pools together, so all prompts fit: the reference.
SYSTEM_PROMPTS, SYSTEM_TOKENS = 8, 256  # 16 blocks of 16 tokens each
SUFFIX_TOKENS, OUTPUT_TOKENS = (8, 24), (16, 32)
ROUTING_REQUESTS, ROUTING_CLIENTS = 192, 16
REPLICA_BLOCKS = 128  # per replica: the 8 prompts need 128 blocks, plus the running requests
ROUTING_QUICK = {"prompts": 4, "requests": 24, "clients": 4, "blocks": 64}


def shared_prefix_requests(
    seed: int, n: int, vocab: int, prompts: int = SYSTEM_PROMPTS
) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens): a random one of ``prompts`` system prompts of
    ``SYSTEM_TOKENS`` tokens, then a user part of 8-24 tokens; outputs of 16-32 tokens."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, vocab, SYSTEM_TOKENS).tolist() for _ in range(prompts)]
    requests = []
    for _ in range(n):
        system = systems[int(rng.integers(prompts))]
        suffix = rng.integers(3, vocab, int(rng.integers(*SUFFIX_TOKENS, endpoint=True)))
        requests.append(
            (system + suffix.tolist(), int(rng.integers(*OUTPUT_TOKENS, endpoint=True)))
        )
    return requests


def hit_rate(metrics: dict[str, float], replicas: int | None) -> dict:
    """The prefix-cache hit rate (hit / (hit + computed) prompt tokens), overall and per
    replica, from ``/metrics``."""
    if not replicas:
        return {"total": metrics["mie_prefix_cache_hit_rate"]}
    rates = {"total": metrics['mie_prefix_cache_hit_rate{replica="total"}']}
    for r in range(replicas):
        rates[str(r)] = metrics[f'mie_prefix_cache_hit_rate{{replica="{r}"}}']
    return rates


def routed(before: dict[str, float], after: dict[str, float], replicas: int) -> list[int]:
    """Requests the ingress routed to each replica between two ``/metrics`` reads."""
    names = [f'mie_router_requests_total{{replica="{r}"}}' for r in range(replicas)]
    return [int(after.get(name, 0) - before.get(name, 0)) for name in names]


def run_routing(args: argparse.Namespace) -> SectionResult:
    """Each router (``--router``, or prefix and round-robin) on ``--replicas`` replicas, and
    one engine with their pools together, on the same shared-prefix workload."""
    quick, seed = getattr(args, "quick", False), getattr(args, "seed", 0)
    backend, replicas = getattr(args, "backend", None), args.replicas
    routers = [args.router] if getattr(args, "router", None) else ["prefix", "round-robin"]
    prompts, n, clients, blocks = (
        ROUTING_QUICK.values()
        if quick
        else (SYSTEM_PROMPTS, ROUTING_REQUESTS, ROUTING_CLIENTS, REPLICA_BLOCKS)
    )
    model = default_model()
    requests = shared_prefix_requests(seed, n, vocab=512, prompts=prompts)
    setups = [("one engine", None, blocks * replicas, ())] + [
        (router, router, blocks, ("--replicas", str(replicas), "--router", router))
        for router in routers
    ]
    runs = {}
    with ProgressBar(len(setups) * n, "routing") as bar:
        for name, router, num_blocks, extra in setups:
            with server_process(model, backend, clients, num_blocks, extra) as url:
                warm_up(url, model.name)
                before = server_metrics(url)
                start = time.perf_counter()
                records = asyncio.run(drive(url, model.name, requests, clients, bar))
                seconds = time.perf_counter() - start
                metrics = server_metrics(url)
            output_tokens = sum(r["tokens"] for r in records)
            runs[name] = {
                "router": router,
                "num_blocks": num_blocks,
                "seconds": seconds,
                "requests_per_s": n / seconds,
                "output_tokens_per_s": output_tokens / seconds,
                "ttft_ms": percentiles_ms([r["ttft"] for r in records]),
                "prefix_cache_hit_rate": hit_rate(metrics, router and replicas),
                "routed": routed(before, metrics, replicas) if router else None,
                "fallbacks": int(
                    metrics.get("mie_router_fallbacks_total", 0)
                    - before.get("mie_router_fallbacks_total", 0)
                ),
                "complete": output_tokens == sum(t for _, t in requests),
            }
    result = {
        "model": model.name,
        "replicas": replicas,
        "requests": n,
        "clients": clients,
        "system_prompts": prompts,
        "system_tokens": SYSTEM_TOKENS,
        "blocks_per_replica": blocks,
        "runs": runs,
    }
    return SectionResult({"serve_routing": result}, routing_report(result))


def routing_report(r: dict) -> str:
    rows = []
    for name, run_ in r["runs"].items():
        rates = run_["prefix_cache_hit_rate"]
        per_replica = " / ".join(f"{v:.2f}" for k, v in rates.items() if k != "total")
        routed = " / ".join(str(int(x)) for x in run_["routed"]) if run_["routed"] else "-"
        fallbacks = run_["fallbacks"] if run_["router"] == "prefix" else "-"
        rows.append(
            [
                name,
                f"{rates['total']:.3f}",
                per_replica or "-",
                routed,
                fallbacks,
                run_["requests_per_s"],
                run_["output_tokens_per_s"],
                *run_["ttft_ms"].values(),
            ]
        )
    return "\n".join(
        [
            f"Routing: {r['model']}, {r['requests']} requests from {r['clients']} streaming "
            "clients; "
            f"each request is one of {r['system_prompts']} system prompts of {r['system_tokens']} "
            f"tokens plus 8-24 tokens of its own, 16-32 output tokens (greedy, ignore_eos); "
            f"{r['replicas']} replicas of {r['blocks_per_replica']} KV blocks each, the one engine "
            f"{r['replicas'] * r['blocks_per_replica']} blocks",
            table(
                [
                    "",
                    "hit rate",
                    "per replica",
                    "routed",
                    "fallbacks",
                    "requests/s",
                    "output tok/s",
                    *(f"TTFT p{p} ms" for p in PERCENTILES),
                ],
                rows,
            ),
            "-> every request complete: "
            + str(all(run_["complete"] for run_ in r["runs"].values())),
        ]
    )
