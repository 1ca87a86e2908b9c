"""Compile time bounded by the clock: a new grammar is first built in a child process that
can be killed.

llguidance bounds the work of each mask, and its limits bound the lexer, but not the
building of some grammars: a JSON schema with n ``patternProperties`` takes time growing
like n**4 (0.07 s at 100, 1.1 s at 200, 30 s at 400 on a 2-core EPYC), and the 64 KiB a
request may send holds thousands. The build is one call into Rust: a thread running it
cannot be interrupted or killed, but a process can. So ``GrammarProbe.check`` first builds
the grammar without the tokenizer (the part that blows up; the tokenizer's part is bounded
by the lexer's limits) in a child process and waits at most ``COMPILE_TIMEOUT`` seconds; a
grammar that takes longer is refused and the child killed (a new one starts on the next
check). Only a grammar that passed is compiled in the engine's own process.

The child is a plain ``python -c`` program that imports llguidance alone, not
``multiprocessing``: spawning with it would re-run the caller's main script in the child.
It serves one grammar at a time over its stdin and stdout, one JSON line each way, and is
kept between checks, so only the first check pays for starting it (about 0.1 s).
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import threading

COMPILE_TIMEOUT = 2.0
"""Seconds a new grammar may take to build (real schemas: milliseconds; docs/structured.md)."""

_CHILD = """
import json, sys
import llguidance
for line in sys.stdin:
    request = json.loads(line)
    limits = llguidance.LLParserLimits(**request["limits"])
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        request["grammar"], None, limits=limits
    )
    sys.stdout.write(json.dumps({"error": messages[0] if failed else ""}) + "\\n")
    sys.stdout.flush()
"""


class GrammarTimeoutError(TimeoutError):
    """Building a grammar took longer than ``COMPILE_TIMEOUT``: refused, child killed."""


class GrammarProbe:
    """A killable child process that tries grammars before the engine compiles them.

    Thread-safe (one grammar at a time: checks only happen on a compile cache miss).
    """

    def __init__(self, limits: dict[str, int], timeout: float = COMPILE_TIMEOUT) -> None:
        self.limits = dict(limits)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None

    def check(self, grammar: str) -> str:
        """llguidance's error building ``grammar`` ("" when it builds);
        ``GrammarTimeoutError`` when that takes longer than ``timeout`` seconds."""
        request = json.dumps({"grammar": grammar, "limits": self.limits}) + "\n"
        with self._lock:
            for _attempt in range(2):  # a child that died since the last check is replaced
                child = self._running_child()
                try:
                    child.stdin.write(request)
                    child.stdin.flush()
                except OSError:
                    self._kill()
                    continue
                if not _readable_within(child.stdout, self.timeout):
                    self._kill()
                    raise GrammarTimeoutError(
                        f"building the grammar took longer than {self.timeout:g} s "
                        "(COMPILE_TIMEOUT)"
                    )
                line = child.stdout.readline()
                if line:
                    return json.loads(line)["error"]
                self._kill()  # it exited while building: a crash in llguidance
            raise RuntimeError("the grammar probe process exited while building a grammar")

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self) -> None:
        """A probe dropped with its engine takes its child along. Otherwise ``subprocess``
        keeps a running child's ``Popen`` (and so its pipes) alive to reap it later, and the
        child waits on its stdin for good: two descriptors and a process per engine."""
        if getattr(self, "_child", None) is not None:
            self._kill()

    def _running_child(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                encoding="utf-8",
            )
        return self._child

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            for stream in (self._child.stdin, self._child.stdout):
                stream.close()
            self._child = None


def _readable_within(stream, timeout: float) -> bool:
    """Whether ``stream`` has something to read within ``timeout`` seconds. A selector (epoll
    or poll), not ``select.select``, which refuses descriptors from 1024 on -- as a server
    holding a thousand connections has."""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        return bool(selector.select(timeout))
