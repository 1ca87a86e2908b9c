"""``python -m mie.bench``: the benchmarks, as readable tables (and JSON, and plots).

Each section is a module with a ``run(args) -> SectionResult``; ``SECTIONS`` lists them in
the order they run. ``--only NAME`` runs one; ``--json PATH`` writes every section's data,
merged into one object; ``--plot DIR`` writes the sections' PNGs (matplotlib needed).
``OPT_IN`` sections run instead of the default ones when their flag is given (``--cuda``,
``--serve``, ``--peers``). ``--dtype``, ``--quantization`` and ``--kv-cache-dtype`` choose the
weights and KV cache the throughput section's forward passes and mixed workload run with
(default float32, as before); its per-format table always measures every format.

The first line printed names the compute backend and the CPU (model, cores, widest SIMD
level), so that a pasted report says what it was measured on; when the fast backend is
unavailable, the next line says why and how to fix it (``mie.extension.fast_unavailable_reason``):
a run on the pure-Python backend takes several times longer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

from mie.backend import Backend, select
from mie.bench import (
    backends,
    cuda_kernels,
    mechanisms,
    peers,
    serve,
    speculative,
    structured,
    throughput,
)
from mie.bench.plots import matplotlib_missing
from mie.cli import HelpFormatter
from mie.extension import ENV_VAR, BackendUnavailableError, fast_unavailable_reason
from mie.model.precision import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS

SECTIONS = {
    "mechanisms": mechanisms.run,
    "throughput": throughput.run,
    "backends": backends.run,
    "structured": structured.run,
    "speculative": speculative.run,
}
OPT_IN = {  # run only when asked for by their flag: a GPU, a live server, an optional extra
    "cuda": cuda_kernels.section,
    "serve": serve.run,
    "peers": peers.run,  # needs the peers extra (gguf, llama-cpp-python)
}


DESCRIPTION = """\
Run mie's benchmarks and print each section as a text table: the scheduling mechanisms
against their naive baselines (seconds), wall-clock throughput of a Qwen2-0.5B-shaped
model (minutes), the Cython backend against the Python reference, and what a JSON schema
costs a decode step at a 151k vocabulary (structured outputs, a minute or two), and what
speculative decoding (n-gram prompt lookup, a draft model) buys at batch 1 and 16 and what
verifying more positions costs (a minute or two). The first line names the backend and the
CPU. --cuda, --serve or --peers runs that benchmark instead of the default ones.
"""
EPILOG = "Results are printed only; --json PATH also writes them to a file."


def busy_count(text: str) -> int:
    """``--peers-busy``'s N: a whole number of processes, 0 or more."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {count}")
    return count


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mie.bench",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=BenchHelpFormatter,
    )
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run just this section")
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write every section's results as JSON"
    )
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--quick", action="store_true", help="a smaller workload, for tests")
    parser.add_argument("--cuda", action="store_true", help="GPU kernel benchmark (needs a GPU)")
    parser.add_argument("--serve", action="store_true", help="HTTP serving benchmark (loopback)")
    parser.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="with --serve: the routing comparison on N Ray Serve replicas (needs the ray extra)",
    )
    parser.add_argument(
        "--router",
        choices=("prefix", "round-robin", "least-loaded"),
        help="with --replicas: only this router (default: prefix and round-robin)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help='llama.cpp on the same weights, batch 1 (needs: pip install -e ".[peers]")',
    )
    parser.add_argument(
        "--peers-busy",
        type=busy_count,
        default=0,
        metavar="N",
        help="with --peers: run its pairs beside N busy processes (one core each), the "
        "comparison on a shared machine",
    )
    parser.add_argument(
        "--dtype",
        choices=[dtype for dtype in DTYPES if dtype != "auto"],  # random weights: no "auto"
        default="float32",
        help="weights of the throughput section's forward passes and mixed workload",
    )
    parser.add_argument(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q is not None],
        help="weight-only quantization for the same (int8: llama.cpp's Q8_0, groups of 32 "
        "with float16 scales; int4: its Q4_0, the embedding / LM head in int6)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache of the same, and of mie in --peers; auto is float32",
    )
    parser.add_argument(
        "--backend",
        choices=("python", "fast"),
        help="compute backend (default: the best one built)",
    )
    args = parser.parse_args(argv)
    if args.peers_busy and not args.peers:
        parser.error("--peers-busy N needs --peers")
    return args


class BenchHelpFormatter(HelpFormatter):
    """The CLI's defaults-from-the-code formatter, keeping the description's paragraph."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


# The widest SIMD level a CPU reports, from its /proc/cpuinfo flags: (flag, name), widest first.
SIMD_LEVELS = [
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
    ("avx", "AVX"),
    ("sse4_2", "SSE4.2"),
    ("sse2", "SSE2"),
    ("sve", "SVE"),
    ("asimd", "NEON"),
]


def cpu_description(cpuinfo: str | None = None) -> str:
    """``"AMD EPYC, 2 cores, AVX-512"``: the CPU model, the cores this process may use, and the
    widest SIMD level, read from ``cpuinfo`` (default: /proc/cpuinfo; elsewhere the model comes
    from ``platform`` and the SIMD level is unknown)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    simd = next((name for flag, name in SIMD_LEVELS if flag in flags), "SIMD level unknown")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, {simd}"


def backend_line(backend: Backend, asked: str | None) -> str:
    """The report's first line: the backend, how it was chosen, the CPU and the versions."""
    if asked:
        how = "--backend"
    elif os.environ.get(ENV_VAR):
        how = ENV_VAR
    else:
        how = "the best built"
    if backend.name == "fast":
        import mie._fast

        threads = f"OpenMP, {mie._fast.max_threads()} threads" if mie._fast.OPENMP else "no OpenMP"
        kind = f"Cython, {threads}"
    else:
        kind = "pure-Python reference"
    return (
        f"mie.bench: backend {backend.name} ({kind}; {how}) on {cpu_description()}; "
        f"Python {platform.python_version()}, NumPy {np.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot and (missing := matplotlib_missing()):
        print(missing, file=sys.stderr)
        return 2
    try:
        backend = select(args.backend)
    except (BackendUnavailableError, ValueError) as exc:  # --backend fast / MIE_BACKEND=...
        print(f"python -m mie.bench: error: {exc}", file=sys.stderr)
        return 2
    print(backend_line(backend, args.backend), flush=True)
    if backend.name != "fast" and (reason := fast_unavailable_reason()):
        print(f"note: the fast backend is unavailable: {reason}", end="\n\n", flush=True)
    else:
        print(flush=True)
    data: dict = {"seed": args.seed, "quick": args.quick, "backend": backend.name}
    opted_in = [name for name in OPT_IN if getattr(args, name)]
    for name in opted_in or ([args.only] if args.only else list(SECTIONS)):
        result = {**SECTIONS, **OPT_IN}[name](args)
        print(result.report, end="\n\n", flush=True)
        data.update(result.data)
        if args.plot and result.plot:
            for path in result.plot(args.plot):
                print(f"wrote {path}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    else:
        print("(results printed only: --json PATH also writes them to a file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
