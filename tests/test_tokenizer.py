"""Tokenizer wrapper and streaming detokenization on the real stories260K tokenizer."""

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import require_module
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from mie.engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    read_tokenizer_config,
)

AutoTokenizer = require_module("transformers").AutoTokenizer

MODEL = Path(__file__).resolve().parents[1] / "models" / "stories260K"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(MODEL)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


def test_encode_matches_transformers(tokenizer, hf_tokenizer):
    for text in ["Once upon a time", "Lily and Ben went to the park.", "héllo 日本 🎉"]:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 512


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer(tmp_path)


@settings(max_examples=150, deadline=None)
@given(text=st.text(min_size=1, max_size=40), cut=st.integers(0, 60))
def test_streamed_deltas_add_up_and_never_split_a_character(tokenizer, text, cut):
    ids = tokenizer.encode(text)
    prompt, generated = ids[: 1 + cut % len(ids)], ids[1 + cut % len(ids) :]
    prompt_text, full_text = tokenizer.decode(prompt), tokenizer.decode(ids)
    assume("\ufffd" not in full_text and full_text.startswith(prompt_text))
    stream = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [stream.add(t) for t in generated]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full_text[len(prompt_text) :]


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.integers(3, 511), min_size=1, max_size=4),
    specials=st.lists(st.integers(0, 2), max_size=10),
    token=st.integers(3, 511),
)
def test_a_token_after_skipped_special_tokens_keeps_its_space(tokenizer, words, specials, token):
    """Skipped special tokens add nothing, however many there are: the text a token adds
    after ``before`` is what transformers' decoding of the whole sequence adds (the example
    hypothesis found: ``▁and`` after ``▁t`` and five ``<unk>`` is " and", where a context
    window of the five ``<unk>`` alone made it "and")."""
    before = words + specials
    transformers = require_module("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(MODEL)
    base = hf.decode(before, skip_special_tokens=True)
    full = hf.decode(before + [token], skip_special_tokens=True)
    assume("\ufffd" not in full and full.startswith(base))
    assert IncrementalDetokenizer(tokenizer, before).add(token) == full[len(base) :]
    assert tokenizer.special_token_ids == frozenset(hf.all_special_ids)


def test_the_example_hypothesis_found_for_skipped_special_tokens(tokenizer):
    assert IncrementalDetokenizer(tokenizer, [259, 0, 0, 0, 0, 0]).add(269) == " and"
    assert IncrementalDetokenizer(tokenizer, [259, 0, 0, 0, 0, 0], False).add(269) == " and"


# -- malformed tokenizer files -------------------------------------------------------------------


@pytest.fixture
def model_copy(tmp_path):
    """A writable copy of stories260K's tokenizer files."""
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copyfile(MODEL / name, tmp_path / name)
    return tmp_path


BAD_TOKENIZER_CONFIGS = [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[]", "not a JSON object"),
    (b'"tokenizer"', "not a JSON object"),
    (b"null", "not a JSON object"),
    (b'{"bos_token": "<s>", "bos_token": "</s>"}', "repeats the key 'bos_token'"),
    (b'{"model_max_length": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b'{"chat_template": 5}', "chat_template must be a string or a list"),
    (b'{"chat_template": {"default": "x"}}', "chat_template must be a string or a list"),
    (b'{"chat_template": ["{{ x }}"]}', "chat_template must be a string or a list"),
    (b'{"chat_template": [{"name": "default", "template": 5}]}', "chat_template must be"),
    (b'{"chat_template": [{"name": null, "template": "x"}]}', "chat_template must be"),
    (b'{"bos_token": 1}', "bos_token must be a string or"),
    (b'{"bos_token": ["<s>"]}', "bos_token must be a string or"),
    (b'{"bos_token": {"content": 1}}', "bos_token must be a string or"),
    (b'{"eos_token": {"id": 2}}', "eos_token must be a string or"),
]


@pytest.mark.parametrize(("content", "message"), BAD_TOKENIZER_CONFIGS)
def test_malformed_tokenizer_config_is_a_tokenizer_error_naming_the_file(
    model_copy, content, message
):
    path = model_copy / "tokenizer_config.json"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=re.escape(f"{path}: ")) as info:
        Tokenizer(model_copy)
    assert message in str(info.value)
    with pytest.raises(TokenizerError, match=re.escape(message)):
        read_tokenizer_config(model_copy)


def test_well_formed_tokenizer_configs_are_read(model_copy):
    path = model_copy / "tokenizer_config.json"
    for config, bos in [
        ({"bos_token": {"content": "<s>", "lstrip": False}}, 1),
        ({"bos_token": None, "chat_template": "{{ messages }}"}, None),
        ({"bos_token": "</s>", "chat_template": [{"name": "default", "template": "x"}]}, 2),
        ({"bos_token": "not in the vocabulary"}, None),
    ]:
        path.write_text(json.dumps(config))
        assert read_tokenizer_config(model_copy) == config
        assert Tokenizer(model_copy).bos_token_id == bos
    path.unlink()
    assert read_tokenizer_config(model_copy) == {}
    assert Tokenizer(model_copy).bos_token_id is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    edits=st.dictionaries(
        st.sampled_from(["chat_template", "bos_token", "eos_token", "unk_token", "x"]),
        json_values
        | st.builds(lambda t, n: [{"name": n, "template": t}], st.text(max_size=5), json_values)
        | st.builds(lambda c: {"content": c}, json_values),
        min_size=1,
    )
)
def test_any_tokenizer_config_field_values_load_or_raise_tokenizer_error(model_copy, edits):
    path = model_copy / "tokenizer_config.json"
    config = {**json.loads((MODEL / "tokenizer_config.json").read_text()), **edits}
    path.write_text(json.dumps(config))
    try:
        tokenizer = Tokenizer(model_copy)
    except TokenizerError as exc:
        assert str(exc).startswith(f"{path}: ")
        return
    read = read_tokenizer_config(model_copy)
    template = read.get("chat_template")
    assert (
        template is None
        or isinstance(template, str)
        or all(isinstance(t["name"], str) and isinstance(t["template"], str) for t in template)
    )
    assert tokenizer.bos_token_id is None or 0 <= tokenizer.bos_token_id < tokenizer.vocab_size


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_damaged_tokenizer_json_loads_or_raises_tokenizer_error(model_copy, data):
    """Truncated, bit-flipped or field-edited copies of the real tokenizer.json."""
    original = (MODEL / "tokenizer.json").read_bytes()
    kind = data.draw(st.sampled_from(["truncate", "flip", "field"]))
    if kind == "truncate":
        content = original[: data.draw(st.integers(0, len(original) - 1))]
    elif kind == "flip":
        content = bytearray(original)
        for _ in range(data.draw(st.integers(1, 4))):
            content[data.draw(st.integers(0, len(content) - 1))] ^= 1 << data.draw(
                st.integers(0, 7)
            )
        content = bytes(content)
    else:
        tree = json.loads(original)
        section = data.draw(
            st.sampled_from(
                [
                    "model",
                    "normalizer",
                    "pre_tokenizer",
                    "decoder",
                    "added_tokens",
                    "post_processor",
                ]
            )
        )
        if data.draw(st.booleans()) and isinstance(tree.get(section), dict) and tree[section]:
            key = data.draw(st.sampled_from(sorted(tree[section])))
            tree[section][key] = data.draw(json_values)
        else:
            tree[section] = data.draw(json_values)
        content = json.dumps(tree).encode()
    path = model_copy / "tokenizer.json"
    path.write_bytes(content)
    try:
        tokenizer = Tokenizer(model_copy)
    except TokenizerError as exc:
        assert str(exc).startswith(f"{path}: cannot load tokenizer: ")
        assert "\n" not in str(exc)
        event(f"{kind}: TokenizerError")
        return
    event(f"{kind}: loaded")
    assert tokenizer.vocab_size >= 0


def test_the_engine_takes_a_tokenizers_path_as_vllm_does(tmp_path):
    """``LLM(model, tokenizer=path)``: vLLM's tokenizer argument is where the tokenizer lies;
    a checkpoint shipped without one (token ids only) then takes text."""
    from mie import LLM, SamplingParams

    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (weights_only / name).write_bytes((MODEL / name).read_bytes())
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = LLM(MODEL, num_blocks=16).generate("Once upon a time", params)[0]
    for where in (str(MODEL), MODEL):
        llm = LLM(weights_only, tokenizer=where, num_blocks=16)
        assert llm.generate("Once upon a time", params)[0].outputs == expected.outputs
    with pytest.raises(FileNotFoundError, match="tokenizer directory"):
        LLM(weights_only, tokenizer=str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        LLM(weights_only, tokenizer=tmp_path)
    with pytest.raises(TypeError, match="tokenizer must be a Tokenizer or the path of one"):
        LLM(weights_only, tokenizer=3)
