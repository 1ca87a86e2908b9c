"""One request may not take every batch slot and the head of the queue.

The rule: a request's samples (``best_of``, ``n`` by default) are at most half the engine's
sequence slots, ``best_of <= max(1, max_num_seqs // 2)``; ``add_request`` refuses more with
``InvalidRequestError`` before anything is queued. So with the largest legal request running,
a client arriving after it still finds a free slot: measured in engine steps (deterministic,
unlike seconds), its first token comes within 5 steps of its arrival where alone it comes in
1, and its text is the same as alone.
"""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import InvalidRequestError, SamplingParams
from mie.model import Model

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
MAX_NUM_SEQS = 8
LATER = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)  # the later client


def steps_to_first_token_and_text(engine: LLMEngine, request_id: str) -> tuple[int, list[int]]:
    """Step until ``request_id`` has its first token (counted), then on to its end."""
    first, steps, tokens = None, 0, None
    while tokens is None:
        steps += 1
        for output in engine.step():
            if output.request_id == request_id:
                if first is None and output.outputs[0].token_ids:
                    first = steps
                if output.finished:
                    tokens = output.outputs[0].token_ids
    return first, tokens


def largest_legal_request(engine: LLMEngine) -> tuple[str, int]:
    """Add the request with the most samples the engine accepts (OpenAI's cap, 128, down)."""
    for best_of in range(128, 0, -1):
        params = SamplingParams(n=best_of, temperature=1.0, seed=5, max_tokens=400, ignore_eos=True)
        try:
            return engine.add_request("Once upon a time", params, "big"), best_of
        except InvalidRequestError:
            continue
    raise AssertionError("no request accepted")


def test_a_later_client_is_served_beside_the_largest_legal_request(backend):
    args = {"backend": backend, "num_blocks": 400, "max_num_seqs": MAX_NUM_SEQS}
    alone_engine = LLMEngine(STORIES, **args)
    alone_engine.add_request("Tom had a", LATER, "later")
    alone_steps, alone_text = steps_to_first_token_and_text(alone_engine, "later")
    assert alone_steps == 1
    engine = LLMEngine(STORIES, **args)
    _, best_of = largest_legal_request(engine)
    for _ in range(3):  # the first sample computes the prompt, the others are forked and run
        engine.step()
    assert len(engine.scheduler.running) == min(best_of, MAX_NUM_SEQS)
    engine.add_request("Tom had a", LATER, "later")
    steps, text = steps_to_first_token_and_text(engine, "later")
    assert steps <= 5 * alone_steps
    assert text == alone_text
    assert engine.has_unfinished_requests()  # the large request is still running beside it
    assert best_of == MAX_NUM_SEQS // 2


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.from_pretrained(STORIES)


@settings(max_examples=40, deadline=None)
@given(max_num_seqs=st.integers(1, 40), n=st.integers(1, 64), extra=st.integers(0, 64))
def test_best_of_beyond_half_the_slots_is_refused_with_nothing_queued(
    model, max_num_seqs, n, extra
):
    engine = LLMEngine(model, num_blocks=8, max_num_seqs=max_num_seqs)
    params = SamplingParams(n=n, best_of=n + extra, temperature=1.0, max_tokens=4)
    limit = max(1, max_num_seqs // 2)
    if params.best_of <= limit:
        engine.add_request([1, 2, 3], params)
        assert engine.num_unfinished_requests == 1
        return
    with pytest.raises(InvalidRequestError, match="best_of") as caught:
        engine.add_request([1, 2, 3], params)
    message = str(caught.value)
    assert f"limit of {limit}" in message and "max_num_seqs" in message
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    # Nothing changed: the next request is the engine's first arrival, its id "0".
    assert engine.add_request([1, 2, 3], SamplingParams(max_tokens=4)) == "0"


def test_a_batch_of_prompts_is_held_to_one_requests_share(backend):
    """A client's batch (``add_requests``, the server's prompt lists) counts all its samples
    as one request's: the largest legal batch leaves the later client its slot, and one over
    the limit is refused with nothing queued."""
    args = {"backend": backend, "num_blocks": 400, "max_num_seqs": MAX_NUM_SEQS}
    engine = LLMEngine(STORIES, **args)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=400, ignore_eos=True)
    limit = engine.max_samples_per_request // params.best_of  # prompts of 2 samples each
    with pytest.raises(InvalidRequestError, match="prompt batch of 3 prompts x best_of 2"):
        engine.add_requests(["Once"] * (limit + 1), params, ["a", "b", "c"])
    assert not engine.has_unfinished_requests() and engine._num_arrivals == 0
    engine.add_requests(["Once upon a time"] * limit, params, ["b0", "b1"])
    for _ in range(3):
        engine.step()
    engine.add_request("Tom had a", LATER, "later")
    steps, text = steps_to_first_token_and_text(engine, "later")
    alone = LLMEngine(STORIES, **args)
    alone.add_request("Tom had a", LATER, "later")
    assert steps <= 5
    assert text == steps_to_first_token_and_text(alone, "later")[1]
