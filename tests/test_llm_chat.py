"""``LLM.chat`` (vLLM's offline chat) against transformers' ``apply_chat_template`` and
``generate``.

The checkpoint is stories260K with a chat template in its tokenizer config whose special
tokens are stories260K's own (``<s>``, ``</s>``: a ChatML template's would be text to this
vocabulary, and new ids to transformers' tokenizer): Mistral-Nemo's published template (with
system messages and tools; test_chat_templates' family), and a Llama-2-style one.
transformers renders the same conversations (``apply_chat_template``, with each option),
encodes them without special tokens (the template writes its own) and generates greedily:
``LLM.chat``'s prompt text, prompt tokens and output tokens must be those.
"""

import json
import shutil
from pathlib import Path

import pytest
from conftest import require_module
from test_chat_templates import CONVERSATIONS, DATA, FAMILIES

from mie import LLM, SamplingParams
from mie.engine.sampling import InvalidRequestError

torch = require_module("torch")
transformers = require_module("transformers")
torch.set_num_threads(1)

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
GREEDY = SamplingParams(temperature=0, max_tokens=12)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '<<SYS>> ' + m['content'] + ' <</SYS>> ' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def checkpoint(directory: Path, family: str) -> Path:
    """stories260K, its tokenizer config carrying ``family``'s template and special tokens."""
    for f in STORIES.iterdir():
        if f.is_file():
            shutil.copy(f, directory / f.name)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    if family == "llama2":
        config["chat_template"] = LLAMA2
    else:
        config.update(FAMILIES[family].special_tokens)
        config["chat_template"] = (DATA / FAMILIES[family].template).read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=["mistral_nemo", "llama2"])
def chat_model(request, tmp_path_factory):
    directory = checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return LLM(directory, num_blocks=256), hf_tokenizer, hf_model.eval()


def transformers_chat(hf_tokenizer, hf_model, messages, max_tokens=12, **options):
    """transformers' prompt text, its tokens (no special tokens added) and greedy tokens."""
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **options)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,  # stories260K rarely ends within 12 tokens; mie stops at EOS too
        )
    return text, ids, out[0, len(ids) :].tolist()


def assert_same(output, expected) -> None:
    text, ids, generated = expected
    assert output.prompt == text
    assert output.prompt_token_ids == ids
    tokens = output.outputs[0].token_ids
    assert tokens == generated[: len(tokens)]
    assert tokens == generated or output.outputs[0].finish_reason == "stop"  # at an EOS


def test_a_batch_of_conversations_is_rendered_encoded_and_generated_as_transformers_does(
    chat_model,
):
    llm, hf_tokenizer, hf_model = chat_model
    conversations = [CONVERSATIONS[0], CONVERSATIONS[2], CONVERSATIONS[3]]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert len(outputs) == 3
    for conversation, output in zip(conversations, outputs, strict=True):
        expected = transformers_chat(
            hf_tokenizer, hf_model, conversation, add_generation_prompt=True
        )
        assert_same(output, expected)
    # One conversation alone, as a plain list of messages, gives the same output.
    (alone,) = llm.chat(CONVERSATIONS[2], GREEDY, use_tqdm=False)
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_the_template_options_are_transformers_own(chat_model):
    llm, hf_tokenizer, hf_model = chat_model
    prefilled = [*CONVERSATIONS[0], {"role": "assistant", "content": "Max went to the"}]
    cases = [
        ({"add_generation_prompt": False}, CONVERSATIONS[2], {"add_generation_prompt": False}),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            prefilled,
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        ({"tools": TOOLS}, CONVERSATIONS[0], {"add_generation_prompt": True, "tools": TOOLS}),
    ]
    prompts = []
    for ours, messages, theirs in cases:
        (output,) = llm.chat(messages, GREEDY, use_tqdm=False, **ours)
        assert_same(output, transformers_chat(hf_tokenizer, hf_model, messages, **theirs))
        prompts.append(output.prompt)
    assert prompts[1].endswith("Max went to the")
    if "AVAILABLE_TOOLS" in llm.engine.tokenizer.config["chat_template"]:  # Mistral-Nemo's
        assert "get_weather" in prompts[2]


def test_a_template_of_ones_own_replaces_the_checkpoints(chat_model):
    llm, hf_tokenizer, hf_model = chat_model
    mine = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    (output,) = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False, chat_template=mine)
    expected = transformers_chat(hf_tokenizer, hf_model, CONVERSATIONS[1], chat_template=mine)
    assert_same(output, expected)
    assert output.prompt.startswith("<system>")


def test_sampling_params_per_conversation_and_seeds_as_generate(chat_model):
    llm, _, _ = chat_model
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=8), GREEDY]
    outputs = llm.chat([CONVERSATIONS[0], CONVERSATIONS[1]], params, use_tqdm=False)
    again = llm.generate(
        [{"prompt_token_ids": o.prompt_token_ids} for o in outputs], params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == [a.outputs[0].token_ids for a in again]
    assert len(outputs[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("messages", "options", "field"),
    [
        ([CONVERSATIONS[0], [{"role": "bot", "content": "x"}]], {}, "messages[0].role"),
        ([CONVERSATIONS[0], [{"role": "user", "content": 3}]], {}, "messages[0].content"),
        ([CONVERSATIONS[0], []], {}, "messages"),
        (CONVERSATIONS[0], {"continue_final_message": True}, "continue_final_message"),
        (CONVERSATIONS[0], {"chat_template": "{% for %}"}, "chat_template"),
        (CONVERSATIONS[0], {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
def test_a_refused_conversation_raises_naming_its_field_and_nothing_runs(
    chat_model, messages, options, field
):
    llm, _, _ = chat_model
    with pytest.raises(InvalidRequestError) as refused:
        llm.chat(messages, GREEDY, use_tqdm=False, **options)
    assert refused.value.field == field
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    cached = engine.scheduler.prefix_cache.num_evictable if engine.scheduler.prefix_cache else 0
    assert engine.pool.num_free + cached == engine.pool.num_blocks


def test_a_template_that_refuses_the_conversation_raises_before_anything_runs(tmp_path):
    llm = LLM(checkpoint(tmp_path, "mistral"), num_blocks=64)
    with pytest.raises(InvalidRequestError, match="roles must alternate") as refused:
        llm.chat([CONVERSATIONS[0], CONVERSATIONS[4]], GREEDY, use_tqdm=False)
    assert refused.value.field == "messages" and not llm.engine.has_unfinished_requests()


def test_a_checkpoint_without_a_template_gets_the_servers_plain_default():
    llm = LLM(STORIES, num_blocks=64)
    (output,) = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)
    assert (
        output.prompt
        == "System: You are a terse assistant. \nUser:   Where did Max go?\n\nAssistant:"
    )
    # encoded like a completion prompt, with the tokenizer's BOS
    (plain,) = llm.generate(output.prompt, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == plain.prompt_token_ids and output.prompt_token_ids[0] == 1
