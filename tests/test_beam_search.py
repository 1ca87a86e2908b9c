"""Beam search against transformers' ``generate(num_beams=k, do_sample=False)``, the oracle.

Two levels: the algorithm alone (``BeamSearch`` fed transformers' own log-softmax, so only the
search itself is compared), and ``LLM.beam_search`` end to end on both backends (mie's
log-probabilities from the engine, its blocks borrowed from the prefix cache), on stories260K
and tiny random Llama / Qwen2 checkpoints. Returned beams and their scores must equal
transformers' ``sequences`` and ``sequences_scores``, best first.
"""

from pathlib import Path

import pytest
from conftest import require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import BeamSearchParams
from mie.engine.beam_search import BeamSearch
from mie.engine.outputs import Logprob

torch = require_module("torch")
transformers = require_module("transformers")
torch.set_num_threads(1)

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
# transformers sums float32 log-probabilities: sums of -100 (a negative length penalty
# multiplies them) carry float32's relative error.
SCORE_TOLERANCE = {"abs": 1e-4, "rel": 1e-5}


@pytest.fixture(scope="module")
def stories_hf():
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    return hf.eval()


def hf_beam_search(hf, prompt, params: BeamSearchParams, eos=None):
    """transformers' beams for one prompt: [(generated tokens, score)], best first."""
    kwargs = {"eos_token_id": eos} if eos is not None else {}
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


# -- the algorithm alone ---------------------------------------------------------------------------


@settings(max_examples=25)
@given(params=params_strategy, prompt=st.lists(st.integers(3, 511), min_size=1, max_size=12))
def test_the_search_equals_transformers_given_its_log_probabilities(stories_hf, params, prompt):
    """Every beam width, length penalty (positive, zero, negative), early-stopping mode and
    length; stories260K stops at EOS tokens 1 and 2 often enough for every rule to act."""
    prompt = [1, *prompt]
    search = BeamSearch(prompt, params, eos_token_ids=(1, 2))
    while not search.done:
        search.advance([hf_logprobs(stories_hf, t) for t in search.beam_prompts()])
    ours = [(s.tokens[len(prompt) :], s.score) for s in search.output().sequences]
    assert_same_beams(ours, hf_beam_search(stories_hf, prompt, params), prompt)
