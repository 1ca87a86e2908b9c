"""``python -m mie generate|serve ...``: one clear line and a non-zero exit for bad input."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

from mie.backend import BACKENDS

# What a user can cause with a bad path, a bad argument or a bad checkpoint (CheckpointError,
# ConfigError and TokenizerError are ValueErrors): reported in one line, no traceback.
USER_ERRORS = (OSError, ValueError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mie",
        description="mie: a miniature LLM inference serving engine.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser("generate", help="generate text from a prompt, streaming it")
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True, help="the prompt text")
    add_sampling_args(generate)
    generate.set_defaults(run=run_generate)

    serve = commands.add_parser("serve", help="serve the OpenAI API over HTTP (docs/serving.md)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="default 8000")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="most waiting requests; beyond: 503 + Retry-After (default: no limit)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the directory's name)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body; larger is a 400 (default 1 MiB)",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds before an idle keep-alive connection is closed (default 5)",
    )
    serve.add_argument(
        "--timeout-request",
        type=float,
        default=30.0,
        help="seconds a request's headers and body may take to arrive (default 30)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds running requests may finish after SIGINT/SIGTERM; then they end with "
        "'abort' (default 5)",
    )
    add_cluster_args(serve)
    serve.set_defaults(run=run_serve)

    return parser


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="max running sequences")
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="default: best built")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine setup")


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """``serve --replicas N``: the engine replicas on Ray Serve (docs/distributed.md)."""
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas on Ray Serve behind one ingress; each replica gets the "
        "engine flags and its own --max-queue (needs the ray extra; default: one engine in "
        "this process, no Ray)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: join this Ray cluster (e.g. 'auto', or HEAD:6379 from 'ray "
        "start --head') instead of starting a local one",
    )
    parser.add_argument(
        "--router",
        choices=("prefix", "round-robin", "least-loaded"),
        default="prefix",
        help="with --replicas: how requests are spread; prefix sends prompts that start with "
        "the same KV block to the same replica",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="default 256")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, in (0, 1]")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")


def make_engine(args: argparse.Namespace):
    from mie.engine.llm_engine import LLMEngine

    logging.getLogger("mie").setLevel(logging.INFO if args.verbose else logging.WARNING)
    return LLMEngine(
        args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        backend=args.backend,
    )


def run_generate(args: argparse.Namespace) -> int:
    from mie.engine.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    engine = make_engine(args)
    engine.add_request(args.prompt, params)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    shown = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return run_cluster(args)
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --replicas")
    try:
        from mie.serve import build_app, server
    except ImportError as exc:
        raise RuntimeError(f"{exc}: install the serve extra, pip install 'mie[serve]'") from None
    engine = make_engine(args)
    app = build_app(
        engine,
        args.model,
        model_name=args.served_model_name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
    )
    timeouts = server.Timeouts(args.timeout_keep_alive, args.timeout_request, args.shutdown_grace)
    server.run(app, args.host, args.port, timeouts)
    return 0


def run_cluster(args: argparse.Namespace) -> int:
    """``serve --replicas N``: Ray is imported only on this path."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    try:
        from mie.serve import cluster
    except ImportError as exc:
        raise RuntimeError(
            f"{exc}: --replicas needs the ray extra, pip install 'mie[ray]'"
        ) from None
    return cluster.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as exc:
        return report(exc)
    except MemoryError as exc:  # e.g. --num-blocks far past the machine's memory
        return report(exc, "out of memory")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, the traceback with --verbose
        if args.verbose:
            raise
        return report(exc, f"internal error, {type(exc).__name__} (run with -v for the traceback)")


def report(exc: BaseException, what: str | None = None) -> int:
    """Print the one ``mie: error:`` line for ``exc`` (its message on one line); exit status 1."""
    message = re.sub(r"\s*\n\s*", " ", str(exc)).strip()
    text = f"{what}: {message}" if what and message else what or message or type(exc).__name__
    print(f"mie: error: {text}", file=sys.stderr)
    return 1
