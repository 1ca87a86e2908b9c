"""``python -m mie.bench``: the benchmarks, as readable tables (and JSON, and plots).

Each section is a module with a ``run(args) -> SectionResult``; ``SECTIONS`` lists them in
the order they run. ``--only NAME`` runs one; ``--json PATH`` writes every section's data,
merged into one object; ``--plot DIR`` writes the sections' PNGs (matplotlib needed).
``OPT_IN`` sections run instead of the default ones when their flag is given (``--cuda``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mie.bench import cuda, fast, mechanisms, serve, throughput
from mie.bench.plots import matplotlib_missing

SECTIONS = {
    "mechanisms": mechanisms.run,
    "throughput": throughput.run,
    "fast": fast.run,
}
OPT_IN = {  # run only when asked for by their flag: they need a GPU, or a live server
    "cuda": cuda.section,
    "serve": serve.run,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mie.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run just this section")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="a smaller workload, for tests")
    parser.add_argument("--cuda", action="store_true", help="GPU kernel benchmark (needs a GPU)")
    parser.add_argument("--serve", action="store_true", help="HTTP serving benchmark (loopback)")
    parser.add_argument(
        "--backend", choices=("python", "fast"), help="compute backend (default: best built)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot and (missing := matplotlib_missing()):
        print(missing, file=sys.stderr)
        return 2
    data: dict = {"seed": args.seed, "quick": args.quick}
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
