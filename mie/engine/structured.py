"""Structured outputs: a grammar decides which tokens may come next.

A request with ``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` asks that
its output match a JSON schema, a regular expression, one of a list of strings, or a
grammar. Each step, before anything else shapes the distribution, every token the grammar
cannot accept next gets -inf (``LLMEngine._sample`` draws among the allowed tokens); the
token drawn is then fed to the matcher, which moves on. The end-of-sequence token is allowed
exactly when the grammar accepts what has been generated, so a finished grammar ends the
request with ``"stop"``.

The grammar engine is llguidance (docs/structured.md says why): a Rust library that walks a
grammar over the tokenizer's vocabulary and fills a bitmask of the allowed tokens, one bit
per token. Building its view of the vocabulary costs up to about a second at a 150k
vocabulary, so ``GrammarCompiler`` builds it once per engine, on first use; a grammar is
compiled once per distinct request (``GrammarCompiler.compile``: an LRU cache keyed by the
grammar's canonical text), and every sample of every request using it starts from a copy of
the compiled matcher.

What a grammar may cost is bounded before anything is queued: its text (``MAX_GRAMMAR_CHARS``),
llguidance's own limits on the grammar's size and the lexer's work (``PARSER_LIMITS``), which
bound the time of each mask, and the clock: a grammar not seen before is first built in a
child process that is killed after ``COMPILE_TIMEOUT`` seconds (``mie.engine.grammar_probe``).
A schema that exceeds them, that is not valid, or that uses a feature llguidance cannot
enforce is an ``InvalidRequestError`` naming what is wrong -- never silently weakened
(llguidance's ``lenient`` mode stays off).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mie.engine.errors import InvalidRequestError
from mie.engine.grammar_probe import GrammarProbe, GrammarTimeoutError

MAX_GRAMMAR_CHARS = 64 * 1024
"""The longest constraint (a schema's canonical JSON, a regex, a grammar, the choices
together) a request may send. It is what bounds compile time: llguidance's work limits below
bound its lexer, not the building of the grammar, which grows faster than the text for some
shapes (an object of n properties: 0.25 s at 1,000, 0.65 s at 2,000, 2.5 s at 5,000 on a
2-core EPYC). At 64 KiB the worst shape found compiles in about a second
(docs/structured.md); real schemas are far smaller (JSONSchemaBench's: a few kilobytes)."""
MAX_CHOICES = 10_000
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (each a few kB to a few MB)
PARSER_LIMITS = {
    "max_grammar_size": 200_000,  # symbols in the grammar's productions (llguidance: 500k)
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes: ~20 ms of work
    "step_lexer_fuel": 200_000,  # one mask's lexer work: ~15 ms at most
    "step_max_items": 50_000,  # one mask's Earley items: ~2.5 ms
}
"""llguidance's ``LLParserLimits``: how much work compiling a grammar and computing one mask
may do. Work, not seconds, so the bound is the same on every machine and under any load; a
grammar that needs more is refused when compiled (or, for a mask, the request's matcher stops
with an error: its step fails naming it)."""
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsError(InvalidRequestError):
    """A structured-outputs constraint is invalid, or cannot be compiled or enforced; the
    message says why. An ``InvalidRequestError`` of the field ``structured_outputs``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="structured_outputs")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names): exactly one of ``json`` (a JSON schema, as
    a dict or a JSON string), ``regex``, ``choice`` (a list of strings), ``grammar`` (a Lark
    grammar in llguidance's dialect, or GBNF, llama.cpp's: recognised by its ``::=``) or
    ``json_object=True`` (any JSON object).

    ``whitespace_pattern`` (a regex) replaces the whitespace a JSON output may have between
    its tokens; ``disable_any_whitespace`` allows none at all (compact JSON).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if _given(k, getattr(self, k))]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as exc:
                raise StructuredOutputsError(f"json: not a JSON document: {exc}") from None
            if schema is None:  # "null" decodes to no schema at all, not to "json absent"
                raise StructuredOutputsError("json: a JSON schema must be an object, got null")
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, dict):
            raise StructuredOutputsError(
                f"json: a JSON schema must be an object, got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise StructuredOutputsError(f"{name} must be a string, got {type(value).__name__}")
        if self.json_object not in (None, True, False):
            raise StructuredOutputsError(f"json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputsError(
                f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
            )
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice:
                raise StructuredOutputsError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in choice):
                raise StructuredOutputsError("choice must be a list of strings")
            if len(choice) > MAX_CHOICES:
                raise StructuredOutputsError(
                    f"choice has {len(choice)} strings, more than MAX_CHOICES={MAX_CHOICES}"
                )
            object.__setattr__(self, "choice", tuple(choice))
        if len(self.key) > MAX_GRAMMAR_CHARS:
            raise StructuredOutputsError(
                f"{self.kind}: the constraint is {len(self.key)} characters, more than "
                f"MAX_GRAMMAR_CHARS={MAX_GRAMMAR_CHARS}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if _given(k, getattr(self, k)))

    @property
    def key(self) -> str:
        """The constraint's canonical text: equal constraints (a schema's keys in any order,
        given as a dict or as a string) share one compiled grammar."""
        text = {
            "json": lambda: _canonical_json(self.json),
            "regex": lambda: self.regex,
            "choice": lambda: json.dumps(self.choice),
            "grammar": lambda: self.grammar,
            "json_object": lambda: "",
        }[self.kind]()
        options = [self.whitespace_pattern, self.disable_any_whitespace]
        return json.dumps([self.kind, text, options])

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: ``compile`` does)."""
        import llguidance

        grammar = llguidance.LLMatcher
        if self.kind in ("json", "json_object"):
            schema = self.json if self.kind == "json" else {"type": "object"}
            options = {"whitespace_flexible": not self.disable_any_whitespace, "lenient": False}
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            try:
                return grammar.grammar_from_json_schema(schema, overrides=options)
            except (ValueError, RecursionError) as exc:
                raise StructuredOutputsError(f"json: {exc}") from None
        if self.kind == "regex":
            return grammar.grammar_from_regex(self.regex)
        if self.kind == "choice":
            # Lark string literals take JSON's escapes: any string is spelled exactly.
            alternatives = " | ".join(json.dumps(c) for c in self.choice)
            return grammar.grammar_from_lark(f"start: {alternatives}\n")
        if "::=" in self.grammar:  # GBNF (llama.cpp's grammar format)
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return grammar.grammar_from_lark(gbnf_to_lark(self.grammar))
            except Exception as exc:  # the converter's own parse errors
                raise StructuredOutputsError(f"grammar: not valid GBNF: {exc}") from None
        return grammar.grammar_from_lark(self.grammar)


def _canonical_json(schema: dict) -> str:
    """The schema as compact JSON with sorted keys, refused once it passes
    ``MAX_GRAMMAR_CHARS``: written piece by piece, so a dict that reuses one sub-schema many
    times over (small in memory, exponential as text) is refused before it is spelled out."""
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
    pieces, length = [], 0
    try:
        for piece in encoder.iterencode(schema):
            pieces.append(piece)
            length += len(piece)
            if length > MAX_GRAMMAR_CHARS:
                break
    except (TypeError, ValueError, RecursionError) as exc:  # not JSON: a set, NaN, a cycle
        raise StructuredOutputsError(f"json: the schema is not JSON data: {exc}") from None
    if length > MAX_GRAMMAR_CHARS:
        raise StructuredOutputsError(
            f"json: the schema is more than MAX_GRAMMAR_CHARS={MAX_GRAMMAR_CHARS} characters "
            "as JSON"
        )
    return "".join(pieces)


def _given(kind: str, value: object) -> bool:
    """Whether a kind's field was given: anything but None, and ``json_object`` only as
    True (``json_object=False`` is vLLM's way of not asking for it)."""
    return value is not None and not (kind == "json_object" and value is False)


class GrammarCompiler:
    """One engine's grammar engine: llguidance's view of the vocabulary (built on first use)
    and the compiled grammars (an LRU cache of ``MAX_CACHED_GRAMMARS``).

    Thread-safe: the server compiles a request's grammar off the engine thread before it
    queues the request (``compile``), and the engine's ``add_request`` then finds it cached.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        """``tokenizer_json``: the ``tokenizers`` tokenizer as JSON; ``vocab_size``: the
        model's logits width (may exceed the tokenizer's: those ids are never allowed);
        ``eos_token_ids``: the tokens that end a sequence, allowed when the grammar accepts."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._probe = GrammarProbe(PARSER_LIMITS)
        self.hits = self.misses = 0

    @property
    def tokenizer(self):
        """llguidance's ``LLTokenizer``, built on first use (it walks the whole vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                try:
                    self._tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                    )
                except Exception as exc:  # llguidance's own error types
                    raise StructuredOutputsError(
                        f"the grammar engine cannot read this model's tokenizer: {exc}"
                    ) from None
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams):
        """The compiled matcher for ``params`` (cached by its canonical text), to copy per
        sample; ``StructuredOutputsError`` naming the problem when it cannot be enforced."""
        key = params.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                self.hits += 1
                return self._compiled[key]
        import llguidance

        tokenizer = self.tokenizer
        text = params.grammar_text()
        try:
            error = self._probe.check(text)  # within COMPILE_TIMEOUT, in a child process
        except GrammarTimeoutError as exc:
            raise StructuredOutputsError(f"{params.kind}: {exc}") from None
        if error:
            raise StructuredOutputsError(f"{params.kind}: {error.strip()}")
        limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
        if matcher.is_error():
            raise StructuredOutputsError(f"{params.kind}: {matcher.get_error().strip()}")
        with self._lock:
            self.misses += 1
            self._compiled[key] = matcher
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sample, at the grammar's start."""
        return GrammarMatcher(self.compile(params).deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One sample's position in its grammar: which tokens may come next, moved on by each
    token the sample draws. ``num_consumed`` lets a failed step put it back exactly."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0

    def allowed(self) -> np.ndarray:
        """The tokens allowed next, as a (vocab_size,) bool array."""
        import llguidance.numpy

        bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask)
        return unpack(bitmask[0], self.vocab_size)

    def consume(self, token_id: int) -> None:
        """Move on past ``token_id``; ``StructuredOutputsError`` if the grammar refuses it,
        the matcher left as it was. A token outside the mask never is, but llguidance's mask
        can offer one its matcher refuses (the special token ``<s>`` where the grammar forces
        the text "<s>"). ``consume_token`` would then put the matcher in its permanent error
        state, where it allows only EOS: the retried step would end the request "stop" with
        an invalid output. ``try_consume_tokens`` refuses without that."""
        matcher = self._matcher
        if matcher.is_stopped():
            # A finished grammar (or one in error): the mask allowed only EOS, which only
            # consume_token takes here, and llguidance records no token for it -- so neither
            # does num_consumed, or undoing this step would roll back a token too many.
            if not matcher.consume_token(token_id):
                raise StructuredOutputsError(
                    f"the grammar refused token {token_id}: {matcher.get_error()}"
                )
            return
        if matcher.try_consume_tokens([token_id]) != 1:
            raise StructuredOutputsError(f"the grammar refused token {token_id}")
        self.num_consumed += 1

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar would take from here (nothing is
        consumed): speculative proposals are cut there before the model verifies them."""
        if not token_ids or self._matcher.is_stopped():
            return 0
        return self._matcher.validate_tokens(token_ids)

    def rollback_to(self, num_consumed: int) -> None:
        """Forget the tokens consumed after the first ``num_consumed`` (a failed step's)."""
        if num_consumed < self.num_consumed:
            self._matcher.rollback(self.num_consumed - num_consumed)
            self.num_consumed = num_consumed

    @property
    def error(self) -> str:
        """Why the matcher stopped working ("" while it works): once in error, it stays."""
        return self._matcher.get_error() if self._matcher.is_error() else ""


def fill_masks(matchers: list[GrammarMatcher]) -> list[np.ndarray]:
    """The next-token masks of several matchers at once, one (vocab_size,) bool array each:
    one call into llguidance, which computes them on its own threads (the GIL released)."""
    import llguidance
    import llguidance.numpy

    vocab_size = matchers[0].vocab_size
    bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab_size)
    pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), pairs, bitmask)
    return [unpack(row, vocab_size) for row in bitmask]


_EXECUTOR = None


def _executor():
    """llguidance's thread pool for batched masks, made once per process."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def unpack(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask (int32 words, token ``i`` at bit ``i % 32`` of word ``i // 32``) as bools."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return bits[:vocab_size].view(bool)
