"""Parallel sampling (``n``, ``best_of``): one prompt computed once, its blocks shared.

The first sample computes the prompt; the others are submitted when it has, and borrow its
full blocks (from the prefix cache, or without it from the running sequence, the partly
filled last block then split by copy-on-write). Checked: the pool holds the shared blocks
once (counted from the block tables, not from the code under test), the trace's saved
fraction says so, every sample's randomness is its own and reproducible alone or in any
batch, under preemption too, ``best_of`` keeps the samples transformers scores highest, and
an abort frees everything. Finishing one sample early (``finish_sample``, the server's stop
strings) frees its blocks at once and leaves its siblings drawing exactly their undisturbed
tokens. Both backends, with and without the prefix cache.
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import backend_named, require_module, run_to_completion
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine, StepError
from mie.engine.sampling import InvalidRequestError
from mie.extension import BACKENDS

torch = require_module("torch")
transformers = require_module("transformers")

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
PROMPT = (  # 54 tokens: three full blocks of 16 and six in a fourth
    "One day, Tom and his mom went to the park. They saw a big dog and a little bird. "
    "The dog was brown and the bird was blue. Tom wanted to"
)


def held_blocks(engine: LLMEngine) -> int:
    """Blocks some table holds: neither free nor idle in the prefix cache."""
    cache = engine.scheduler.prefix_cache
    return engine.pool.num_blocks - engine.pool.num_free - (cache.num_evictable if cache else 0)


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
    (out,) = run_to_completion(engine).values()
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
    run_to_completion(engine)
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
    crowd = llm.generate(
        ["Lily", PROMPT, "Tom had"], [others[0], params, others[1]], use_tqdm=False
    )
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
    done = run_to_completion(engine)
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


# -- finishing one sample early (what the server does when a stop string completes) ----------
def full_run(backend, params: SamplingParams, **engine_args):
    """The request run to its end with no sample finished early: the reference."""
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64, **engine_args)
    engine.add_request(PROMPT, params, "r")
    return run_to_completion(engine)["r"]


def table_blocks(engine: LLMEngine) -> dict[int, set[int]]:
    """The blocks each running sequence's table holds, by seq_id."""
    return {s.seq_id: set(s.table.blocks) for s in engine.scheduler.running}


@pytest.mark.parametrize("steps", [1, 2, 6])
def test_finishing_a_sample_frees_its_blocks_and_leaves_its_siblings_as_they_were(backend, steps):
    params = SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=24, ignore_eos=True)
    reference = full_run(backend, params)
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    engine.add_request(PROMPT, params, "r")
    for _ in range(steps):
        (before,) = engine.step()
    stopped = before.outputs[1]
    seq_id = next(seq_id for seq_id, s in engine._by_seq.items() if s.index == 1)
    tables = table_blocks(engine)
    mine = tables.pop(seq_id, set())  # not admitted yet after one step: it holds nothing
    private = mine - set().union(*tables.values())
    held = held_blocks(engine)
    after = engine.finish_sample("r", 1, text_end=len(stopped.text) // 2)
    # Its blocks are back at once (the ones its siblings share stay), it runs nowhere.
    assert held_blocks(engine) == held - len(private)
    assert steps < 6 or private, "a sample decoding for a while has blocks of its own"
    assert seq_id not in {s.seq_id for s in engine.scheduler.running}
    assert seq_id not in {s.seq_id for s in engine.scheduler.waiting}
    assert not after.finished
    cut = after.outputs[1]
    assert cut.finish_reason == "stop" and cut.token_ids == stopped.token_ids
    assert cut.text == stopped.text[: len(stopped.text) // 2]
    assert engine.finish_sample("r", 1) is None, "finished already"
    generated = engine.stats.generated_tokens
    while engine.has_unfinished_requests():
        (out,) = engine.step()
        assert engine.last_trace.num_running <= 2, "no step computes the finished sample"
    # The others drew exactly the tokens they draw when nothing is finished early.
    assert [c.token_ids for c in out.outputs] == [
        reference.outputs[0].token_ids,
        stopped.token_ids,
        reference.outputs[2].token_ids,
    ]
    assert out.outputs[0].text == reference.outputs[0].text
    assert [c.finish_reason for c in out.outputs] == ["length", "stop", "length"]
    left = [len(reference.outputs[i].token_ids) - len(before.outputs[i].token_ids) for i in (0, 2)]
    assert engine.stats.generated_tokens - generated == sum(left)
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.scheduler.check_integrity()


@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(2, 4),
    # (sample, the step it is finished before or during, during?)
    plan=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14), st.booleans()), max_size=5),
    prefix_caching=st.booleans(),
)
def test_samples_finished_at_any_steps_leave_the_others_as_they_were(
    backend_name, n, plan, prefix_caching
):
    backend = backend_named(backend_name)
    params = SamplingParams(n=n, temperature=1.0, seed=n, max_tokens=12, ignore_eos=True)
    args = {"prefix_caching": prefix_caching, "max_num_batched_tokens": 32}
    reference = full_run(backend, params, **args).outputs
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64, **args)
    engine.add_request(PROMPT, params, "r")
    forward, step, last, at_finish = engine.model.forward, 0, {}, {}

    def finish(index: int) -> None:
        out = engine.finish_sample("r", index % n)
        if out is not None:
            last["r"] = at_finish[index % n] = out

    def forward_finishing(inputs, kv_cache):  # the plan's finishes during this step
        for index, at, during in plan:
            if during and at == step:
                finish(index)
        return forward(inputs, kv_cache)

    engine.model.forward = forward_finishing
    while engine.has_unfinished_requests():
        for index, at, during in plan:
            if not during and at == step:
                finish(index)
                # Whatever it held alone is back in the pool at once: the pool holds exactly
                # the blocks of the sequences still running.
                assert held_blocks(engine) == len(set().union(*table_blocks(engine).values()))
        for out in engine.step():
            last[out.request_id] = out
        step += 1
    final = last["r"]
    assert final.finished
    for sample, expected in zip(final.outputs, reference, strict=True):
        kept = len(sample.token_ids)
        assert sample.token_ids == expected.token_ids[:kept]
        if sample.index in at_finish:  # finished early: as it was then, a prefix of the rest
            assert sample == at_finish[sample.index].outputs[sample.index]
            assert sample.finish_reason == "stop"
            continue
        assert sample.token_ids == expected.token_ids and sample.finish_reason == "length"
    # Every token the engine generated is one a sample kept: none for a finished sample.
    assert engine.stats.generated_tokens == sum(len(c.token_ids) for c in final.outputs)
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.scheduler.check_integrity()


def test_finishing_the_sample_computing_the_prompt_hands_the_prompt_to_the_next(backend):
    # A chunked prompt (16 tokens a step) with its log-probabilities: sample 0 is finished
    # halfway through the prompt, sample 1 computes it instead (recording only the positions
    # still missing), and everything else is as if nothing happened.
    params = SamplingParams(
        n=3, temperature=1.0, seed=4, max_tokens=10, ignore_eos=True, prompt_logprobs=2
    )
    args = {"max_num_batched_tokens": 16, "max_num_seqs": 6}  # n=3: at most max_num_seqs // 2
    reference = full_run(backend, params, **args)
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64, **args)
    engine.add_request(PROMPT, params, "r")
    assert engine.step() == [] and engine.step() == []  # two chunks of the prompt
    after = engine.finish_sample("r", 0)
    assert after.outputs[0].finish_reason == "stop" and after.outputs[0].token_ids == []
    # Before any step the other way round: the last sample, never submitted, just ends.
    (out,) = run_to_completion(engine).values()
    assert [c.token_ids for c in out.outputs[1:]] == [c.token_ids for c in reference.outputs[1:]]
    assert out.prompt_logprobs == reference.prompt_logprobs
    assert engine.stats.generated_tokens == 2 * 10
    engine.add_request(PROMPT, params, "s")
    assert engine.finish_sample("s", 2).outputs[2].finish_reason == "stop"
    (out,) = run_to_completion(engine).values()
    assert [c.token_ids for c in out.outputs[:2]] == [c.token_ids for c in reference.outputs[:2]]
    assert out.outputs[2].token_ids == [] and out.outputs[2].finish_reason == "stop"
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("end", ["finish_sample", "abort_request"])
def test_ending_a_sample_while_its_step_runs(backend, end):
    # From inside the forward pass (between the scheduler's step and its commit): that step
    # gives the sample no token, and nothing else changes.
    params = SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    engine.add_request(PROMPT, params, "r")
    engine.add_request("Lily", other, "o")
    reference = run_to_completion(engine)
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    engine.add_request(PROMPT, params, "r")
    engine.add_request("Lily", other, "o")
    forward, calls, ended = engine.model.forward, [], {}

    def forward_then_end(inputs, kv_cache):
        calls.append(None)
        if len(calls) == 5:
            if end == "finish_sample":
                ended["out"] = engine.finish_sample("r", 1)
            else:
                ended["out"] = engine.abort_request("r")
        return forward(inputs, kv_cache)

    engine.model.forward = forward_then_end
    done = run_to_completion(engine)
    assert done["o"].outputs[0].token_ids == reference["o"].outputs[0].token_ids
    if end == "abort_request":
        assert ended["out"] is True and list(done) == ["o"]
    else:
        assert ended["out"].outputs[1].finish_reason == "stop"
        sample = done["r"].outputs
        assert sample[0].token_ids == reference["r"].outputs[0].token_ids
        assert sample[1].token_ids == ended["out"].outputs[1].token_ids
        assert sample[1].text == ended["out"].outputs[1].text
        assert sample[1].finish_reason == "stop"
        kept = len(sample[1].token_ids)
        assert sample[1].token_ids == reference["r"].outputs[1].token_ids[:kept]
    engine.scheduler.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.scheduler.check_integrity()


def test_a_sample_finished_in_a_step_that_fails_stays_as_it_was_cut(backend):
    params = SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=12, ignore_eos=True)
    reference = full_run(backend, params)
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    engine.add_request(PROMPT, params, "r")
    for _ in range(4):
        (before,) = engine.step()
    forward = engine.model.forward

    def finish_then_fail(inputs, kv_cache):
        engine.finish_sample("r", 1, text_end=1)
        raise RuntimeError("the forward pass failed")

    engine.model.forward = finish_then_fail
    with pytest.raises(StepError):
        engine.step()  # rolled back: sample 0 recomputes, sample 1 stays finished
    engine.model.forward = forward
    (out,) = run_to_completion(engine).values()
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert out.outputs[1].token_ids == before.outputs[1].token_ids
    assert out.outputs[1].text == before.outputs[1].text[:1]
    assert out.outputs[1].finish_reason == "stop"


def test_best_of_ranks_a_sample_finished_early_on_the_tokens_it_kept(backend):
    every = SamplingParams(n=3, temperature=1.3, seed=12, max_tokens=12, logprobs=0)
    best = SamplingParams(n=1, best_of=3, temperature=1.3, seed=12, max_tokens=12)
    samples = full_run(backend, every).outputs
    scores = [
        [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)] for c in samples
    ]
    worst = min(range(3), key=lambda i: sum(scores[i]))
    kept = [s[:2] if i == worst else s for i, s in enumerate(scores)]  # it ends after 2
    winner = max(range(3), key=lambda i: sum(kept[i]))
    assert winner == worst, "cut short, the least likely sample becomes the most likely"
    engine = LLMEngine(STORIES, backend=backend, num_blocks=64)
    engine.add_request(PROMPT, best, "r")
    while len(engine.step()[0].outputs[worst].token_ids) < 2:
        pass
    engine.finish_sample("r", worst)
    (out,) = run_to_completion(engine).values()
    (chosen,) = out.outputs
    assert chosen.index == worst and chosen.token_ids == samples[worst].token_ids[:2]
    assert chosen.cumulative_logprob == pytest.approx(sum(kept[worst]), abs=1e-4)


def test_finish_sample_refuses_bad_arguments_and_changes_nothing():
    engine = LLMEngine(STORIES, num_blocks=64)
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=8, seed=0), "r")
    (out,) = engine.step()
    free = engine.pool.num_free
    for index, text_end, field in [
        (2, None, "index"),
        (-1, None, "index"),
        (True, None, "index"),
        ("0", None, "index"),
        (0, 999, "text_end"),
        (0, -1, "text_end"),
        (0, 1.0, "text_end"),
    ]:
        with pytest.raises(InvalidRequestError, match=field):
            engine.finish_sample("r", index, text_end=text_end)
    assert engine.pool.num_free == free and engine.num_unfinished_requests == 1
    assert engine.finish_sample("nobody", 0) is None
    done = run_to_completion(engine)
    assert [len(c.token_ids) for c in done["r"].outputs] == [8, 8]
    assert engine.finish_sample("r", 0) is None, "finished requests are gone"
