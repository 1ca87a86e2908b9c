"""Log-probabilities against transformers: ``log_softmax`` of its logits, within 1e-4.

For generated tokens (``logprobs``) and prompt tokens (``prompt_logprobs``), on tiny random
Llama / Qwen2 models and stories260K, both backends: the token's own log-probability, its
rank, and the top-k alternatives. Prompts are computed in chunks, preempted, recomputed,
rolled back and offered a cached prefix; the prompt's log-probabilities still come out once
per position, each from the raw logits.
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import require_module, run_to_completion
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams, StepError
from mie.engine.llm_engine import LLMEngine
from mie.engine.logprobs import log_softmax, position_logprobs

torch = require_module("torch")
transformers = require_module("transformers")
from test_model_hf import SPECS, build_hf_model  # noqa: E402  (after the skip above)

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
TOLERANCE = 1e-4


def hf_logprobs(hf, token_ids: list[int]) -> np.ndarray:
    """transformers' log_softmax at every position of ``token_ids`` (row p predicts p + 1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0].to(torch.float64)
    return torch.log_softmax(logits, dim=-1).numpy()


def check_position(ours: dict, token: int, k: int, expected: np.ndarray) -> None:
    """One position's dict against transformers' row: the token's value and rank, and the
    top-k alternatives (any order among values within the tolerance)."""
    assert next(iter(ours)) == token, "the token at the position comes first"
    for t, entry in ours.items():
        assert abs(entry.logprob - expected[t]) < TOLERANCE, (t, entry, expected[t])
        # rank: 1 + tokens strictly more likely, allowing for near-ties within the tolerance
        low = 1 + np.count_nonzero(expected > expected[t] + TOLERANCE)
        high = 1 + np.count_nonzero(expected > expected[t] - TOLERANCE)
        assert low <= entry.rank <= high, (t, entry.rank, low, high)
    alternatives = [t for t in ours if t != token or len(ours) == k]
    assert len(ours) in (k, k + 1) and len(set(ours)) == len(ours)
    kth = np.sort(expected)[-k] if k else np.inf
    assert all(expected[t] >= kth - TOLERANCE for t in alternatives[:k])


def check_request(out, hf, k_gen: int | None, k_prompt: int | None) -> None:
    prompt = out.prompt_token_ids
    for completion in out.outputs if k_gen is not None else ():
        tokens = prompt + completion.token_ids
        expected = hf_logprobs(hf, tokens[:-1])
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (token, ours) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            check_position(ours, token, k_gen, expected[len(prompt) - 1 + i])
        total = sum(expected[len(prompt) - 1 + i, t] for i, t in enumerate(completion.token_ids))
        assert abs(completion.cumulative_logprob - total) < TOLERANCE * len(tokens)
    if k_prompt is None:
        assert out.prompt_logprobs is None
        return
    expected = hf_logprobs(hf, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        check_position(out.prompt_logprobs[p], prompt[p], k_prompt, expected[p - 1])


# -- the computation alone ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    # exact ties, and distinct values far enough apart that rounding cannot tie them
    row=st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0]) | st.integers(-500, 500).map(
                 lambda x: x / 100), min_size=1, max_size=30),
    data=st.data(),
)  # fmt: skip
def test_position_logprobs_is_the_sorted_distribution(row, data):
    logits = np.array(row, dtype=np.float32)
    token = data.draw(st.integers(0, len(row) - 1))
    k = data.draw(st.integers(0, 25))
    expected = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    ours = position_logprobs(log_softmax(logits), token, k)
    # The top-k by the documented order (value, then lower id), after the token itself.
    ranking = sorted(range(len(row)), key=lambda t: (-expected[t], t))[: min(k, len(row))]
    assert list(ours) == [token] + [t for t in ranking if t != token]
    for t, entry in ours.items():
        np.testing.assert_allclose(entry.logprob, expected[t], atol=1e-12)
        assert entry.rank == 1 + sum(expected[u] > expected[t] for u in range(len(row)))


# -- tiny random models -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama-gqa2-hd16-tied-fp32", "qwen2-gqa1-hd16-untied-fp32"])
def tiny(request, tmp_path_factory):
    spec = SPECS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    build_hf_model(spec, seed=7).save_pretrained(directory)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, hf


def test_tiny_models_chunked_prefix_cached_and_preempted(tiny, backend):
    """Prompts in chunks of 7 tokens (blocks of 4), a second copy of a prompt the prefix
    cache could lend, and a pool so small that requests are preempted and recomputed."""
    directory, hf = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 320, n).tolist() for n in (23, 9, 30)]
    prompts.append(prompts[0])  # the same prompt again: its prefix is cached by then
    engine = LLMEngine(directory, backend=backend, block_size=4, num_blocks=18,
                       max_num_batched_tokens=7, max_num_seqs=4)  # fmt: skip
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, logprobs=5, prompt_logprobs=5),
        SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=0),
        SamplingParams(temperature=0.7, seed=2, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, logprobs=20, prompt_logprobs=20),
    ]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = run_to_completion(engine)
    assert engine.stats.preemptions > 0, "the pool was meant to force preemption"
    for request_id, sp in zip(ids, params, strict=True):
        check_request(done[request_id], hf, sp.logprobs, sp.prompt_logprobs)


def test_logprobs_are_raw_whatever_the_sampling_knobs(tiny):
    """Penalties, bias, temperature and filters change the token picked, not the
    log-probabilities reported: they are the model's."""
    directory, hf = tiny
    engine = LLMEngine(directory, block_size=4, num_blocks=40)
    params = SamplingParams(temperature=0.5, top_k=5, min_p=0.1, seed=4, max_tokens=10,
                            repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5,
                            logit_bias={7: 3.0}, min_tokens=3, logprobs=4)  # fmt: skip
    engine.add_request(list(range(40, 60)), params)
    (out,) = run_to_completion(engine).values()
    check_request(out, hf, 4, None)


# -- stories260K ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_hf():
    return transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()


def test_stories260k_generated_and_prompt_logprobs(stories_hf, backend):
    llm = LLM(STORIES, backend=backend, num_blocks=64, max_num_batched_tokens=32)
    prompt = "One day, Tom and his mom went to the park. They saw a big dog and a little bird."
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, logprobs=5, prompt_logprobs=5)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    check_request(out, stories_hf, 5, 5)
    tokenizer = llm.engine.tokenizer
    for position in out.outputs[0].logprobs:
        for t, entry in position.items():
            assert entry.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
    # Asked again, the whole prompt could be borrowed from the prefix cache: it is
    # recomputed instead, and gives the same log-probabilities.
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.prompt_logprobs == out.prompt_logprobs
    plain = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].logprobs is None
    assert plain.outputs[0].cumulative_logprob is None


def test_a_rolled_back_step_records_nothing_twice(stories_hf):
    """Forward passes that fail mid-prompt and mid-generation: every prompt position and
    every generated token is recorded once, with transformers' values."""
    engine = LLMEngine(STORIES, num_blocks=64, max_num_batched_tokens=8, max_num_seqs=4)
    model, calls = engine.model, [0]

    class Flaky:  # the model, its forward failing on calls 2, 5 and 9
        def __getattr__(self, name):
            return getattr(model, name)

        def forward(self, *args):
            calls[0] += 1
            if calls[0] in (2, 5, 9):
                raise RuntimeError("injected")
            return model.forward(*args)

    engine.model = Flaky()
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=6, logprobs=2, prompt_logprobs=2)
    engine.add_request("Once upon a time, there was a little girl named Lily who", params)
    failures, done = 0, {}
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        except StepError:
            failures += 1
    assert failures == 3
    (out,) = done.values()
    check_request(out, stories_hf, 2, 2)


def test_a_prompt_preempted_halfway_is_recorded_once(stories_hf, backend):
    """A long prompt computed in chunks runs out of blocks halfway (a long generation holds
    most of the pool) and is preempted; when readmitted it computes everything again, and the
    positions recorded before the preemption are not recorded twice."""
    engine = LLMEngine(STORIES, backend=backend, num_blocks=8, max_num_batched_tokens=16,
                       max_num_seqs=4)  # fmt: skip
    engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=100,
                                                          ignore_eos=True))  # fmt: skip
    for _ in range(85):  # 89 tokens: 6 of the 8 blocks
        engine.step()
    prompt = engine.tokenizer.encode("Lily and Ben went to the park with their mom. " * 4)[:60]
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=3)
    request_id = engine.add_request(prompt, params)
    partial = []
    while engine.has_unfinished_requests():
        preempted = engine.stats.preemptions
        outputs = {o.request_id: o for o in engine.step()}
        request = engine._requests.get(request_id)
        if engine.stats.preemptions > preempted and request is not None:
            partial.append(len(request.prompt_logprobs))
        if request_id in outputs and outputs[request_id].finished:
            out = outputs[request_id]
    assert partial and 1 < partial[0] < len(prompt), "meant to preempt it inside its prompt"
    assert out.outputs[0].logprobs is None
    check_request(out, stories_hf, None, 3)
