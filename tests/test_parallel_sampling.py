"""Parallel sampling (``n``, ``best_of``): one prompt computed once, its blocks shared.

The first sample computes the prompt; the others are submitted when it has, and borrow its
full blocks (from the prefix cache, or without it from the running sequence, the partly
filled last block then split by copy-on-write). Checked: the pool holds the shared blocks
once (counted from the block tables, not from the code under test), the trace's saved
fraction says so, every sample's randomness is its own and reproducible alone or in any
batch, under preemption too, ``best_of`` keeps the samples transformers scores highest, and
an abort frees everything. Both backends, with and without the prefix cache.
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import require_module

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine

torch = require_module("torch")
transformers = require_module("transformers")

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
PROMPT = (  # 54 tokens: three full blocks of 16 and six in a fourth
    "One day, Tom and his mom went to the park. They saw a big dog and a little bird. "
    "The dog was brown and the bird was blue. Tom wanted to"
)


def held_blocks(engine: LLMEngine) -> int:
    """Blocks some table holds: neither free nor idle in the prefix cache."""
    cache = engine.scheduler.prefix_cache
    return engine.pool.num_blocks - engine.pool.num_free - (cache.num_evictable if cache else 0)


def run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_samples_share_the_prompts_blocks(backend, prefix_caching):
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64, prefix_caching=prefix_caching)
    n, prompt = 4, engine.tokenizer.encode(PROMPT)
    full = (len(prompt) - 1) // 16  # full prompt blocks (the last prompt token excluded)
    assert full >= 2 and len(prompt) % 16, "the prompt ends inside a block"
    params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=20, ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    outputs = engine.step()  # the first sample computes the prompt, samples its first token
    assert [len(c.token_ids) for c in outputs[0].outputs] == [1, 0, 0, 0]
    engine.step()  # the others borrow it and compute its last token; the first decodes
    tables = [s.table for s in engine.scheduler.running]
    assert len(tables) == n
    listed = sum(t.num_blocks for t in tables)
    # Every full prompt block once; every other block (the last prompt block, split by
    # copy-on-write or recomputed, and the generated ones) once per sample.
    assert held_blocks(engine) == full + n * (tables[0].num_blocks - full) < listed
    assert engine.last_trace.sharing_saved_fraction == pytest.approx(
        1 - held_blocks(engine) / listed
    )
    assert engine.last_trace.sharing_saved_fraction >= (n - 1) * full / listed - 1e-12
    assert all(t.blocks[:full] == tables[0].blocks[:full] for t in tables)
    cache_ref = 1 if prefix_caching else 0  # the prefix cache holds a reference of its own
    assert all(engine.pool.refcount(b) == n + cache_ref for b in tables[0].blocks[:full])
    assert len({t.blocks[full] for t in tables}) == n, "the partly filled block is private"
    (out,) = run(engine).values()
    assert out.request_id == request_id and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 20 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "each sample draws its own"
    # Independent requests share nothing: the trace says so.
    for p in ("Once upon a time", "The little dog"):
        engine.add_request(p, SamplingParams(max_tokens=5))
    engine.step()
    assert engine.last_trace.sharing_saved_fraction == 0.0


def test_prompt_computed_once(backend):
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add_request(prompt, SamplingParams(n=5, max_tokens=3, seed=1))
    run(engine)
    # The first computes the whole prompt; the four others borrow its full blocks (from the
    # prefix cache) and its partly filled one (from its running table), and compute the
    # last prompt token only: its logits are their first draw.
    assert engine.stats.prompt_tokens == len(prompt) + 4
    assert engine.stats.prefix_hit_tokens == 4 * (len(prompt) - 1)


def test_seeded_samples_are_the_same_alone_or_in_any_batch(backend):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=77, max_tokens=40)
    alone = LLM(STORIES, backend=backend).generate(PROMPT, params, use_tqdm=False)[0]
    texts = [c.token_ids for c in alone.outputs]
    assert len({tuple(t) for t in texts}) == 3
    # In a crowd, in a pool so small that sequences are preempted (samples among them).
    others = [SamplingParams(n=2, temperature=0.9, max_tokens=m, seed=m) for m in (30, 60)]
    llm = LLM(STORIES, backend=backend, num_blocks=14, max_num_seqs=6)
    crowd = llm.generate(["Lily", PROMPT, "Tom had"], [others[0], params, others[1]],
                         use_tqdm=False)  # fmt: skip
    assert llm.engine.stats.preemptions > 0
    assert [c.token_ids for c in crowd[1].outputs] == texts
    # n=1 with the same seed is the first sample alone: sample 0's generator is the seed's.
    one = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=40)
    assert LLM(STORIES).generate(PROMPT, one, use_tqdm=False)[0].outputs[0].token_ids == texts[0]


def test_unseeded_samples_follow_the_engine_seed():
    params = SamplingParams(n=3, max_tokens=20)
    a = LLM(STORIES, seed=3).generate(["Lily", PROMPT], params, use_tqdm=False)
    b = LLM(STORIES, seed=3).generate(["Lily", PROMPT], params, use_tqdm=False)
    c = LLM(STORIES, seed=4).generate(["Lily", PROMPT], params, use_tqdm=False)
    tokens = [[[x.token_ids for x in o.outputs] for o in run_] for run_ in (a, b, c)]
    assert tokens[0] == tokens[1] != tokens[2]
    assert len({tuple(t) for t in tokens[0][1]}) == 3


def test_best_of_keeps_the_n_most_likely_by_transformers(backend):
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    llm = LLM(STORIES, backend=backend)
    every = SamplingParams(n=6, temperature=1.3, seed=11, max_tokens=12)
    best = SamplingParams(n=2, best_of=6, temperature=1.3, seed=11, max_tokens=12)
    (all_six,) = llm.generate("Lily wanted to", every, use_tqdm=False)
    (kept,) = llm.generate("Lily wanted to", best, use_tqdm=False)
    prompt = all_six.prompt_token_ids

    def hf_score(tokens: list[int]) -> float:  # sum of the generated tokens' log-probabilities
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].to(torch.float64)
        logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        return float(logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].sum())

    scores = [hf_score(c.token_ids) for c in all_six.outputs]
    ranking = sorted(range(6), key=lambda i: -scores[i])
    assert scores[ranking[1]] - scores[ranking[2]] > 1e-3, "a clear cut between 2nd and 3rd"
    assert [c.index for c in kept.outputs] == ranking[:2]  # best first, their sample index
    for c in kept.outputs:
        assert c.token_ids == all_six.outputs[c.index].token_ids
        assert abs(c.cumulative_logprob - scores[c.index]) < 1e-4
    assert all(c.cumulative_logprob is None for c in all_six.outputs)  # not asked for


@pytest.mark.parametrize("when", [0, 1, 3])
def test_abort_frees_every_sample(backend, when):
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    params = SamplingParams(n=4, best_of=6, max_tokens=50, ignore_eos=True, seed=2)
    request_id = engine.add_request(PROMPT, params)
    keep = engine.add_request("The little dog", SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(when):
        engine.step()
    assert engine.abort_request(request_id) and not engine.abort_request(request_id)
    assert len(engine.scheduler.running) + len(engine.scheduler.waiting) <= 1
    done = run(engine)
    assert list(done) == [keep]
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.scheduler.check_integrity()


def test_streamed_outputs_carry_every_sample_by_index():
    engine = LLMEngine(STORIES, num_blocks=64)
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=4, ignore_eos=True, seed=5))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append([len(c.token_ids) for c in out.outputs])
            assert [c.index for c in out.outputs] == [0, 1, 2]
    assert seen == [[1, 0, 0], [2, 1, 1], [3, 2, 2], [4, 3, 3], [4, 4, 4]]
    np.testing.assert_equal(engine.stats.generated_tokens, 12)
