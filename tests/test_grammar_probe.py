"""A grammar that would take too long to build is refused on the clock, and the engine goes on.

Oracle: the wall clock. The slow grammar is a JSON schema with 400 ``patternProperties``,
which llguidance takes about 30 s to build on a 2-core EPYC (its build time grows like n**4),
far beyond ``COMPILE_TIMEOUT``; nothing else in the test is slow.
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import time
from pathlib import Path

import llguidance
import pytest

from mie import InvalidRequestError, LLMEngine, SamplingParams, StructuredOutputsParams
from mie.engine.grammar_probe import COMPILE_TIMEOUT, GrammarProbe, GrammarTimeoutError
from mie.engine.structured import PARSER_LIMITS

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
SLOW_SCHEMA = {
    "type": "object",
    "patternProperties": {f"^p{i}_": {"type": "integer"} for i in range(400)},
}


def grammar_of(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


def test_the_probe_waits_on_descriptors_past_1023_as_a_busy_server_has_them():
    """``select.select`` refuses descriptors from 1024 on (a ValueError, a 500 for a server
    holding a thousand connections when a new grammar came): the probe's pipes opened with
    the low descriptors taken must still be waited on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1100
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.fail(f"the hard limit on open files, {hard}, leaves no descriptor past 1023")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held = []
    probe = GrammarProbe(PARSER_LIMITS)
    try:
        while not held or held[-1] < 1050:  # the lowest free descriptors, taken
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert probe.check(grammar_of({"type": "integer"})) == ""
        assert probe._child.stdout.fileno() > 1023
    finally:
        probe.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_engine_dropped_takes_its_probe_process_and_pipes_along():
    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))
    gc.collect()  # what earlier tests left for the collector closes now, not in the count
    before = open_descriptors()
    for _ in range(3):
        engine = LLMEngine(STORIES, num_blocks=16)
        engine.add_request("Once", params)  # a new grammar: the probe's child starts
        child = engine.grammar._probe._child
        assert child.poll() is None
        del engine
        gc.collect()
        assert child.poll() is not None, "the probe's child outlived its engine"
    assert open_descriptors() <= before  # none left open (another test's may close meanwhile)


def test_a_grammar_slower_than_the_timeout_is_refused_in_time_and_the_probe_recovers():
    probe = GrammarProbe(PARSER_LIMITS, timeout=0.5)
    try:
        assert probe.check(grammar_of({"type": "integer"})) == ""
        start = time.monotonic()
        with pytest.raises(GrammarTimeoutError, match="longer than 0.5 s"):
            probe.check(grammar_of(SLOW_SCHEMA))
        assert time.monotonic() - start < 0.5 + 1.0  # refused on time, not after the build
        assert probe._child is None  # killed
        assert probe.check(grammar_of({"type": "string"})) == ""  # a new child serves
        assert "invalid regex" in probe.check(llguidance.LLMatcher.grammar_from_regex("a("))
    finally:
        probe.close()


def test_a_probe_whose_child_was_killed_from_outside_starts_a_new_one():
    probe = GrammarProbe(PARSER_LIMITS)
    try:
        assert probe.check(grammar_of({"type": "integer"})) == ""
        os.kill(probe._child.pid, signal.SIGKILL)
        probe._child.wait()
        assert probe.check(grammar_of({"type": "boolean"})) == ""
    finally:
        probe.close()


def test_the_engine_refuses_a_slow_schema_with_nothing_queued_and_serves_the_next():
    engine = LLMEngine(STORIES, num_blocks=64)
    slow = SamplingParams(structured_outputs=StructuredOutputsParams(json=SLOW_SCHEMA))
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="COMPILE_TIMEOUT") as info:
        engine.add_request("Once", slow)
    assert time.monotonic() - start < COMPILE_TIMEOUT + 1.5
    assert info.value.field == "structured_outputs"
    assert not engine.has_unfinished_requests() and engine._num_arrivals == 0
    choice = StructuredOutputsParams(choice=["yes", "no"])
    engine.add_request("Once", SamplingParams(temperature=0, structured_outputs=choice), "next")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["next"]
    assert finished[0].outputs[0].text in ("yes", "no")


def shared_levels(depth: int) -> dict:
    """A schema whose every level reuses the one below twice: ``depth`` dicts in memory,
    2**depth leaves once written out as JSON."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": schema}}
    return schema


@pytest.mark.parametrize(
    "schema, match",
    [
        (shared_levels(40), "MAX_GRAMMAR_CHARS"),
        ({"type": "number", "minimum": float("nan")}, "not JSON data"),
        ({"enum": [{1, 2}]}, "not JSON data"),
    ],
    ids=["shared-40-levels", "nan", "set"],
)
def test_a_schema_too_large_as_text_or_not_json_is_refused_at_once(schema, match):
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    assert time.monotonic() - start < 1.0
    assert info.value.field == "structured_outputs"
