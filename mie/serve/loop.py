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

The thread must outlive any one request: a request the engine refuses is a 400 for its
client alone; a step that fails (``StepError``: the engine has already rolled the batch
back) ends the requests of that batch with an error and the loop carries on with the rest.
A step that computes nothing (no prompt token, no output token) while requests wait would
only repeat itself: the thread then waits briefly for a command instead of spinning
(``STALL_BACKOFF_S``), and if nothing has been computed for ``no_progress_s`` while requests
wait, ``stalled`` says so and ``/health`` answers 503 until a step computes again.

Stop strings are the engine's (``SamplingParams.stop``, ``mie.engine.stop_strings``): a
sample's text never shows what may still become one, and a sample whose stop string completes
leaves the batch in the step that completed it. So each update here is simply what a sample's
visible text and tokens gained since the last one; tokens wait with the text held back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from mie.engine.llm_engine import LLMEngine, StepError
from mie.engine.outputs import CompletionOutput, Logprob, RequestOutput
from mie.engine.sampling import SamplingParams
from mie.serve.metrics import ServerMetrics
from mie.serve.protocol import APIError, engine_refusal

logger = logging.getLogger("mie.serve")

IDLE_POLL_S = 0.5  # how often an idle engine thread checks whether it should stop
NO_PROGRESS_S = 30.0
"""How long the engine may hold unfinished requests without computing a single prompt or
output token before ``/health`` reports it stuck (503). A step computes something whenever
the scheduler can run anything, and the chunk budget keeps a step to seconds, so 30 s
without progress is a scheduler that cannot admit what waits (a livelock), not a slow step."""
STALL_BACKOFF_S = 0.01
"""How long the engine thread waits after a step that computed nothing while requests wait:
the next step would find the same state unless something arrives or is aborted, and either
command ends the wait at once. Without it a stuck scheduler spins a core at ~10^5 empty
steps a second."""


@dataclass(frozen=True)
class Update:
    """What one choice (sample) of a request gained since its last update: its new visible
    text, the tokens generated meanwhile (with their log-probabilities when asked for), and
    its finish reason once it is done.

    A request with ``n`` samples interleaves the updates of its choices (``index``); its last
    update has ``final`` set: every choice has finished, or the request failed. ``error`` is
    set when the request did not finish normally: the server is shutting down (finish reason
    "abort", a 503 for a non-streaming client) or the engine step it was in failed (finish
    reason None, a 500).
    """

    text: str
    num_output_tokens: int  # the choice's tokens so far (what usage counts)
    finish_reason: str | None = None  # "stop", "length", or "abort" (server stopping)
    error: APIError | None = None
    stop_reason: int | str | None = None  # with "stop": the stop string or token that ended it
    index: int = 0
    token_ids: tuple[int, ...] = ()  # generated since the choice's last update
    logprobs: tuple[dict[int, Logprob], ...] | None = None  # theirs, when asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # once, when asked for
    final: bool = False


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
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self.started: asyncio.Future = self._loop.create_future()
        self._updates: asyncio.Queue[Update] = asyncio.Queue()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def __aiter__(self):
        return until_final(self._updates)

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
class _Choice:
    """The engine thread's bookkeeping for one sample of a running request."""

    shown: int = 0  # characters of the sample's text already sent
    sent_tokens: int = 0  # tokens already sent in updates
    finish_reason: str | None = None


@dataclass
class _Tracked:
    """The engine thread's bookkeeping for one running request (its samples by index)."""

    stream: RequestStream
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    last_token_time: float | None = None

    def choice(self, index: int) -> _Choice:
        if index not in self.choices:
            self.choices[index] = _Choice()
        return self.choices[index]


class EngineLoop:
    """Runs ``engine.step()`` in its own thread while there is work; see the module doc."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics,
        max_queue: int | None = None,
        no_progress_s: float = NO_PROGRESS_S,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = check_max_queue(max_queue)  # most requests waiting; None: no limit
        self.no_progress_s = no_progress_s  # see NO_PROGRESS_S and ``stalled``
        self.error: BaseException | None = None  # why the engine thread died, if it did
        # Progress, written by the engine thread only (``stalled`` reads them): the engine's
        # token totals after the last step, when they last grew (or the engine was idle), and
        # how many requests were unfinished then.
        self._tokens_done = (0, 0)
        self._last_progress = time.monotonic()
        self._num_unfinished = 0
        self._made_progress = True  # by the last step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mie-engine", daemon=True)

    # -- the event loop's side -----------------------------------------------------------------
    def start(self) -> None:
        self.metrics.update_engine(self.engine)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, end every open stream with "abort", join the thread.

        Streams end with finish reason "abort" and a 503 error ("the server is shutting
        down"): a streaming handler sends the abort chunk and ``[DONE]``, a non-streaming
        one the JSON error. Requests still queued are refused with the same 503.
        """
        self._stopping.set()
        self._commands.put(None)  # wake an idle thread
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def stalled(self) -> str | None:
        """Why the engine is stuck, or None: it has had unfinished requests for longer than
        ``no_progress_s`` and no step has computed a prompt or an output token meanwhile
        (``/health`` answers 503 with this). Clears itself once a step computes again."""
        num_unfinished = self._num_unfinished
        for_s = time.monotonic() - self._last_progress
        if num_unfinished == 0 or for_s <= self.no_progress_s:
            return None
        return f"no progress for {for_s:.0f} s with {num_unfinished} requests waiting"

    def submit(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> RequestStream:
        """Hand a request to the engine thread; await ``stream.started`` before responding."""
        return self.submit_all([(request_id, prompt, prompt_token_ids)], params)[0]

    def submit_all(
        self,
        prompts: list[tuple[str, str | None, list[int]]],
        params: SamplingParams,
    ) -> list[RequestStream]:
        """``submit`` for the prompts of one HTTP request (a completions batch), each
        ``(request_id, text, token_ids)``: the engine thread queues all of them or none (if
        it refuses one, every stream's ``started`` raises that one's error)."""
        if not self.healthy:
            raise unavailable("the engine is not running")
        streams = [RequestStream(rid, text, ids, params) for rid, text, ids in prompts]
        self._commands.put(("add", streams))
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); a no-op if it already finished."""
        self._commands.put(("abort", request_id))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.engine.has_unfinished_requests():
                    wait: float | None = IDLE_POLL_S
                else:  # a step that computed nothing would only repeat itself at once
                    wait = None if self._made_progress else STALL_BACKOFF_S
                self._apply_commands(wait)
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    try:
                        outputs = self.engine.step()
                    except StepError as exc:  # rolled back by the engine: fail its batch only
                        self._fail(exc)
                    else:
                        self._dispatch(outputs)
                self._track_progress()
                self.metrics.update_engine(self.engine)
        except BaseException as exc:  # a bug outside any one step: say so, /health reports it
            logger.exception("the engine loop failed")
            self.error = exc
        finally:
            self._stopping.set()
            self._end_all()

    def _apply_commands(self, wait: float | None) -> None:
        """Apply every queued add and abort; first wait up to ``wait`` seconds for one (None:
        do not wait)."""
        try:
            command = self._commands.get(block=wait is not None, timeout=wait)
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

    def _track_progress(self) -> None:
        """After a step (or an idle wait): whether the engine computed anything, for the
        back-off in ``_run`` and for ``stalled``. Idle is not stuck: the clock starts when
        work arrives."""
        stats = self.engine.stats
        tokens_done = (stats.prompt_tokens, stats.generated_tokens)
        idle = not self.engine.has_unfinished_requests()
        self._made_progress = idle or tokens_done != self._tokens_done
        self._tokens_done = tokens_done
        self._num_unfinished = len(self._tracked)
        if self._made_progress:
            self._last_progress = time.monotonic()

    def _add(self, streams: list[RequestStream]) -> None:
        """Queue the prompts of one HTTP request (they share their parameters), all or none:
        a refused prompt refuses them all, with nothing queued. (Under ``--max-queue`` a
        batch is admitted like one request.)"""
        waiting = len(self.engine.scheduler.waiting)
        if self.max_queue is not None and waiting >= self.max_queue:
            self.metrics.count_rejected()
            error = APIError(
                503,
                f"the server is busy: {waiting} requests are waiting (--max-queue "
                f"{self.max_queue}); retry later",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
            for stream in streams:
                stream._start(error)
            return
        prompts = [
            {"prompt": stream.prompt, "prompt_token_ids": stream.prompt_token_ids}
            for stream in streams
        ]
        try:  # refused: nothing queued (add_requests takes back those it had queued)
            self.engine.add_requests(prompts, streams[0].params, [s.request_id for s in streams])
        except Exception as exc:  # that client's 400
            if not isinstance(exc, ValueError):  # InvalidRequestError, RequestTooLongError
                logger.warning("add_request refused a request with %s: %s", type(exc).__name__, exc)
            self.metrics.count_rejected()
            batch_index = getattr(exc, "prompt_index", None) if len(streams) > 1 else None
            error = engine_refusal(exc, batch_index)
            for stream in streams:
                stream._start(error)
            return
        for stream in streams:
            self._tracked[stream.request_id] = _Tracked(stream)
            stream._start()

    def _abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self.metrics.count_finished("abort")

    def _fail(self, exc: StepError) -> None:
        """A step failed and the engine rolled it back: end that batch's requests with an
        error (they might fail again and again), keep everyone else running."""
        cause = exc.__cause__ or exc
        error = APIError(
            500,
            f"the engine step running this request failed: {type(cause).__name__}: {cause}"[:500],
            type="server_error",
            code="engine_step_failed",
        )
        for request_id in exc.request_ids:
            self.engine.abort_request(request_id)
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self.metrics.count_finished("error")
                tracked.stream._post(Update("", 0, None, error, final=True))
        self.metrics.count_step_failure()
        logger.error(
            "engine step failed (%s: %s); aborted its %d request(s), serving on",
            type(cause).__name__,
            cause,
            len(exc.request_ids),
        )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            ttft = None if tracked.last_token_time is not None else now - tracked.stream.arrival
            itl = None if tracked.last_token_time is None else now - tracked.last_token_time
            self.metrics.observe_token(ttft, itl, len(tracked.stream.prompt_token_ids))
            tracked.last_token_time = now
            updates = []
            for completion in output.outputs:
                update = self._advance(tracked.choice(completion.index), completion)
                if update is not None:
                    updates.append(update)
            if updates and output.prompt_logprobs is not None and not tracked.prompt_logprobs_sent:
                updates[0] = replace(updates[0], prompt_logprobs=output.prompt_logprobs)
                tracked.prompt_logprobs_sent = True
            if output.finished:
                del self._tracked[output.request_id]
                last = tracked.choices[max(tracked.choices)].finish_reason
                self.metrics.count_finished(last, now - tracked.stream.arrival)
                updates = updates or [Update("", 0)]
                updates[-1] = replace(updates[-1], final=True)
            for update in updates:
                tracked.stream._post(update)

    @staticmethod
    def _advance(choice: _Choice, completion: CompletionOutput) -> Update | None:
        """One sample's new state after a step -> its update, if a client has something new:
        the text it gained and the tokens generated meanwhile (which wait while the engine
        holds the text back: it may still become a stop string)."""
        if choice.finish_reason is not None:
            return None
        text, finish_reason = completion.text, completion.finish_reason
        choice.finish_reason = finish_reason
        if len(text) <= choice.shown and finish_reason is None:
            return None
        new = slice(choice.sent_tokens, len(completion.token_ids))
        logprobs = None if completion.logprobs is None else tuple(completion.logprobs[new])
        update = Update(
            text[choice.shown :],
            len(completion.token_ids),
            finish_reason,
            index=completion.index,
            token_ids=tuple(completion.token_ids[new]),
            logprobs=logprobs,
            stop_reason=completion.stop_reason,
        )
        choice.shown, choice.sent_tokens = len(text), len(completion.token_ids)
        return update

    def _end_all(self) -> None:
        """The thread is ending: refuse what is queued, end every open stream with abort."""
        error = unavailable("the server is shutting down")
        if self.error is not None:
            error = APIError(
                500,
                f"the engine loop failed: {type(self.error).__name__}: {self.error}"[:500],
                type="server_error",
                code="engine_unavailable",
            )
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None and command[0] == "add":
                for stream in command[1]:
                    stream._start(unavailable("the server is shutting down"))
        for request_id, tracked in self._tracked.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be broken (that is why we are here)
                pass
            self.metrics.count_finished("abort")
            # Every choice still open ends with "abort" (at least one update: the final one).
            # A choice is open until it finished, whether or not it has sent anything: a
            # request still queued, or whose samples are not yet forked, has sent nothing.
            samples = range(tracked.stream.params.best_of or 1)
            open_ = [i for i in samples if tracked.choice(i).finish_reason is None] or [0]
            for i in open_:
                tracked.stream._post(
                    Update(
                        "",
                        tracked.choice(i).sent_tokens,
                        "abort",
                        error,
                        index=i,
                        final=i == open_[-1],
                    )
                )
        self._tracked.clear()


def check_max_queue(max_queue: int | None) -> int | None:
    """``max_queue`` if it is None (no limit) or a positive int, else ValueError: a queue of
    at most 0 would refuse every request."""
    if max_queue is not None and (
        isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1
    ):
        raise ValueError(f"max_queue must be at least 1, got {max_queue!r}")
    return max_queue


async def until_final(updates: asyncio.Queue[Update]):
    """A stream's updates as they arrive, through the one marked ``final``."""
    while True:
        update = await updates.get()
        yield update
        if update.final:
            return


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")
