"""The engine end to end on the real stories260K model, against Hugging Face transformers."""

from pathlib import Path

import numpy as np
import pytest
from conftest import require_module, run_to_completion

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import InvalidRequestError
from mie.scheduler import RequestTooLongError

torch = require_module("torch")
transformers = require_module("transformers")
AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily wanted to",
    "One day, Tom and his mom went to the park. They saw",
    "The sun was",
    "Ben had a red ball",
]


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(STORIES, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(STORIES)


def hf_greedy(hf, prompt: str, max_new_tokens: int) -> list[int]:
    model, tokenizer = hf
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, input_ids.shape[1] :].tolist()


def engine(backend, **kwargs) -> LLMEngine:
    return LLMEngine(STORIES, backend=backend, **kwargs)


def test_greedy_batch_with_preemption_equals_transformers(backend, hf):
    # 6 prompts x up to 200 tokens in a pool of 24 blocks of 16: they cannot all run at once.
    eng = engine(backend, num_blocks=24, prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=200)
    ids = [eng.add_request(p, params) for p in PROMPTS]
    done = run_to_completion(eng)
    assert eng.stats.preemptions > 0, "the pool was meant to force preemption"
    for prompt, request_id in zip(PROMPTS, ids, strict=True):
        ours = done[request_id].outputs[0]
        assert ours.token_ids == hf_greedy(hf, prompt, 200), prompt
        assert ours.finish_reason in ("stop", "length")
    assert eng.pool.num_free + eng.scheduler.prefix_cache.num_cached == eng.pool.num_blocks
    eng.scheduler.clear_prefix_cache()
    assert eng.pool.num_free == eng.pool.num_blocks


def test_stop_at_eos_and_text_matches_transformers_decode(hf):
    llm = LLM(STORIES, seed=0)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=400))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] in (1, 2)
    assert completion.token_ids == hf_greedy(hf, "Once upon a time", 400)
    full = hf[1].decode(out.prompt_token_ids + completion.token_ids, skip_special_tokens=True)
    assert out.prompt + completion.text == full
    assert "Lily" in completion.text  # a real story, not noise
    assert out.metrics.time_to_first_token > 0 and out.metrics.latency >= (
        out.metrics.time_to_first_token
    )


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 4}])
def test_a_stop_token_ends_the_text_unshown(hf, speculative):
    # " was" is an ordinary token with text: as a stop token it is kept in token_ids (it was
    # generated) but its text is not shown, as for EOS (vLLM's detokenizer likewise).
    model, tokenizer = hf
    stop = tokenizer.convert_tokens_to_ids("▁was")
    greedy = hf_greedy(hf, "Once upon a time", 10)
    assert stop in greedy[1:]  # greedy reaches it after a token or more
    llm = LLM(STORIES, speculative_config=speculative)
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop])
    completion = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == greedy[: greedy.index(stop) + 1]
    assert completion.finish_reason == "stop"
    assert completion.text == tokenizer.decode(completion.token_ids[:-1])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_the_text_as_transformers_decodes_them(hf, skip):
    # With ignore_eos greedy runs past the story's end into "<s>" (token 1) and a new story:
    # that token adds no text by default and "<s>" with skip_special_tokens=False (vLLM's
    # field), as transformers' decode has it; its log-probability's text says the same.
    model, tokenizer = hf
    params = SamplingParams(
        temperature=0, max_tokens=400, ignore_eos=True, skip_special_tokens=skip, logprobs=0
    )
    out = LLM(STORIES).generate("Once upon a time", params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert 1 in completion.token_ids
    ids = out.prompt_token_ids
    before = tokenizer.decode(ids, skip_special_tokens=skip)
    full = tokenizer.decode(ids + completion.token_ids, skip_special_tokens=skip)
    assert completion.text == full[len(before) :]
    assert ("<s>" in completion.text) == (not skip)
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    pieces = [candidates[token].decoded_token for token, candidates in pairs]
    assert "".join(pieces) == completion.text


def test_truncate_prompt_tokens_keeps_the_prompts_tail_as_transformers_reads_it(hf):
    # A prompt longer than the context (512): refused whole; with truncate_prompt_tokens its
    # last k tokens (vLLM's left truncation, BOS dropped with the rest) are the prompt, and
    # greedy continues them as transformers does.
    model, tokenizer = hf
    text = "Once upon a time, there was a little girl named Lily. " * 60
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 512
    llm = LLM(STORIES)
    with pytest.raises(InvalidRequestError, match="context length"):
        llm.generate(text, SamplingParams(max_tokens=8), use_tqdm=False)
    for k, prompt in [(40, text), (500, text), (7, {"prompt_token_ids": ids})]:
        params = SamplingParams(temperature=0, max_tokens=12, truncate_prompt_tokens=k)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids[-k:]
        with torch.inference_mode():
            expected = model.generate(torch.tensor([ids[-k:]]), do_sample=False, max_new_tokens=12)[
                0, k:
            ].tolist()
        assert out.outputs[0].token_ids == expected
    # -1: the context's length, 512 tokens: the context's end leaves one token (as vLLM).
    whole = SamplingParams(temperature=0, max_tokens=12, truncate_prompt_tokens=-1)
    (out,) = llm.generate(text, whole, use_tqdm=False)
    assert out.prompt_token_ids == ids[-512:] and out.outputs[0].finish_reason == "length"
    with torch.inference_mode():
        expected = model(torch.tensor([ids[-512:]])).logits[0, -1].argmax().item()
    assert out.outputs[0].token_ids == [expected]
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(text, SamplingParams(truncate_prompt_tokens=513), use_tqdm=False)
    assert info.value.field == "truncate_prompt_tokens"
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(truncate_prompt_tokens=bad)
        assert info.value.field == "truncate_prompt_tokens"


def test_length_finish_and_ignore_eos():
    llm = LLM(STORIES)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    out = llm.generate("Once upon a time", params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 400
    assert 1 in out.token_ids[:-1]  # greedy ends the story at token 342: went past it


def test_generate_keeps_input_order_and_accepts_every_prompt_form():
    llm = LLM(STORIES)
    tok = llm.engine.tokenizer
    prompts = [
        "The cat",
        tok.encode("The cat"),
        {"prompt_token_ids": tok.encode("The cat")},
        {"prompt": "The cat"},
        "A long time ago, in a small town, there lived",
    ]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (5, 9, 13, 17, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 9, 13, 17, 3]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids[:5]
    assert outs[1].prompt is None and outs[3].prompt == "The cat"
    assert len({o.request_id for o in outs}) == 5


def test_seeded_sampling_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=1234)
    alone = LLM(STORIES).generate("The little dog", params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n) for n in (7, 30, 55)]
    crowd = LLM(STORIES, max_num_seqs=4, num_blocks=12).generate(
        ["Lily", "The little dog", "Tom had", "The sun"], [others[0], params, *others[1:]]
    )
    assert crowd[1].outputs[0].token_ids == alone
    again = LLM(STORIES).generate("The little dog", params)[0].outputs[0].token_ids
    assert again == alone


def test_unseeded_sampling_is_reproducible_for_an_engine_seed():
    params = SamplingParams(temperature=1.0, max_tokens=30)
    a = [o.outputs[0].token_ids for o in LLM(STORIES, seed=5).generate(PROMPTS, params)]
    b = [o.outputs[0].token_ids for o in LLM(STORIES, seed=5).generate(PROMPTS, params)]
    c = [o.outputs[0].token_ids for o in LLM(STORIES, seed=6).generate(PROMPTS, params)]
    assert a == b and a != c


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([5, 512], None, "outside the vocabulary"),
        ([5, -1], None, "outside the vocabulary"),
        ([], None, "empty"),
        ("Once", SamplingParams(max_tokens=600, min_tokens=600), r"min_tokens \(600\) exceeds"),
        (3.5, None, "prompt is a string"),
        ({"text": "x"}, None, "prompt_token_ids"),
    ],
)
def test_bad_requests_raise_and_leave_the_engine_untouched(prompt, params, match):
    eng = engine(None, num_blocks=64)
    good = eng.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    free = eng.pool.num_free
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request(prompt, params)
    assert eng.pool.num_free == free and eng.num_unfinished_requests == 1
    assert [o.request_id for o in run_to_completion(eng).values()] == [good]


def test_a_request_past_the_context_ends_at_its_end_as_vllm_does_offline():
    """prompt + max_tokens beyond the context (or max_tokens None) is vLLM's "as many as fit":
    the request ends at the context's end with finish reason "length" -- the same tokens as
    asking for exactly that many; a prompt that fills the context gets its one next token."""
    llm = LLM(STORIES, num_blocks=64)
    greedy = {"temperature": 0, "ignore_eos": True}
    exact = llm.generate("Once upon a time", SamplingParams(max_tokens=507, **greedy))[0]
    assert len(exact.prompt_token_ids) == 5
    for max_tokens in (508, 600, 10**9, None):
        params = SamplingParams(max_tokens=max_tokens, **greedy)
        (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
        assert out.outputs[0].token_ids == exact.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "length"
    (full,) = llm.generate([5] * 512, SamplingParams(max_tokens=4, temperature=0))
    assert len(full.outputs[0].token_ids) == 1 and full.outputs[0].finish_reason == "length"
    assert llm.engine.pool.num_free + llm.engine.scheduler.prefix_cache.num_evictable == 64


def test_request_too_big_for_the_pool_is_rejected_at_submission():
    eng = engine(None, num_blocks=4)  # 64 tokens in all
    with pytest.raises(RequestTooLongError, match="whole pool has 4"):
        eng.add_request("Once upon a time", SamplingParams(max_tokens=100))
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("given", [{"temperature": 0}, "temperature=0", 0.5])
def test_sampling_params_that_are_not_params_or_a_list_of_them_are_named(given):
    llm = LLM(STORIES, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="SamplingParams or a list of them") as info:
        llm.generate(["Once upon a time"], given)
    assert info.value.field == "sampling_params" and not llm.engine.has_unfinished_requests()


def test_one_bad_prompt_in_generate_runs_nothing():
    llm = LLM(STORIES, num_blocks=64)
    with pytest.raises(InvalidRequestError):
        llm.generate(["Once upon a time", [1, 9999]], SamplingParams(max_tokens=5))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.pool.num_free == 64


def test_abort_frees_blocks_at_once_and_spares_the_others():
    eng = engine(None, num_blocks=64, prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    keep = eng.add_request("The little dog", params)
    drop = eng.add_request("Once upon a time there was a girl", params)
    for _ in range(5):
        eng.step()
    held = eng.pool.num_blocks - eng.pool.num_free
    assert eng.abort_request(drop) and not eng.abort_request(drop)
    assert eng.pool.num_blocks - eng.pool.num_free < held
    (out,) = run_to_completion(eng).values()
    assert out.request_id == keep and len(out.outputs[0].token_ids) == 50
    assert eng.pool.num_free == 64


def test_abort_takes_a_list_of_ids_as_vllm_does_and_refuses_ids_that_are_not_str():
    eng = engine(None, num_blocks=64, prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [eng.add_request(prompt, params) for prompt in ("The little dog", "Once", "Lily")]
    eng.step()
    with pytest.raises(TypeError, match="request ids are str"):
        eng.abort_request([ids[0], 7])
    with pytest.raises(TypeError, match="request ids are str"):
        eng.abort_request(7)
    assert eng.num_unfinished_requests == 3, "a refused call aborted something"
    assert eng.abort_request(ids[:2]) and not eng.abort_request(ids[:2])
    assert eng.abort_request(i for i in ids) and eng.num_unfinished_requests == 0
    assert eng.pool.num_free == 64


def test_pool_sized_from_memory_budget():
    eng = engine(None, kv_cache_memory=1 << 20)  # 1 MiB; a block is 5*2*16*4*8*4 = 20480 B
    assert eng.pool.num_blocks == (1 << 20) // 20480
    with pytest.raises(ValueError, match="less than one block"):
        engine(None, kv_cache_memory=100)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLMEngine(tmp_path / "nope")


def test_step_trace_is_recorded():
    eng = engine(None, num_blocks=64)
    eng.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=3))
    eng.step()
    trace = eng.last_trace
    assert trace.num_running == 1 and trace.num_prefill_tokens == 5
    assert 0 < trace.utilization <= 1
    assert np.isclose(trace.utilization, trace.reserved_tokens / trace.capacity_tokens)
