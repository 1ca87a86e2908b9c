"""The HTTP side: a Starlette app with OpenAI's routes, in front of the engine loop.

A handler validates its request (``protocol``), turns text into token ids (in a worker
thread: a long prompt must not stall the event loop), hands the request to the engine loop
and waits until the loop has accepted it -- so anything the engine refuses is still a clean
JSON error, before any streaming has begun. Then it either streams server-sent events as
tokens arrive or collects the whole answer. However a request's HTTP exchange ends (done,
client gone, error), it ends with an abort of its request, a no-op when it already finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import InvalidRequestError
from mie.serve import protocol
from mie.serve.chat import ChatTemplate
from mie.serve.loop import EngineLoop, RequestStream
from mie.serve.metrics import ServerMetrics
from mie.serve.protocol import APIError, Options

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB of JSON is far more than any prompt mie can take
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its answer: unread


class EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends.

    Starlette cancels a streaming response when the client disconnects, possibly before the
    event generator has even started; wrapping the whole response is the one place that
    sees every ending.
    """

    def __init__(self, events: AsyncIterator[str], on_close) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class OpenAIServer:
    """The routes and what they share: the engine loop, metrics, chat template, settings."""

    def __init__(
        self,
        engine: LLMEngine,
        model_dir: str | Path,
        *,
        model_name: str | None = None,
        api_key: str | None = None,
        max_queue: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError(f"{model_dir}: serving needs the checkpoint's tokenizer.json")
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.engine = engine
        self.model_name = model_name or Path(model_dir).resolve().name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, self.metrics, max_queue)
        self.chat_template = ChatTemplate(model_dir, engine.tokenizer)
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]
        handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        self.loop.start()
        try:
            yield
        finally:
            await run_in_threadpool(self.loop.stop)

    # -- routes ---------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._json_body(request)
        options = protocol.parse_options(body, self.model_name, chat=False)
        prompt = protocol.parse_prompt(body)
        if isinstance(prompt, str):
            text, ids = prompt, await run_in_threadpool(self.engine.tokenizer.encode, prompt)
        else:
            text, ids = None, prompt
        stream = await self._submit("cmpl", text, ids, options, COMPLETION_DEFAULT_MAX_TOKENS)
        if options.stream:
            return self._event_stream(stream, self._completion_events(stream, options))
        if (answer := await self._collect(request, stream)) is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(protocol.completion(
            stream.request_id, self.created, self.model_name, *answer
        ))  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._json_body(request)
        options = protocol.parse_options(body, self.model_name, chat=True)
        text = self.chat_template.render(protocol.parse_messages(body))
        ids = await run_in_threadpool(self.chat_template.encode, text)
        # Like OpenAI, a chat may by default run to the end of the context.
        default_max_tokens = max(self.engine.max_model_len - len(ids), 1)
        stream = await self._submit("chatcmpl", text, ids, options, default_max_tokens)
        if options.stream:
            return self._event_stream(stream, self._chat_events(stream, options))
        if (answer := await self._collect(request, stream)) is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(protocol.chat_completion(
            stream.request_id, self.created, self.model_name, *answer
        ))  # fmt: skip

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "mie",
            "max_model_len": self.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        if not self.loop.healthy:
            error = self.loop.error
            raise APIError(503, f"the engine loop is not running ({error!r})" if error else
                           "the engine loop is not running", type="server_error")  # fmt: skip
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # -- helpers --------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), self.api_key.encode()
        ):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")  # fmt: skip

    async def _json_body(self, request: Request) -> dict:
        """The body, read up to ``max_body_bytes`` (a larger one is a 400), as a JSON object."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(size)
            chunks.append(chunk)
        return protocol.parse_json(b"".join(chunks))

    def _too_large(self, size: int) -> APIError:
        return protocol.bad_request(
            f"the request body is too large ({size} bytes > {self.max_body_bytes})",
            code="body_too_large",
        )

    async def _submit(
        self, kind: str, text: str | None, ids: list[int], options: Options, default: int
    ) -> RequestStream:
        """Hand the request to the engine loop; return once it is accepted (or raise)."""
        try:
            params = options.sampling_params(options.max_tokens or default)
        except InvalidRequestError as exc:
            raise protocol.bad_request(str(exc)) from None
        stream = self.loop.submit(f"{kind}-{uuid.uuid4().hex}", text, ids, params, options.stop)
        try:
            await stream.started
        except asyncio.CancelledError:
            self.loop.abort(stream.request_id)
            raise
        return stream

    def _event_stream(self, stream: RequestStream, events: AsyncIterator[str]) -> EventStream:
        return EventStream(events, on_close=lambda: self.loop.abort(stream.request_id))

    async def _collect(
        self, request: Request, stream: RequestStream
    ) -> tuple[str, str, dict] | None:
        """The whole answer, or None if the client left first (its request is aborted)."""

        async def answer() -> tuple[str, str, dict]:
            parts, update = [], None
            async for update in stream:
                parts.append(update.text)
            usage = protocol.usage(stream.num_prompt_tokens, update.num_output_tokens)
            return "".join(parts), update.finish_reason, usage

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        collecting = asyncio.ensure_future(answer())
        watching = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not collecting.done():
                collecting.cancel()
                self.loop.abort(stream.request_id)
        return collecting.result() if collecting.done() and not collecting.cancelled() else None

    async def _completion_events(self, stream: RequestStream, options: Options):
        rid, model = stream.request_id, self.model_name
        async for update in stream:
            yield protocol.sse(protocol.completion_chunk(
                rid, self.created, model, update.text, update.finish_reason
            ))  # fmt: skip
        if options.include_usage:
            usage = protocol.usage(stream.num_prompt_tokens, update.num_output_tokens)
            yield protocol.sse(
                protocol.usage_chunk(rid, self.created, model, "text_completion", usage)
            )
        yield protocol.sse("[DONE]")

    async def _chat_events(self, stream: RequestStream, options: Options):
        rid, model = stream.request_id, self.model_name
        first = {"role": "assistant", "content": ""}
        yield protocol.sse(protocol.chat_chunk(rid, self.created, model, first))
        async for update in stream:
            delta = {"content": update.text} if update.text else {}
            yield protocol.sse(
                protocol.chat_chunk(rid, self.created, model, delta, update.finish_reason)
            )
        if options.include_usage:
            usage = protocol.usage(stream.num_prompt_tokens, update.num_output_tokens)
            yield protocol.sse(
                protocol.usage_chunk(rid, self.created, model, "chat.completion.chunk", usage)
            )
        yield protocol.sse("[DONE]")


def build_app(engine: LLMEngine, model_dir: str | Path, **settings) -> Starlette:
    """The ASGI app serving ``engine``; ``settings`` are ``OpenAIServer``'s keywords."""
    return OpenAIServer(engine, model_dir, **settings).app()


# -- errors as OpenAI's JSON ------------------------------------------------------------------
async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404 unknown route, 405 wrong method) in OpenAI's shape."""
    message = f"{exc.detail}: {request.method} {request.url.path}"
    code = "not_found" if exc.status_code == 404 else None
    error = APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
    return await _api_error(request, error)


async def _server_error(request: Request, exc: Exception) -> Response:
    error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    return await _api_error(request, error)
