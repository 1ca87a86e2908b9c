"""The server's pure parts, without a server: request validation, answers, metrics."""

import re
from pathlib import Path

import pytest
from conftest import require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie.engine.outputs import Logprob
from mie.engine.sampling import InvalidRequestError, SamplingParams
from mie.engine.tokenizer import Tokenizer

# mie.serve's package imports the server stack (starlette, uvicorn): without it, skip (not in CI)
require_module("mie.serve")

from mie.engine.chat import ChatTemplate  # noqa: E402
from mie.serve.answers import Answer  # noqa: E402
from mie.serve.loop import Update  # noqa: E402
from mie.serve.metrics import ServerMetrics  # noqa: E402
from mie.serve.protocol import (  # noqa: E402
    MAX_CHOICES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    APIError,
    chat_logprobs,
    completion_logprobs,
    engine_refusal,
    parse_messages,
    parse_options,
    parse_prompts,
)

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 3) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)
# Values on and around the fields' bounds (penalties +-2, logprobs 20, n 128, min_p 1, ...),
# and token id -> bias objects: arbitrary JSON alone rarely lands near a bound.
boundary_numbers = st.sampled_from([-2.5, -2, -0.5, 0, 0.5, 1, 1.5, 2, 2.01, 3, 20, 21, 128, 129])
field_values = st.one_of(
    json_values,
    boundary_numbers,
    st.integers(-2, 130),
    st.dictionaries(st.integers(0, 600).map(str), st.floats(-150, 150), max_size=2),
)
FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "echo",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "suffix",
    "tools",
    "response_format",
]
# Fields that reach SamplingParams under their own name.
SAMPLING_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repetition_penalty",
    "min_tokens",
]


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=4), st.booleans())
def test_options_are_either_a_400_naming_the_field_or_valid_sampling_params(fields, chat):
    body = {"model": "m", **fields}
    try:
        options = parse_options(body, "m", chat=chat)
    except APIError as exc:
        assert exc.status == 400 and exc.param in FIELDS
        assert exc.body()["error"]["message"] == exc.message
        return
    # What the protocol lets through, the engine's own validation accepts (or, for what
    # needs the endpoint's default max_tokens, the protocol refuses naming the field).
    try:
        params = options.sampling_params(16)
    except APIError as exc:
        assert exc.status == 400 and exc.param == "min_tokens" and options.max_tokens is None
        return
    assert isinstance(params, SamplingParams)
    for name in SAMPLING_FIELDS:
        if fields.get(name) is not None:
            assert getattr(params, name) == fields[name]
    assert params.n == options.best_of >= options.n == (fields.get("n") or 1)
    if fields.get("logit_bias"):
        assert params.logit_bias == {int(k): v for k, v in fields["logit_bias"].items()}
    if not chat and fields.get("logprobs") is not None:
        assert params.logprobs == fields["logprobs"]
        assert params.prompt_logprobs == (fields["logprobs"] if options.echo else None)


def test_model_name_must_match():
    with pytest.raises(APIError, match="does not exist") as info:
        parse_options({"model": "other"}, "m", chat=False)
    assert info.value.param == "model" and info.value.code == "model_not_found"
    assert info.value.status == 404  # OpenAI's and vLLM's status for an unknown model


def test_chat_prefers_max_completion_tokens():
    body = {"model": "m", "max_tokens": 5, "max_completion_tokens": 9}
    assert parse_options(body, "m", chat=True).max_tokens == 9
    assert parse_options(body, "m", chat=False).max_tokens == 5


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force():
    # Clients that write every field send the unset ones as null (OpenAI and vLLM: not set).
    body = {"model": "m", "max_tokens": 5, "max_completion_tokens": None}
    assert parse_options(body, "m", chat=True).max_tokens == 5


# Each SamplingParams field as the wire spells it, with values on and around its bounds, of
# the JSON type HTTP checks (a JSON type error is HTTP's own 400, not a sampling rule).
ints = st.integers(-3, 3) | st.sampled_from([20, 21, 2**63, 2**64, -(2**63) - 1, -(2**64)])
BOUNDS = [-100.5, -100, -2.01, -2, 0, 1e-5, 0.009, 0.01, 0.5, 1, 1.01, 2, 2.01, 100, 100.5]
numbers = st.floats(allow_nan=False) | st.integers(-(10**30), 10**30) | st.sampled_from(BOUNDS)
WIRE_SAMPLING_VALUES = {
    "temperature": numbers,
    "top_p": numbers,
    "min_p": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "top_k": ints,
    "seed": ints,
    "min_tokens": ints,
    "n": ints,
    "best_of": ints,
    "logprobs": ints,
    "stop_token_ids": st.lists(ints, max_size=3),
    "logit_bias": st.dictionaries(
        st.integers(0, 9).map(str), numbers | st.text(max_size=2), max_size=2
    ),
}


def sampling_outcome(make) -> tuple:
    """("ok",) or (the field named, the message) of a refusal, whichever path refused."""
    try:
        make()
    except InvalidRequestError as exc:
        return exc.field, str(exc)
    except APIError as exc:
        return exc.param, exc.message
    return ("ok",)


@settings(max_examples=800, deadline=None)
@given(st.sets(st.sampled_from(list(WIRE_SAMPLING_VALUES)), min_size=1, max_size=3), st.data())
def test_sampling_values_are_refused_by_sampling_params_alone(names, data):
    """No sampling rule is restated over HTTP: values of SamplingParams' fields (a
    temperature, a penalty, n...) are accepted by the server exactly when SamplingParams
    accepts them, and refused with its message, ``param`` the field it names."""
    fields = {name: data.draw(WIRE_SAMPLING_VALUES[name], label=name) for name in sorted(names)}
    if any(fields.get(name, 0) > MAX_CHOICES for name in ("n", "best_of")):
        return  # over HTTP's own cap (tested below)
    offline = {**fields, "max_tokens": 16}
    if "logit_bias" in fields:
        offline["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()} or None
    body = {"model": "m", "max_tokens": 16, **fields}
    wire = sampling_outcome(lambda: parse_options(body, "m", chat=False))
    assert wire == sampling_outcome(lambda: SamplingParams(**offline))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2),
        ("seed", 2**64),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("stop_token_ids", [-1]),
        ("logit_bias", {"5": 200}),
        ("n", 0),
        ("best_of", 0),
        ("logprobs", 21),
    ],
)
def test_a_bad_sampling_value_is_a_400_naming_the_field_sampling_params_names(field, value):
    with pytest.raises(APIError) as info:
        parse_options({"model": "m", "max_tokens": 16, field: value}, "m", chat=False)
    assert info.value.status == 400 and info.value.param == field
    assert info.value.message.startswith(f"SamplingParams: {field} ")


def test_sampling_fields_spelled_otherwise_over_http_are_named_as_the_client_spelled_them():
    with pytest.raises(APIError) as info:  # chat's top_logprobs is SamplingParams' logprobs
        parse_options({"model": "m", "logprobs": True, "top_logprobs": 21}, "m", chat=True)
    assert info.value.param == "top_logprobs" and "logprobs must be" in info.value.message
    for body, param in [
        ({"n": 2, "temperature": 0}, "n"),
        ({"best_of": 2, "temperature": 0}, "best_of"),
    ]:
        with pytest.raises(APIError, match="sampling greedily") as info:
            parse_options({"model": "m", **body}, "m", chat=False)
        assert info.value.param == param
    for name in ("n", "best_of"):  # HTTP's own cap
        with pytest.raises(APIError, match=f"at most {MAX_CHOICES}") as info:
            parse_options({"model": "m", "n": 1, name: MAX_CHOICES + 1}, "m", chat=False)
        assert info.value.param == name


def test_an_engine_refusal_names_the_field_the_engine_names_not_a_word_of_its_message():
    named = InvalidRequestError("stop_token_ids token ids must be in the vocabulary", field="x")
    assert engine_refusal(named).param == "x"
    unnamed = InvalidRequestError("prompt (5 tokens) + max_tokens (600) exceeds the context")
    assert engine_refusal(unnamed).param is None
    assert engine_refusal(unnamed, prompt_index=2).param == "prompt"  # a batch's prompt


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        ([1, 2], [[1, 2]]),
        (["hi"], ["hi"]),
        ([[3, 4]], [[3, 4]]),
        (["a", "b"], ["a", "b"]),  # a batch of strings
        ([[3, 4], [5]], [[3, 4], [5]]),  # a batch of token-id lists
    ],
)
def test_prompt_forms(prompt, expected):
    assert parse_prompts({"prompt": prompt}) == expected


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        [],
        [""],
        [[]],
        ["a", ""],
        [[1], []],
        [1, "a"],
        ["a", [1]],
        [[1], 2],
        [[1, "a"]],
        [True],
        [[True]],
        ["a\ud800"],
        7,
        {"a": 1},
    ],
)
def test_bad_prompts(prompt):
    with pytest.raises(APIError) as info:
        parse_prompts({"prompt": prompt})
    assert info.value.status == 400 and info.value.param == "prompt"


def test_a_batch_is_bounded_like_one_requests_samples():
    """prompts x best_of <= MAX_CHOICES: a batch takes no more of the engine than the largest
    single request may."""
    assert len(parse_prompts({"prompt": ["a"] * MAX_CHOICES})) == MAX_CHOICES
    assert len(parse_prompts({"prompt": [[1]] * 32}, samples_per_prompt=4)) == 32
    for prompt, best_of in ((["a"] * (MAX_CHOICES + 1), 1), ([[1]] * 33, 4)):
        with pytest.raises(APIError, match="at most 128") as info:
            parse_prompts({"prompt": prompt}, samples_per_prompt=best_of)
        assert info.value.param == "prompt" and info.value.code == "prompt_limit"


def test_messages_reach_the_template_in_vllms_shapes():
    # vLLM's chat_utils: text parts joined by newlines, every role's name kept, an
    # assistant's null content beside its calls as "", an empty tool_calls list dropped (so
    # Llama 3's template takes its plain path instead of refusing "single tool-calls").
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": parts, "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1", "tool_call_id": "c", "name": "f"},
        {"role": "assistant", "content": "ok", "tool_calls": []},
    ]
    assert parse_messages({"messages": messages}) == [
        {"role": "user", "content": "a\nb", "name": "bob"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
            ],
        },
        {"role": "tool", "content": "1", "name": "f", "tool_call_id": "c"},
        {"role": "assistant", "content": "ok"},
    ]


def test_default_chat_template_is_one_line_per_message_then_assistant():
    template = ChatTemplate(STORIES, Tokenizer(STORIES))
    assert not template.from_checkpoint
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert template.apply(messages) == "System: S\nUser: U\nAssistant:"
    assert template.encode("Hi")[0] == 1  # like a completion prompt: BOS added


def test_stop_strings_are_capped_in_number_and_length():
    ok = parse_options(
        {"model": "m", "stop": ["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS}, "m", chat=False
    )
    assert len(ok.sampling.stop) == MAX_STOP_STRINGS
    for stop, words in [
        (["x"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS}"),
        ("x" * (MAX_STOP_LENGTH + 1), f"at most {MAX_STOP_LENGTH}"),
    ]:
        with pytest.raises(APIError, match=words) as info:
            parse_options({"model": "m", "stop": stop}, "m", chat=False)
        assert info.value.status == 400 and info.value.param == "stop"
        assert info.value.code == "stop_limit"


def test_error_messages_quote_client_values_briefly():
    with pytest.raises(APIError) as info:
        parse_options({"model": "x" * 100_000}, "m", chat=False)
    assert len(info.value.message) < 200
    with pytest.raises(APIError) as info:
        parse_options({"model": "m", "max_tokens": -(10**4000)}, "m", chat=False)
    assert "4001 digits" in info.value.message


# -- metrics ------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 20), max_size=30))
def test_histogram_buckets_count_observations_at_most_their_bound(values):
    metrics = ServerMetrics()
    for v in values:
        metrics.observe_token(v, None)
    h = "mie_time_to_first_token_seconds"
    samples = [line.rsplit(" ", 1) for line in metrics.render().splitlines()]
    lines = {name: float(value) for name, value in samples if name.startswith(h)}
    for bound in ("0.1", "1.0", "10.0"):
        assert int(lines[f'{h}_bucket{{le="{bound}"}}']) == sum(v <= float(bound) for v in values)
    assert int(lines[f'{h}_bucket{{le="+Inf"}}']) == int(lines[f"{h}_count"]) == len(values)
    assert lines[f"{h}_sum"] == pytest.approx(sum(values))


def test_metrics_text_declares_every_sample_it_writes():
    text = ServerMetrics().render()
    declared = set(re.findall(r"^# TYPE (\S+) (gauge|counter|histogram)$", text, re.M))
    names = {name for name, _ in declared}
    for line in text.splitlines():
        if not line.startswith("#"):
            sample = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
            assert sample, line
            float(sample.group(3))
            base = re.sub(r"_(bucket|sum|count)$", "", sample.group(1))
            assert sample.group(1) in names or base in names, line


# -- answers: best_of, log-probabilities -----------------------------------------------------------
def lp(value: float, token: str) -> Logprob:
    return Logprob(value, decoded_token=token)


def test_best_of_keeps_the_n_highest_cumulative_logprobs_best_first():
    answer = Answer()
    totals = [-3.0, -1.0, -2.0, -1.0]  # samples 1 and 3 tie: the lower index first
    for index, total in enumerate(totals):
        logprobs = ({7: lp(total / 2, "a")}, {7: lp(total / 2, "a")})
        answer.add(Update("aa", 2, "length", index=index, token_ids=(7, 7), logprobs=logprobs))
    assert [c.index for c in answer.best(3)] == [1, 3, 2]
    assert [c.index for c in answer.best(4)] == [0, 1, 2, 3]  # n = best_of: every one, in order
    assert answer.num_generated_tokens == 8


def test_completion_logprobs_offsets_run_over_the_token_texts():
    candidates = [
        None,
        {5: lp(-0.5, " cat"), 6: lp(-1.5, " dog")},
        {9: lp(-float("inf"), "!"), 5: lp(-0.1, " cat")},
    ]
    shape = completion_logprobs(
        [1, 5, 9],
        candidates,
        lambda t, logprob: logprob.decoded_token if logprob else "<s>",
        offset=3,
    )
    assert shape == {
        "tokens": ["<s>", " cat", "!"],
        "token_logprobs": [None, -0.5, -9999.0],  # -inf is not JSON
        "top_logprobs": [None, {" cat": -0.5, " dog": -1.5}, {" cat": -0.1, "!": -9999.0}],
        "text_offset": [3, 6, 10],
    }


def test_top_logprobs_keys_stay_distinct_when_texts_collide():
    """Tokens with the same text at one position (byte-fallback tokens leaving a character
    unfinished, skipped special tokens: all "") keep their own values under distinct keys:
    the token at the position keeps its text, then the most likely; the others are spelled
    by id, with a suffix where even that is some token's text."""
    candidates = {
        12: lp(-2.0, ""),  # the token at the position: it keeps "", though not most likely
        10: lp(-0.5, ""),  # most likely: "token_id:10"
        13: lp(-0.7, "token_id:14"),  # a text that is another token's id spelling
        14: lp(-1.0, ""),  # so "token_id:14#2"
        15: lp(-1.0, " c"),  # distinct texts are kept
        16: lp(-1.5, "c"),
    }
    shape = completion_logprobs(
        [12, 15], [candidates, {15: lp(-1.0, " c")}], lambda t, logprob: logprob.decoded_token
    )
    assert shape["tokens"] == ["", " c"] and shape["text_offset"] == [0, 0]
    assert shape["top_logprobs"][0] == {
        "token_id:10": -0.5,
        "token_id:14": -0.7,
        "token_id:14#2": -1.0,
        " c": -1.0,
        "c": -1.5,
        "": -2.0,
    }
    assert list(shape["top_logprobs"][0].values()) == [-0.5, -0.7, -1.0, -1.0, -1.5, -2.0]


def test_chat_logprobs_list_the_top_alternatives_with_their_bytes():
    candidates = [{5: lp(-2.0, "é"), 6: lp(-0.2, "a"), 7: lp(-0.3, "b")}]
    shape = chat_logprobs([5], candidates, lambda t, logprob: logprob.decoded_token, top=2)
    (entry,) = shape["content"]
    assert entry["token"] == "é" and entry["logprob"] == -2.0 and entry["bytes"] == [195, 169]
    assert [(a["token"], a["logprob"]) for a in entry["top_logprobs"]] == [("a", -0.2), ("b", -0.3)]
