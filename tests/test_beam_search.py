"""Beam search against transformers' ``generate(num_beams=k, do_sample=False)``, the oracle.

Two levels: the algorithm alone (``BeamSearch`` fed transformers' own log-softmax, so only the
search itself is compared), and ``LLM.beam_search`` end to end on both backends (mie's
log-probabilities from the engine, its blocks borrowed from the prefix cache), on stories260K
and tiny random Llama / Qwen2 checkpoints. Returned beams and their scores must equal
transformers' ``sequences`` and ``sequences_scores``, best first.
"""

import json
import shutil
from pathlib import Path

import pytest
from conftest import backend_named, require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, BeamSearchParams, InvalidRequestError, SamplingParams
from mie.engine.beam_search import BeamSearch
from mie.engine.outputs import Logprob
from mie.extension import BACKENDS

torch = require_module("torch")
transformers = require_module("transformers")
torch.set_num_threads(1)
from test_model_hf import SPECS, build_hf_model  # noqa: E402 (needs torch, as above)

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
# transformers sums float32 log-probabilities: sums of -100 (a negative length penalty
# multiplies them) carry float32's relative error.
SCORE_TOLERANCE = {"abs": 1e-4, "rel": 1e-5}
NO_EOS = ()  # hf_beam_search(eos=NO_EOS): no EOS at all


@pytest.fixture(scope="module")
def stories_hf():
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    return hf.eval()


def hf_beam_search(hf, prompt, params: BeamSearchParams, eos=None):
    """transformers' beams for one prompt: [(generated tokens, score)], best first."""
    kwargs = {"eos_token_id": None if eos is NO_EOS else eos} if eos is not None else {}
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            output_scores=True,
            return_dict_in_generate=True,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=0,
            **kwargs,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # generated tokens per beam
    sequences = out.sequences[:, len(prompt) :].tolist()
    scores = out.sequences_scores.tolist()
    return [(seq[:n], s) for seq, n, s in zip(sequences, lengths, scores, strict=True)]


def hf_logprobs(hf, tokens):
    """transformers' log-softmax of the next token after ``tokens``, as mie's logprob rows."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, -1].double()
    row = torch.log_softmax(logits, dim=-1).tolist()
    return {token: Logprob(lp) for token, lp in enumerate(row)}


def assert_same_beams(ours, theirs, prompt):
    """Same beams in the same order, with the same scores. Where two neighbours' scores tie
    within the tolerance (float32 sums), their order is free: the beams match as a set."""
    assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], **SCORE_TOLERANCE)
    scores = [s for _, s in ours]
    if all(
        a != pytest.approx(b, **SCORE_TOLERANCE) for a, b in zip(scores, scores[1:], strict=False)
    ):
        assert [t for t, _ in ours] == [t for t, _ in theirs], prompt
    else:
        assert sorted(t for t, _ in ours) == sorted(t for t, _ in theirs), prompt


params_strategy = st.builds(
    BeamSearchParams,
    beam_width=st.integers(2, 5),  # 1: transformers runs greedy search instead
    max_tokens=st.integers(1, 24),
    length_penalty=st.sampled_from([1.0, 0.0, -0.7, 2.0]),
    early_stopping=st.sampled_from([False, True, "never"]),
)
# stories260K's own EOS tokens (1, 2) hardly ever come within 24 tokens; '.' (426), ',' (432)
# and ' the' (265) come all the time, so beams finish at every step and every rule acts.
EOS_SETS = [(1, 2), (426,), (426, 432), (265, 426, 432)]


def run_search(prompt, params, eos, next_logprobs):
    """Run a search to its end; check on the way that ``parents`` names each running beam's
    parent (the beam whose KV it forks)."""
    search = BeamSearch(prompt, params, eos_token_ids=eos)
    while not search.done:
        before = [beam.generated for beam in search.running]
        search.advance([next_logprobs(t) for t in search.beam_prompts()])
        for beam, parent in zip(search.running, search.parents, strict=True):
            assert beam.generated[:-1] == before[parent]
    return search


# -- the algorithm alone ---------------------------------------------------------------------------


@settings(max_examples=40)
@given(
    params=params_strategy,
    eos=st.sampled_from(EOS_SETS),
    prompt=st.lists(st.integers(3, 511), min_size=1, max_size=12),
)
def test_the_search_equals_transformers_given_its_log_probabilities(
    stories_hf, params, eos, prompt
):
    """Every beam width, length penalty (positive, zero, negative), early-stopping mode,
    length and number of EOS tokens (which sets how many candidates a step ranks)."""
    prompt = [1, *prompt]
    search = run_search(prompt, params, eos, lambda t: hf_logprobs(stories_hf, t))
    ours = [(s.tokens[len(prompt) :], s.score) for s in search.output().sequences]
    assert_same_beams(ours, hf_beam_search(stories_hf, prompt, params, list(eos)), prompt)


def test_beams_that_end_at_eos_carry_it_count_it_and_hide_it_from_the_text(stories_hf):
    """A beam finished by EOS ends with the EOS token, its length (for the length penalty)
    counts it, its finish_reason is "stop"; one cut by max_tokens says "length"."""
    prompt = [1, 403, 407, 261, 378]
    params = BeamSearchParams(4, 16, length_penalty=2.0)
    search = run_search(prompt, params, (426,), lambda t: hf_logprobs(stories_hf, t))
    sequences = search.output(decode=lambda prompt, ids: " ".join(map(str, ids))).sequences
    reasons = {s.finish_reason for s in sequences}
    assert reasons == {"stop", "length"}  # both kinds in this search
    for s in sequences:
        generated = s.tokens[len(prompt) :]
        stopped = generated[-1] == 426
        assert s.finish_reason == ("stop" if stopped else "length")
        assert len(generated) == 16 or stopped
        assert s.score == pytest.approx(s.cum_logprob / len(generated) ** 2.0)
        assert s.text == " ".join(map(str, generated[:-1] if stopped else generated))
        assert len(s.logprobs) == len(generated)
        assert s.cum_logprob == pytest.approx(
            sum(row[t].logprob for row, t in zip(s.logprobs, generated, strict=True))
        )
    assert [s.score for s in sequences] == sorted((s.score for s in sequences), reverse=True)


# -- LLM.beam_search end to end --------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_eos(tmp_path_factory):
    """stories260K whose generation_config.json says EOS is '.' (426) or ',' (432): the same
    weights and tokenizer, and beams that finish all the time (for mie and transformers)."""
    directory = tmp_path_factory.mktemp("stories_eos")
    for f in STORIES.iterdir():
        if f.is_file():
            shutil.copy(f, directory / f.name)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [426, 432]}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return directory, hf.eval()


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    """Tiny random Llama and Qwen2 checkpoints (test_model_hf's), EOS set to two tokens their
    greedy continuation of PROMPT uses, so beams meet them."""
    models = []
    for name in ("llama-gqa2-hd16-tied-fp32", "qwen2-gqa1-hd16-untied-fp32"):
        directory = tmp_path_factory.mktemp(name)
        build_hf_model(SPECS[name], seed=len(name)).save_pretrained(directory)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            greedy = hf.generate(
                torch.tensor([RANDOM_PROMPT]), max_new_tokens=6, do_sample=False, pad_token_id=0
            )[0, len(RANDOM_PROMPT) :].tolist()
        eos = sorted({greedy[2], greedy[5]})
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        models.append((directory, hf.eval()))
    return models


RANDOM_PROMPT = [5, 77, 140, 3, 250, 19, 64]
E2E_PARAMS = [
    BeamSearchParams(4, 20),
    BeamSearchParams(3, 30, length_penalty=0.0, early_stopping=True),
    BeamSearchParams(5, 12, length_penalty=-0.5, early_stopping="never"),
]


def assert_llm_matches_transformers(llm, hf, prompts, params):
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.sequences) == params.beam_width
        assert all(s.tokens[: len(prompt)] == prompt for s in output.sequences)
        ours = [(s.tokens[len(prompt) :], s.score) for s in output.sequences]
        assert_same_beams(ours, hf_beam_search(hf, prompt, params), prompt)
    return outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", E2E_PARAMS, ids=["default", "early-stop", "never"])
def test_llm_beam_search_equals_transformers_on_stories(stories_eos, backend, params):
    """Three prompts searched together, each one's beams and scores transformers' own."""
    directory, hf = stories_eos
    llm = LLM(directory, backend=backend_named(backend))
    prompts = [[1, 403, 407, 261, 378], [1, 9, 50, 70], [1, 338, 401, 396, 267, 337] * 3]
    outputs = assert_llm_matches_transformers(llm, hf, prompts, params)
    reasons = {s.finish_reason for o in outputs for s in o.sequences}
    assert "stop" in reasons  # beams finished at EOS, not only at max_tokens
    # Each beam's text is what its tokens add to the prompt's text (transformers' decoding of
    # the whole, less the prompt's): prompt + text reads right, spaces included.
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    for prompt, output in zip(prompts, outputs, strict=True):
        for beam in output.sequences:
            shown = beam.tokens[: -1 if beam.finish_reason == "stop" else None]
            whole = tokenizer.decode(shown, skip_special_tokens=True)
            assert beam.text == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]


@pytest.fixture(scope="module")
def stories_eos_llm(stories_eos):
    return LLM(stories_eos[0])


@settings(max_examples=12)
@given(
    params=params_strategy,
    prompts=st.lists(
        st.lists(st.integers(3, 511), min_size=1, max_size=20), min_size=1, max_size=3
    ),
)
def test_llm_beam_search_equals_transformers_on_any_params(
    stories_eos, stories_eos_llm, params, prompts
):
    """Any width, penalty, early-stopping mode and length; up to three prompts at once, some
    longer than a block (so their beams borrow prompt blocks from the prefix cache)."""
    _, hf = stories_eos
    assert_llm_matches_transformers(stories_eos_llm, hf, [[1, *p] for p in prompts], params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_llm_beam_search_equals_transformers_on_random_llama_and_qwen2(random_models, backend):
    for directory, hf in random_models:
        llm = LLM(directory, backend=backend_named(backend))
        reasons = set()
        for params in E2E_PARAMS[:2]:
            prompts = [RANDOM_PROMPT, RANDOM_PROMPT[:3]]
            outputs = assert_llm_matches_transformers(llm, hf, prompts, params)
            reasons.update(s.finish_reason for o in outputs for s in o.sequences)
        assert reasons == {"stop", "length"}, directory.name  # EOS and max_tokens both met


def test_ignore_eos_searches_as_transformers_without_eos(stories_eos):
    """ignore_eos: EOS tokens are ordinary tokens (transformers' eos_token_id=None), every
    beam runs to max_tokens."""
    directory, hf = stories_eos
    llm = LLM(directory)
    prompt = [1, 403, 407, 261, 378]
    params = BeamSearchParams(3, 18, ignore_eos=True)
    (output,) = llm.beam_search({"prompt_token_ids": prompt}, params, use_tqdm=False)
    theirs = hf_beam_search(hf, prompt, params, eos=NO_EOS)
    ours = [(s.tokens[len(prompt) :], s.score) for s in output.sequences]
    assert_same_beams(ours, theirs, prompt)
    assert all(s.finish_reason == "length" and len(s.tokens) == 5 + 18 for s in output.sequences)
    assert any(t in (426, 432) for s in output.sequences for t in s.tokens[5:-1])  # went past


# -- blocks: beams fork by borrowing them and die by releasing them --------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_beams_borrow_every_full_block_and_release_all_at_the_end(stories_eos, backend):
    """Each step's request for a beam of n tokens computes only the tokens of its last block
    (n - 16 * ((n - 1) // 16)): every full block before it is borrowed from the prefix cache.
    While a step's requests run, the pool holds one block per distinct token prefix ending a
    full block before the last one (beams descending from one ancestor share its blocks) plus
    one last block per beam -- the formula the sampling_sharing figure's simulation is tested
    against (tests/test_bench.py). The first request of a prompt computes it whole (nothing
    cached yet). At the end no table holds a block: they are idle cached blocks."""
    directory, _ = stories_eos
    llm = LLM(directory, backend=backend_named(backend), block_size=16)
    rounds = []  # (the beams' tokens, the traces of the steps that ran them)
    generate, step = llm.generate, llm.engine.step

    def recording_generate(prompts, params, use_tqdm=True):
        rounds.append(([tuple(p["prompt_token_ids"]) for p in prompts], []))
        return generate(prompts, params, use_tqdm=use_tqdm)

    def recording_step():
        outputs = step()
        rounds[-1][1].append(llm.engine.last_trace)
        return outputs

    llm.generate, llm.engine.step = recording_generate, recording_step
    prompts = [[1, 403, 407, 261, 378], [1, 9, 50, 70, 338, 401, 396]]
    params = BeamSearchParams(4, 40, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(rounds) == 40
    assert rounds[0][0] == [tuple(p) for p in prompts]
    later = [len(t) for beams, _ in rounds[1:] for t in beams]
    stats = llm.engine.stats
    assert stats.prefix_hit_tokens == sum(16 * ((n - 1) // 16) for n in later)
    assert stats.prompt_tokens == sum(map(len, prompts)) + sum(
        n - 16 * ((n - 1) // 16) for n in later
    )
    for beams, traces in rounds:
        assert len(traces) == 1  # a round is one step: every beam's request runs at once
        full = {t[: (j + 1) * 16] for t in beams for j in range((len(t) - 1) // 16)}
        assert traces[0].reserved_tokens == 16 * (len(full) + len(beams))
    assert max(traces[0].sharing_saved_fraction for _, traces in rounds) > 0.4
    llm.engine.step()  # an empty step, for its trace of what tables hold now
    assert llm.engine.last_trace.reserved_tokens == 0
    assert llm.engine.last_trace.cached_blocks > 0


def test_without_the_prefix_cache_beams_are_the_same(stories_eos):
    """prefix_caching=False: every step recomputes each beam whole (nothing running to borrow
    from), slower, the same beams."""
    directory, hf = stories_eos
    llm = LLM(directory, prefix_caching=False)
    assert_llm_matches_transformers(llm, hf, [[1, 403, 407, 261, 378]], BeamSearchParams(3, 12))
    assert llm.engine.stats.prefix_hit_tokens == 0


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("beam_width", 0),
        ("beam_width", -1),
        ("beam_width", 2.0),
        ("beam_width", True),
        ("beam_width", 21),
        ("beam_width", "4"),
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("max_tokens", None),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", True),
        ("length_penalty", float("nan")),
        ("length_penalty", float("-inf")),
        ("length_penalty", "1"),
        ("early_stopping", "always"),
        ("early_stopping", 1),
        ("early_stopping", None),
    ],
)
def test_bad_params_are_refused_naming_the_field(field, value):
    arguments = {"beam_width": 2, "max_tokens": 4, field: value}
    with pytest.raises(InvalidRequestError, match=field):
        BeamSearchParams(**arguments)


@pytest.fixture
def stories_llm():
    return LLM(STORIES)


def refused_with_nothing_run(llm, prompts, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.beam_search(prompts, params, use_tqdm=False)
    assert llm.engine.stats.steps == 0 and not llm.engine.has_unfinished_requests()


def test_too_wide_for_the_log_probabilities_is_refused_before_anything_runs(stories_llm):
    """beam_width + #EOS log-probabilities per beam: stories260K has 2 EOS tokens, so 18 is
    the widest (20, MAX_LOGPROBS)."""
    prompt = {"prompt_token_ids": [1, 403]}
    refused_with_nothing_run(stories_llm, prompt, BeamSearchParams(19, 4), "beam_width 19")


def test_bad_prompts_and_lengths_are_refused_before_anything_runs(stories_llm):
    good = {"prompt_token_ids": [1, 403]}
    params = BeamSearchParams(2, 4)
    refused_with_nothing_run(stories_llm, [good, {"prompt_token_ids": [1, 512]}], params, "512")
    refused_with_nothing_run(stories_llm, [good, b"bytes"], params, "bytes")
    refused_with_nothing_run(stories_llm, good, BeamSearchParams(2, 511), "max_tokens")
    sampling = SamplingParams(max_tokens=4)
    refused_with_nothing_run(stories_llm, good, sampling, "expected BeamSearchParams")


def test_text_prompts_and_a_single_prompt_are_accepted(stories_llm):
    """A str prompt is tokenized as generate's are; one prompt (not in a list) is one output."""
    params = BeamSearchParams(2, 6)
    (by_text,) = stories_llm.beam_search("Once upon a time", params, use_tqdm=False)
    ids = stories_llm.engine.tokenizer.encode("Once upon a time")
    (by_ids,) = stories_llm.beam_search([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]
    assert by_text.sequences[0].tokens[: len(ids)] == ids


@settings(max_examples=15)
@given(
    eos=st.sampled_from(EOS_SETS),
    length_penalty=st.sampled_from([1.0, 0.0, -0.7, 2.0]),
    early_stopping=st.sampled_from([False, True]),
    prompt=st.lists(st.integers(3, 511), min_size=1, max_size=12),
)
def test_width_one_is_greedy_search(stories_hf, eos, length_penalty, early_stopping, prompt):
    """beam_width=1: transformers' generate(num_beams=1) runs greedy search, not its beam
    search, so it is not the oracle there; mie runs its beam search with one beam, which is
    greedy decoding: when the best token is an EOS the finished hypothesis beats the running
    beam at the same length and the search stops. (With early_stopping="never" and a positive
    length_penalty the running beam is judged at max_tokens instead and may go on past an EOS:
    there width 1 is not greedy, by transformers' own heuristic.)"""
    prompt = [1, *prompt]
    params = BeamSearchParams(1, 20, length_penalty=length_penalty, early_stopping=early_stopping)
    search = run_search(prompt, params, eos, lambda t: hf_logprobs(stories_hf, t))
    (best,) = search.output().sequences
    with torch.no_grad():
        greedy = stories_hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt) :].tolist()
    assert best.tokens[len(prompt) :] == greedy


def test_width_one_with_never_goes_past_greedys_eos(stories_hf):
    """The difference pinned: early_stopping="never" with length_penalty 2 judges the running
    beam at max_tokens, so one beam goes on past the EOS where greedy search stops, and
    returns a longer sequence that scores higher by the same rule."""
    prompt = [1, 76, 421, 485, 129, 161]
    params = BeamSearchParams(1, 20, length_penalty=2.0, early_stopping="never")
    search = run_search(prompt, params, (426,), lambda t: hf_logprobs(stories_hf, t))
    (best,) = search.output().sequences
    with torch.no_grad():
        greedy = stories_hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=[426],
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt) :].tolist()
    assert greedy[-1] == 426 and len(greedy) < 20  # greedy stopped at its first EOS
    generated = best.tokens[len(prompt) :]
    # the same path up to greedy's EOS, where the beam takes the best other token instead
    assert generated[: len(greedy) - 1] == greedy[:-1] and generated[len(greedy) - 1] != 426
    assert len(generated) > len(greedy)
    greedy_sum = sum(
        hf_logprobs(stories_hf, prompt + greedy[:i])[t].logprob for i, t in enumerate(greedy)
    )
    assert best.score > greedy_sum / len(greedy) ** 2.0
