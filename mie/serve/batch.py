"""A completions batch: several prompts in one request, streamed as one answer.

OpenAI and vLLM take ``prompt`` as a list, and clients batch with it (lm-evaluation-harness
sends ``--batch_size`` prompts per request). Each prompt is an engine request of its own, with
its ``n`` samples; the answer numbers the choices across them as OpenAI does: choice
``p * n + i`` is sample ``i`` of prompt ``p``.

A non-streamed batch is just one ``Answer`` per prompt (``OpenAIFrontend.completions``). A
streamed one goes through the same event code as one prompt (``app._events``), which reads a
stream and a renderer: ``PromptBatch`` is both. As a stream it yields the prompts' updates
interleaved as they arrive, each with its choice's index in the answer; as a renderer it hands
each choice to its own prompt's ``ChoiceRenderer`` (which echoes that prompt, and knows that
prompt's log-probabilities, handed to it here as they arrive).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from mie.serve.answers import ChoiceRenderer
from mie.serve.loop import Update


class PromptBatch:
    """The streams of one request's prompts, as one stream and one renderer."""

    def __init__(
        self, request_id: str, streams: list, renderers: list[ChoiceRenderer], n: int
    ) -> None:
        self.request_id = request_id
        self.streams = streams
        self.renderers = renderers
        self.n = n
        self.options = renderers[0].options
        # What ``_events`` sets from an update; a batch's updates never carry any: each
        # prompt's log-probabilities go to that prompt's renderer (``__aiter__``).
        self.prompt_logprobs = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(stream.num_prompt_tokens for stream in self.streams)

    async def __aiter__(self) -> AsyncIterator[Update]:
        """Every prompt's updates, as they arrive, indexed across the batch; it ends when
        every prompt's stream has (its last update then has ``final``)."""
        arrived: asyncio.Queue = asyncio.Queue()  # (prompt, update, exception or None)

        async def forward(p: int, stream) -> None:
            try:
                async for update in stream:
                    arrived.put_nowait((p, update, None))
            except Exception as exc:  # handed on, to end the batch's stream as it would one
                arrived.put_nowait((p, None, exc))
            else:
                arrived.put_nowait((p, None, None))  # this prompt's stream ended

        tasks = [asyncio.ensure_future(forward(p, s)) for p, s in enumerate(self.streams)]
        try:
            open_ = len(tasks)
            while open_:
                p, update, exc = await arrived.get()
                if exc is not None:
                    raise exc
                if update is None:
                    open_ -= 1
                    continue
                if update.prompt_logprobs is not None:
                    self.renderers[p].prompt_logprobs = update.prompt_logprobs
                yield replace(
                    update,
                    index=p * self.n + update.index,
                    prompt_logprobs=None,
                    final=update.final and open_ == 1,
                )
        finally:
            for task in tasks:
                task.cancel()

    # -- the renderer's part: choice ``index`` is sample ``index % n`` of prompt ``index // n``
    def echoes(self, update: Update) -> bool:
        return self.renderers[update.index // self.n].echoes(update)

    def prompt_tokens(self, index: int) -> int:
        return self.renderers[index // self.n].prompt_tokens(index)

    def completion(self, index: int, choice) -> dict:
        return self.renderers[index // self.n].completion(index, choice)
