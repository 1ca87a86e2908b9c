"""lm-evaluation-harness against a live ``python -m mie serve`` and against transformers.

    python scripts/lm_eval_check.py [--batch-size 8] [--model models/stories260K]

Runs the three small local tasks of ``tests/data/lm_eval`` (``multiple_choice``,
``loglikelihood_rolling``, ``generate_until`` on stories written for this check) twice:

* with lm-eval's ``local-completions`` model against a live ``python -m mie serve`` started
  here (token-id prompts in batches of ``--batch-size``: lm-eval's own tokenizer, the
  checkpoint's, with ``add_bos_token``);
* with lm-eval's ``hf`` model (transformers, float32, CPU) on the same directory, also with
  ``add_bos_token``, so both see the same tokens.

and requires, per sample, equal log-likelihoods (within ``--tolerance``, 1e-4), equal
``is_greedy`` and equal greedy strings. It prints the figures and the versions and exits 1 on
any difference. lm-eval is not in the test extras (on top of them it installs 43 packages,
645 MB, in about 75 s; see bench/RESULTS.md): ``pip install "lm-eval[api,hf]"`` first.
Nothing is downloaded: the datasets are local JSON, and HF_DATASETS_OFFLINE / HF_HUB_OFFLINE
are set.

Run it from the repository root (the task files name their data relative to it).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASKS = ["mie_stories_choice", "mie_stories_rolling", "mie_stories_generate"]
SERVER_START_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, port: int) -> subprocess.Popen:
    """``python -m mie serve`` on ``port``; returns once ``/health`` answers 200."""
    import httpx

    command = [sys.executable, "-m", "mie", "serve", "--model", str(model), "--port", str(port)]
    command += ["--num-blocks", "2048"]
    server = subprocess.Popen(command, cwd=ROOT)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.terminate()
    raise SystemExit(f"the server did not answer /health within {SERVER_START_S:.0f} s")


def evaluate(model: str, model_args: str, batch_size: int, limit: int | None) -> dict:
    """lm-eval's per-sample responses: ``{task: {doc_id: [response, ...]}}``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
        limit=limit,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    samples = {}
    for task in TASKS:
        samples[task] = {s["doc_id"]: [r[0] for r in s["resps"]] for s in results["samples"][task]}
    return {"samples": samples, "results": results["results"]}


def same_continuation(served: str, hf: str) -> bool:
    """The same greedy text. lm-eval's ``hf`` model decodes the generated tokens alone, and a
    SentencePiece tokenizer drops the leading space of the first token of what it decodes
    ("▁mom" -> "mom"); the server's text is the continuation in context (" mom"), as OpenAI's
    and vLLM's are. That one leading space is the only difference allowed."""
    return served == hf or (served.startswith(" ") and served[1:] == hf)


def compare(server: dict, hf: dict, tolerance: float) -> tuple[list[str], dict]:
    """Every per-sample difference, and the figures of the comparison."""
    problems: list[str] = []
    worst = 0.0
    counts = {"loglikelihoods": 0, "is_greedy": 0, "greedy_true": 0, "strings": 0}
    for task in TASKS:
        ours, theirs = server["samples"][task], hf["samples"][task]
        if sorted(ours) != sorted(theirs):
            problems.append(f"{task}: different documents")
            continue
        for doc in sorted(ours):
            for k, (a, b) in enumerate(zip(ours[doc], theirs[doc], strict=True)):
                where = f"{task} doc {doc} response {k}"
                if isinstance(a, str):  # generate_until: a greedy string
                    counts["strings"] += 1
                    if not same_continuation(a, b):
                        problems.append(f"{where}: server {a!r} != transformers {b!r}")
                    continue
                if isinstance(a, (list, tuple)):  # loglikelihood: (logprob, is_greedy)
                    (a, greedy_a), (b, greedy_b) = a, b
                    counts["is_greedy"] += 1
                    counts["greedy_true"] += bool(greedy_b)
                    if bool(greedy_a) != bool(greedy_b):
                        problems.append(f"{where}: is_greedy {greedy_a} != {greedy_b}")
                counts["loglikelihoods"] += 1
                difference = abs(float(a) - float(b))
                worst = max(worst, difference)
                if not difference <= tolerance or not math.isfinite(float(a)):
                    problems.append(f"{where}: log-likelihood {a} vs {b} ({difference:.2e})")
    return problems, {**counts, "max_abs_difference": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "stories260K")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--limit", type=int, default=None, help="documents per task")
    args = parser.parse_args()
    os.chdir(ROOT)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="mie-lm-eval-"))
    model = args.model.resolve()

    sys.path.insert(0, str(ROOT))  # this checkout's mie, as the server's ``-m mie`` is
    import lm_eval
    import torch
    import transformers

    import mie

    port = free_port()
    started = time.perf_counter()
    server = start_server(model, port)
    try:
        served = evaluate(
            "local-completions",
            f"base_url=http://127.0.0.1:{port}/v1/completions,model={model.name},"
            f"tokenizer_backend=huggingface,tokenizer={model},tokenized_requests=True,"
            f"add_bos_token=True,max_length=512,num_concurrent=1,max_retries=1",
            args.batch_size,
            args.limit,
        )
    finally:
        server.terminate()
        server.wait(30)
    served_s = time.perf_counter() - started
    started = time.perf_counter()
    reference = evaluate(
        "hf",
        f"pretrained={model},add_bos_token=True,dtype=float32,max_length=512",
        args.batch_size,
        args.limit,
    )
    hf_s = time.perf_counter() - started
    problems, figures = compare(served, reference, args.tolerance)

    versions = {
        "lm-eval": lm_eval.__version__,
        "mie": mie.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "Python": platform.python_version(),
    }
    print(", ".join(f"{name} {version}" for name, version in versions.items()))
    print(
        f"tasks: {', '.join(TASKS)} ({TASK_DIR.relative_to(ROOT)}); batch size "
        f"{args.batch_size}; server {served_s:.1f} s, transformers {hf_s:.1f} s"
    )
    print(
        f"compared: {figures['loglikelihoods']} log-likelihoods (max |difference| "
        f"{figures['max_abs_difference']:.2e}, tolerance {args.tolerance:g}), "
        f"{figures['is_greedy']} is_greedy ({figures['greedy_true']} true), "
        f"{figures['strings']} greedy strings"
    )
    for task in TASKS:
        ours, theirs = served["results"][task], reference["results"][task]
        shown = {k: v for k, v in ours.items() if isinstance(v, float) and "stderr" not in k}
        print(f"  {task}: server {shown}")
        print(f"  {' ' * len(task)}  transformers { {k: theirs[k] for k in shown} }")
    for problem in problems:
        print("DIFFERENCE:", problem)
    print(
        "OK: the server and transformers agree"
        if not problems
        else f"FAILED: {len(problems)} differences"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
