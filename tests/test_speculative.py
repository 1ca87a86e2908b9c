"""Speculative decoding in the engine: proposals change the speed, never the tokens.

The oracle is plain decoding of the same requests by an engine without speculation (itself
checked against transformers elsewhere): greedy or seeded-sampled, every sample's tokens,
text, finish reason and log-probabilities must be the same, whatever the proposals -- the
n-gram lookup's, a perfect proposer's, random ones, or an adversary's (the least likely
token at every position) -- under preemption, chunked prefill, the prefix cache and sliding
windows, on both backends. Each test also checks that speculation really ran (proposals were
verified, some accepted), so a run that silently never speculated cannot pass.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    STORIES,
    assert_drained,
    backend_named,
    engine_of,
    require_module,
    run_to_completion,
    stories_with_window,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie.engine import speculative
from mie.engine.config import EngineConfig
from mie.engine.llm_engine import LLMEngine, StepError
from mie.engine.sampling import SamplingParams
from mie.engine.speculative import (
    FIRST_PROPOSAL_SIZE,
    MAX_BACKOFF_STEPS,
    MAX_LOOKUP_BACKOFF_STEPS,
    MAX_NGRAM_VOCAB,
    NgramLookup,
    ProposalPolicy,
    SpeculativeConfig,
    check_ngram_vocabulary,
    ngram_proposal,
)
from mie.model import Model

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play with her ball "
    "in the park. One day, she saw a big dog."
)
PROMPTS = [STORY + " " + STORY[:30], "Tom and Tom and Tom and", "The dog", STORY, "Lily"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@functools.cache
def stories_model(backend_name: str, path: Path = STORIES) -> Model:
    return Model.from_pretrained(path, backend_named(backend_name).kernels)


def outputs(engine, prompts, params) -> list:
    """Every request's samples as (token ids, text, finish reason, logprobs), in order; the
    log-probabilities as {token: (value, rank)} per position."""
    ids = [engine.add_request(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    done = run_to_completion(engine)
    return [
        [
            (c.token_ids, c.text, c.finish_reason, _logprobs(c.logprobs))
            for c in done[request_id].outputs
        ]
        for request_id in ids
    ]


def _logprobs(positions) -> list | None:
    if positions is None:
        return None
    return [{t: (p.logprob, p.rank) for t, p in position.items()} for position in positions]


def assert_same(actual: list, expected: list) -> None:
    """The same tokens, texts and finish reasons; the same log-probabilities to float32
    rounding (a verified position's logits come from a multi-token forward pass, whose
    products and attention sum in another order than a one-token decode's: differences of
    up to 1.2e-6 were seen, on log-probabilities of magnitude 0.1 to 10)."""
    assert [[c[:3] for c in r] for r in actual] == [[c[:3] for c in r] for r in expected]
    for request, expected_request in zip(actual, expected, strict=True):
        for sample, expected_sample in zip(request, expected_request, strict=True):
            if expected_sample[3] is None:
                assert sample[3] is None
                continue
            for got, want in zip(sample[3], expected_sample[3], strict=True):
                assert got.keys() == want.keys()
                for token, (value, rank) in want.items():
                    assert got[token][0] == pytest.approx(value, rel=1e-5, abs=2e-5)
                    assert got[token][1] == rank


# -- the configuration --------------------------------------------------------------------
def test_speculative_config_takes_vllms_keys_as_a_dict_or_json():
    config = EngineConfig(speculative_config=NGRAM)
    assert config.speculative_config == SpeculativeConfig(3, "ngram", 3, 3)
    assert EngineConfig(speculative_config=json.dumps(NGRAM)) == config
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}) == SpeculativeConfig(2)
    both = {"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert SpeculativeConfig.parse(both).prompt_lookup_min == 2
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "lookup": 3}, "no key 'lookup'"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "'eagle' is not supported"),
        ({"num_speculative_tokens": 2, "method": "draft_model"}, "go together"),
        ({"num_speculative_tokens": 2, "model": "/d", "prompt_lookup_max": 2}, "no key"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "must not exceed",
        ),
        ("{not json", "must be a JSON object"),
        ([3], "must be a dict"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=value)


def test_the_cli_flag_takes_json():
    from mie import cli

    args = cli.build_parser().parse_args(
        [
            "generate",
            "--model",
            str(STORIES),
            "--prompt",
            "x",
            "--speculative-config",
            '{"num_speculative_tokens": 4}',
        ]
    )
    assert cli.engine_config(args).speculative_config == SpeculativeConfig(4)


# -- the proposer ---------------------------------------------------------------------------
def brute_force_proposal(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


# A small alphabet, so that n-grams repeat, over the whole range of ids a character holds
# (a surrogate's among them).
TOKEN_ALPHABET = st.sampled_from([0, 0, 1, 2, 256, 0xD800, 2**16 + 1, MAX_NGRAM_VOCAB - 1])


@settings(max_examples=500, deadline=None)
@given(
    tokens=st.lists(TOKEN_ALPHABET, min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=5),
    k=st.integers(1, 6),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_ngram_lookup_is_the_most_recent_longest_match(tokens, cuts, k, lo, extra):
    """The lookup, asked as the sequence grows (at every cut), answers what scanning the whole
    sequence answers; so does the one-shot ``ngram_proposal``."""
    lookup = NgramLookup(lo, lo + extra)
    for end in [*sorted(c for c in cuts if c < len(tokens)), len(tokens)]:
        expected = brute_force_proposal(tokens[:end], k, lo, lo + extra)
        assert lookup.propose(tokens[:end], k) == expected
    assert ngram_proposal(tokens, k, lo, lo + extra) == expected


def test_ngram_speculation_refuses_a_vocabulary_a_character_cannot_hold(monkeypatch):
    """Checked when the engine is built, naming both sizes: here with the limit lowered below
    stories260K's 512 tokens (a real model over 1,114,112 would take gigabytes to build)."""
    assert check_ngram_vocabulary(SpeculativeConfig(2), MAX_NGRAM_VOCAB) is None
    assert check_ngram_vocabulary(None, MAX_NGRAM_VOCAB + 1) is None
    draft = SpeculativeConfig(2, method="draft_model", model="x")
    assert check_ngram_vocabulary(draft, MAX_NGRAM_VOCAB + 1) is None
    monkeypatch.setattr(speculative, "MAX_NGRAM_VOCAB", 511)
    with pytest.raises(ValueError, match="at most 511 tokens, and this model's has 512"):
        engine_of(stories_model("python"), speculative_config=NGRAM)
    draft_config = {"model": str(STORIES), "num_speculative_tokens": 2}
    engine = engine_of(stories_model("python"), speculative_config=draft_config)
    assert engine.draft is not None  # a draft model keeps no characters: built


def test_proposal_policy_adapts_the_size_and_sits_out_after_failures():
    policy = ProposalPolicy(5)
    assert policy.next_size(0) == FIRST_PROPOSAL_SIZE == 2  # a first proposal is short
    policy.record(2, 2, 3)  # all accepted: two more
    policy.record(4, 4, 8)  # ... up to the limit
    assert policy.next_size(8) == 5
    policy.record(5, 2, 11)  # some rejected: one fewer
    policy.record(4, 4, 16)  # all accepted: two more, up to the limit
    assert policy.next_size(16) == 5
    generated, waits = 16, []
    for _ in range(6):
        generated += 1
        policy.record(policy.next_size(generated - 1), 0, generated)  # nothing accepted
        wait = 0
        while not policy.next_size(generated):
            generated += 1  # a decode step without proposals: one token
            wait += 1
        waits.append(wait)
    assert waits == [2, 4, 8, 16, MAX_BACKOFF_STEPS, MAX_BACKOFF_STEPS]
    assert policy.next_size(generated) == 1  # one fewer each time, never none
    policy.record(1, 1, generated + 2)
    assert policy.failures == 0 and policy.next_size(generated + 2) == 3


@pytest.mark.parametrize(
    "k, sizes", [(1, [1]), (2, [2]), (3, [2, 3]), (4, [2, 4]), (6, [2, 4, 6]), (7, [2, 4, 6, 7])]
)
def test_a_first_proposal_is_short_and_full_hits_grow_it_to_k(k, sizes):
    """A sample proposes ``FIRST_PROPOSAL_SIZE`` tokens first, not k (on free text most of a
    first long proposal's rows are wasted), and each verification that accepts everything
    adds two, up to k."""
    policy = ProposalPolicy(k)
    seen, generated = [], 0
    for _ in range(len(sizes) + 2):
        seen.append(policy.next_size(generated))
        generated += seen[-1] + 1
        policy.record(seen[-1], seen[-1], generated)
    assert seen == sizes + [k, k]


def test_lookups_that_find_nothing_are_tried_less_and_less_often():
    policy = ProposalPolicy(4)
    generated, waits = 10, []
    for _ in range(8):
        generated += 1
        policy.found_nothing(generated)  # a step whose lookup found nothing: one token
        wait = 0
        while not policy.next_size(generated):
            generated += 1
            wait += 1
        waits.append(wait)
    assert waits == [1, 2, 4, 8, 8, 8, 8, 8] and MAX_LOOKUP_BACKOFF_STEPS == 8
    policy.record(2, 1, generated + 2)  # a lookup found something: the count starts afresh
    policy.found_nothing(generated + 3)
    assert policy.next_size(generated + 3) == 0 and policy.next_size(generated + 4) == 1


def reference_policy(k: int, outcomes: list[tuple[int, float]]) -> list[int]:
    """The sizes ``ProposalPolicy(k)`` must choose, step by step, written out as its rule
    says: the first is min(2, k); all accepted, two more (at most k); any rejected, one
    fewer (at least one); after f verifications in a row that accepted nothing, sit out
    the next min(2**f, MAX_BACKOFF_STEPS) decode steps; after e lookups in a row that found
    nothing, the next min(2**(e - 1), MAX_LOOKUP_BACKOFF_STEPS). ``outcomes``: per step, whether
    the lookup finds a proposal (an int: how many tokens it has, 0 for none) and which
    fraction of what is proposed is accepted."""
    size, failures, empty, skip, chosen = min(2, k), 0, 0, 0, []
    for found, fraction in outcomes:
        chosen.append(0 if skip else size)
        if skip:
            skip -= 1
            continue
        proposed = min(size, found)
        if not proposed:  # the lookup found nothing
            empty += 1
            skip = min(2 ** (empty - 1), MAX_LOOKUP_BACKOFF_STEPS)
            continue
        empty = 0
        accepted = int(fraction * proposed)
        size = min(size + 2, k) if accepted == proposed else max(size - 1, 1)
        if accepted:
            failures = 0
        else:
            failures += 1
            skip = min(2**failures, MAX_BACKOFF_STEPS)
    return chosen


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(1, 8),
    outcomes=st.lists(
        st.tuples(st.integers(0, 8), st.sampled_from([0.0, 0.0, 0.4, 1.0])), max_size=120
    ),
)
def test_proposal_policy_decides_as_its_rule_says(k, outcomes):
    """Any sequence of outcomes -- lookups finding nothing, short ones, misses, partial and
    full hits -- gives the sizes the rule in ``ProposalPolicy``'s docstring gives. The
    engine tells the policy what each step in which it looked up did, with the sample's
    output length after the step (its accepted proposals and one token of the model's
    own)."""
    policy = ProposalPolicy(k)
    chosen, generated = [], 0
    for found, fraction in outcomes:
        chosen.append(policy.next_size(generated))
        proposed = min(chosen[-1], found)
        accepted = int(fraction * proposed) if proposed else 0
        generated += accepted + 1
        if proposed:
            policy.record(proposed, accepted, generated)
        elif chosen[-1]:
            policy.found_nothing(generated)
    assert chosen == reference_policy(k, outcomes)
    assert all(0 <= size <= k for size in chosen)


def recorded_lookups(monkeypatch) -> list[list[int]]:
    """Every ``NgramLookup.propose`` answer from now on, in order (the answers unchanged)."""
    lookups = []
    original = NgramLookup.propose
    monkeypatch.setattr(
        NgramLookup, "propose", lambda self, *a: lookups.append(original(self, *a)) or lookups[-1]
    )
    return lookups


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_a_sample_whose_lookups_find_nothing_looks_less_and_less_often(backend_name, monkeypatch):
    """The engine tells each sample's policy of its empty lookups (once the step commits):
    a request whose 6-grams never repeat looks its text up every 8 tokens after the first
    few, not once a step, and its tokens are plain decoding's."""
    model = stories_model(backend_name)
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)]
    prompt = ["Once upon a time"]
    expected = outputs(engine_of(model, backend_name), prompt, params)
    lookups = recorded_lookups(monkeypatch)
    spec = {"num_speculative_tokens": 2, "prompt_lookup_max": 6, "prompt_lookup_min": 6}
    engine = engine_of(model, backend_name, speculative_config=spec)
    assert_same(outputs(engine, prompt, params), expected)
    assert lookups and not any(lookups)  # every lookup found nothing ...
    assert len(lookups) == 9  # ... at output lengths 1, 3, 6, 11, 20, 29, 38, 47, 56


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_each_empty_lookup_is_told_to_its_policy_once(backend_name, monkeypatch):
    """A sample's policy hears of an empty lookup once, after its step commits -- also when
    the next steps propose for nobody because enough sequences decode together (a request
    arriving after another's empty lookup takes the batch to ``disable_by_batch_size``)."""
    lookups, told = recorded_lookups(monkeypatch), []
    original_told = ProposalPolicy.found_nothing
    monkeypatch.setattr(
        ProposalPolicy, "found_nothing", lambda self, n: told.append(original_told(self, n))
    )
    spec = {
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 6,
        "prompt_lookup_min": 6,
        "disable_by_batch_size": 2,
    }
    engine = engine_of(stories_model(backend_name), backend_name, speculative_config=spec)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("Once upon a time", params)
    for _ in range(3):  # the first decode steps look up (and find nothing)
        engine.step()
    engine.add_request("The sun was", params)  # from its first decode on, nobody proposes
    run_to_completion(engine)
    empty = [tokens for tokens in lookups if not tokens]
    assert empty and len(told) == len(empty)


class CountingReads:
    """A speculative configuration that counts how often its ``disable_by_batch_size`` is
    read: once by every ``_propose`` that works out who proposes, never by one that skips."""

    def __init__(self, config) -> None:
        self._config, self.reads = config, 0

    def __getattr__(self, name: str):
        self.reads += name == "disable_by_batch_size"
        return getattr(self._config, name)


def proposal_log(backend_name: str, monkeypatch, spec: dict, skip: bool) -> tuple[list, int]:
    """Every step's proposals (and every lookup) of one workload with requests arriving
    while others decode -- some repeating themselves, one sampled twice, one chunked -- and
    how many steps worked out who proposes (``skip`` False: every step does)."""
    log = []
    original_propose = NgramLookup.propose
    monkeypatch.setattr(
        NgramLookup,
        "propose",
        lambda self, *a: log.append(("lookup", original_propose(self, *a))) or log[-1][1],
    )
    engine = engine_of(
        stories_model(backend_name),
        backend_name,
        speculative_config=spec,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    engine.speculative = config = CountingReads(engine.speculative)
    step_propose = engine._propose

    def logged_propose():
        if not skip:
            engine._quiet_steps = 0  # no known-quiet steps: every step works it out
        running = engine.scheduler.running
        decoding = sum(s.num_computed == s.num_tokens - 1 for s in running)
        log.append(("step", step_propose(), decoding))
        return log[-1][1]

    engine._propose = logged_propose
    arrivals = {
        0: ("Once upon a time", SamplingParams(max_tokens=90, temperature=0.0)),
        9: (
            "The cat sat on the mat. The cat sat on the mat. The cat",
            SamplingParams(max_tokens=25, temperature=0.0),
        ),
        30: ("Tom and his dog", SamplingParams(max_tokens=40, temperature=0.9, seed=3, n=2)),
        41: ("One day, a little girl " * 6, SamplingParams(max_tokens=12, temperature=0.0)),
    }
    arrivals.update(
        (step, ("The sun was", SamplingParams(max_tokens=8, temperature=0.0)))
        for step in range(50, 90, 5)
    )
    step = 0
    while engine.has_unfinished_requests() or step <= max(arrivals):
        if step in arrivals:
            engine.add_request(*arrivals[step])
        engine.step()
        step += 1
    assert_drained(engine)
    return log, config.reads


@pytest.mark.parametrize("disable_by_batch_size", [64, 3])
@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_steps_known_to_be_quiet_change_no_proposal(
    backend_name, disable_by_batch_size, monkeypatch
):
    """``_propose`` skips working out who proposes in steps it knows nobody does (every
    sample sitting out; or ``disable_by_batch_size`` decoding, with the same sequences
    running): every step's proposals and every lookup are those of an engine that works it
    out every step -- and it did skip some steps."""
    spec = {**NGRAM, "disable_by_batch_size": disable_by_batch_size}
    skipping, worked_out = proposal_log(backend_name, monkeypatch, spec, skip=True)
    monkeypatch.undo()
    every_step, steps = proposal_log(backend_name, monkeypatch, spec, skip=False)
    assert skipping == every_step
    assert any(entry[0] == "step" and entry[1] for entry in skipping)  # some proposals ...
    assert worked_out < steps  # ... and some steps known to be quiet


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_nobody_proposes_while_disable_by_batch_size_sequences_decode(backend_name, monkeypatch):
    """vLLM's rule: with ``disable_by_batch_size`` or more sequences decoding, a step has no
    proposals; with fewer, every sample that wants to propose does (here every one wants to,
    every step: its policy always says one token, and its lookup always finds one). While
    the same sequences run, the steps after the first that found the batch that large skip
    counting it."""
    monkeypatch.setattr(ProposalPolicy, "next_size", lambda self, n: 1)
    monkeypatch.setattr(ProposalPolicy, "steps_sitting_out", lambda self, n: 0)
    monkeypatch.setattr(NgramLookup, "propose", lambda self, token_ids, k: [13] * k)
    spec = {**NGRAM, "disable_by_batch_size": 3}
    log, worked_out = proposal_log(backend_name, monkeypatch, spec, skip=True)
    steps = [(proposals, decoding) for kind, proposals, *decoding in log if kind == "step"]
    assert all(proposals is None for proposals, (decoding,) in steps if decoding >= 3)
    assert any(decoding == 3 for _, (decoding,) in steps)
    assert any(proposals for proposals, (decoding,) in steps if decoding == 2)
    assert worked_out < len(steps)


# -- the engine: the same tokens as plain decoding ---------------------------------------------
request_params = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.0, 0.8, 1.3]),
        "top_p": st.sampled_from([1.0, 0.9]),
        "max_tokens": st.integers(1, 60),
        "seed": st.integers(0, 2**32),
        "n": st.sampled_from([1, 1, 2]),
        "ignore_eos": st.booleans(),
        "repetition_penalty": st.sampled_from([1.0, 1.3]),
        "presence_penalty": st.sampled_from([0.0, 0.5]),
        "logit_bias": st.sampled_from([None, {13: 2.0, 29: -1.0}]),
        "min_tokens": st.sampled_from([0, 1]),
        "logprobs": st.sampled_from([None, 2]),
        # Common tokens ("." and "her"): a stop token inside an accepted run ends it there.
        "stop_token_ids": st.sampled_from([None, [426], [311, 267]]),
    }
).map(lambda kw: SamplingParams(**{**kw, "n": kw["n"] if kw["temperature"] else 1}))


@pytest.mark.parametrize("backend_name", ["python", "fast"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=st.lists(request_params, min_size=1, max_size=4),
    num_prompts=st.integers(1, 5),
    k=st.integers(1, 5),
    lookup=st.sampled_from([(1, 2), (1, 4), (3, 3)]),
    num_blocks=st.sampled_from([16, 64]),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
)
def test_ngram_speculation_gives_plain_decodings_tokens(
    backend_name, params, num_prompts, k, lookup, num_blocks, prefix_caching, chunked
):
    model = stories_model(backend_name)
    options = {
        "num_blocks": num_blocks,
        "prefix_caching": prefix_caching,
        "enable_chunked_prefill": chunked,
        "seed": 7,
    }
    prompts = PROMPTS[:num_prompts]
    expected = outputs(engine_of(model, backend_name, **options), prompts, params)
    spec = {
        "num_speculative_tokens": k,
        "prompt_lookup_min": lookup[0],
        "prompt_lookup_max": lookup[1],
        "disable_by_batch_size": 64,
    }
    engine = engine_of(model, backend_name, speculative_config=spec, **options)
    assert_same(outputs(engine, prompts, params), expected)
    assert engine.stats.spec_accepted_tokens <= engine.stats.spec_draft_tokens
    assert_drained(engine)


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_ngram_speculation_accepts_proposals_on_repetitive_text(backend_name):
    """The fixed case the property test's examples might miss: proposals are made, some are
    accepted, fewer steps are taken, and the tokens are still plain decoding's."""
    model = stories_model(backend_name)
    params = [SamplingParams(max_tokens=100, temperature=0.0)]
    prompt = ["Tom had a red ball. Tom liked his red ball. One day, Tom had a red"]
    plain = engine_of(model, backend_name)
    expected = outputs(plain, prompt, params)
    spec = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    engine = engine_of(model, backend_name, speculative_config=spec)
    assert_same(outputs(engine, prompt, params), expected)
    stats = engine.stats  # (17 of 50 proposed tokens accepted, in 21 verifications)
    assert stats.spec_drafts > 10 and stats.spec_accepted_tokens > 10
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens <= 4 * stats.spec_drafts
    assert stats.steps < plain.stats.steps
    assert stats.generated_tokens == plain.stats.generated_tokens


@pytest.mark.parametrize("backend_name", ["python", "fast"])
def test_a_samples_first_verification_checks_a_short_proposal(backend_name):
    """The engine proposes what each sample's ``ProposalPolicy`` says: on text where the
    lookup has k tokens to offer, a request's first verification checks
    ``FIRST_PROPOSAL_SIZE`` of them, and full hits grow later ones past it."""
    model = stories_model(backend_name)
    spec = {"num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    engine = engine_of(model, backend_name, speculative_config=spec)
    prompt = "Tom had a red ball. Tom liked his red ball. One day, Tom had a red"
    engine.add_request(prompt, SamplingParams(max_tokens=100, temperature=0.0))
    verified = []  # proposed tokens verified, step by step
    while engine.has_unfinished_requests():
        engine.step()
        verified.append(engine.last_trace.spec_tokens)
    assert next(n for n in verified if n) == FIRST_PROPOSAL_SIZE
    assert max(verified) > FIRST_PROPOSAL_SIZE
    assert_drained(engine)


def replaying_proposer(engine, expected_tokens: dict[tuple, list[int]], k: int, shift: int):
    """Proposes, for each decoding sample, the plain run's next ``k`` tokens (looked up by its
    prompt) plus ``shift``: 0 is a perfect proposer, 1 an adversary whose every proposal is a
    token plain decoding did not draw there (the next id after it)."""
    vocab = engine.model.config.vocab_size

    def propose():
        proposals = {}
        for seq in engine.scheduler.running:
            if seq.num_computed != seq.num_tokens - 1:
                continue
            done = seq.num_output_tokens
            future = expected_tokens[tuple(seq.prompt_token_ids)][done : done + k]
            if future:
                proposals[seq.seq_id] = [(t + shift) % vocab for t in future]
        return proposals

    return propose


@pytest.mark.parametrize("backend_name", ["python", "fast"])
@pytest.mark.parametrize("proposer", ["perfect", "random", "wrong"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_any_proposals_leave_the_tokens_as_plain_decodings(backend_name, proposer, temperature):
    """Speculation's whole contract: whatever is proposed -- always right, random, or a
    token the model rates unlikely -- the tokens are plain decoding's, greedy or seeded; and
    the blocks of rejected proposals all come back (a small pool forces preemptions too).
    Proposals come from a stand-in for the engine's own lookup (``_propose``)."""
    model = stories_model(backend_name)
    prompts = PROMPTS[1:5]
    params = [SamplingParams(max_tokens=40, temperature=temperature, seed=3, ignore_eos=True)]
    options = {"num_blocks": 12, "seed": 1}
    plain = engine_of(model, backend_name, **options)
    expected = outputs(plain, prompts, params)
    engine = engine_of(model, backend_name, speculative_config=NGRAM, **options)
    k = 4
    futures = {
        tuple(plain.tokenizer.encode(p)): out[0][0]
        for p, out in zip(prompts, expected, strict=True)
    }
    if proposer in ("perfect", "wrong"):
        shift = 1 if proposer == "wrong" else 0
        engine._propose = replaying_proposer(engine, futures, k, shift)
    else:
        rng = np.random.default_rng(0)
        engine._propose = lambda: {
            s.seq_id: rng.integers(0, model.config.vocab_size, k).tolist()
            for s in engine.scheduler.running
            if s.num_computed == s.num_tokens - 1
        }
    assert_same(outputs(engine, prompts, params), expected)
    stats = engine.stats
    assert stats.spec_draft_tokens > 0
    if proposer == "perfect":  # most tokens came from a proposal
        assert stats.spec_accepted_tokens >= 0.6 * stats.generated_tokens
        assert stats.steps < plain.stats.steps
    if proposer == "wrong":
        assert stats.spec_accepted_tokens == 0
    assert_drained(engine)


# -- the server: stop strings inside an accepted run, and /metrics ---------------------------
def served(engine):
    serve = require_module("mie.serve")
    return serve.serve_in_thread(serve.build_app(engine, STORIES, model_name="stories260K"))


def test_the_server_ends_a_stop_string_at_the_token_that_completed_it(monkeypatch):
    """A speculative step brings several tokens; a stop string completed by one of them ends
    the answer there: its text, its token count (usage), its log-probabilities and its
    streamed tokens are a plain server's, for stop strings taken from the answer itself."""
    openai = require_module("openai")

    prompt = PROMPTS[2]  # stories260K's answer repeats itself: proposals are accepted
    with served(LLMEngine(STORIES, backend="python", num_blocks=64)) as url:
        plain = openai.OpenAI(base_url=url + "/v1", api_key="-")
        request = {"model": "stories260K", "prompt": prompt, "max_tokens": 80, "temperature": 0}
        text = plain.completions.create(**request).choices[0].text
        # Pieces of the answer, each ending it at its first occurrence: in its first words
        # (plain steps) or, longer than what the answer repeats, inside an accepted run.
        pieces = dict.fromkeys(text[max(0, end - 40) : end] for end in range(10, len(text), 12))
        expected = {
            stop: plain.completions.create(**request, stop=[stop], logprobs=1)
            for stop in pieces
            if len(stop.strip()) > 3
        }
    cuts = []
    verify = LLMEngine._verify

    def counting(self, sample, proposals, *args):
        tokens = verify(self, sample, proposals, *args)
        if sample.stopped_by_string and len(tokens) > 1:  # inside an accepted run
            cuts.append(len(tokens))
        return tokens

    monkeypatch.setattr(LLMEngine, "_verify", counting)
    engine = LLMEngine(STORIES, backend="python", num_blocks=64, speculative_config=NGRAM)
    with served(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-")
        for stop, want in expected.items():
            got = client.completions.create(**request, stop=[stop], logprobs=1)
            assert got.choices[0].text == want.choices[0].text
            assert got.usage.completion_tokens == want.usage.completion_tokens
            assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
            streamed = client.completions.create(
                **request, stop=[stop], stream=True, stream_options={"include_usage": True}
            )
            chunks = list(streamed)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
            assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
        metrics = httpx_get(url + "/metrics")
    assert cuts, "no stop string completed inside a multi-token step: the test proved nothing"
    drafts = engine.stats.spec_draft_tokens
    assert drafts > 0 and "vllm:spec_decode_num_draft_tokens_total{" in metrics
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:spec_decode_num_draft_t"))
    assert float(line.rsplit(" ", 1)[1]) == drafts


def test_the_server_passes_over_stop_strings_in_the_first_min_tokens(monkeypatch):
    """With min_tokens, a speculative step may bring tokens on both sides of the first
    min_tokens: the stop strings that end before that boundary are passed over exactly as a
    plain server passes them over (``test_serve.py`` checks the plain server's rule)."""
    openai = require_module("openai")

    prompt, stop = PROMPTS[2], " ball"
    request = {"model": "stories260K", "prompt": prompt, "max_tokens": 80, "temperature": 0}
    cases = [{**request, "stop": [stop], "extra_body": {"min_tokens": m}} for m in range(6, 40, 3)]
    with served(LLMEngine(STORIES, backend="python", num_blocks=64)) as url:
        plain = openai.OpenAI(base_url=url + "/v1", api_key="-")
        assert plain.completions.create(**request).choices[0].text.count(stop) > 3
        expected = [plain.completions.create(**case).choices[0] for case in cases]
    assert len({choice.text for choice in expected}) > 3, "min_tokens changed nothing"
    crossings = []
    verify = LLMEngine._verify

    def counting(self, sample, proposals, *args):
        before = sample.seq.num_output_tokens
        tokens = verify(self, sample, proposals, *args)
        if before < sample.request.params.min_tokens < before + len(tokens):
            crossings.append(None)  # tokens on both sides of the first min_tokens
        return tokens

    monkeypatch.setattr(LLMEngine, "_verify", counting)
    engine = LLMEngine(STORIES, backend="python", num_blocks=64, speculative_config=NGRAM)
    with served(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-")
        for case, want in zip(cases, expected, strict=True):
            got = client.completions.create(**case).choices[0]
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert crossings, "no step brought tokens on both sides of min_tokens: nothing was tested"


def httpx_get(url: str) -> str:
    httpx = require_module("httpx")
    return httpx.get(url, timeout=30).text


# -- draft models ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shuffled_stories(tmp_path_factory) -> Path:
    """A bad draft: stories260K with every weight matrix's rows shuffled (same vocabulary,
    same shapes, nonsense predictions)."""
    safetensors_numpy = require_module("safetensors.numpy")
    directory = tmp_path_factory.mktemp("draft") / "shuffled"
    shutil.copytree(STORIES, directory)
    tensors = safetensors_numpy.load_file(directory / "model.safetensors")
    rng = np.random.default_rng(0)
    shuffled = {name: rng.permutation(t) if t.ndim == 2 else t for name, t in tensors.items()}
    safetensors_numpy.save_file(shuffled, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize("backend_name", ["python", "fast"])
@pytest.mark.parametrize("draft", ["same", "shuffled"])
def test_a_draft_models_proposals_leave_the_tokens_as_plain_decodings(
    backend_name, draft, shuffled_stories
):
    """A draft model that is the target itself (every greedy proposal right) and one that
    predicts nonsense: plain decoding's tokens either way, greedy and seeded, under
    preemption; the draft's own pool is empty once the engine drains."""
    model = stories_model(backend_name)
    prompts = PROMPTS[:4]
    params = [
        SamplingParams(max_tokens=50, temperature=0.0),
        SamplingParams(max_tokens=50, temperature=1.0, seed=4, n=2),
    ]
    options = {"num_blocks": 16, "seed": 2}
    expected = outputs(engine_of(model, backend_name, **options), prompts, params)
    directory = STORIES if draft == "same" else shuffled_stories
    spec = {"model": str(directory), "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    engine = engine_of(model, backend_name, speculative_config=spec, **options)
    assert_same(outputs(engine, prompts, params), expected)
    stats = engine.stats
    assert stats.spec_draft_tokens > 0
    if draft == "same":  # the greedy requests accept every proposal
        assert stats.spec_accepted_tokens > 0.4 * stats.generated_tokens
    assert_drained(engine)
    assert engine.draft.num_drafts == 0 and engine.draft.pool.num_free == engine.pool.num_blocks
    # the draft's steps are prepared as the target's: the compiled pass on the fast backend
    assert engine.draft.prepare_inputs is engine.backend.prepare_inputs


def test_a_draft_model_must_exist_and_share_the_vocabulary(tmp_path):
    safetensors_numpy = require_module("safetensors.numpy")
    other = tmp_path / "other"  # stories260K cut to its first 256 tokens
    shutil.copytree(STORIES, other)
    config = json.loads((other / "config.json").read_text())
    tensors = safetensors_numpy.load_file(other / "model.safetensors")
    vocab = config["vocab_size"]
    cut = {name: t[:256] if t.shape[0] == vocab else t for name, t in tensors.items()}
    safetensors_numpy.save_file(cut, other / "model.safetensors")
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    with pytest.raises(FileNotFoundError, match="draft model not found"):
        LLMEngine(
            STORIES, speculative_config={"model": str(tmp_path / "x"), "num_speculative_tokens": 2}
        )
    with pytest.raises(ValueError, match="vocabulary of"):
        LLMEngine(STORIES, speculative_config={"model": str(other), "num_speculative_tokens": 2})


# -- outside oracles: transformers' generate, and a sliding-window model ------------------------
@pytest.mark.parametrize("backend_name", ["python", "fast"])
@pytest.mark.parametrize(
    "spec",
    [NGRAM, {"model": str(STORIES), "num_speculative_tokens": 4}],
    ids=["ngram", "draft"],
)
def test_greedy_speculation_matches_transformers_generate(backend_name, spec):
    """transformers' greedy ``generate`` on stories260K is the oracle: speculation (n-gram
    and a draft model) gives its tokens, several prompts in one continuous batch."""
    torch = require_module("torch")
    transformers = require_module("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    engine = engine_of(stories_model(backend_name), backend_name, speculative_config=spec)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    got = outputs(engine, PROMPTS[:3], [params])
    for prompt, (sample,) in zip(PROMPTS[:3], got, strict=True):
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=60, min_new_tokens=60, do_sample=False
            )
        assert sample[0] == out[0, len(ids) :].tolist()
    assert engine.stats.spec_accepted_tokens > 0


@pytest.fixture(scope="module")
def windowed_stories(tmp_path_factory) -> Path:
    return stories_with_window(tmp_path_factory.mktemp("windowed"), 24)


@pytest.mark.parametrize("backend_name", ["python", "fast"])
@pytest.mark.parametrize("chunked", [True, False])
def test_speculation_under_a_sliding_window(backend_name, chunked, windowed_stories):
    """A windowed model releases the blocks behind its window as sequences advance, several
    tokens a step here: plain decoding's tokens, in a pool too small for every context."""
    model = stories_model(backend_name, windowed_stories)
    params = [
        SamplingParams(max_tokens=90, temperature=0.0),
        SamplingParams(max_tokens=90, temperature=0.9, seed=5),
    ]
    # Whole prompts hold a whole context at once (a preempted sequence is recomputed in one
    # prefill); chunks need only a window's blocks.
    num_blocks = 14 if chunked else 40
    options = {"num_blocks": num_blocks, "enable_chunked_prefill": chunked, "block_size": 4}
    expected = outputs(engine_of(model, backend_name, **options), PROMPTS[:4], params)
    spec = {**NGRAM, "disable_by_batch_size": 64}
    engine = engine_of(model, backend_name, speculative_config=spec, **options)
    assert_same(outputs(engine, PROMPTS[:4], params), expected)
    assert engine.stats.spec_accepted_tokens > 0
    assert_drained(engine)


def test_proposals_are_cut_where_the_grammar_would_refuse_them():
    """``GrammarMatcher.num_valid`` (llguidance's ``validate_tokens``): how many proposed
    tokens the grammar takes from where the sample is, nothing consumed."""
    from mie.engine.structured import StructuredOutputsParams

    engine = LLMEngine(STORIES, backend="python", num_blocks=16)
    matcher = engine.grammar.matcher(StructuredOutputsParams(choice=["Lily is happy", "no"]))
    valid = []  # a path the grammar takes: the lowest allowed token, three times
    for _ in range(3):
        valid.append(int(np.flatnonzero(matcher.allowed())[0]))
        matcher.consume(valid[-1])
    matcher.rollback_to(0)
    refused = int(np.flatnonzero(~matcher.allowed())[0])
    assert matcher.num_valid(valid) == 3
    assert matcher.num_valid(valid[:1] + [refused] + valid[1:]) == 1
    assert matcher.num_valid([refused, *valid]) == 0
    assert matcher.num_consumed == 0 and matcher.num_valid(valid) == 3  # nothing consumed
    matcher.consume(valid[0])
    assert matcher.num_valid(valid[1:]) == 2


def test_a_draft_gives_its_blocks_back_when_its_sample_is_finished_or_aborted():
    """A caller ending a sample (a stop string) or a request between steps leaves the draft's
    pool empty at once, even if no step follows."""
    spec = {"model": str(STORIES), "num_speculative_tokens": 2, "disable_by_batch_size": 64}
    engine = LLMEngine(STORIES, backend="python", num_blocks=16, speculative_config=spec)
    for request_id in ("a", "b"):
        engine.add_request("Once upon a time", SamplingParams(max_tokens=40), request_id)
    for _ in range(4):
        engine.step()
    assert engine.draft.num_drafts == 2
    engine.finish_sample("a", 0)
    assert engine.draft.num_drafts == 1
    engine.abort_request("b")
    assert engine.draft.num_drafts == 0 and engine.draft.pool.num_free == engine.pool.num_blocks
    assert_drained(engine)


@pytest.mark.parametrize("backend_name", ["python", "fast"])
@pytest.mark.parametrize("failing_call", [1, 3, 4])
def test_a_failing_draft_fails_its_step_as_a_step_error_and_costs_nothing(
    backend_name, failing_call
):
    """The draft model's forward pass raising (its first, catch-up pass or a later one) fails
    the step like the target's would: a StepError naming the running requests, nothing
    scheduled, and the drafts it was computing dropped -- so the next steps go on with the
    same tokens as plain decoding's and the draft's pool drains."""
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLMEngine(STORIES, backend=backend_name, num_blocks=64)
    for request_id in ("a", "b"):
        plain.add_request("Once upon a time", params, request_id)
    expected = {r: out.outputs[0].token_ids for r, out in run_to_completion(plain).items()}

    spec = {"model": str(STORIES), "num_speculative_tokens": 3}
    engine = LLMEngine(STORIES, backend=backend_name, num_blocks=64, speculative_config=spec)
    for request_id in ("a", "b"):
        engine.add_request("Once upon a time", params, request_id)
    forward, calls = engine.draft.model.forward, []

    def failing_forward(*args, **kwargs):
        calls.append(None)
        if len(calls) == failing_call:
            raise MemoryError("injected draft failure")
        return forward(*args, **kwargs)

    engine.draft.model.forward = failing_forward
    failures, done = [], {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except StepError as error:
            failures.append(error)
            assert isinstance(error.__cause__, MemoryError)
            assert engine.draft.num_drafts == 0  # both were in the failed proposal
            continue
        done.update({o.request_id: o for o in outputs if o.finished})
    assert len(failures) == 1 and set(failures[0].request_ids) == {"a", "b"}
    assert {r: out.outputs[0].token_ids for r, out in done.items()} == expected
    assert engine.stats.spec_accepted_tokens > 0  # the draft proposed, and was right, afterwards
    assert_drained(engine)
    assert engine.draft.pool.num_free == engine.draft.pool.num_blocks
