"""What a benchmark section hands back to ``python -m mie.bench``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SectionResult:
    data: dict  # merged into the --json output, key by key
    report: str  # printed to stdout
    plot: Callable[[Path], list[Path]] | None = None  # writes PNGs into a folder (--plot)
