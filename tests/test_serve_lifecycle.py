"""The server's life around requests: slow clients, failing engine steps, shutdown.

* Slow clients: a connection whose request does not arrive in time -- nothing sent, half the
  headers, headers and half the body, bytes trickled in -- is closed after the request
  timeout; idle keep-alive connections after the keep-alive timeout; a request that has
  fully arrived is never cut, however long its answer takes.
* Failing steps (fault injection): the model's forward raises on chosen calls while several
  requests run; exactly the requests in the failed batch end with an error (a streamed error
  event then ``[DONE]``, or a 500), every other one gets its offline answer, the engine
  thread lives on, no block leaks and the scheduler's invariants hold.
* Shutdown: ``python -m mie serve`` with 16 long streams (some with ``n`` = 2 or 3) and two
  non-streaming requests in flight, on SIGTERM and on SIGINT: after the grace period every
  choice of every stream ends with its ``finish_reason: "abort"`` chunk, then ``data:
  [DONE]``, every non-streaming request gets a 503 in OpenAI's shape, and the process exits
  0 without a traceback. A second signal during a long grace period ends it at once, and
  still cuts no stream.
"""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import require_module
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine

httpx = require_module("httpx")
serve = require_module("mie.serve")  # the server stack: starlette, uvicorn
build_app, serve_in_thread = serve.build_app, serve.serve_in_thread
Timeouts = require_module("mie.serve.server").Timeouts
OpenAIServer = require_module("mie.serve.app").OpenAIServer
openai = require_module("openai")

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
BACKEND = "python"
TIMEOUT = 60.0
MODEL = "stories260K"


def metrics(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_for(condition, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return result


def wait_idle(url: str) -> dict[str, float]:
    def idle():
        m = metrics(url)
        return m if m["mie_num_requests_running"] + m["mie_num_requests_waiting"] == 0 else None

    return wait_for(idle, "the server to become idle")


def sse_events(lines) -> list:
    """The ``data:`` payloads of a server-sent event stream, JSON decoded ("[DONE]" kept)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- slow clients -------------------------------------------------------------------------------
REQUEST_TIMEOUT = 0.5
KEEP_ALIVE = 0.5


class SlowModel:
    """The engine's model, taking at least ``seconds`` per forward call."""

    def __init__(self, model, seconds: float):
        self._model, self._seconds = model, seconds

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, *args, **kwargs):
        time.sleep(self._seconds)
        return self._model.forward(*args, **kwargs)


@pytest.fixture(scope="module")
def strict_server():
    engine = LLMEngine(STORIES, backend=BACKEND, num_blocks=256)
    engine.model = SlowModel(engine.model, 0.005)  # 200 tokens: over a second
    timeouts = Timeouts(keep_alive=KEEP_ALIVE, request=REQUEST_TIMEOUT)
    with serve_in_thread(build_app(engine, STORIES), timeouts=timeouts) as url:
        yield url


def seconds_until_closed(url: str, send) -> float:
    """Connect, let ``send(sock)`` write what it writes, and time how long until the server
    closes the connection (reading, and discarding, whatever it answers)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        start = time.monotonic()
        send(sock)
        while sock.recv(65536):
            pass
        return time.monotonic() - start


BODY = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}).encode()
HEAD = (
    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(BODY)}\r\n\r\n"
).encode()


def trickle(data: bytes, every: float):
    def send(sock):
        for i in range(len(data)):
            try:
                sock.sendall(data[i : i + 1])
            except OSError:  # closed on us: what the test waits for
                return
            time.sleep(every)

    return send


@pytest.mark.parametrize(
    "send",
    [
        pytest.param(lambda sock: None, id="nothing"),
        pytest.param(lambda sock: sock.sendall(HEAD[:30]), id="half-the-headers"),
        pytest.param(lambda sock: sock.sendall(HEAD + BODY[:10]), id="half-the-body"),
        pytest.param(trickle(HEAD + BODY, every=0.05), id="trickled-bytes"),
    ],
)
def test_a_request_that_does_not_arrive_in_time_is_disconnected(strict_server, send):
    took = seconds_until_closed(strict_server, send)
    # Trickling keeps the connection busy but does not move the deadline.
    assert REQUEST_TIMEOUT * 0.9 <= took < REQUEST_TIMEOUT + 5, took
    ok = httpx.post(strict_server + "/v1/completions", content=BODY, timeout=TIMEOUT)
    assert ok.status_code == 200, "the server serves on"


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(strict_server):
    def one_request_then_idle(sock):
        sock.sendall(HEAD + BODY)
        response = b""
        while b"}}" not in response:  # the whole JSON answer
            response += sock.recv(65536)
        assert response.startswith(b"HTTP/1.1 200")

    took = seconds_until_closed(strict_server, one_request_then_idle)
    assert KEEP_ALIVE * 0.9 <= took < KEEP_ALIVE + 5, took


def test_an_answer_that_takes_longer_than_the_request_timeout_is_not_cut(strict_server):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    with httpx.stream(
        "POST", strict_server + "/v1/completions", json=body, timeout=TIMEOUT
    ) as response:
        events = sse_events(response.iter_lines())
    assert time.monotonic() - start > REQUEST_TIMEOUT, "too fast to tell"
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


# -- failing steps ------------------------------------------------------------------------------
class FaultyModel:
    """The engine's model, whose ``forward`` raises on chosen calls and records, for each
    failed call, the token lists of the sequences it was computing (after a scheduler step,
    every running sequence is in the batch)."""

    def __init__(self, model, scheduler):
        self._model = model
        self._scheduler = scheduler
        self.calls = 0
        self.fail_at: dict[int, type[BaseException]] = {}
        self.failed_batches: list[list[list[int]]] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, *args, **kwargs):
        self.calls += 1
        error = self.fail_at.get(self.calls)
        if error is not None:
            self.failed_batches.append([list(s.token_ids) for s in self._scheduler.running])
            raise error(f"injected fault at forward call {self.calls}")
        return self._model.forward(*args, **kwargs)


FAULT_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily wanted to",
    "Ben had a red ball",
    "The sun was hot",
    "Tom and Sue went",
]
FAULT_PARAMS = {"max_tokens": 30, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def faulty():
    engine = LLMEngine(STORIES, backend=BACKEND, num_blocks=256, max_num_seqs=2)
    engine.model = FaultyModel(engine.model, engine.scheduler)
    with serve_in_thread(build_app(engine, STORIES)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def fault_oracle():
    llm = LLM(STORIES, backend=BACKEND, num_blocks=256)
    outputs = llm.generate(FAULT_PROMPTS, SamplingParams(**FAULT_PARAMS), use_tqdm=False)
    prompt_ids = [out.prompt_token_ids for out in outputs]
    return [out.outputs[0].text for out in outputs], prompt_ids


def run_request(url: str, prompt: str, stream: bool):
    """("text", text) for an answer, ("error", error object) for an error."""
    body = {"model": MODEL, "prompt": prompt, "stream": stream, **FAULT_PARAMS}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        if response.status_code != 200:
            assert response.status_code == 500, response.text
            return "error", response.json()["error"]
        return "text", response.json()["choices"][0]["text"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]", events[-3:]
    errors = [e["error"] for e in events[:-1] if "error" in e]
    if errors:
        assert len(errors) == 1 and "error" in events[-2], "the error is the last event"
        return "error", errors[0]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    return "text", "".join(e["choices"][0]["text"] for e in events[:-1])


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    faults=st.dictionaries(
        st.integers(1, 60), st.sampled_from([RuntimeError, MemoryError, ValueError]), max_size=3
    ),
    streaming=st.lists(st.booleans(), min_size=len(FAULT_PROMPTS), max_size=len(FAULT_PROMPTS)),
)
@example(faults={3: RuntimeError, 20: MemoryError}, streaming=[True, False] * 3)
def test_a_failed_step_ends_only_its_batch_and_the_server_serves_on(
    faulty, fault_oracle, faults, streaming
):
    url, engine = faulty
    model: FaultyModel = engine.model
    expected, prompt_ids = fault_oracle
    before = wait_idle(url)
    model.failed_batches.clear()
    model.fail_at = {model.calls + n: error for n, error in faults.items()}
    with ThreadPoolExecutor(len(FAULT_PROMPTS)) as pool:
        results = list(pool.map(run_request, [url] * len(FAULT_PROMPTS), FAULT_PROMPTS, streaming))
    after = wait_idle(url)
    model.fail_at = {}

    def in_failed_batch(ids: list[int]) -> bool:
        return any(tokens[: len(ids)] == ids for batch in model.failed_batches for tokens in batch)

    for i, (kind, value) in enumerate(results):
        if in_failed_batch(prompt_ids[i]):
            assert kind == "error", (FAULT_PROMPTS[i], value)
            assert value["code"] == "engine_step_failed" and value["type"] == "server_error"
            assert "injected fault" in value["message"]
        else:
            assert (kind, value) == ("text", expected[i]), FAULT_PROMPTS[i]
    failures = after["mie_engine_step_failures_total"] - before["mie_engine_step_failures_total"]
    assert failures == len(model.failed_batches)
    errors = 'mie_request_finished_total{finish_reason="error"}'
    assert after[errors] - before[errors] == sum(kind == "error" for kind, _ in results)
    assert httpx.get(url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    # The engine thread is idle (blocked on its queue): its state can be read safely.
    engine.scheduler.check_integrity()
    cached = engine.scheduler.prefix_cache.num_evictable if engine.scheduler.prefix_cache else 0
    assert engine.pool.num_free + cached == engine.pool.num_blocks, "a block leaked"


def test_the_server_outlives_every_request_of_a_batch_that_always_fails(faulty, fault_oracle):
    # A "poisoned" step fault on every forward call for a while: every request then ends
    # with an error, one log line each time, and the server is fine afterwards.
    url, engine = faulty
    model: FaultyModel = engine.model
    expected, _ = fault_oracle
    model.fail_at = {model.calls + n: RuntimeError for n in range(1, 200)}
    results = [
        run_request(url, prompt, stream)
        for prompt, stream in zip(FAULT_PROMPTS[:2], [True, False], strict=True)
    ]
    model.fail_at = {}
    assert [kind for kind, _ in results] == ["error", "error"]
    assert run_request(url, FAULT_PROMPTS[0], True) == ("text", expected[0])


def test_an_interrupt_inside_a_step_stops_the_engine_loop_and_says_so():
    # KeyboardInterrupt and SystemExit are not step failures: the engine rolls back and lets
    # them through, and the engine thread stops. Its requests still end properly (an abort
    # chunk and [DONE], or a 500), and /health reports the loop gone, with the reason.
    engine = LLMEngine(STORIES, backend=BACKEND, num_blocks=64)
    engine.model = FaultyModel(engine.model, engine.scheduler)
    engine.model.fail_at = {3: KeyboardInterrupt}
    with serve_in_thread(build_app(engine, STORIES)) as url:
        body = {"model": MODEL, "prompt": "Once upon a time", "stream": True, **FAULT_PARAMS}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        health = httpx.get(url + "/health", timeout=TIMEOUT)
        assert (
            health.status_code == 503 and "KeyboardInterrupt" in health.json()["error"]["message"]
        )
        refused = httpx.post(
            url + "/v1/completions", json={**body, "stream": False}, timeout=TIMEOUT
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_unavailable"
    engine.scheduler.check_integrity()
    assert (
        engine.pool.num_free + engine.scheduler.prefix_cache.num_evictable == engine.pool.num_blocks
    )


# -- an engine that makes no progress ----------------------------------------------------------
def test_health_reports_an_engine_that_makes_no_progress_and_recovers_with_it(fault_oracle):
    # An engine whose steps compute nothing while requests wait (the shape of a livelock; the
    # scheduler itself now refuses to repeat an idle empty step, so the engine's step is what
    # is stubbed). /health says so once the threshold passes, the engine thread backs off
    # instead of spinning, and once steps compute again the requests get their answers.
    expected, _ = fault_oracle
    engine = LLMEngine(STORIES, backend=BACKEND, num_blocks=64)
    server = OpenAIServer(engine, STORIES)
    server.loop.no_progress_s = 1.0
    empty_steps = 0

    def stuck_step() -> list:
        nonlocal empty_steps
        empty_steps += 1
        return []

    engine.step = stuck_step  # the instance's, over its class's method
    with serve_in_thread(server.app()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)

        def complete(prompt: str) -> str:
            answer = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=30,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return answer.choices[0].text

        def health() -> httpx.Response:
            return httpx.get(url + "/health", timeout=TIMEOUT)

        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(complete, prompt) for prompt in FAULT_PROMPTS[:2]]
            wait_for(lambda: len(server.loop._tracked) == 2, "both requests in the engine")
            assert health().status_code == 200, "not before the threshold"
            stuck = wait_for(lambda: (r := health()).status_code == 503 and r.json(), "a 503")
            message = stuck["error"]["message"]
            assert re.fullmatch(
                r"the engine is stuck: no progress for \d+ s with 2 requests "
                r"waiting",
                message,
            ), message
            assert stuck["error"]["code"] == "engine_stalled"
            steps, cpu = empty_steps, time.process_time()
            time.sleep(1.0)
            steps, cpu = empty_steps - steps, time.process_time() - cpu
            # Before: tens of thousands of empty steps a second, a whole core.
            assert steps < 200, f"{steps} empty steps in a second: the engine thread spins"
            assert cpu < 0.5, f"{cpu:.2f} s of CPU in a second while stuck"
            del engine.step
            texts = [answer.result(TIMEOUT) for answer in answers]
        assert texts == expected[:2]
        assert health().json() == {"status": "ok"}


# -- shutdown -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stream_request(i: int) -> dict:
    """The ``i``-th of the shutdown tests' 16 streams: one in two samples ``n = 2`` or 3 (at
    temperature 1, seeded), so that streams with several choices are running and queued."""
    n = (1, 2, 1, 3)[i % 4]
    sampling = {"temperature": 0} if n == 1 else {"temperature": 1.0, "seed": i, "n": n}
    return {
        "model": MODEL,
        "prompt": f"{FAULT_PROMPTS[i % 6]} {i}",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
        **sampling,
    }


def serve_then_signal(
    tmp_path: Path, signals: list[signal.Signals], grace: float, between: float = 0.5
):
    """``python -m mie serve`` with 16 long streams (``stream_request``) and two queued
    non-streaming requests in flight, sent ``signals`` ``between`` seconds apart: (each
    stream's events, the two responses, the exit status, seconds from the first signal to
    the exit, the log)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    # Six sequences at a time (a request may take half: n = 3) and 18 requests of 500 tokens
    # each, 32 samples in all: several seconds of work, far beyond the grace period.
    command = [sys.executable, "-m", "mie", "serve", "--model", str(STORIES), "--port", str(port)]
    command += ["--backend", BACKEND, "--max-num-seqs", "6", "--num-blocks", "512"]
    command += ["--shutdown-grace", str(grace)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:

        def healthy():
            assert process.poll() is None, log_path.read_text()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, "the server to come up")
        accepted = threading.Barrier(17)  # the 16 streams and this thread

        def stream(i: int):
            with httpx.stream(
                "POST", url + "/v1/completions", json=stream_request(i), timeout=TIMEOUT
            ) as response:
                assert response.status_code == 200  # headers: the engine accepted it
                accepted.wait(TIMEOUT)
                return sse_events(response.iter_lines())  # raises if the body is cut short

        def whole(i: int):
            request = {
                "model": MODEL,
                "prompt": f"{FAULT_PROMPTS[i % 6]} whole {i}",
                "max_tokens": 500,
                "temperature": 0,
                "ignore_eos": True,
            }
            return httpx.post(url + "/v1/completions", json=request, timeout=TIMEOUT)

        with ThreadPoolExecutor(18) as pool:
            streams = [pool.submit(stream, i) for i in range(16)]
            accepted.wait(TIMEOUT)
            wholes = [pool.submit(whole, i) for i in range(2)]  # queued behind the streams

            def all_queued():  # requests, each once (sequences would count forked samples)
                return metrics(url)["mie_num_requests_unfinished"] == 18

            wait_for(all_queued, "all 18 requests to be in the engine")
            signalled = time.monotonic()
            for k, sig in enumerate(signals):
                if k:
                    time.sleep(between)
                process.send_signal(sig)
            stream_events = [s.result(TIMEOUT) for s in streams]
            responses = [w.result(TIMEOUT) for w in wholes]
        status = process.wait(30)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    return stream_events, responses, status, took, log_path.read_text()


def final_chunks(events: list, n: int) -> list[str]:
    """The finish reason of each of a stream's ``n`` choices (one final chunk each, checked),
    after checking that the stream ends with ``[DONE]`` and has no error event."""
    assert events[-1] == "[DONE]", events[-3:]
    assert all("error" not in e for e in events[:-1])
    reasons: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            if choice["finish_reason"] is not None:
                assert choice["index"] not in reasons, "a choice ended twice"
                reasons[choice["index"]] = choice["finish_reason"]
    assert sorted(reasons) == list(range(n)), f"choices that ended: {sorted(reasons)} of {n}"
    return [reasons[i] for i in range(n)]


def check_clean_shutdown(stream_events, responses, status, log) -> list[str]:
    """Every stream ended every choice then ``[DONE]``, the waiting requests got their 503,
    the process exited 0 without a traceback; returns every choice's finish reason."""
    assert status == 0, log
    finish_reasons = []
    for i, events in enumerate(stream_events):
        finish_reasons += final_chunks(events, stream_request(i).get("n", 1))
    assert set(finish_reasons) <= {"abort", "length"}, finish_reasons
    for response in responses:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable" and "shutting down" in error["message"]
    assert "Traceback" not in log and "ERROR" not in log, log
    assert "Cancel" not in log, "uvicorn had to cancel a response"
    return finish_reasons


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_ends_every_choice_of_every_open_stream_with_abort_and_done_then_exits_0(
    tmp_path, sig
):
    # Streams with n = 2 or 3 among them, running and queued: every choice gets its own
    # "abort" chunk (before: a queued one ended choice 0 only).
    results = serve_then_signal(tmp_path, [sig], grace=0.5)
    finish_reasons = check_clean_shutdown(*results[:3], results[4])
    assert finish_reasons.count("abort") >= 24, "only the first ones could finish in time"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_grace_period_at_once_and_cuts_no_stream(tmp_path, sig):
    # A 60-second grace, shortened by the second signal: every stream still gets its final
    # chunks and [DONE], no traceback (before: uvicorn's force-exit cut streams mid-body).
    stream_events, responses, status, took, log = serve_then_signal(
        tmp_path, [sig, sig], grace=60.0
    )
    finish_reasons = check_clean_shutdown(stream_events, responses, status, log)
    assert finish_reasons.count("abort") >= 24
    assert took < 30, f"the second signal did not end the grace period ({took:.1f} s)"
