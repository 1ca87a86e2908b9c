"""Structured outputs in the engine, checked by validators outside the grammar engine.

llguidance builds the masks; nothing here asks it whether an output is valid. JSON outputs are
checked against their schema by ``jsonschema`` (Draft 2020-12), regex outputs by Python's
``re.fullmatch``, choices by membership and Lark grammars by ``lark``'s own parser.

Where the claim is "the mask makes the output valid", the model is a random-weight Llama over
stories260K's 512-token vocabulary: its next-token distribution is close to uniform, so it
knows nothing of JSON or of any pattern, and every valid output it gives is the mask's doing.
The trained stories260K would write plausible text on its own and prove less.

What the engine promises (``mie.engine.structured``): the mask comes first and the reported
log-probabilities stay raw (before it); the end-of-sequence token is allowed exactly when the
grammar accepts, so a finished grammar ends with "stop" and max_tokens first gives "length";
every sample has its own matcher; constrained requests batch, preempt, chunk and share
prefixes without changing a token (each request alone on a fresh engine is the oracle).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    assert_drained,
    backend_named,
    engine_of,
    require_module,
    run_to_completion,
    stories_tokenizer,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mie import SamplingParams, StepError, StructuredOutputsParams
from mie.engine import llm_engine
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import InvalidRequestError
from mie.engine.structured import MAX_CHOICES, MAX_GRAMMAR_CHARS, StructuredOutputsError
from mie.model import Model, ModelConfig

jsonschema = require_module("jsonschema")
lark = require_module("lark")

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
EOS = 2  # stories260K's </s>
RANDOM_LLAMA = ModelConfig(  # stories260K's vocabulary, random weights
    architecture="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(EOS,),
)
BACKENDS = ["python", "fast"]
SEEDS = range(8)


@functools.cache
def random_model(backend_name: str) -> Model:
    return Model.random(RANDOM_LLAMA, 7, backend_named(backend_name).kernels)


def new_engine(backend_name: str = "python", **kwargs) -> LLMEngine:
    return engine_of(random_model(backend_name), backend_name, **kwargs)


def constrained(max_tokens: int = 64, **kinds) -> SamplingParams:
    """Sampling at temperature 1 (unless told) under the constraint ``kinds`` describes."""
    options = {
        key: kinds.pop(key)
        for key in ("temperature", "seed", "n", "best_of", "logprobs", "logit_bias")
        if key in kinds
    }
    options.setdefault("temperature", 1.0)
    return SamplingParams(
        max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kinds), **options
    )


def generate(engine: LLMEngine, prompt, params: SamplingParams):
    """One request run to the end on ``engine``: its ``RequestOutput``."""
    request_id = engine.add_request(prompt, params)
    return run_to_completion(engine)[request_id]


def snapshot(engine: LLMEngine):
    return (
        engine.num_unfinished_requests,
        engine._num_arrivals,
        len(engine.scheduler.waiting),
        len(engine.scheduler.running),
        engine.pool.num_free,
    )


# -- StructuredOutputsParams and SamplingParams -------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one of .* got none"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of .* got regex, choice"),
        ({"json": {"type": "object"}, "json_object": True}, "got json, json_object"),
        ({"json": "{not json"}, "json: not a JSON document"),
        ({"json": "[1, 2]"}, "json: a JSON schema must be an object, got list"),
        ({"json": 3}, "got int"),
        ({"regex": 5}, "regex must be a string, got int"),
        ({"grammar": b"start: x"}, "grammar must be a string, got bytes"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": "yes"}, "choice must be a non-empty list"),
        ({"choice": ["yes", 1]}, "choice must be a list of strings"),
        ({"choice": ["x"] * (MAX_CHOICES + 1)}, "MAX_CHOICES"),
        ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "regex: .* MAX_GRAMMAR_CHARS"),
        ({"json": {"enum": ["x" * MAX_GRAMMAR_CHARS]}}, "json: .* MAX_GRAMMAR_CHARS"),
        ({"json": "null"}, "json: a JSON schema must be an object, got null"),
        ({"json": "5"}, "json: a JSON schema must be an object, got int"),
    ],
)
def test_structured_outputs_params_refuse_what_they_cannot_mean(kwargs, match):
    with pytest.raises(StructuredOutputsError, match=match):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("field, value", [("ignore_eos", True), ("min_tokens", 2)])
def test_eos_overrides_are_refused_with_a_constraint_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=f"{field} cannot be combined") as refused:
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), **{field: value})
    assert refused.value.field == field


def test_a_schema_as_a_dict_or_as_any_spelling_of_its_text_compiles_once():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spellings = [
        schema,
        json.dumps(schema),
        '{"required": ["a"],\n "properties": {"a": {"type": "integer"}}, "type": "object"}',
    ]
    engine = new_engine()
    for spelling in spellings:
        engine.add_request("Once", constrained(json=spelling, max_tokens=4))
    assert (engine.grammar.misses, engine.grammar.hits) == (1, 2)
    engine.add_request("Once", constrained(json=schema, disable_any_whitespace=True, max_tokens=4))
    assert engine.grammar.misses == 2  # another grammar: compiled on its own


# -- refusals at add_request: nothing queued ----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"regex": "a(b"}, "regex: .*unclosed group"),
        ({"regex": "[z-a]"}, "regex: .*invalid character class range"),
        ({"grammar": "start: item\n"}, 'grammar: .*unknown name: "item"'),
        ({"grammar": 'root ::= "a" item'}, "grammar: not valid GBNF: Rule 'item' not found"),
        ({"json": {"type": "string", "format": "colour"}}, "json: Unknown format: colour"),
        ({"json": {"type": "strnig"}}, "json: Invalid type: strnig"),
        ({"json": {"type": "array", "uniqueItems": True}}, 'json: Unimplemented keys: \\["unique'),
        ({"json": {"not": {"type": "integer"}}}, 'json: Unimplemented keys: \\["not"\\]'),
        ({"json": {"$ref": "#/$defs/node"}}, "json: Pointer '/\\$defs/node' does not exist"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "json: Unsatisfiable"),
    ],
)
def test_a_constraint_that_cannot_be_enforced_is_refused_with_nothing_queued(kwargs, match):
    engine = new_engine()
    engine.add_request("Once upon a time", SamplingParams(max_tokens=3))
    engine.step()
    before = snapshot(engine)
    with pytest.raises(InvalidRequestError, match=f"(?s){match}") as refused:
        engine.add_request("Once", constrained(**kwargs))
    assert refused.value.field == "structured_outputs"
    assert snapshot(engine) == before
    engine.scheduler.check_integrity()


def test_an_engine_without_a_tokenizer_refuses_constraints_with_nothing_queued():
    engine = LLMEngine(random_model("python"), backend=backend_named("python"), num_blocks=16)
    assert engine.tokenizer is None
    before = snapshot(engine)
    with pytest.raises(InvalidRequestError, match="needs the model's tokenizer") as refused:
        engine.add_request([1, 5, 9], constrained(regex="[a-z]+"))
    assert refused.value.field == "structured_outputs"
    assert snapshot(engine) == before


# -- the mask makes every output valid ----------------------------------------------------------


def json_validator(schema: dict):
    validator = jsonschema.Draft202012Validator(schema)
    jsonschema.Draft202012Validator.check_schema(schema)

    def valid(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return validator.is_valid(value)

    return valid


def lark_validator(grammar: str):
    parser = lark.Lark(grammar, start="start")

    def valid(text: str) -> bool:
        try:
            parser.parse(text)
        except lark.exceptions.LarkError:
            return False
        return True

    return valid


def regex_validator(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


TREE = {  # a recursive schema: a node holds a digit and at most two nodes
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "name": {"type": "string", "maxLength": 4},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    "array minItems maxItems": {
        "type": "array",
        "items": {"type": "integer", "minimum": -9, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {"enum": ["red", "green", 3, None, [1, 2]]},
    "string length": {"type": "string", "minLength": 2, "maxLength": 5},
    "integer range": {"type": "integer", "minimum": -20, "maximum": 300},
    "anyOf": {
        "anyOf": [
            {"type": "integer", "minimum": 100, "maximum": 199},
            {"type": "string", "maxLength": 2},
            {"type": "boolean"},
        ]
    },
    "$ref recursion": TREE,
    "additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 9}, "b": {"enum": ["x", "y"]}},
        "additionalProperties": False,
    },
}
REGEXES = [
    r"[a-z]{2,6}",
    r"(yes|no|maybe), [0-9]{1,3}\.",
    r"\(\d{1,2}(,\d{1,2}){0,3}\)",
    r"[A-Z][a-z ]{0,10}[.!?]",
]
CHOICES = [["yes", "no"], ["red", "reddish", "green"], ["Once upon a time", "The end", "\n{}"]]
LARK_SUM = r"""
start: term ("+" term)*
term: NUMBER | "(" NUMBER ("*" NUMBER)? ")"
NUMBER: /[0-9]{1,3}/
"""
GBNF_LIST = r"""
root ::= "[" item ("," item)? ("," item)? "]"
item ::= [a-z] [a-z]? [a-z]?
"""
CASES = {
    **{f"json: {name}": ({"json": s}, json_validator(s)) for name, s in SCHEMAS.items()},
    "json: compact nested object": (
        {"json": SCHEMAS["nested object"], "disable_any_whitespace": True},
        json_validator(SCHEMAS["nested object"]),
    ),
    **{f"regex: {r}": ({"regex": r}, regex_validator(r)) for r in REGEXES},
    **{f"choice: {c}": ({"choice": c}, c.__contains__) for c in CHOICES},
    "lark grammar": ({"grammar": LARK_SUM}, lark_validator(LARK_SUM)),
    "gbnf grammar": ({"grammar": GBNF_LIST}, regex_validator(r"\[[a-z]{1,3}(,[a-z]{1,3}){0,2}\]")),
}


MAX_TOKENS = 96  # enough for most outputs of every case (JSON's free whitespace is the longest)


def prefix_of_a_choice(kinds: dict, text: str) -> bool:
    return any(c.startswith(text) for c in kinds["choice"])


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_every_finished_output_validates(backend_name, case):
    """Eight seeds at temperature 1 and one greedy run: every output that stopped passes the
    outside validator, most stop, and a choice cut by max_tokens is a prefix of one."""
    kinds, valid = CASES[case]
    engine = new_engine(backend_name)
    ids = [engine.add_request("Once upon", constrained(MAX_TOKENS, seed=s, **kinds)) for s in SEEDS]
    ids.append(engine.add_request("Once upon", constrained(MAX_TOKENS, temperature=0.0, **kinds)))
    outputs = run_to_completion(engine)
    finished = 0
    for request_id in ids:
        (out,) = outputs[request_id].outputs
        if out.finish_reason == "stop":
            finished += 1
            assert out.token_ids[-1] == EOS
            assert valid(out.text), (case, out.text)
        else:
            assert out.finish_reason == "length"
            assert len(out.token_ids) == MAX_TOKENS
            if "choice" in kinds:
                assert prefix_of_a_choice(kinds, out.text), out.text
    assert finished >= len(ids) / 2, f"{case}: only {finished} of {len(ids)} finished"
    assert_drained(engine)


def test_the_random_model_alone_writes_nothing_valid():
    """The control: without the mask, the random model's outputs satisfy none of the
    constraints, so the outputs above are valid because of the mask."""
    engine = new_engine()
    params = [SamplingParams(max_tokens=16, seed=seed) for seed in SEEDS]
    texts = [generate(engine, "Once upon", p).outputs[0].text for p in params]
    for case, (_, valid) in CASES.items():
        assert not any(valid(text) for text in texts), case


# -- the end of the output ----------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_choice_stops_on_eos_right_after_it(backend_name):
    engine = new_engine(backend_name)
    tokenizer = stories_tokenizer()
    choices = ["a little dog", "a big cat"]
    for seed in SEEDS:
        (out,) = generate(engine, "Once", constrained(choice=choices, seed=seed)).outputs
        assert out.finish_reason == "stop"
        assert out.text in choices
        assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
        assert tokenizer.decode(out.token_ids[:-1]) == out.text


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_max_tokens_before_the_grammar_accepts_gives_length_and_the_truncated_text(backend_name):
    engine = new_engine(backend_name)
    choice = "Once upon a time there was a little dog"
    for seed in SEEDS:
        (out,) = generate(
            engine, "Hi", constrained(choice=[choice], max_tokens=3, seed=seed)
        ).outputs
        assert out.finish_reason == "length"
        assert len(out.token_ids) == 3 and EOS not in out.token_ids
        assert out.text and choice.startswith(out.text) and out.text != choice


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_eos_only_once_the_grammar_accepts(backend_name):
    """A fixed length: EOS is refused before the fifth letter, even pushed by logit_bias, and
    forced after it."""
    engine = new_engine(backend_name)
    for seed in SEEDS:
        params = constrained(regex="[a-z]{5}", seed=seed, logit_bias={EOS: 100.0})
        (out,) = generate(engine, "Hi", params).outputs
        assert out.finish_reason == "stop"
        assert re.fullmatch("[a-z]{5}", out.text), out.text


# -- what shapes the distribution: the mask first, then logit_bias ------------------------------


def tokens_spelling_parts_of(word: str) -> list[int]:
    """The ids of the vocabulary's tokens that spell a piece of ``word`` (bytes included)."""
    vocab = json.loads((STORIES / "tokenizer.json").read_text())["model"]["vocab"]
    byte = re.compile(r"<0x([0-9A-F]{2})>")
    pieces = {
        t: chr(int(byte.fullmatch(s)[1], 16)) if byte.fullmatch(s) else s for s, t in vocab.items()
    }
    return [t for t, piece in pieces.items() if piece and piece in word]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_logit_bias_cannot_bring_back_a_masked_token_but_steers_among_allowed_ones(backend_name):
    engine = new_engine(backend_name)
    # Every token but EOS at +100: the mask still leaves only the choices' spellings.
    push_all = {t: 100.0 for t in range(RANDOM_LLAMA.vocab_size) if t != EOS}
    for seed in SEEDS:
        params = constrained(choice=["yes", "no"], seed=seed, logit_bias=push_all)
        (out,) = generate(engine, "Once", params).outputs
        assert out.finish_reason == "stop" and out.text in ("yes", "no")
    # Among the tokens the mask allows, the bias still counts: greedy follows it.
    for word in ("yes", "no"):
        bias = {t: 100.0 for t in tokens_spelling_parts_of(word)}
        params = constrained(choice=["yes", "no"], temperature=0.0, logit_bias=bias)
        (out,) = generate(engine, "Once", params).outputs
        assert out.text == word


# -- log-probabilities stay raw -----------------------------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_logprobs_are_the_unmasked_models_teacher_forced(backend_name):
    """A constrained request's log-probabilities, top alternatives included, are those of the
    raw logits: the same tokens fed as a prompt to an unconstrained request give them. The
    masked distribution's would differ: after a complete choice only EOS is allowed, so its
    log-probability there would be 0."""
    engine = new_engine(backend_name)
    prompt = stories_tokenizer().encode("Once upon a time")
    for seed in range(3):
        params = constrained(choice=["yes", "no", "maybe"], seed=seed, logprobs=3)
        (out,) = generate(engine, prompt, params).outputs
        assert out.finish_reason == "stop"
        teacher = generate(
            engine, prompt + out.token_ids, SamplingParams(max_tokens=1, prompt_logprobs=3)
        )
        forced = teacher.prompt_logprobs[len(prompt) :]
        assert len(forced) == len(out.logprobs) == len(out.token_ids)
        for token, got, want in zip(out.token_ids, out.logprobs, forced, strict=True):
            assert got.keys() == want.keys() and token in got
            for t in got:
                assert got[t].rank == want[t].rank
                assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)
        assert out.logprobs[-1][EOS].logprob < -1.0  # EOS was the only token allowed
        assert out.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)), abs=1e-6
        )


# -- every sample its own matcher ---------------------------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("n, best_of", [(4, 4), (2, 5)])
def test_each_sample_follows_the_grammar_on_its_own(backend_name, n, best_of):
    schema = SCHEMAS["nested object"]
    valid = json_validator(schema)
    engine = new_engine(backend_name)
    params = constrained(json=schema, disable_any_whitespace=True, n=n, best_of=best_of, seed=3)
    outputs = generate(engine, "Once upon", params).outputs
    assert len(outputs) == n
    assert len({tuple(o.token_ids) for o in outputs}) == n
    for out in outputs:
        assert out.finish_reason == "stop" and valid(out.text), out.text
    assert_drained(engine)


# -- batching, preemption, chunked prefill, prefix caching change nothing -----------------------


PROMPTS = ["Once upon a time", "Once upon a time there was", "The little dog", "Lily wanted to"]
REGEX_PIECES = ["[a-z]{1,3}", "[0-9]{1,2}", "(yes|no)", " ", "\\.", "[A-Z]?", "(ab|c)?", "x"]
regexes = st.lists(st.sampled_from(REGEX_PIECES), min_size=1, max_size=4).map("".join)
choice_lists = st.lists(
    st.text(alphabet="abcxyz .", min_size=1, max_size=6), min_size=1, max_size=4, unique=True
)
requests = st.tuples(
    st.sampled_from(PROMPTS),
    st.one_of(
        st.none(),
        st.builds(StructuredOutputsParams, regex=regexes),
        st.builds(StructuredOutputsParams, choice=choice_lists),
    ),
    st.sampled_from([0.0, 1.0]),
    st.integers(4, 28),  # max_tokens
    st.sampled_from([1, 2]),  # n
    st.integers(0, 2**32),  # seed
)


def request_params(request) -> SamplingParams:
    _, constraint, temperature, max_tokens, n, seed = request
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        n=n if temperature else 1,
        seed=seed,
        structured_outputs=constraint,
    )


def samples_of(output):
    return [(o.token_ids, o.finish_reason) for o in output.outputs]


@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.lists(requests, min_size=3, max_size=6),
    num_blocks=st.sampled_from([10, 64]),  # of 4 tokens: 10 hold one request, not all
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
)
def test_constrained_requests_batch_as_if_alone(
    backend_name, batch, num_blocks, chunked, prefix_caching
):
    """Constrained and unconstrained requests (n up to 2) in one continuous batch -- preempted
    when 10 blocks hold only some, prompts cut into chunks of 8 tokens, prefixes shared --
    each give exactly the tokens they give alone on a fresh engine (every one is seeded)."""
    options = {"block_size": 4, "num_blocks": num_blocks, "enable_prefix_caching": prefix_caching}
    if chunked:
        options.update(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=8)
    engine = new_engine(backend_name, **options)
    ids = [engine.add_request(r[0], request_params(r)) for r in batch]
    together = run_to_completion(engine)
    event("preempted" if engine.stats.preemptions else "not preempted")
    event("prefix hit" if engine.stats.prefix_hit_tokens else "no prefix hit")
    assert_drained(engine)
    for request_id, request in zip(ids, batch, strict=True):
        alone = generate(new_engine(backend_name), request[0], request_params(request))
        assert samples_of(together[request_id]) == samples_of(alone)
        constraint = request[1]
        for out in alone.outputs:
            if constraint is not None and constraint.regex and out.finish_reason == "stop":
                assert re.fullmatch(constraint.regex, out.text), (constraint.regex, out.text)


# -- ending a constrained request early ---------------------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_aborting_or_finishing_a_constrained_request_midway_leaves_the_engine_whole(
    backend_name, prefix_caching
):
    long_regex = r"[a-z ]{30,40}\."
    engine = new_engine(backend_name, num_blocks=12, enable_prefix_caching=prefix_caching)
    aborted = engine.add_request("Once upon a time", constrained(regex=long_regex, n=2, seed=1))
    cut = engine.add_request("Once upon a time", constrained(regex=long_regex, n=2, seed=2))
    for _ in range(5):
        engine.step()
    assert engine.abort_request(aborted)
    cut_output = engine.finish_sample(cut, 0)
    assert cut_output.outputs[0].finish_reason == "stop"
    assert cut_output.outputs[0].text and not re.fullmatch(long_regex, cut_output.outputs[0].text)
    rest = run_to_completion(engine)
    assert aborted not in rest
    (survivor,) = [o for o in rest[cut].outputs if o.index == 1]
    assert survivor.finish_reason == "stop" and re.fullmatch(long_regex, survivor.text)
    assert_drained(engine)
    # Still usable: a new constrained request runs exactly as on a fresh engine.
    params = constrained(json=SCHEMAS["nested object"], n=2, seed=4)
    after = generate(engine, "Once upon a time", params)
    assert samples_of(after) == samples_of(
        generate(new_engine(backend_name), "Once upon a time", params)
    )
    assert_drained(engine)


# -- a token the grammar refuses ----------------------------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_refused_token_fails_its_step_and_leaves_the_matcher_as_it_was(backend_name, monkeypatch):
    """If a mask ever lets through a token the grammar then refuses, the step fails naming the
    request and the matcher is as before it: the retried step carries on from there, so the
    request ends exactly as in a run without the bad mask (not, say, stopped in an error)."""
    params = constrained(json=SCHEMAS["nested object"], seed=5)
    clean = generate(new_engine(backend_name), "Once upon", params)
    engine = new_engine(backend_name)
    request_id = engine.add_request("Once upon", params)
    engine.step()  # the first token, under the true mask
    with monkeypatch.context() as patch:  # then a mask allowing every token, once
        patch.setattr(llm_engine, "fill_masks", lambda m: np.ones((len(m), 512), dtype=bool))
        with pytest.raises(StepError, match="the grammar refused token"):
            while True:  # until the draw falls outside the true mask
                engine.step()
    (out,) = run_to_completion(engine)[request_id].outputs
    assert (out.token_ids, out.text) == (clean.outputs[0].token_ids, clean.outputs[0].text)
    assert_drained(engine)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("fail_after", ["a letter", "EOS"])
@pytest.mark.parametrize(
    "kinds", [{"choice": ["yes", "no"]}, {"regex": "[a-z]{3}"}, {"regex": "[a-z]{1,3}"}]
)
def test_a_step_failing_after_its_token_is_retried_exactly(backend_name, fail_after, kinds):
    """A step that fails after a sample's matcher took its token is undone with the rest:
    the retry draws from the same grammar state. The EOS after a finished grammar is taken
    by llguidance without recording a token (one ending a grammar that could go on is
    recorded): undoing must put back exactly what was recorded, or the retry resumes a token
    too early."""
    params = constrained(seed=2, **kinds)
    clean = generate(new_engine(backend_name), "Once", params)
    engine = new_engine(backend_name)
    sample, failed = engine._sample, []

    def sample_then_fail_once(*args):
        token = sample(*args)
        if (token == EOS) == (fail_after == "EOS") and not failed:
            failed.append(token)
            raise RuntimeError("a later part of the step failed")
        return token

    engine._sample = sample_then_fail_once
    request_id = engine.add_request("Once", params)
    with pytest.raises(StepError, match="a later part of the step failed"):
        run_to_completion(engine)
    assert samples_of(run_to_completion(engine)[request_id]) == samples_of(clean)
    assert_drained(engine)


@pytest.mark.parametrize("choice", ["<s>", "</s>", "a</s>"])
def test_a_choice_spelling_a_special_token_never_stops_invalid(choice):
    """llguidance's mask, spelling text the grammar forces, offers the special token of the
    same text (``<s>``), which its matcher then refuses: the step fails, and must fail again
    when retried rather than let the request end "stop" with an output that is no choice."""
    engine = new_engine()
    request_id = engine.add_request("Once", constrained(choice=[choice], max_tokens=8))
    outputs = []
    for _ in range(6):
        try:
            outputs += [o for o in engine.step() if o.finished]
        except StepError as failed:
            assert failed.request_ids == (request_id,)
    for out in outputs:
        assert out.outputs[0].finish_reason == "length" or out.outputs[0].text == choice
    engine.abort_request(request_id)
    assert_drained(engine)
