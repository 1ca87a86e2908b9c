"""``python -m mie generate|serve ...``: one clear line and a non-zero exit for bad input."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import re
import socket
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mie.engine.config import EngineConfig

# What a user can cause with a bad path, a bad argument or a bad checkpoint (CheckpointError,
# ConfigError and TokenizerError are ValueErrors): reported in one line, no traceback.
USER_ERRORS = (OSError, ValueError, RuntimeError)


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help, X read from the parser: defaults are stated
    once, in the code. Skips flags without a value (``None``, switches) and help that already
    says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            any(action.default is skip for skip in (None, False, argparse.SUPPRESS))
            or not action.option_strings
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a flag it does not know is reported with *its* usage (argparse
    leaves unknown flags to the top-level parser, whose usage names no flag at all)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(extras, self))
        return namespace, extras


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """``unrecognized arguments: --modle (did you mean --model?)``."""
    known = [option for action in parser._actions for option in action.option_strings]
    hints = {}
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if flag.startswith("-") and (close := difflib.get_close_matches(flag, known, n=1)):
            hints[flag] = close[0]
    if len(hints) == 1:
        hint = f" (did you mean {next(iter(hints.values()))}?)"
    else:
        hint = "".join(f" ({flag}: did you mean {close}?)" for flag, close in hints.items())
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def port_number(text: str) -> int:
    """``--port``: a TCP port, 0..65535 (the OS would take a larger one modulo 65536, so 70000
    would listen on 4464 without a word)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: choose one in 0..65535")
    return port


def byte_count(text: str) -> int:
    """``--max-body-bytes``: a positive whole number of bytes (0 or less would refuse every
    request body as too large)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: a whole number of bytes, 1 or more"
        )
    return value


def seconds(text: str) -> float:
    """A timeout flag: a finite number of seconds above 0. NaN compares false with every
    deadline and inf is none, so either would make a timeout that never expires."""
    value = _float_or_nan(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a timeout: finite seconds above 0")
    return value


def seconds_or_zero(text: str) -> float:
    """A duration flag that may be 0 (``--shutdown-grace 0``: no grace): finite seconds >= 0."""
    value = _float_or_nan(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: finite seconds, 0 or more")
    return value


def _float_or_nan(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mie",
        description="mie: a miniature LLM inference serving engine.",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=SubcommandParser
    )

    generate = commands.add_parser(
        "generate",
        help="generate text from a prompt, streaming it",
        description="Generate text from a prompt and stream it to stdout. Stops at EOS or "
        "after --max-tokens tokens, or at the model's context length (a note on stderr says "
        "when a limit cut the text).",
        formatter_class=HelpFormatter,
    )
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True, help="the prompt text")
    add_sampling_args(generate)
    generate.set_defaults(run=run_generate)

    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API over HTTP (docs/serving.md)",
        description="Serve the OpenAI API (completions, chat, streaming) over HTTP. The port "
        "is bound before the model loads; one line on stderr then names the model, the KV "
        "pool, the backend and the URL.",
        formatter_class=HelpFormatter,
    )
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (loopback)")
    serve.add_argument("--port", type=port_number, default=8000, help="TCP port (0: any free port)")
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
        type=byte_count,
        default=1 << 20,
        help="largest request body in bytes; larger is a 400",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=seconds,
        default=5.0,
        help="seconds before an idle keep-alive connection is closed",
    )
    serve.add_argument(
        "--timeout-request",
        type=seconds,
        default=30.0,
        help="seconds a request's headers and body may take to arrive",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=seconds_or_zero,
        default=5.0,
        help="seconds running requests may finish after SIGINT/SIGTERM; then they end with 'abort'",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="allow tool_choice 'auto': the model decides, --tool-call-parser finds its calls",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="the tool-call format the model writes: hermes (Qwen2.5, Qwen3, Hermes), "
        "llama3_json (Llama 3.1, 3.2)",
    )
    add_cluster_args(serve)
    serve.set_defaults(run=run_serve)

    return parser


def sampling_default(name: str) -> object:
    """The default of ``SamplingParams(name=...)``."""
    from mie.engine.sampling import SamplingParams

    return {field.name: field.default for field in dataclasses.fields(SamplingParams)}[name]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, a flag for every ``EngineConfig`` setting, and ``-v``."""
    from mie.engine.config import EngineConfig

    parser.add_argument(
        "--model",
        required=True,
        help="Hugging Face checkpoint directory (with tokenizer.json), or a GGUF file",
    )
    hints = typing.get_type_hints(EngineConfig)
    for setting in dataclasses.fields(EngineConfig):
        add_setting_flag(parser, setting, hints[setting.name])
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine setup")


def add_setting_flag(
    parser: argparse.ArgumentParser, setting: dataclasses.Field, hint: object
) -> None:
    """``EngineConfig``'s field as a flag: ``--kebab-case`` of its name, its default and help
    text; a bool is a switch with its ``--no-`` form; a named choice lists its values.

    The flag parses its text into the field's type (argparse refuses text that is no int, or
    no listed choice, with the subcommand's usage); ``EngineConfig`` checks the value, so a bad
    value is refused with the message a bad keyword gets, from the same place."""
    flag = "--" + setting.name.replace("_", "-")
    text = setting.metadata["help"]
    if hint is bool:
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=setting.default, help=text
        )
        return
    parse = int if int in (typing.get_args(hint) or (hint,)) else str
    choices = setting.metadata["choices"]
    parser.add_argument(flag, type=parse, choices=choices, default=setting.default, help=text)


MAX_TOKENS = 256  # the CLI's own limit: SamplingParams' default (16, as vLLM's) is too short


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
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="most tokens to generate"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=sampling_default("temperature"),
        help="0 = greedy; above 0 samples at random",
    )
    parser.add_argument(
        "--top-k", type=int, default=sampling_default("top_k"), help="-1 or 0 = disabled"
    )
    parser.add_argument(
        "--top-p", type=float, default=sampling_default("top_p"), help="nucleus mass, in (0, 1]"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the text before this stop string (repeat for several)",
    )


def checkpoint_dir(path: str) -> Path:
    """``--model`` as the CLI needs it: a GGUF file (its vocabulary is in it), or a directory
    (not the ``.safetensors`` file in it) with a ``tokenizer.json`` (the CLI takes text, never
    token ids). A missing directory is left to the engine, whose error names it."""
    from mie.gguf_file import is_gguf

    directory = Path(path)
    if is_gguf(directory):
        return directory
    if directory.is_file():
        raise ValueError(
            f"--model takes a checkpoint's directory or a GGUF file; {directory} is a file but "
            f"not GGUF: pass the directory that holds it ({directory.parent})"
        )
    if directory.is_dir() and not (directory / "tokenizer.json").is_file():
        raise ValueError(
            f"{directory} has no tokenizer.json: the CLI takes text prompts and needs the "
            "checkpoint's tokenizer.json"
        )
    return directory


def configure_logging(verbose: bool) -> None:
    """Where mie's log lines go when it runs as a program: stderr, prefixed ``mie:``, warnings
    and up (``-v``: what the engine set up, too). As a library mie configures nothing."""
    logger = logging.getLogger("mie")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("mie: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of the engine flags: what ``generate``, ``serve`` and the Ray
    replicas of ``serve --replicas`` all build their engines from. A bad value raises here,
    before a model is loaded or Ray started."""
    from mie.engine.config import EngineConfig

    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def make_engine(args: argparse.Namespace):
    from mie.engine.llm_engine import LLMEngine

    configure_logging(args.verbose)
    return LLMEngine(checkpoint_dir(args.model), config=engine_config(args))


def run_generate(args: argparse.Namespace) -> int:
    from mie.engine.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )
    engine = make_engine(args)
    engine.add_request(args.prompt, params)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    shown, finish_reason, generated = 0, None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            sys.stdout.write(completion.text[shown:])
            sys.stdout.flush()
            shown, finish_reason = len(completion.text), completion.finish_reason
            generated = len(completion.token_ids)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if finish_reason == "length" and generated < args.max_tokens:
        print(f"[stopped at the model's context length {engine.max_model_len}]", file=sys.stderr)
    elif finish_reason == "length" and not args.ignore_eos:
        print(f"[stopped at max_tokens={args.max_tokens}; raise --max-tokens]", file=sys.stderr)
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound at once: a port in use is an error before the model loads
    (seconds to minutes), not after."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off only on sockets that say TCP.
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port"
        ) from None
    return sock


def startup_line(engine, model_dir: Path, block_size: int, url: str) -> str:
    """What ``serve`` loaded, in one line: model, architecture, parameters, KV pool, backend,
    URL."""
    config = engine.model.config
    num_blocks = engine.pool.num_blocks
    weights = engine.model.weights
    pool_mib = num_blocks * engine.pool.bytes_per_block / 2**20
    return (
        f"mie serve: model {model_dir} ({config.architecture}, "
        f"{weights.num_parameters:,} parameters, {weights.format} "
        f"{engine.weight_bytes / 2**20:,.2f} MiB); KV pool {num_blocks:,} "
        f"blocks x {block_size} = {num_blocks * block_size:,} tokens ({pool_mib:,.2f} MiB, "
        f"{engine.kv_cache.dtype.name}); "
        f"backend {engine.backend.name}; listening on {url}"
    )


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", or None when "auto" is not enabled (vLLM's flags:
    enabling it needs a parser)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def run_serve(args: argparse.Namespace) -> int:
    args.auto_tool_parser = auto_tool_parser(args)  # checked before anything starts
    if args.replicas is not None:
        return run_cluster(args)
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --replicas")
    try:
        from mie.serve import build_app, server
    except ImportError as exc:
        raise RuntimeError(f"{exc}: install the serve extra, pip install 'mie[serve]'") from None
    sock = listening_socket(args.host, args.port)
    try:
        engine = make_engine(args)
        app = build_app(
            engine,
            args.model,
            model_name=args.served_model_name,
            api_key=args.api_key,
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
            auto_tool_parser=args.auto_tool_parser,
        )
        host, port = sock.getsockname()[:2]
        shown_host = f"[{host}]" if ":" in host else host
        print(
            startup_line(engine, Path(args.model), args.block_size, f"http://{shown_host}:{port}"),
            file=sys.stderr,
        )
        timeouts = server.Timeouts(
            args.timeout_keep_alive, args.timeout_request, args.shutdown_grace
        )
        server.run(app, args.host, args.port, timeouts, sock=sock)
    finally:
        sock.close()
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
    return cluster.run(args, engine_config(args))


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
