"""Speculative decoding in the scheduler (both backends): ``step(proposals)`` reserves slots for
tokens proposed after a sequence's newest one, the runner verifies them in the same pass, and
``commit`` keeps the accepted ones' KV and cuts the rejected ones' slots off the table.

The runner is ``tests/scheduler_model.py``'s KV-reading model with greedy verification: at each
proposed position it computes the model's own next token from the KV it just wrote, accepts
the proposals while they match and answers the accepted ones plus its own token. So whatever
the proposer guesses -- the oracle's true continuation, random tokens, a mix -- every request
must end with exactly ``expected_output``, the scheduler-free oracle: a rejected token whose KV
stayed in the table, or reached the prefix cache, changes a later token.
"""

import pytest
from conftest import backend_named
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_model import (
    STOP,
    VOCAB,
    KVModel,
    expected_output,
    scheduler_and_model,
)

from mie.extension import BACKENDS


class VerifyingModel(KVModel):
    """``KVModel`` that also verifies an entry's proposals (greedy): writes every token's KV,
    then, at each proposed position, compares the proposal with the token the model computes
    from the KV before it; answers the accepted proposals then the model's own token."""

    def __call__(self, batch) -> list:
        answers = []
        for entry in batch.entries:
            blocks = self.write(entry)
            if not entry.samples:
                continue
            spec = entry.spec_token_ids
            newest = entry.context_len - len(spec)  # the position after the newest token
            answer = []
            for end in range(newest, entry.context_len + 1):
                answer.append(self.token_after(blocks, end))
                proposed = end - newest
                if proposed == len(spec) or answer[-1] != spec[proposed]:
                    break
            answers.append(answer if spec else answer[0])
        return answers


def decoding(scheduler) -> list:
    """The running sequences whose next step is a decode (only their newest token uncomputed)."""
    return [s for s in scheduler.running if s.num_computed == s.num_tokens - 1]


def true_continuation(seq, window) -> list[int]:
    """The tokens the oracle says follow ``seq``'s newest one."""
    full = expected_output(seq.prompt_token_ids, seq.max_tokens, seq.stop_token_ids, window)
    return full[seq.num_output_tokens :]


def check_tables(scheduler) -> None:
    """Between steps every running table holds exactly the blocks of its computed tokens."""
    scheduler.check_integrity()
    bs = scheduler.block_size
    for seq in scheduler.running:
        assert seq.table.num_tokens == seq.num_computed
        assert len(seq.table.blocks) == -(-seq.num_computed // bs), seq


def run(scheduler, model, propose, max_steps=2000) -> list:
    """Step until drained, proposing ``propose(seq)`` for every decoding sequence; checks the
    tables after every step; returns the finished sequences."""
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        batch = scheduler.step({s.seq_id: propose(s) for s in decoding(scheduler)})
        assert batch.trace.spec_tokens == batch.num_spec_tokens
        finished += scheduler.commit(batch, model(batch))
        check_tables(scheduler)
    raise AssertionError(f"not drained after {max_steps} steps")


def check_drained(scheduler) -> None:
    pool, cache = scheduler.pool, scheduler.prefix_cache
    assert pool.num_free + (cache.num_evictable if cache is not None else 0) == pool.num_blocks


requests = st.lists(
    st.tuples(
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=10),  # no STOP in prompts
        st.integers(1, 10),  # max_tokens
        st.booleans(),  # stops at STOP
    ),
    min_size=1,
    max_size=6,
)


def proposer(kind, rng_tokens, window):
    """good: the true continuation cut at a drawn length; bad: drawn tokens; mixed: a true
    prefix then drawn tokens."""

    def propose(seq):
        k = next(rng_tokens) % 5
        truth = true_continuation(seq, window)[:k]
        noise = [next(rng_tokens) % VOCAB for _ in range(k)]
        if kind == "good":
            return truth
        if kind == "bad":
            return noise
        cut = next(rng_tokens) % (k + 1)
        return (truth[:cut] + noise)[:k]

    return propose


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_any_proposer_gives_the_oracle_output(backend_name):
    """Random workloads, small pools (preemption), caching and chunking on or off, windows,
    block sizes 1..4; good, bad or mixed proposals: every output is the oracle's, the tables
    hold exactly their computed blocks after every step, and no block leaks."""
    any_proposer_gives_the_oracle_output(backend_named(backend_name))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    block_size=st.integers(1, 4),
    extra_blocks=st.integers(0, 3),
    caching=st.booleans(),
    chunked=st.booleans(),
    window=st.one_of(st.none(), st.integers(2, 6)),
    kind=st.sampled_from(["good", "bad", "mixed"]),
    seed=st.lists(st.integers(0, 10**6), min_size=1, max_size=50),
    max_num_seqs=st.integers(1, 4),
)
def any_proposer_gives_the_oracle_output(
    backend, reqs, block_size, extra_blocks, caching, chunked, window, kind, seed, max_num_seqs
):
    longest = max(len(p) + m - 1 for p, m, _ in reqs)
    budget = max(longest, max_num_seqs, 4) if not chunked else max(max_num_seqs, 3)
    num_blocks = -(-longest // block_size) + extra_blocks
    scheduler, _ = scheduler_and_model(
        backend, num_blocks, block_size, max_num_seqs, budget,
        prefix_caching=caching, enable_chunked_prefill=chunked, sliding_window=window,
    )  # fmt: skip
    model = VerifyingModel(scheduler.pool, block_size, window)
    seqs = [scheduler.submit(p, m, (STOP,) if stops else ()) for p, m, stops in reqs]
    tokens = iter(seed * 1000)
    run(scheduler, model, proposer(kind, tokens, window))
    for seq, (prompt, max_tokens, stops) in zip(seqs, reqs, strict=True):
        stop_ids = (STOP,) if stops else ()
        assert seq.output_token_ids == expected_output(prompt, max_tokens, stop_ids, window)
    check_drained(scheduler)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_a_prefix_cache_hit_never_serves_a_rejected_token(backend_name, block_size):
    """A request whose proposals were all rejected wrote their KV into slots past its computed
    tokens; a second request sharing its prompt and output must still get the oracle output
    from the cached blocks."""
    backend = backend_named(backend_name)
    scheduler, _ = scheduler_and_model(backend, 16, block_size, 2, 64, prefix_caching=True)
    model = VerifyingModel(scheduler.pool, block_size)
    prompt = [5, 9, 13, 2, 7]
    first = scheduler.submit(prompt, 8)

    def wrong(seq):  # never the true next token
        truth = true_continuation(seq, None)
        return [(t + 1) % VOCAB or 1 for t in truth[:4]]

    run(scheduler, model, wrong)
    assert first.output_token_ids == expected_output(prompt, 8)
    rejected_any = False
    for length in range(1, 8):  # the second prompt: the first's prompt and output, cut
        second_prompt = prompt + first.output_token_ids[:length]
        second = scheduler.submit(second_prompt, 4)
        batches = []
        while scheduler.has_unfinished():
            batch = scheduler.step({s.seq_id: wrong(s) for s in decoding(scheduler)})
            batches.append(batch)
            scheduler.commit(batch, model(batch))
            check_tables(scheduler)
        rejected_any |= any(b.num_spec_tokens for b in batches)
        assert batches[0].trace.prefix_hit_tokens > 0 or len(second_prompt) <= block_size
        assert second.output_token_ids == expected_output(second_prompt, 4)
    assert rejected_any
    check_drained(scheduler)


# -- units ------------------------------------------------------------------------------------
def decoding_scheduler(backend, max_tokens=8, num_blocks=16, block_size=4, budget=64, n=1, **flags):
    """``n`` requests of 3-token prompts, prefilled: each has one output token, decoding."""
    scheduler, model = scheduler_and_model(backend, num_blocks, block_size, n, budget, **flags)
    seqs = [scheduler.submit([1 + i, 2, 3], max_tokens) for i in range(n)]
    batch = scheduler.step()
    scheduler.commit(batch, model(batch))
    return scheduler, model, seqs


def state(scheduler) -> tuple:
    return (
        scheduler.pending_batch,
        [(s.seq_id, list(s.token_ids), s.num_computed, s.table.blocks) for s in scheduler.running],
        list(scheduler.waiting),
        scheduler.pool.num_free,
        scheduler.num_steps,
    )


def test_proposals_are_trimmed_to_max_tokens(backend):
    scheduler, _, (seq,) = decoding_scheduler(backend, max_tokens=3)
    batch = scheduler.step({seq.seq_id: [7, 8, 9, 10]})
    (entry,) = batch.entries
    # one token generated, 3 allowed: one proposal, then the model's own token
    assert entry.spec_token_ids == (7,)
    assert entry.num_tokens == 2 and entry.token_ids == [seq.token_ids[-1], 7]
    assert entry.samples and batch.trace.spec_tokens == batch.num_spec_tokens == 1
    finished = scheduler.commit(batch, [[7, 11]])
    assert finished == [seq] and seq.output_token_ids[1:] == [7, 11]
    assert seq.finish_reason == "length"


def test_proposals_are_trimmed_to_the_budget_left_after_every_decode(backend):
    scheduler, _, (a, b) = decoding_scheduler(backend, budget=6, n=2, enable_chunked_prefill=True)
    batch = scheduler.step({a.seq_id: [7, 8, 9, 10, 11], b.seq_id: [7, 8]})
    # 6 tokens: one each for a and b, a's proposals take the other 4, b gets none
    assert [e.spec_token_ids for e in batch.entries] == [(7, 8, 9, 10), ()]
    assert [e.num_tokens for e in batch.entries] == [5, 1]
    assert batch.trace.num_decode_tokens == 6 and batch.trace.spec_tokens == 4


def test_proposals_without_memory_are_dropped_not_preempting(backend):
    # two sequences, 4-token blocks, a pool of 3 blocks: each holds one, one is free
    scheduler, model, (a, b) = decoding_scheduler(backend, num_blocks=3, block_size=4, n=2)
    assert scheduler.pool.num_free == 1
    batch = scheduler.step({a.seq_id: [7, 8, 9, 10, 11], b.seq_id: [7, 8, 9, 10]})
    assert not batch.preempted and batch.trace.preemptions == 0
    # a's 1 + 5 tokens need 2 more blocks: dropped; b's 1 + 4 fit in its block and the free one
    assert [(e.seq, e.spec_token_ids) for e in batch.entries] == [(a, ()), (b, (7, 8, 9, 10))]
    scheduler.commit(batch, model(batch))
    check_tables(scheduler)


def test_rejected_proposals_give_back_their_blocks(backend):
    scheduler, model, (seq,) = decoding_scheduler(backend, block_size=2, max_tokens=10)
    free = scheduler.pool.num_free
    batch = scheduler.step({seq.seq_id: [7, 8, 9, 10, 11]})
    assert scheduler.pool.num_free == free - 3  # positions 3..8: 3 more blocks of 2
    new_token = seq.token_ids[-1]
    scheduler.commit(batch, [[7, 40]])  # one accepted
    assert seq.token_ids[-3:] == [new_token, 7, 40] and seq.num_computed == 5
    assert len(seq.table.blocks) == 3 and scheduler.pool.num_free == free - 1
    check_tables(scheduler)


def test_a_stop_token_among_the_accepted_drops_the_rest(backend):
    """The tokens after the stop are dropped, and so is their KV: the prefix cache registers
    blocks of the sequence's own tokens only (one-token blocks: one per token)."""
    scheduler, _ = scheduler_and_model(backend, 16, 1, 1, 64, prefix_caching=True)
    seq = scheduler.submit([1, 2, 3], 10, [STOP])
    scheduler.commit(scheduler.step(), [5])
    batch = scheduler.step({seq.seq_id: [6, STOP, 8]})
    assert scheduler.commit(batch, [[6, STOP, 8, 9]]) == [seq]
    assert seq.output_token_ids == [5, 6, STOP] and seq.finish_reason == "stop"
    scheduler.check_integrity()
    assert scheduler.prefix_cache.num_evictable == len(seq.token_ids)
    check_drained(scheduler)


@pytest.mark.parametrize(
    ("proposals", "exception", "message"),
    [
        ([1, 2], ValueError, "proposals must map seq_id to token ids, got [1, 2]"),
        ({"0": [1]}, ValueError, "proposals' keys must be seq_ids (ints), got '0'"),
        ({0: [1, -1]}, ValueError, "proposals[0] must be non-negative ints below 2**63"),
        ({0: [1.5]}, ValueError, "proposals[0] must be non-negative ints below 2**63"),
        ({0: 5}, TypeError, "not iterable"),  # like a prompt that is not a container
    ],
)
def test_bad_proposals_are_refused_with_nothing_changed(backend, proposals, exception, message):
    scheduler, _, (seq,) = decoding_scheduler(backend)
    before = state(scheduler)
    with pytest.raises(exception) as error:
        scheduler.step(proposals)
    assert message in str(error.value)
    assert state(scheduler) == before
    assert scheduler.step({seq.seq_id: [1]}).num_spec_tokens == 1  # and it still steps


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([[8, 9]], "seq_id 0 was proposed [7, 8]; its answer must be the proposals accepted"),
        ([[7, 8, 9, 10]], "got [7, 8, 9, 10]"),
        ([[]], "got []"),
        ([[7], [9]], "needs one next token per sampling entry: 1 of 1 entries sample, got 2"),
        ([[7, -1]], "next_tokens must be non-negative ints below 2**63"),
        (5, "got a non-iterable tokens"),
    ],
)
def test_bad_answers_are_refused_with_nothing_changed(backend, answer, message):
    scheduler, _, (seq,) = decoding_scheduler(backend)
    batch = scheduler.step({seq.seq_id: [7, 8]})
    before = state(scheduler)
    with pytest.raises(ValueError) as error:
        scheduler.commit(batch, answer)
    assert message in str(error.value)
    assert state(scheduler) == before
    scheduler.commit(batch, [[7, 8, 9]])  # all accepted
    assert seq.output_token_ids[1:] == [7, 8, 9] and seq.num_computed == seq.num_tokens - 1
