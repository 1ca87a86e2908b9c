"""The engine loop: one thread owns the ``LLMEngine``; HTTP handlers talk to it by message.

The engine is single-threaded NumPy and a step takes milliseconds to seconds, so it cannot
run on the asyncio event loop (it would stall every connection) and must not be called from
two threads. Instead::

    handler (event loop)                      engine thread (the engine's only user)
    ─────────────────────                     ─────────────────────────────────────────
    stream = loop.submit(...)  ──commands──>  between steps: add_request / abort_request
    await stream.started       <─call_soon_threadsafe── accepted, or rejected (an APIError)
    async for update in stream <─call_soon_threadsafe── after each step: the new text
    client gone: loop.abort()  ──commands──>  abort_request: blocks back in the pool at once

Commands go through one thread-safe queue and are applied between steps, so every request
that arrives while a step runs joins the batch at the next one (continuous batching across
clients). Each request's updates go into its own ``asyncio.Queue``, filled from the engine
thread with ``loop.call_soon_threadsafe``.

Stop strings are applied here, to the detokenized text: the text a client sees ends before
the first stop string, and text that could still turn into one is held back until it cannot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from mie.engine.llm_engine import LLMEngine
from mie.engine.outputs import RequestOutput
from mie.engine.sampling import SamplingParams
from mie.serve.metrics import ServerMetrics
from mie.serve.protocol import APIError

logger = logging.getLogger("mie.serve")

IDLE_POLL_S = 0.5  # how often an idle engine thread checks whether it should stop


@dataclass(frozen=True)
class Update:
    """New visible text of one request, and its finish reason once it is done."""

    text: str
    num_output_tokens: int
    finish_reason: str | None = None  # "stop", "length", or "abort" (server stopping)


class RequestStream:
    """One request as its handler sees it: ``started``, then its updates in order.

    Made by ``EngineLoop.submit`` on the event loop; the engine thread touches it only
    through ``_start`` and ``_post``, which hop onto that event loop.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: tuple[str, ...],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stop = stop
        self.arrival = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self.started: asyncio.Future = self._loop.create_future()
        self._updates: asyncio.Queue[Update] = asyncio.Queue()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    async def __aiter__(self):
        while True:
            update = await self._updates.get()
            yield update
            if update.finish_reason is not None:
                return

    # -- called from the engine thread ----------------------------------------------------
    def _start(self, error: APIError | None = None) -> None:
        def resolve() -> None:
            if not self.started.done():  # a handler that gave up may have cancelled it
                if error is None:
                    self.started.set_result(None)
                else:
                    self.started.set_exception(error)

        self._call(resolve)

    def _post(self, update: Update) -> None:
        self._call(self._updates.put_nowait, update)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Tracked:
    """The engine thread's bookkeeping for one running request."""

    stream: RequestStream
    shown: int = 0  # characters of the engine's text already sent
    num_tokens: int = 0
    last_token_time: float | None = None


class EngineLoop:
    """Runs ``engine.step()`` in its own thread while there is work; see the module doc."""

    def __init__(
        self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int | None = None
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue  # most requests in the waiting queue; None: no limit
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mie-engine", daemon=True)

    # -- the event loop's side -----------------------------------------------------------------
    def start(self) -> None:
        self.metrics.update_engine(self.engine)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, end every open stream with "abort", join the thread."""
        self._stopping.set()
        self._commands.put(None)  # wake an idle thread
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def submit(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: tuple[str, ...] = (),
    ) -> RequestStream:
        """Hand a request to the engine thread; await ``stream.started`` before responding."""
        if not self.healthy:
            raise unavailable("the engine is not running")
        stream = RequestStream(request_id, prompt, prompt_token_ids, params, stop)
        self._commands.put(("add", stream))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); a no-op if it already finished."""
        self._commands.put(("abort", request_id))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(wait=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                self.metrics.update_engine(self.engine)
        except BaseException as exc:  # a bug: say so, and let /health report it
            logger.exception("the engine loop failed")
            self.error = exc
        finally:
            self._stopping.set()
            self._end_all()

    def _apply_commands(self, wait: bool) -> None:
        """Apply every queued add and abort; when idle, first wait (briefly) for one."""
        try:
            command = self._commands.get(block=wait, timeout=IDLE_POLL_S)
        except queue.Empty:
            return
        while command is not None:
            kind, arg = command
            if kind == "add":
                self._add(arg)
            else:
                self._abort(arg)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, stream: RequestStream) -> None:
        waiting = len(self.engine.scheduler.waiting)
        if self.max_queue is not None and waiting >= self.max_queue:
            self.metrics.count_rejected()
            stream._start(APIError(
                503, f"the server is busy: {waiting} requests are waiting (--max-queue "
                f"{self.max_queue}); retry later", type="server_error", code="queue_full",
                headers={"Retry-After": "1"},
            ))  # fmt: skip
            return
        prompt = {"prompt": stream.prompt, "prompt_token_ids": stream.prompt_token_ids}
        try:
            self.engine.add_request(prompt, stream.params, stream.request_id)
        except ValueError as exc:  # InvalidRequestError, RequestTooLongError: nothing queued
            self.metrics.count_rejected()
            stream._start(APIError(400, str(exc)))
            return
        self._tracked[stream.request_id] = _Tracked(stream)
        stream._start()

    def _abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self.metrics.count_finished("abort")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            stream, completion = tracked.stream, output.outputs[0]
            ttft = now - stream.arrival if tracked.last_token_time is None else None
            itl = None if tracked.last_token_time is None else now - tracked.last_token_time
            self.metrics.observe_token(ttft, itl)
            tracked.last_token_time = now
            tracked.num_tokens = len(completion.token_ids)
            text, stopped = visible_text(completion.text, stream.stop, output.finished)
            finish_reason = "stop" if stopped else completion.finish_reason
            if finish_reason is not None:
                del self._tracked[output.request_id]
                if not output.finished:  # a stop string ended it: free its blocks now
                    self.engine.abort_request(output.request_id)
                self.metrics.count_finished(finish_reason)
            if len(text) > tracked.shown or finish_reason is not None:
                stream._post(Update(text[tracked.shown :], tracked.num_tokens, finish_reason))
                tracked.shown = len(text)

    def _end_all(self) -> None:
        """The thread is ending: refuse what is queued, end every open stream with abort."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None and command[0] == "add":
                command[1]._start(unavailable("the server is shutting down"))
        for tracked in self._tracked.values():
            self.metrics.count_finished("abort")
            tracked.stream._post(Update("", tracked.num_tokens, "abort"))
        self._tracked.clear()


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")


def visible_text(text: str, stop: tuple[str, ...], finished: bool) -> tuple[str, bool]:
    """The part of ``text`` a client may see, and whether a stop string ended it there.

    The text ends before the stop string that is complete first, reading left to right (of
    two complete at the same character, the longer): the answer is the same however the
    text grew, token by token or all at once. Until the request finishes, a tail of ``text``
    that is the beginning of a stop string is held back: it may become one.
    """
    matches = [(i + len(s), i) for s in stop if (i := text.find(s)) >= 0]
    if matches:
        return text[: min(matches)[1]], True
    if finished:
        return text, False
    hold = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold], False
