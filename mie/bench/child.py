"""Benchmarks that run part of their work in a fresh Python process, and read its answer.

A fresh process gives a measurement its own memory (its peak RSS is that run's alone) and its
own runtime state (an engine loaded into another's process shares its OpenMP runtime).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory holding this ``mie`` package: the child imports the very same one."""


def run_json_child(module: str, args: list[str], what: str, stderr_tail: int = 3000) -> dict:
    """``python -m module *args`` in a fresh process, with this ``mie`` package importable;
    returns the JSON object on the last line of its stdout. ``RuntimeError`` naming ``what``,
    with the end of its stderr, if it exits non-zero."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({exit_text(done.returncode)}):\n{done.stderr[-stderr_tail:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def exit_text(returncode: int) -> str:
    """``"exit 1"``; ``"exit -11, SIGSEGV"`` for a child killed by a signal."""
    if returncode < 0:
        try:
            return f"exit {returncode}, {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exit {returncode}"
