"""The published chat templates of the families mie loads, rendered as transformers renders
them, and the published generation configs' stop-token lists, honoured.

Templates: tests/data/chat_templates/<family>.jinja hold the published ``chat_template``
text of each family, byte for byte (sources in ``FAMILIES``). For each, mie's
``ChatTemplate`` and transformers' ``apply_chat_template(..., add_generation_prompt=True,
tokenize=False)`` are given the same conversations -- fixed ones, and hypothesis's, of any
roles in any order with arbitrary text -- and must agree: the same text, or both refusing
the conversation with the template's own message (Mistral's ``raise_exception`` on roles
that do not alternate). The tokenizer is stories260K's with the family's special-token
strings in its config: rendering only sees those strings.

Stop tokens: a random-weight Llama 3.2 / Qwen2.5 directory with the family's vocabulary and
its published ``generation_config.json`` (several ``eos_token_id``s, ``config.json`` naming
only one), prompts given as token ids. Rows of the output projection are swapped so that
each listed stop token is the greedy choice somewhere; the engine's greedy tokens must then
equal transformers' ``generate`` with the directory's generation config, request by
request, each ending on its own stop token.
"""

from __future__ import annotations

import datetime
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require_module, run_to_completion
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mie.engine.chat import ChatTemplate, template_environment
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import InvalidRequestError, SamplingParams
from mie.engine.tokenizer import Tokenizer as MieTokenizer
from mie.engine.tokenizer import TokenizerError
from mie.extension import fast_available

torch = require_module("torch")
transformers = require_module("transformers")
jinja2 = require_module("jinja2")

DATA = Path(__file__).resolve().parent / "data" / "chat_templates"
STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
BACKENDS = [
    "python",
    pytest.param("fast", marks=pytest.mark.skipif(not fast_available(), reason="not built")),
]


@dataclass(frozen=True)
class Family:
    template: str  # file under DATA
    special_tokens: dict  # the family's tokenizer_config.json entries (None: absent there)


# Where each template's text comes from (each a copy of the model's tokenizer_config.json
# chat_template; the Hugging Face model named first):
# * llama3_2 -- meta-llama/Llama-3.2-1B-Instruct and -3B-Instruct (one template): the GGUF
#   template of ollama's library/llama3.2:3b in huggingface/huggingface.js
#   packages/ollama-utils/src/chat-template-automap.ts (commit fe42e68); the same text is
#   ggml-org/llama.cpp models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja.
# * qwen2_5 -- Qwen/Qwen2.5-7B-Instruct (the Qwen2.5 Instruct template):
#   huggingface/huggingface.js packages/jinja/test/e2e.test.js (commit fe42e68).
# * qwen3 -- Qwen/Qwen3-0.6B: huggingface.js e2e.test.js, identical to ollama's
#   library/qwen3:0.6b GGUF template in chat-template-automap.ts and to llama.cpp's
#   models/templates/Qwen-Qwen3-0.6B.jinja.
# * mistral -- mistralai/Mistral-7B-Instruct-v0.1 (the sliding-window Mistral): e2e.test.js
#   ("TheBloke/Mistral-7B-Instruct-v0.1-GPTQ", a copy), identical to ollama's
#   library/mistral:7b-instruct GGUF template in chat-template-automap.ts.
# * mistral_nemo -- mistralai/Mistral-Nemo-Instruct-2407 (MistralForCausalLM; the newer
#   Mistral template with system messages, tools and "After the optional system message,
#   conversation roles must alternate ..."): e2e.test.js.
# * smollm2 -- HuggingFaceTB/SmolLM2-135M-Instruct: ollama's library/smollm2:135m GGUF
#   template in chat-template-automap.ts.
CHATML = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
FAMILIES = {
    "llama3_2": Family(
        "llama3_2.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    ),
    "qwen2_5": Family("qwen2_5.jinja", CHATML),
    "qwen3": Family("qwen3.jinja", CHATML),
    "mistral": Family("mistral.jinja", MISTRAL),
    "mistral_nemo": Family("mistral_nemo.jinja", MISTRAL),
    "smollm2": Family(
        "smollm2.jinja",
        {
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|im_end|>",
        },
    ),
}

SYSTEM = {"role": "system", "content": "You are a terse assistant. "}
CONVERSATIONS = [
    [{"role": "user", "content": "Where did Max go?"}],
    [SYSTEM, {"role": "user", "content": "  Where did Max go?\n"}],
    [
        SYSTEM,
        {"role": "user", "content": "Where did Max go?"},
        {"role": "assistant", "content": "To the park."},
        {"role": "user", "content": "And then?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
        {"role": "user", "content": "Tell me a story."},
    ],
    [{"role": "assistant", "content": "I speak first."}],  # Mistral refuses this
    [SYSTEM, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
]


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict:
    """family -> (mie's ChatTemplate, transformers' tokenizer), on one directory each:
    stories260K's tokenizer.json, a tokenizer_config.json with the family's template and
    special tokens."""
    pairs = {}
    for name, family in FAMILIES.items():
        directory = tmp_path_factory.mktemp(name)
        shutil.copy(STORIES / "tokenizer.json", directory)
        config = json.loads((STORIES / "tokenizer_config.json").read_text())
        config.update(family.special_tokens)
        config["chat_template"] = (DATA / family.template).read_text()
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        hf = transformers.AutoTokenizer.from_pretrained(directory)
        pairs[name] = (ChatTemplate(directory, MieTokenizer(directory)), hf)
    return pairs


def transformers_outcome(hf, messages) -> str | tuple[str, str]:
    """The prompt transformers renders, or ("refused", the template's message)."""
    try:
        return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as exc:
        return "refused", str(exc)


def mie_outcome(chat: ChatTemplate, messages) -> str | tuple[str, str]:
    try:
        return chat.apply(messages)
    except InvalidRequestError as exc:
        return "refused", str(exc).removeprefix("chat template: ")


def both_outcomes(chat: ChatTemplate, hf, messages) -> tuple:
    """mie's and transformers' outcomes, rendered on one calendar day: Llama 3.2 writes
    today's date, so a pair straddling midnight is rendered again."""
    while True:
        day = datetime.date.today()
        outcomes = mie_outcome(chat, messages), transformers_outcome(hf, messages)
        if datetime.date.today() == day:
            return outcomes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_published_templates_render_like_transformers(templates, family):
    """Fixed conversations (system or not, multi-turn, stray whitespace for Llama's trim,
    Qwen3's thinking, orders Mistral refuses): the same prompt or the same refusal; every
    family renders the well-formed ones (Mistral v0.1 has no system role)."""
    chat, hf = templates[family]
    assert chat.from_checkpoint
    pairs = [both_outcomes(chat, hf, c) for c in CONVERSATIONS]
    outcomes = [ours for ours, _ in pairs]
    assert outcomes == [theirs for _, theirs in pairs]
    rendered = [isinstance(o, str) for o in outcomes]
    assert rendered[0] and rendered[3]
    assert rendered[1] and rendered[2] or family == "mistral"
    assert not rendered[4] if family.startswith("mistral") else rendered[4]


def test_a_template_saved_by_transformers_today_is_read_from_chat_template_jinja(tmp_path):
    # save_pretrained writes chat_template.jinja and leaves the config without one; a list of
    # named templates gives "tool_use" to requests with tools, as transformers chooses.
    hf = transformers.AutoTokenizer.from_pretrained(STORIES)
    hf.chat_template = (DATA / "qwen2_5.jinja").read_text()
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    chat = ChatTemplate(tmp_path, MieTokenizer(tmp_path))
    assert chat.from_checkpoint
    messages = CONVERSATIONS[1]
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert chat.apply(messages) == expected and "<|im_start|>" in expected

    named = tmp_path / "named"
    named.mkdir()
    shutil.copy(STORIES / "tokenizer.json", named)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "{{ tools[0]['function']['name'] }}"},
    ]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    chat = ChatTemplate(named, MieTokenizer(named))
    hf = transformers.AutoTokenizer.from_pretrained(named)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    for requested in (None, tools):
        assert chat.apply(messages, requested) == hf.apply_chat_template(
            messages, tools=requested, add_generation_prompt=True, tokenize=False
        )
    assert chat.apply(messages, tools) == "get_time"


def test_llama3_2_dates_its_system_header_with_strftime_now(templates):
    """Llama 3.2's template writes today's date when ``strftime_now`` is defined and a fixed
    "26 Jul 2024" otherwise; transformers defines it, so mie must too."""
    chat, hf = templates["llama3_2"]
    text, theirs = both_outcomes(chat, hf, CONVERSATIONS[0])
    assert text == theirs
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert "Today Date: 26 Jul 2024" not in text


MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.text(st.characters(codec="utf-8"), max_size=12)
        | st.sampled_from(["</think>", "<think>\nx\n</think>\n\ny", " padded ", "<|im_end|>"]),
    }
)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=40, deadline=None)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=5))
@example(messages=[{"role": "user", "content": "\u00e9\u4e2d\U0001f600"}])
def test_any_conversation_renders_or_is_refused_like_transformers(templates, family, messages):
    """Any roles in any order, any text: mie and transformers agree on the prompt, or both
    refuse the conversation with the same message."""
    ours, theirs = both_outcomes(*templates[family], messages)
    assert ours == theirs


def test_a_template_refusal_is_an_invalid_request_naming_messages(templates):
    """Mistral's raise_exception: ``apply`` raises InvalidRequestError (a ValueError, like
    every refused request) naming ``messages``, with the template's message -- which the
    server answers as a 400 on that field (test_serve), and ``LLM.chat`` raises."""
    chat, _ = templates["mistral"]
    with pytest.raises(InvalidRequestError) as refused:
        chat.apply(CONVERSATIONS[4])
    assert refused.value.field == "messages"
    assert "Conversation roles must alternate user/assistant" in str(refused.value)
    with pytest.raises(InvalidRequestError, match="Only user and assistant roles are supported"):
        chat.apply([{"role": "user", "content": "Hi"}, SYSTEM])
    nemo, _ = templates["mistral_nemo"]
    with pytest.raises(InvalidRequestError, match="After the optional system message"):
        nemo.apply(CONVERSATIONS[5])


@pytest.mark.parametrize("name", ["unk_token", "pad_token", "mask_token"])
def test_every_special_token_a_template_sees_is_checked(tmp_path, name):
    """The special tokens handed to the template must be strings or ``{"content": str}``
    like bos and eos: a number is a TokenizerError naming the file, not a token dropped."""
    shutil.copy(STORIES / "tokenizer.json", tmp_path)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, name: 5}))
    with pytest.raises(TokenizerError, match=f"tokenizer_config.json: {name} must be"):
        ChatTemplate(tmp_path, None)


@pytest.mark.parametrize(
    "value", [{"a": "<b> & 'c'"}, ["\u00e9", "\u4e2d", 1.5, None, True], "x\ny"]
)
def test_tojson_is_transformers_json_dumps(value):
    """Templates serialise tool calls with ``tojson`` (``indent=4`` in Llama 3.x's): as
    transformers overrides it, without Jinja's HTML escaping and with non-ASCII kept."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    for source in ("{{ v | tojson }}", "{{ v | tojson(indent=4) }}"):
        mine = template_environment().from_string(source).render(v=value)
        assert mine == _compile_jinja_template(source).render(v=value)


def test_loop_controls_and_generation_blocks_render_as_in_transformers():
    """``{% break %}`` (loop controls) and ``{% generation %}`` (SmolLM3-style templates)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = (
        "{% for m in messages %}{% if m == 'stop' %}{% break %}{% endif %}"
        "{% generation %}{% set inner = m %}[{{ m }}]{% endgeneration %}{% endfor %}{{ inner }}"
    )
    messages = ["a", "b", "stop", "c"]
    mine = template_environment().from_string(source).render(messages=messages)
    assert mine == _compile_jinja_template(source).render(messages=messages) == "[a][b]"


# -- generation_config.json's stop tokens -------------------------------------------------------


@dataclass(frozen=True)
class StopFamily:
    config_class: str
    vocab_size: int
    config_eos: int  # config.json's eos_token_id
    generation_config: dict  # the published generation_config.json


# The stopping fields of the published generation_config.json files (their sampling defaults
# -- do_sample, temperature, top_p, ... -- left out: the tests here decode greedily):
# meta-llama/Llama-3.2-1B-Instruct's lists three stop tokens (Llama 3.1 Instruct's is the same,
# quoted e.g. in pypi-data/pypi-mirror-300 packages/fastmindapi/.../DEVELOPMENT.md), while
# the base model's config.json names 128001 (<|end_of_text|>) alone; Qwen/Qwen2.5-0.5B-Instruct's
# lists two, its config.json 151645 (<|im_end|>).
STOP_FAMILIES = {
    "llama3_2": StopFamily(
        "LlamaConfig",
        128256,
        128001,
        {
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
        },
    ),
    "qwen2_5": StopFamily(
        "Qwen2Config",
        151936,
        151645,
        {
            "bos_token_id": 151643,
            "pad_token_id": 151643,
            "eos_token_id": [151645, 151643],
        },
    ),
}
LENGTH = 24  # tokens generated per request


def greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=LENGTH,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(STOP_FAMILIES))
def stop_checkpoint(request, tmp_path_factory):
    """A one-layer random model with the family's vocabulary, saved with its published
    generation_config.json; one token-id prompt per listed stop token, that stop token
    planted in the prompt's greedy continuation by swapping two rows of the output
    projection (a token that is greedy nowhere else trades places with it)."""
    family = STOP_FAMILIES[request.param]
    stops = family.generation_config["eos_token_id"]
    config = getattr(transformers, family.config_class)(
        vocab_size=family.vocab_size,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(len(request.param))
    hf = getattr(transformers, config.model_type.capitalize() + "ForCausalLM")(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1]))
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(0, family.vocab_size, (5 + i,), generator=generator).tolist()
        for i in range(len(stops))
    ]
    free = [greedy(hf, p) for p in prompts]
    used = {t for seq in prompts + free for t in seq}
    head = hf.lm_head.weight.data
    for i, stop in enumerate(stops):
        others = {t for j, seq in enumerate(free) if j != i for t in seq}
        step = next(
            k
            for k in range(3 + 2 * i, LENGTH)
            if free[i][k] not in free[i][:k] and free[i][k] not in others | set(stops)
        )
        token = free[i][step]
        assert stop not in used
        head[[stop, token]] = head[[token, stop]]
    hf.config.eos_token_id = family.config_eos
    directory = tmp_path_factory.mktemp(f"{request.param}-stops")
    hf.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(family.generation_config))
    return directory, prompts, stops


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_stop_token_of_generation_config_ends_a_request(stop_checkpoint, backend):
    """Each request ends on a different listed stop token (all but the first missing from
    config.json); mie's greedy tokens equal transformers' ``generate`` with the directory's
    own generation config."""
    directory, prompts, stops = stop_checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert hf.generation_config.eos_token_id == stops  # transformers reads the same file
    expected = [greedy(hf.eval(), p) for p in prompts]
    assert [e[-1] for e in expected] == stops  # the fixture planted each one

    engine = LLMEngine(directory, backend=backend, block_size=4, num_blocks=64)
    assert engine.model.config.eos_token_ids == tuple(stops)
    params = SamplingParams(temperature=0, max_tokens=LENGTH)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {i: out.outputs[0] for i, out in run_to_completion(engine).items()}
    assert [done[i].token_ids for i in ids] == expected
    assert all(done[i].finish_reason == "stop" for i in ids)


# -- vLLM's chat extensions: add_generation_prompt, continue_final_message, kwargs ---------------
def outcomes_with(chat: ChatTemplate, hf, messages, **options) -> tuple:
    """mie's and transformers' prompts for ``messages`` with the same options, or "refused"
    for each that refuses them (the messages differ: transformers raises ValueError)."""
    kwargs = options.pop("template_kwargs", {})
    while True:
        day = datetime.date.today()
        try:
            ours = chat.apply(messages, **options, template_kwargs=kwargs)
        except InvalidRequestError:
            ours = "refused"
        try:
            theirs = hf.apply_chat_template(messages, tokenize=False, **options, **kwargs)
        except (ValueError, jinja2.TemplateError):
            theirs = "refused"
        if datetime.date.today() == day:
            return ours, theirs


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=30, deadline=None)
@given(
    messages=st.lists(MESSAGE, min_size=1, max_size=4),
    mode=st.sampled_from(["continue", "no generation prompt", "thinking off"]),
)
@example(
    messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once "}],
    mode="continue",
)
def test_chat_extensions_render_like_transformers(templates, family, messages, mode):
    """A prefilled answer (continue_final_message, cut where transformers cuts it), no
    generation prompt, and a template variable (Qwen3's enable_thinking): the same prompt as
    transformers' apply_chat_template with the same options, or both refusing."""
    options = {
        "continue": {"add_generation_prompt": False, "continue_final_message": True},
        "no generation prompt": {"add_generation_prompt": False},
        "thinking off": {
            "add_generation_prompt": True,
            "template_kwargs": {"enable_thinking": False},
        },
    }[mode]
    ours, theirs = outcomes_with(*templates[family], messages, **options)
    assert ours == theirs


def test_a_prefilled_answer_is_continued_and_counted_over_http(templates):
    # The default template (stories260K): "Assistant: Once upon" is continued, and
    # /tokenize counts the same prompt the chat answer's usage does.
    openai = require_module("openai")
    httpx = require_module("httpx")
    from mie.serve import build_app, serve_in_thread

    messages = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon"},
    ]
    extension = {"add_generation_prompt": False, "continue_final_message": True}
    engine = LLMEngine(STORIES, num_blocks=64)
    prompt = ChatTemplate(STORIES, engine.tokenizer).apply(messages, **extension)
    assert prompt == "User: Tell me a story.\nAssistant: Once upon"
    expected = LLMEngine(STORIES, num_blocks=64)
    expected.add_request(prompt, SamplingParams(temperature=0, max_tokens=8), "r")
    want = run_to_completion(expected)["r"].outputs[0].text
    with serve_in_thread(build_app(engine, STORIES)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-")
        got = client.chat.completions.create(
            model="stories260K",
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body=extension,
        )
        assert got.choices[0].message.content == want
        body = {"model": "stories260K", "messages": messages, **extension}
        counted = httpx.post(url + "/tokenize", json=body).json()["count"]
        assert counted == got.usage.prompt_tokens
        # vLLM's chat echo: the answer starts with the message it continues, whole and
        # streamed (after the role, a delta with that text).
        echoed = {**extension, "echo": True}
        request = {"model": "stories260K", "messages": messages, "max_tokens": 8}
        whole = client.chat.completions.create(**request, temperature=0, extra_body=echoed)
        assert whole.choices[0].message.content == "Once upon" + want
        chunks = client.chat.completions.create(
            **request, temperature=0, extra_body=echoed, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Once upon" + want
        user_last = client.chat.completions.create(
            model="stories260K",
            messages=messages[:1],
            max_tokens=4,
            temperature=0,
            extra_body={"echo": True},
        )
        assert not user_last.choices[0].message.content.startswith("Tell me")
        for bad, param in [
            ({"continue_final_message": True}, "continue_final_message"),  # with the prompt
            ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
            ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ]:
            response = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "stories260K", "messages": messages, **bad},
            )
            assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_tokenize_counts_a_chat_with_tools_and_add_special_tokens_as_the_chat_is_computed(
    tmp_path,
):
    # Qwen2.5's template shows the tools to the model: /tokenize renders them too, so its
    # count is the chat's usage.prompt_tokens and the tokens of transformers' prompt text;
    # and add_special_tokens (vLLM's) changes both routes alike. (The copy's tokenizer.json
    # is stories260K's, which has no <|im_start|> token: the text is encoded with it.)
    httpx = require_module("httpx")
    from mie.serve import build_app, serve_in_thread

    directory = tmp_path / "qwen"
    shutil.copytree(STORIES, directory)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    config.update(CHATML)
    config["chat_template"] = (DATA / "qwen2_5.jinja").read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    ids = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    tool = {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
    }
    messages = [{"role": "user", "content": "Hi"}]
    engine = LLMEngine(directory, num_blocks=64)
    with serve_in_thread(build_app(engine, directory)) as url:
        for special in (None, True, False):
            extra = {} if special is None else {"add_special_tokens": special}
            body = {"messages": messages, "tools": [tool], **extra}
            counted = httpx.post(url + "/tokenize", json=body).json()["count"]
            chat = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "qwen", "max_tokens": 1, "tool_choice": "none", **body},
            ).json()
            prompt = hf.apply_chat_template(
                messages, tools=[tool], add_generation_prompt=True, tokenize=False
            )
            expected = ids.encode(prompt, add_special_tokens=bool(special))
            assert counted == chat["usage"]["prompt_tokens"] == len(expected)
        plain = httpx.post(url + "/tokenize", json={"messages": messages}).json()["count"]
        assert plain < counted, "the tools were rendered"
        for special in (True, False):
            body = {"prompt": "Once upon a time", "add_special_tokens": special}
            counted = httpx.post(url + "/tokenize", json=body).json()["count"]
            done = httpx.post(
                url + "/v1/completions", json={"model": "qwen", "max_tokens": 1, **body}
            )
            expected = hf.encode("Once upon a time", add_special_tokens=special)
            assert counted == done.json()["usage"]["prompt_tokens"] == len(expected)


def test_documents_reach_the_template_as_in_transformers(tmp_path):
    # A retrieval template (in the style of Command R's: the documents before the chat):
    # the same prompt as transformers' apply_chat_template(documents=...), over HTTP too.
    httpx = require_module("httpx")
    from mie.serve import build_app, serve_in_thread

    template = (
        "{% if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
        "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    directory = tmp_path / "rag"
    shutil.copytree(STORIES, directory)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    documents = [
        {"title": "Park", "text": "Lily went to the park."},
        {"title": "Ball", "text": "It was red."},
    ]
    messages = [{"role": "user", "content": "Where did Lily go?"}]
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    expected = hf.apply_chat_template(
        messages, documents=documents, add_generation_prompt=True, tokenize=False
    )
    chat = ChatTemplate(directory, MieTokenizer(directory))
    assert chat.apply(messages, documents=documents) == expected
    assert "[Park] Lily went to the park." in expected
    with serve_in_thread(build_app(LLMEngine(directory, num_blocks=64), directory)) as url:
        body = {"messages": messages, "documents": documents}
        counted = httpx.post(url + "/tokenize", json=body).json()["count"]
        assert counted == len(hf.encode(expected, add_special_tokens=False))
        bad = httpx.post(url + "/tokenize", json={**body, "documents": [{"title": 1}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
