"""A tiny progress bar on stderr, with no dependency (the benchmarks and ``LLM.generate``).

On a terminal it redraws one line in place; anywhere else (a CI log, a pipe) it stays quiet
until ``close()`` and then writes its final line once, so logs get one line, not hundreds.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``with ProgressBar(total, "desc") as bar: ... bar.update(1, desc="now doing x")``."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        file: TextIO | None = None,
        width: int = 24,
        live: bool | None = None,
    ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a non-negative int, got {total!r}")
        self.total = total
        self.desc = desc
        self.count = 0
        self._file = file if file is not None else sys.stderr
        self._width = width
        self._live = self._file.isatty() if live is None else live
        self._start = time.monotonic()
        self._last_len = 0
        self._closed = False
        if self._live:
            self._draw()

    def update(self, n: int = 1, desc: str | None = None) -> None:
        """Advance by ``n`` (and optionally say what is being done now)."""
        self.count = min(self.total, self.count + n)
        if desc is not None:
            self.desc = desc
        if self._live:
            self._draw()

    def render(self) -> str:
        filled = self._width * self.count // self.total if self.total else self._width
        bar = "#" * filled + "." * (self._width - filled)
        elapsed = time.monotonic() - self._start
        return f"{self.desc} [{bar}] {self.count}/{self.total} {elapsed:.0f}s"

    def close(self) -> None:
        """Finish the line (once)."""
        if self._closed:
            return
        self._closed = True
        if self._live:
            self._draw()
            self._file.write("\n")
        else:
            self._file.write(self.render() + "\n")
        self._file.flush()

    def _draw(self) -> None:
        line = self.render()
        self._file.write("\r" + line + " " * max(0, self._last_len - len(line)))
        self._file.flush()
        self._last_len = len(line)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
