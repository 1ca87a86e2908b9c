"""``LLM.generate`` on an engine that also runs someone else's requests.

``generate`` waits for exactly its own requests, leaves the others running (their outputs,
which each step returns once, kept in ``LLM.other_outputs``), and cleans up on every exit.
Counting another request's finished output as its own would return early, raise
``KeyError`` outside the ``try`` that aborts its requests, and leave its own request in the
engine, so that every later ``generate`` / ``beam_search`` would fail the same way.
"""

from pathlib import Path

import pytest
from conftest import run_to_completion

from mie import LLM, SamplingParams
from mie.engine.beam_search import BeamSearchParams

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def alone(llm_args: dict, prompt: str, params: SamplingParams) -> list[int]:
    return LLM(STORIES, **llm_args).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("foreign_tokens", [3, 40])  # finishes during generate / outlives it
def test_generate_waits_for_its_own_requests_and_leaves_others_running(backend, foreign_tokens):
    args = {"backend": backend, "num_blocks": 64}
    foreign_params = SamplingParams(temperature=0.0, max_tokens=foreign_tokens, ignore_eos=True)
    expected_foreign = alone(args, "Lily", foreign_params)
    expected_mine = alone(args, "Once upon a time", GREEDY)
    llm = LLM(STORIES, **args)
    engine = llm.engine
    foreign = engine.add_request("Lily", foreign_params, request_id="theirs")
    (mine,) = llm.generate("Once upon a time", GREEDY, use_tqdm=False)
    assert mine.request_id != foreign and mine.finished
    assert mine.outputs[0].token_ids == expected_mine
    # Nothing of generate's is left; the foreign request is where its owner left it.
    if foreign_tokens < GREEDY.max_tokens:  # it ended during generate: its output is kept
        assert not engine.has_unfinished_requests()
        assert llm.other_outputs[foreign].finished
        assert llm.other_outputs[foreign].outputs[0].token_ids == expected_foreign
    else:
        assert engine.num_unfinished_requests == 1
        (theirs,) = run_to_completion(engine).values()  # its owner steps it to the end
        assert theirs.request_id == foreign and theirs.outputs[0].token_ids == expected_foreign
    # The engine is not wedged: a later generate and beam_search work.
    again = llm.generate(["Once upon a time", "Tom had"], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected_mine
    beams = llm.beam_search(["Lily"], BeamSearchParams(beam_width=2, max_tokens=4), False)
    assert len(beams[0].sequences) == 2
    assert not engine.has_unfinished_requests()


def test_generate_cleans_up_when_a_later_prompt_is_refused(backend):
    llm = LLM(STORIES, backend=backend, num_blocks=64)
    llm.engine.add_request("Lily", GREEDY, request_id="theirs")
    with pytest.raises(ValueError):
        llm.generate(["Once upon a time", [10**6]], GREEDY, use_tqdm=False)
    assert llm.engine.num_unfinished_requests == 1  # theirs only
    assert list(run_to_completion(llm.engine)) == ["theirs"]
