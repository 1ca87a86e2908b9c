"""Progress of long work on stderr (the benchmarks, ``LLM.generate``, beam search): tqdm, the
bar every vLLM and transformers user already knows, with mie's defaults.

On a terminal it redraws one line in place, ten times a second at most. Anywhere else (a file,
a pipe, a CI log) it writes its status when it starts, then at most once every
``OFF_TERMINAL_INTERVAL_S`` seconds as work completes, and a last time when it ends (tqdm's
way: each status after a carriage return, the last one ending the line): long work shows that
it is alive wherever its output goes, and a log gets a few statuses, not thousands.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from mie.checks import as_int

OFF_TERMINAL_INTERVAL_S = 10.0


class ProgressBar(tqdm):
    """``with ProgressBar(total, "desc") as bar: ... bar.update(1, desc="now doing x")``.

    ``live``: redraw in place (default: whether ``file`` is a terminal).
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        file: TextIO | None = None,
        live: bool | None = None,
    ) -> None:
        count = as_int(total)
        if count is None or count < 0:
            raise ValueError(f"total must be a non-negative int, got {total!r}")
        total = count
        file = file if file is not None else sys.stderr
        live = file.isatty() if live is None else live
        super().__init__(
            total=total,
            desc=desc,
            file=file,
            mininterval=0.1 if live else OFF_TERMINAL_INTERVAL_S,
            dynamic_ncols=live,
            ncols=None if live else 100,
            leave=True,
        )

    def update(self, n: int = 1, desc: str | None = None) -> bool | None:
        """Advance by ``n`` (and optionally say what is being done now)."""
        if desc is not None:
            self.set_description_str(desc, refresh=False)
        return super().update(n)
