"""Chunked prefill: the step's token budget shared by decodes and prompt chunks.

Unit tests of the rule on both backends (the reference and the Cython mirror), with the
deterministic KV model as the oracle, then the engine against transformers. The random
workloads with random (tiny) budgets are in test_scheduler_properties.py and, side by side
on both backends, in test_fast_scheduler.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_model import (
    STOP,
    checked_step,
    drain,
    expected_output,
    kv_pool,
    scheduler_and_model,
)

from mie import LLMEngine, SamplingParams
from mie.scheduler import RequestTooLongError

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def make(backend, num_blocks=64, block_size=4, max_num_seqs=4, budget=8, **kwargs):
    return scheduler_and_model(
        backend,
        num_blocks,
        block_size,
        max_num_seqs,
        budget,
        enable_chunked_prefill=True,
        **kwargs,
    )


def test_a_long_prompt_is_chunked_while_the_streams_keep_decoding(backend):
    sched, model = make(backend, budget=8)
    streams = [sched.submit([41 + i, 42, 43], 40, []) for i in range(3)]  # nothing shared
    checked_step(sched, model)  # the three short prompts, admitted together (9 tokens > 8: two fit)
    checked_step(sched, model)
    assert all(s in sched.running for s in streams)
    long = sched.submit(list(range(1, 31)), 2, [])  # 30 tokens: chunks of 8 - 3 decodes = 5
    seen = []
    while long.num_output_tokens == 0:
        batch = sched.step()
        (chunk,) = [e for e in batch.entries if e.seq is long]
        seen.append((chunk.start, chunk.num_tokens, chunk.samples))  # before commit appends
        sched.commit(batch, model(batch))
        sched.check_integrity()
        assert sum(e.num_tokens for e in batch.entries) <= 8
        decodes = [e.seq for e in batch.entries if not e.is_prefill]
        assert decodes == streams, "a stream missed its token while the prompt was prefilled"
    assert seen == [
        (0, 5, False),
        (5, 5, False),
        (10, 5, False),
        (15, 5, False),
        (20, 5, False),
        (25, 5, True),
    ]
    assert any(start % 4 for start, _, _ in seen[1:]), "chunks end mid-block too"
    drain(sched, model)
    assert long.output_token_ids == expected_output(list(range(1, 31)), 2)
    for seq in streams:
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 40)
    assert sched.pool.num_free == sched.pool.num_blocks


def test_a_non_final_chunk_takes_no_token_and_commit_checks_that(backend):
    sched, model = make(backend, budget=4, max_num_seqs=1)
    seq = sched.submit([5, 6, 7, 8, 9, 10], 3, [])
    batch = sched.step()
    (entry,) = batch.entries
    assert (entry.start, entry.num_tokens, entry.samples, batch.num_sampling) == (0, 4, False, 0)
    assert model(batch) == []  # writes the chunk's KV, answers nothing
    with pytest.raises(ValueError, match="one next token per sampling entry: 0 of 1"):
        sched.commit(batch, [1])
    assert sched.commit(batch, []) == [] and seq.num_computed == 4 and seq.output_token_ids == []
    batch = sched.step()
    assert [(e.start, e.num_tokens, e.samples) for e in batch.entries] == [(4, 2, True)]
    sched.commit(batch, model(batch))
    assert seq.output_token_ids == expected_output([5, 6, 7, 8, 9, 10], 3)[:1]


@pytest.mark.parametrize("budget", [1, 2, 7])
def test_requests_longer_than_the_budget_are_accepted_and_complete(backend, budget):
    prompt = list(range(1, 24))
    whole = backend.Scheduler(kv_pool(64, 4, backend.BlockPool), 4, 1, max(budget, 8))
    with pytest.raises(RequestTooLongError, match="chunked prefill lifts this limit"):
        whole.submit(prompt, 10, [])
    sched, model = make(backend, budget=budget, max_num_seqs=1)
    seq = sched.submit(prompt, 10, [])
    steps = len(drain(sched, model)) and sched.num_steps
    assert seq.output_token_ids == expected_output(prompt, 10)
    assert steps == -(-len(prompt) // budget) + 9  # the prompt in chunks, then 9 decodes


def test_prompt_blocks_are_cached_chunk_by_chunk(backend):
    """A full block enters the prefix cache as soon as the chunk that fills it is computed,
    so a second request borrows the first's prompt while the first is still prefilling."""
    sched, model = make(backend, budget=10, max_num_seqs=2, prefix_caching=True)
    prompt = list(range(1, 26))
    first = sched.submit(prompt, 2, [])
    for _ in range(2):
        checked_step(sched, model)  # 20 of 25 tokens computed: 5 full blocks registered
    assert first.num_computed == 20 and first.num_output_tokens == 0
    second = sched.submit(prompt[:20] + [40, 41], 2, [])
    batch, _ = checked_step(sched, model)  # the first's last 5 tokens, and the second borrows 20
    assert [(e.seq, e.start, e.num_tokens) for e in batch.entries] == [
        (first, 20, 5),
        (second, 20, 2),
    ]
    assert batch.trace.prefix_hit_tokens == 20
    drain(sched, model)
    assert first.output_token_ids == expected_output(prompt, 2)
    assert second.output_token_ids == expected_output(prompt[:20] + [40, 41], 2)


def test_a_sequence_preempted_inside_its_prompt_is_recomputed_in_chunks(backend):
    # 6 blocks of 2: the stream grows until the long prompt, admitted last, must give way.
    sched, model = make(backend, num_blocks=6, block_size=2, max_num_seqs=2, budget=4)
    stream = sched.submit([1, 2], 9, [STOP])
    checked_step(sched, model)
    long = sched.submit(list(range(3, 12)), 2, [STOP])
    preempted_inside = False
    while sched.has_unfinished():
        batch, _ = checked_step(sched, model)
        preempted_inside |= long in batch.preempted and 0 < long.peak_computed < 9
        assert sum(e.num_tokens for e in batch.entries) <= 4
    assert preempted_inside, "the workload was meant to preempt the prompt mid-way"
    assert stream.output_token_ids == expected_output([1, 2], 9, [STOP])
    assert long.output_token_ids == expected_output(list(range(3, 12)), 2, [STOP])


# -- the engine ---------------------------------------------------------------------------------

torch = require_module("torch")
transformers = require_module("transformers")


@pytest.fixture(scope="module")
def hf():
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(STORIES)


PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friends. One day, she saw a big tree with",
    "Tom had a red ball.",
    "The sun was shining and the birds were singing. A little dog named Max ran to the pond",
]


def hf_greedy(hf, prompt, n):
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def expected(hf):
    return [hf_greedy(hf, p, 24) for p in PROMPTS]


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(budget=st.integers(3, 40), caching=st.booleans(), stagger=st.booleans())
def test_engine_greedy_equals_transformers_at_any_budget(
    backend, expected, budget, caching, stagger
):
    """Prompts split at random budgets (chunks ending mid-block, prefixes borrowed from the
    cache or a running sequence: the first two prompts share none, the third is submitted
    twice) decode exactly transformers' greedy tokens."""
    engine = LLMEngine(
        STORIES,
        backend=backend,
        max_num_seqs=3,
        max_num_batched_tokens=budget,
        block_size=4,
        prefix_caching=caching,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(PROMPTS[0], params)]
    if stagger:
        engine.step()
    ids += [engine.add_request(p, params) for p in PROMPTS[1:]]
    ids.append(engine.add_request(PROMPTS[2], params))  # shares all of the third's prompt
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        assert engine.last_trace.num_prefill_tokens + engine.last_trace.num_decode_tokens <= (
            budget
        )
    assert [done[i] for i in ids] == [*expected, expected[2]]


def test_the_engine_chunks_by_default_and_whole_prompts_on_request():
    chunked = LLMEngine(STORIES, backend="python")
    whole = LLMEngine(STORIES, backend="python", enable_chunked_prefill=False)
    assert (
        chunked.scheduler.enable_chunked_prefill and chunked.scheduler.max_num_batched_tokens == 512
    )
    assert not whole.scheduler.enable_chunked_prefill
    assert whole.scheduler.max_num_batched_tokens == whole.max_model_len
    with pytest.raises(ValueError, match="enable_chunked_prefill must be a bool"):
        LLMEngine(STORIES, enable_chunked_prefill="yes")


def test_the_cli_takes_the_chunked_prefill_flags():
    run = [sys.executable, "-m", "mie", "generate", "--model", str(STORIES), "--backend", "python"]
    run += ["--prompt", "Once upon a time", "--max-tokens", "12", "--temperature", "0"]
    outputs = [
        subprocess.run([*run, *flags], capture_output=True, text=True, timeout=120)
        for flags in (
            ["--max-num-batched-tokens", "1", "--max-num-seqs", "1"],  # one token per step
            ["--no-enable-chunked-prefill"],
        )
    ]
    assert all(out.returncode == 0 for out in outputs), [out.stderr for out in outputs]
    assert outputs[0].stdout == outputs[1].stdout and len(outputs[0].stdout) > 30
    too_small = subprocess.run(
        [
            *run,
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            "3",
            "--max-num-seqs",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert too_small.returncode != 0 and "chunked prefill lifts this limit" in too_small.stderr
