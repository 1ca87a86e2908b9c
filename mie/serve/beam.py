"""Beam search over HTTP (vLLM's ``use_beam_search``): the offline search, its steps as requests.

``mie.engine.beam_search`` runs a search from outside the engine: each step, every running
beam is a request of one greedy token whose log-probabilities advance the search, and the
prefix cache lends each beam the blocks it shares with the others. A server can drive the
same ``BeamSearch`` the same way, through whatever runs its requests (the engine loop in this
process, or Ray replicas), without a change to the engine or its loop -- as vLLM's server
does. ``BeamSearchStream`` is one prompt's search, seen by the handler as the stream of any
other request: when the search is done, one update per beam (best first: choice 0 is the
best), the last one final. So the whole and streamed answers, usage and batches of prompts
go through the code every request goes through; a stream gets each beam's whole text in one
chunk, as from vLLM.

Every step's requests are the server's own: they count on ``/metrics`` as requests (each with
its beam's whole prompt, nearly all of it borrowed from the prefix cache), as vLLM's do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from mie.engine.beam_search import BeamSearch
from mie.engine.sampling import SamplingParams
from mie.serve.answers import Answer
from mie.serve.loop import Update, until_final
from mie.serve.protocol import APIError

FULL_QUEUE_RETRY_S = (0.01, 0.5)
"""How long a later step waits before it asks again while the waiting queue is full: first,
and at most (doubling in between)."""

logger = logging.getLogger("mie.serve")

StartAll = Callable[[list[tuple[str, str | None, list[int]]], SamplingParams], Awaitable[list]]


class BeamSearchStream:
    """One prompt's beam search as a request stream (module doc): ``await start()`` hands
    over its first step (raising that step's refusal, as a request's start does), then the
    search runs as a task of its own; ``abort()`` stops it and its running step."""

    def __init__(
        self,
        request_id: str,
        search: BeamSearch,
        step: SamplingParams,
        start_all: StartAll,
        abort: Callable[[object], None],
        decode: Callable[[list[int], list[int]], str],
    ) -> None:
        self.request_id = request_id
        self.search = search
        self.step = step
        self._start_all = start_all
        self._abort = abort
        self._decode = decode
        self._running: list = []  # the streams of the step in flight
        self._steps = 0
        self._task: asyncio.Task | None = None
        self._updates: asyncio.Queue[Update] = asyncio.Queue()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.search.prompt)

    async def start(self) -> None:
        await self._start_step()
        self._task = asyncio.ensure_future(self._run())

    def abort(self) -> None:
        """Stop the search (its client went away); a no-op once it has finished."""
        if self._task is not None:
            self._task.cancel()
        self._abort_step()

    def __aiter__(self):
        return until_final(self._updates)

    async def _start_step(self) -> None:
        """Hand over one request per running beam: ``request_id-s.b`` for beam b of step s."""
        prompts = self.search.beam_prompts()
        name = f"{self.request_id}-{self._steps}"
        requests = [(f"{name}.{b}", None, tokens) for b, tokens in enumerate(prompts)]
        self._running = await self._start_all(requests, self.step)
        self._steps += 1

    async def _start_next_step(self) -> None:
        """``_start_step`` for a search already under way, which waits its turn rather than
        fail halfway: while the server's waiting queue is full (``--max-queue``: a 503 with
        code ``queue_full``) it asks again, after ``FULL_QUEUE_RETRY_S``. Any other refusal
        (the server stopping) ends the search."""
        wait, longest = FULL_QUEUE_RETRY_S
        while True:
            try:
                return await self._start_step()
            except APIError as error:
                if error.code != "queue_full":
                    raise
            await asyncio.sleep(wait)
            wait = min(2 * wait, longest)

    def _abort_step(self) -> None:
        for stream in self._running:
            self._abort(stream)
        self._running = []

    async def _run(self) -> None:
        try:
            while True:
                rows = []
                for stream in self._running:
                    answer = Answer()
                    async for update in stream:
                        answer.add(update)
                    if answer.error is not None:  # the server is stopping, or the step failed
                        self._fail(answer.error, answer.choices[0].finish_reason)
                        return
                    rows.append(answer.choices[0].logprobs[0])
                self._running = []
                self.search.advance(rows)
                if self.search.done:
                    break
                await self._start_next_step()
            self._finish()
        except APIError as error:  # a later step refused (the server is busy or stopping)
            self._fail(error, None)
        except asyncio.CancelledError:
            self._abort_step()
            raise
        except Exception as exc:  # a bug: the client hears of it rather than wait for good
            logger.exception("internal error in the beam search of %s", self.request_id)
            message = f"internal error: {type(exc).__name__}: {exc}"
            self._fail(APIError(500, message, type="server_error"), None)

    def _finish(self) -> None:
        """The beams, one update each, best first; the last one final."""
        sequences = self.search.output(self._decode).sequences
        prompt_length = len(self.search.prompt)
        for index, sequence in enumerate(sequences):
            generated = sequence.tokens[prompt_length:]
            update = Update(
                sequence.text,
                len(generated),
                finish_reason=sequence.finish_reason,
                index=index,
                token_ids=tuple(generated),
                final=index == len(sequences) - 1,
            )
            self._updates.put_nowait(update)

    def _fail(self, error: APIError, finish_reason: str | None) -> None:
        self._abort_step()
        self._updates.put_nowait(Update("", 0, finish_reason, error=error, final=True))
