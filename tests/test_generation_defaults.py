"""A checkpoint's recommended sampling (``generation_config.json``), used as vLLM uses it.

stories260K with a generation config recommending ``top_k`` 1 (so sampling is greedy and
comparable token for token), ``repetition_penalty`` 1.3 and ``max_new_tokens`` 40: offline,
``LLM.generate`` without parameters must give transformers' ``generate(do_sample=False,
repetition_penalty=1.3, max_new_tokens=40)``; over HTTP a request that leaves the fields out
gets them, one that gives them keeps its own, and ``max_new_tokens`` caps ``max_tokens``.
"""

import json
import shutil
from pathlib import Path

import pytest
from conftest import require_module

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine
from mie.model.config import ConfigError

httpx = require_module("httpx")
torch = require_module("torch")
transformers = require_module("transformers")
serve = require_module("mie.serve")
torch.set_num_threads(1)

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
ADVICE = {
    "temperature": 0.5,
    "top_k": 1,
    "top_p": 0.9,
    "repetition_penalty": 1.3,
    "max_new_tokens": 40,
    "do_sample": True,  # not a sampling default: vLLM does not read it
}
PROMPTS = ["Once upon a time", "The little dog"]


def checkpoint(directory: Path, generation_config: dict) -> Path:
    for f in STORIES.iterdir():
        if f.is_file():
            shutil.copy(f, directory / f.name)
    config = {"bos_token_id": 1, "eos_token_id": [1, 2], **generation_config}
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def advised(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("advised"), ADVICE)


def transformers_greedy(directory: Path, prompt: str, max_new_tokens: int) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            repetition_penalty=1.3,
            max_new_tokens=max_new_tokens,
        )
    return out[0, ids.shape[1] :].tolist()


def test_generate_without_parameters_samples_as_the_checkpoint_advises(advised):
    llm = LLM(advised, num_blocks=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.5, 1, 0.9)
    assert (defaults.repetition_penalty, defaults.max_tokens) == (1.3, 40)
    outputs = llm.generate(PROMPTS, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == transformers_greedy(advised, prompt, 40)
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat.outputs[0].token_ids) == 40 or chat.outputs[0].finish_reason == "stop"
    # vLLM's neutral defaults with generation_config="vllm"
    plain = LLM(advised, num_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_only_values_that_differ_from_transformers_defaults_count(tmp_path):
    directory = checkpoint(tmp_path, {"top_k": 50, "temperature": 1.0, "min_p": 0.05})
    assert LLMEngine(directory, num_blocks=16).sampling_defaults == {"min_p": 0.05}


def test_a_value_sampling_refuses_is_a_config_error_naming_the_file(tmp_path):
    directory = checkpoint(tmp_path, {"temperature": -1})
    with pytest.raises(ConfigError, match="generation_config.json: .*temperature"):
        LLMEngine(directory, num_blocks=16)
    with pytest.raises(ValueError, match="generation_config must be one of"):
        LLM(directory, generation_config="model")


def test_the_server_fills_what_a_request_leaves_out_and_caps_max_tokens(advised):
    engine = LLMEngine(advised, backend="python", num_blocks=256)
    expected = transformers_greedy(advised, PROMPTS[0], 40)
    with serve.serve_in_thread(serve.build_app(engine, advised)) as url:

        def completion(**fields) -> list[int]:
            body = {"model": advised.name, "prompt": PROMPTS[0], **fields}
            body.update(logprobs=0, return_tokens_as_token_ids=True)
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            tokens = answer.json()["choices"][0]["logprobs"]["tokens"]
            return [int(t.removeprefix("token_id:")) for t in tokens]

        # completions' own default max_tokens, 16, under the cap; the advised sampling
        assert completion() == expected[:16]
        assert completion(max_tokens=100) == expected  # capped at max_new_tokens, 40
        # fields the request gives are its own: no repetition penalty, plain greedy
        own = completion(max_tokens=40, repetition_penalty=1.0, temperature=0, top_k=-1)
        plain = LLM(advised, backend="python", num_blocks=64, generation_config="vllm")
        greedy = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))[0]
        assert own == greedy.outputs[0].token_ids != expected
