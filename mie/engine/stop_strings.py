"""Stop strings: the generated text ends before the first one (vLLM's ``SamplingParams.stop``).

The engine detokenizes each sample one token at a time, and a ``StopMatcher`` per sample
reads the text as it grows. Once a stop string is complete the sample finishes at the token
that completed it: its text ends where the stop string begins (or where it ends, with
``include_stop_str_in_output``), and the tokens a speculative step accepted after it are not
kept. While a sample runs, the text that could still turn into a stop string is held back from
its output, so no caller ever sees text that a stop string later takes away.

The matching is Knuth-Morris-Pratt per stop string, so a request's stop list costs each new
character O(number of strings) amortized, whatever their length: no request's stop strings can
slow everyone's step down. ``MAX_STOP_STRINGS`` and ``MAX_STOP_LENGTH`` bound the one-time
cost of the failure tables (about a millisecond at the caps) and the state per sample.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 16
"""OpenAI allows 4 stop strings; 16 leaves room for chat templates with several end markers."""
MAX_STOP_LENGTH = 1024
"""Characters per stop string: far beyond any real stop marker (tens of characters)."""


class StopMatcher:
    """Stop strings over text that arrives a piece at a time (Knuth-Morris-Pratt per string).

    For each stop string it keeps how much of the string the text currently ends with (the
    longest prefix of the string that is a suffix of the text read so far) and the string's
    KMP failure table. Each new character advances every state in amortized O(1), so a piece
    of n characters costs O(n * number of strings) amortized and O(n * number of strings +
    total stop length) at worst -- never the O(L^2) of rescanning for held-back prefixes.

    What it decides is exactly this rule, however the text is cut into pieces:

    * the text ends before the stop string that is complete first, reading left to right (of
      two complete at the same character, the longer);
    * until then, the longest tail of the text that is the beginning of some stop string is
      held back (``held``): it may still become one;
    * a stop string that ends within the first ``protected`` characters does not count: they
      are the text of the first ``min_tokens`` tokens, which no stop string may end (vLLM's
      rule; one that begins there and ends later does).
    """

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop  # the stop string stays in the text, nothing held
        self._failure = [_failure_table(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: length of its prefix ending the text
        self.length = 0  # characters read
        self.stop_at: int | None = None  # where the text ends, once a stop string completed
        self.stop_end: int | None = None  # ... and where that stop string ends
        self.stop_string: str | None = None  # ... and which it was
        self.protected = 0  # no stop string ends within this many characters (min_tokens)

    def fresh(self) -> StopMatcher:
        """A matcher for the same stop strings with nothing read (the tables are shared):
        each sample of a request ends at its own stop string."""
        other = StopMatcher((), self.include_stop)
        other.stops, other._failure = self.stops, self._failure
        other._matched = [0] * len(self.stops)
        return other

    @property
    def held(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        return max(self._matched, default=0)

    def feed(self, piece: str) -> None:
        """Read the next characters of the text (a no-op once a stop string completed)."""
        if self.stop_at is not None:
            return
        stops, failure, matched = self.stops, self._failure, self._matched
        for ch in piece:
            self.length += 1
            longest, found = 0, None
            for k, stop in enumerate(stops):
                q = matched[k]
                while q and stop[q] != ch:
                    q = failure[k][q - 1]
                if stop[q] == ch:
                    q += 1
                if q == len(stop):  # complete: keep the longest one ending here
                    if self.length > self.protected and q > longest:
                        longest, found = q, stop
                    q = failure[k][q - 1]
                matched[k] = q
            if longest:
                self.stop_at, self.stop_end = self.length - longest, self.length
                self.stop_string = found
                return

    def visible(self, finished: bool) -> int:
        """How many characters of the text read so far a caller may see now: up to the stop
        string (through it with ``include_stop``), else all but what is held back."""
        if self.stop_at is not None:
            return self.stop_end if self.include_stop else self.stop_at
        if finished or self.include_stop:
            return self.length
        return self.length - self.held

    def checkpoint(self) -> tuple:
        """Its state, for ``restore`` (a step that fails is undone exactly)."""
        found = self.stop_at, self.stop_end, self.stop_string
        return list(self._matched), self.length, found, self.protected

    def restore(self, state: tuple) -> None:
        matched, self.length, found, self.protected = state
        self._matched = list(matched)
        self.stop_at, self.stop_end, self.stop_string = found


def _failure_table(s: str) -> list[int]:
    """KMP's prefix function: ``table[i]`` is the longest proper border of ``s[: i + 1]``."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table
