"""The HTTP side: a Starlette app with OpenAI's routes, in front of the engine loop.

A handler validates its request (``protocol``), turns text into token ids (in a worker
thread: a long prompt or chat must not stall the event loop), hands the request to the
engine loop and waits until the loop has accepted it -- so anything the engine refuses is
still a clean JSON error, before any streaming has begun. Then it either streams server-sent
events as tokens arrive or collects the whole answer. However a request's HTTP exchange ends
(done, client gone, error), it ends with an abort of its request, a no-op when it already
finished.

Errors, whatever raises them, are OpenAI's JSON and leave the connection usable:

* everything up to the hand-off to the engine is *reading the request*: an exception there
  is the client's bad input, a 400, even one no check foresaw (``_reading_request``);
* an unexpected exception after that is a 500 in the same shape (``_LastResort``), logged
  once; a stream that already started ends with an error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import mie
from mie.engine.beam_search import beam_text, start_search, step_params
from mie.engine.chat import ChatTemplate
from mie.engine.llm_engine import LLMEngine
from mie.engine.outputs import Logprob
from mie.engine.prompts import check_fits_context, prompt_tokens_kept
from mie.engine.sampling import InvalidRequestError
from mie.engine.structured import StructuredOutputsError, StructuredOutputsParams
from mie.engine.tokenizer import IncrementalDetokenizer
from mie.serve import protocol, tools
from mie.serve.answers import Answer, ChoiceRenderer
from mie.serve.batch import PromptBatch
from mie.serve.beam import BeamSearchStream
from mie.serve.loop import EngineLoop, RequestStream, Update
from mie.serve.metrics import METRICS_MEDIA_TYPE, ServerMetrics
from mie.serve.protocol import APIError, Options
from mie.serve.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB of JSON is far more than any prompt mie can take
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its answer: unread

logger = logging.getLogger("mie.serve")


class JSON(JSONResponse):
    """JSON as ``json.dumps`` writes it by default: ASCII only, so text holding a lone
    surrogate (a client's ``"\\ud800"`` quoted back in an error) is escaped, not a
    ``UnicodeEncodeError`` in the middle of answering."""

    def render(self, content: object) -> bytes:
        return json.dumps(content).encode("ascii")


class EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends.

    Starlette cancels a streaming response when the client disconnects, possibly before the
    event generator has even started; wrapping the whole response is the one place that
    sees every ending.
    """

    def __init__(self, events: AsyncIterator[str], on_close) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _LastResort:
    """ASGI middleware: an exception no handler caught becomes a 500 in OpenAI's shape.

    Starlette's own 500 handler (``ServerErrorMiddleware``) re-raises after answering, so
    uvicorn logs a traceback and drops the keep-alive connection. Here the exception is
    logged once and answered, and the connection carries on. If the response had already
    started there is nothing left to say on it; the stream generators catch their own
    errors, so that is only a last resort too.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except ClientDisconnect:
            pass  # nobody to answer
        except Exception as exc:
            logger.exception("internal error on %s %s", scope["method"], scope["path"])
            if not started:
                error = APIError(
                    500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"
                )
                await _json_error(error)(scope, receive, send)


@contextlib.contextmanager
def _reading_request() -> Iterator[None]:
    """Everything that goes wrong while reading a request is the request's fault: a 400.

    The checks in ``protocol`` name the field at fault; this catches what they did not
    foresee (a tokenizer refusing odd text, a template tripping over a value, an overflow)
    so that no input can turn into a 500.
    """
    try:
        yield
    except (APIError, ClientDisconnect):
        raise
    except Exception as exc:
        logger.info("bad request (%s: %s)", type(exc).__name__, exc)
        raise protocol.bad_request(f"invalid request: {type(exc).__name__}: {exc}") from None


class OpenAIFrontend:
    """The routes and what every server shares: validation, tokenizing, OpenAI's shapes, SSE.

    What runs a request is left to a subclass: ``OpenAIServer`` hands it to the engine loop
    in this process; the Ray ingress (``mie.serve.cluster``) to one of several engine
    replicas. A subclass provides ``_start`` (hand over one request, return its stream once
    accepted; or ``_start_all``, for the prompts of a batch at once), ``_abort``, ``health``,
    ``metrics_text``, ``_lifespan`` and ``end_requests``.
    A stream is anything with ``request_id``, ``num_prompt_tokens`` and async iteration over
    ``Update``s, the last one with a finish reason or an error.
    """

    def __init__(
        self,
        tokenizer,
        model_dir: str | Path,
        max_model_len: int,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        sampling_defaults: dict,
        model_name: str | None = None,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        system_fingerprint: str | None = None,
        max_samples_per_request: int = protocol.MAX_CHOICES,
        auto_tool_parser: str | None = None,
    ) -> None:
        """``eos_token_ids``, ``vocab_size``: the model's (what a beam search reads);
        ``sampling_defaults``: the checkpoint's recommended sampling, for the fields a
        request leaves out (``LLMEngine.sampling_defaults``);
        ``auto_tool_parser``: a ``TOOL_PARSERS`` name, which allows ``tool_choice: "auto"``
        and finds the calls (``--enable-auto-tool-choice --tool-call-parser``); None: "auto"
        is refused."""
        if tokenizer is None:
            raise ValueError(f"{model_dir}: serving needs the checkpoint's tokenizer.json")
        if auto_tool_parser is not None and auto_tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool-call parser {auto_tool_parser!r}; known: {', '.join(TOOL_PARSERS)}"
            )
        self.tool_parser = TOOL_PARSERS[auto_tool_parser]() if auto_tool_parser else None
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.sampling_defaults = dict(sampling_defaults)
        self.model_name = model_name or Path(model_dir).resolve().name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_samples_per_request = max_samples_per_request  # the engine's (a batch's too)
        self.chat_template = ChatTemplate(model_dir, tokenizer)
        self.created = int(time.time())  # the model object's: when this server loaded it
        self.system_fingerprint = system_fingerprint  # see ``system_fingerprint``
        # A token's text at the start of a text (the prompt's first token, which has no
        # log-probabilities and so no engine text), as the engine's detokenizer reads it
        # there: "" for an unfinished character, or a skipped special token (BOS) unless
        # special tokens are shown. At most two entries per token of the vocabulary.
        self._first_token_text = functools.lru_cache(maxsize=None)(
            lambda token_id, skip: IncrementalDetokenizer(tokenizer, [], skip).add(token_id)
        )

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]
        handlers = {APIError: _api_error, HTTPException: _http_error}
        app = Starlette(
            routes=routes,
            exception_handlers=handlers,
            middleware=[Middleware(_LastResort)],
            lifespan=self._lifespan,
        )
        app.state.end_requests = self.end_requests  # the server calls it at shutdown
        return app

    # -- routes ---------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        """A completion of one prompt, or of a batch: each prompt is an engine request of its
        own, and choice ``p * n + i`` of the answer is sample ``i`` of prompt ``p`` (OpenAI's
        numbering), whole or streamed; the usage counts every prompt."""
        self._authorize(request)
        created = int(time.time())
        with _reading_request():
            body = await self._json_body(request)
            options = protocol.parse_options(
                body, self.model_name, chat=False, defaults=self.sampling_defaults
            )
            prompts = protocol.parse_prompts(body, options.best_of, self.max_samples_per_request)
            # Tokenizing grows with the prompts' size: off the event loop.
            encoded = await run_in_threadpool(self._encode_prompts, prompts, options)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit(request_id, encoded, options, COMPLETION_DEFAULT_MAX_TOKENS)
        token_text = self._token_texts(options)
        renderers = [ChoiceRenderer(options, text or "", ids, token_text) for text, ids in encoded]
        n = options.n
        if options.stream and options.best_of == n:
            if len(streams) == 1:
                stream, renderer = streams[0], renderers[0]
            else:  # plays both parts for the one-prompt streaming code (see PromptBatch)
                stream = renderer = PromptBatch(request_id, streams, renderers, n)
            events = self._completion_events(stream, renderer, created)
            return self._event_stream(streams, events)
        if (answers := await self._collect(request, streams)) is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices, generated = [], 0
        for p, (renderer, answer) in enumerate(zip(renderers, answers, strict=True)):
            renderer.prompt_logprobs = answer.prompt_logprobs
            prompt_choices = [
                renderer.completion(p * n + i, c) for i, c in enumerate(answer.best(n))
            ]
            if options.prompt_logprobs:  # vLLM's: on each choice of the prompt
                wire = protocol.wire_prompt_logprobs(answer.prompt_logprobs)
                prompt_choices = [{**choice, "prompt_logprobs": wire} for choice in prompt_choices]
            choices += prompt_choices
            generated += 0 if options.scores_only else answer.num_generated_tokens
        usage = protocol.usage(sum(len(ids) for _, ids in encoded), generated)
        body = protocol.completion(
            request_id,
            created,
            self.model_name,
            choices,
            usage,
            fingerprint=self.system_fingerprint,
        )
        if options.stream:  # best_of > n: the answer is known only at the end (as vLLM does)
            return self._event_stream(streams, _one_event(body))
        return JSON(body)

    def _encode_prompts(
        self, prompts: list[str | list[int]], options: Options
    ) -> list[tuple[str | None, list[int]]]:
        """Each prompt's text (None for token ids, unless echoed) and the token ids the engine
        computes (``_kept``). An echoed text is what the echoed tokens spell: the
        prompt as given, or, where that differs -- token ids, a truncated prompt, special
        tokens shown (``skip_special_tokens: false``) -- those tokens read as the engine reads
        them."""
        skip, special = options.sampling.skip_special_tokens, options.add_special_tokens
        encoded = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt, special) if isinstance(prompt, str) else prompt
            kept = self._kept(ids, options)
            text = prompt if isinstance(prompt, str) else None
            if options.echo and (text is None or len(kept) < len(ids) or not skip):
                detokenizer = IncrementalDetokenizer(self.tokenizer, [], skip)
                text = "".join(detokenizer.add(t) for t in kept)  # as the engine reads them
            encoded.append((text, kept))
        return encoded

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        created = int(time.time())
        with _reading_request():
            body = await self._json_body(request)
            options = protocol.parse_options(
                body, self.model_name, chat=True, defaults=self.sampling_defaults
            )
            tool_request = tools.parse_tool_request(body, self.tool_parser)
            options = tool_request.constrain(options)
            messages = protocol.parse_messages(body)
            template_options = protocol.chat_template_options(body)
            # Rendering and encoding grow with the chat's size: off the event loop.
            text, ids = await run_in_threadpool(
                self._render_chat,
                messages,
                tool_request.tools,
                template_options,
                options.add_special_tokens,
            )
            ids = self._kept(ids, options)
        # Like OpenAI, a chat may by default run to the end of the context.
        default_max_tokens = max(self.max_model_len - len(ids), 1)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._submit(request_id, [(text, ids)], options, default_max_tokens)
        last = messages[-1]
        echo = options.echo_last_message and last["role"] == "assistant"
        echoed = last["content"] if echo else ""
        renderer = ChoiceRenderer(
            options, text, ids, self._token_texts(options), tool_request, echoed=echoed
        )
        if options.stream:
            return self._event_stream(streams, self._chat_events(streams[0], renderer, created))
        if (answers := await self._collect(request, streams)) is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        answer = answers[0]
        choices = [renderer.chat(i, c) for i, c in enumerate(answer.best(options.n))]
        usage = protocol.usage(len(ids), answer.num_generated_tokens)
        body = protocol.chat_completion(
            request_id,
            created,
            self.model_name,
            choices,
            usage,
            fingerprint=self.system_fingerprint,
        )
        if options.prompt_logprobs:  # vLLM's: beside the choices
            body["prompt_logprobs"] = protocol.wire_prompt_logprobs(answer.prompt_logprobs)
        return JSON(body)

    def _kept(self, ids: list[int], options: Options) -> list[int]:
        """The prompt tokens the engine will compute: the last ``truncate_prompt_tokens``
        (the engine's rule), so that usage, echo and the default ``max_tokens`` count them."""
        try:
            keep = prompt_tokens_kept(options.sampling.truncate_prompt_tokens, self.max_model_len)
        except InvalidRequestError as exc:
            raise protocol.bad_request(str(exc), param=exc.field) from None
        return ids if keep is None else ids[-keep:]

    def _render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        template_options: dict,
        add_special_tokens: bool | None,
    ) -> tuple[str, list[int]]:
        try:
            text = self.chat_template.apply(messages, tools, **template_options)
        except InvalidRequestError as exc:  # the template refused them
            raise protocol.engine_refusal(exc) from None
        return text, self.chat_template.encode(text, add_special_tokens)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: the token ids of a prompt, or of chat messages rendered
        and encoded exactly as ``/v1/chat/completions`` does (what its ``usage`` would count),
        without generating anything."""
        self._authorize(request)
        with _reading_request():
            body = await self._json_body(request)
            prompt, add_special_tokens = protocol.parse_tokenize(body, self.model_name)
            if prompt is None:
                messages = protocol.parse_messages(body)
                tool_request = tools.parse_tool_request(body, self.tool_parser)
                options = protocol.chat_template_options(body)
                _, ids = await run_in_threadpool(
                    self._render_chat, messages, tool_request.tools, options, add_special_tokens
                )
            else:
                ids = await run_in_threadpool(self.tokenizer.encode, prompt, add_special_tokens)
        return JSON(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: the text of token ids, special tokens included (as
        vLLM decodes them)."""
        self._authorize(request)
        with _reading_request():
            body = await self._json_body(request)
            ids = protocol.parse_detokenize(body, self.model_name, self.tokenizer.vocab_size)
            text = await run_in_threadpool(self.tokenizer.decode, ids, False)
        return JSON({"prompt": text})

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSON({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the model served, or OpenAI's 404 for any other id."""
        self._authorize(request)
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise APIError(
                404,
                f"the model {protocol._show(model_id)} does not exist; this "
                f"server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        return JSON(self._model_object())

    def _model_object(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "mie",
            "max_model_len": self.max_model_len,
        }

    # -- helpers --------------------------------------------------------------------------------
    def _token_texts(self, options: Options):
        """How a request's log-probabilities spell a token (``token_id, Logprob | None ->
        text``): the engine's text, in context; with no context (the prompt's first token),
        its text at the start of a text, special tokens shown as the request asks; with
        ``return_tokens_as_token_ids``, ``token_id:<id>`` (vLLM's spelling)."""
        skip = options.sampling.skip_special_tokens

        def token_text(token_id: int, logprob: Logprob | None) -> str:
            if options.tokens_as_ids:
                return f"token_id:{token_id}"
            if logprob is not None and logprob.decoded_token is not None:
                return logprob.decoded_token
            return self._first_token_text(token_id, skip)

        return token_text

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )

    async def _json_body(self, request: Request) -> dict:
        """The body, read up to ``max_body_bytes`` (a larger one is a 400), as a JSON object.

        How long the body may take to arrive is the HTTP protocol's business (the server's
        request timeout closes the connection of a client that stalls)."""
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
        error = protocol.bad_request(
            f"the request body is too large ({size} bytes > {self.max_body_bytes})",
            code="body_too_large",
        )
        error.headers["Connection"] = "close"  # rather than read the rest of it
        return error

    async def _submit(
        self,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        options: Options,
        default: int,
    ) -> list:
        """Hand the request over, one engine request per prompt (``(text, token ids)``);
        return their streams once all are accepted (or raise, with none left running).
        One prompt's engine request is ``request_id`` itself, a batch's ``request_id-p``;
        with ``use_beam_search`` each prompt is a ``BeamSearchStream``."""
        if len(prompts) == 1:
            ids = [request_id]
        else:
            ids = [f"{request_id}-{p}" for p in range(len(prompts))]
        requests = [(rid, text, tokens) for rid, (text, tokens) in zip(ids, prompts, strict=True)]
        try:
            if options.beam_width is not None:
                return await self._start_beam_searches(requests, options, default)
            params = options.sampling_params(default)
            self._check_context(requests, params.max_tokens)
            if params.structured_outputs is not None:
                await self._compile_constraint(params.structured_outputs, options.constraint_param)
            return await self._start_all(requests, params, options)
        except APIError as error:  # the engine's refusal names its own field: name the client's
            if error.param == "structured_outputs" and options.constraint_param:
                error.param = options.constraint_param
            elif error.param == "prompt":
                error.param = options.prompt_param
            elif error.param == "beam_width":
                error.param = "n"
            raise

    def _check_context(self, requests: list, max_tokens: int) -> None:
        """Each prompt + ``max_tokens`` must fit the context (``check_fits_context``): a 400
        otherwise, as vLLM's server answers -- a client that asked for more tokens than it
        can get should hear so (offline, the engine ends such a request at the context's
        end instead)."""
        for index, (_, _, ids) in enumerate(requests):
            try:
                check_fits_context(len(ids), max_tokens, self.max_model_len)
            except InvalidRequestError as exc:
                raise protocol.engine_refusal(exc, index if len(requests) > 1 else None) from None

    async def _start_beam_searches(
        self, requests: list[tuple[str, str | None, list[int]]], options: Options, default: int
    ) -> list[BeamSearchStream]:
        """One ``BeamSearchStream`` per prompt, every prompt checked before any step runs
        (``start_search``'s refusals); their first steps handed over, or none left running."""
        params = options.beam_search_params(default)
        if params.beam_width > self.max_samples_per_request:  # a batch's: parse_prompts
            raise protocol.bad_request(
                f"'n' ({params.beam_width} beams) exceeds the {self.max_samples_per_request} "
                "sequences one request may hold (half the engine's sequence slots: each beam "
                "runs as one, as a sample does)",
                param="n",
            )
        start_all = functools.partial(self._start_all, options=options)
        decode = functools.partial(beam_text, self.tokenizer)
        streams = []
        for index, (request_id, _, ids) in enumerate(requests):
            try:
                search = start_search(ids, params, self.eos_token_ids, self.max_model_len)
            except InvalidRequestError as exc:
                raise protocol.engine_refusal(exc, index if len(requests) > 1 else None) from None
            step = step_params(search, self.vocab_size)
            streams.append(
                BeamSearchStream(request_id, search, step, start_all, self._abort, decode)
            )
        started = []
        try:
            for stream in streams:
                await stream.start()
                started.append(stream)
        except BaseException:
            for stream in started:
                stream.abort()
            raise
        return streams

    def _stop(self, stream) -> None:
        """Stop a request's stream: a beam search stops itself and its step, any other
        request is aborted where it runs (``_abort``)."""
        if isinstance(stream, BeamSearchStream):
            stream.abort()
        else:
            self._abort(stream)

    def _event_stream(self, streams: list, events: AsyncIterator[str]) -> EventStream:
        def abort_all() -> None:
            for stream in streams:
                self._stop(stream)

        return EventStream(events, on_close=abort_all)

    # -- what a subclass provides ---------------------------------------------------------------
    async def _start_all(
        self, requests: list[tuple[str, str | None, list[int]]], params, options: Options
    ) -> list:
        """Hand over every prompt of one request (``(request_id, text, token ids)``) and
        return their streams once all are accepted. Here: one at a time, aborting those
        already accepted if a later one is refused; a subclass that can queue them all or
        none at once (``OpenAIServer``) does so instead."""
        streams = []
        try:
            for index, (request_id, text, ids) in enumerate(requests):
                try:
                    streams.append(await self._start(request_id, text, ids, params, options))
                except APIError as error:
                    if len(requests) > 1 and error.status == 400:  # that prompt's fault
                        raise protocol.in_batch(error, index) from None
                    raise
        except BaseException:
            for stream in streams:
                self._abort(stream)
            raise
        return streams

    async def _start(
        self, request_id: str, text: str | None, ids: list[int], params, options: Options
    ):
        """Hand one request to whatever runs it; return its stream once accepted."""
        raise NotImplementedError

    async def _compile_constraint(self, constraint: StructuredOutputsParams, param: str) -> None:
        """Compile a request's constraint before it is handed over (a 400 naming ``param``
        if it cannot be), where a subclass can: here nothing, and whatever runs the request
        compiles it when it is added (its refusal: a 400 all the same, renamed by ``_submit``)."""

    def _abort(self, stream) -> None:
        """Stop a request (its client went away); a no-op if it already finished."""
        raise NotImplementedError

    async def health(self, request: Request) -> Response:
        raise NotImplementedError

    async def metrics_text(self, request: Request) -> Response:
        raise NotImplementedError

    def end_requests(self) -> None:
        """Shutting down: end every open request (see ``OpenAIServer.end_requests``)."""
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        yield

    async def _collect(self, request: Request, streams: list) -> list[Answer] | None:
        """Each stream's whole answer, or None if the client left first. Unless every answer
        was collected, every stream is aborted (a no-op for those that finished)."""

        async def answer(stream) -> Answer:
            collected = Answer()
            async for update in stream:
                collected.add(update)
            if collected.error is not None:  # shutting down (503), or its step failed (500)
                raise collected.error
            return collected

        async def answers() -> list[Answer]:
            # One after the other: the engine runs them together; their updates wait queued.
            return [await answer(stream) for stream in streams]

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        collecting = asyncio.ensure_future(answers())
        watching = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not collecting.done():
                collecting.cancel()
            if not collecting.done() or collecting.cancelled() or collecting.exception():
                for stream in streams:
                    self._stop(stream)
        return collecting.result() if collecting.done() and not collecting.cancelled() else None

    async def _completion_events(self, stream, renderer: ChoiceRenderer, created: int):
        """A completion's events; ``stream`` and ``renderer``: one prompt's, or a batch."""
        rid, model, fingerprint = stream.request_id, self.model_name, self.system_fingerprint
        include_usage = renderer.options.include_usage

        def chunks(update: Update) -> list[dict]:
            choice = renderer.completion(update.index, update)
            chunk = protocol.completion_chunk(
                rid, created, model, choice, fingerprint=fingerprint, include_usage=include_usage
            )
            return [chunk]

        def usage_chunk(usage: dict) -> dict:
            return protocol.usage_chunk(
                rid, created, model, "text_completion", usage, fingerprint=fingerprint
            )

        async for event in _events(stream, renderer, chunks, usage_chunk):
            yield event

    async def _chat_events(self, stream, renderer: ChoiceRenderer, created: int):
        rid, model, fingerprint = stream.request_id, self.model_name, self.system_fingerprint
        include_usage = renderer.options.include_usage

        def chunk(choice: dict) -> dict:
            return protocol.chat_chunk(
                rid, created, model, choice, fingerprint=fingerprint, include_usage=include_usage
            )

        # Each choice's first delta carries the role, then (chat's echo) the echoed text.
        n = renderer.options.n
        first = [protocol.chat_delta_choice(i, "", role="assistant") for i in range(n)]
        if renderer.echoed:
            first += [protocol.chat_delta_choice(i, renderer.echoed) for i in range(n)]
        for choice in first:
            body = chunk(choice)
            if renderer.options.continuous_usage:
                body["usage"] = protocol.usage(renderer.prompt_tokens(choice["index"]), 0)
            yield protocol.sse(body)

        def chunks(update: Update) -> list[dict]:
            return [chunk(choice) for choice in renderer.chat_deltas(update.index, update)]

        def usage_chunk(usage: dict) -> dict:
            return protocol.usage_chunk(
                rid, created, model, "chat.completion.chunk", usage, fingerprint=fingerprint
            )

        async for event in _events(stream, renderer, chunks, usage_chunk):
            yield event


class OpenAIServer(OpenAIFrontend):
    """The single-process server: one engine, driven by the engine loop in this process."""

    def __init__(
        self,
        engine: LLMEngine,
        model_dir: str | Path,
        *,
        model_name: str | None = None,
        api_key: str | None = None,
        max_queue: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        auto_tool_parser: str | None = None,
    ) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        super().__init__(
            engine.tokenizer,
            model_dir,
            engine.max_model_len,
            eos_token_ids=engine.model.config.eos_token_ids,
            vocab_size=engine.model.config.vocab_size,
            sampling_defaults=engine.sampling_defaults,
            model_name=model_name,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            system_fingerprint=system_fingerprint(engine),
            max_samples_per_request=engine.max_samples_per_request,
            auto_tool_parser=auto_tool_parser,
        )
        self.engine = engine
        self.metrics = ServerMetrics(self.model_name)
        self.loop = EngineLoop(engine, self.metrics, max_queue)

    def end_requests(self) -> None:
        """Shutting down: stop the engine loop after its current step; every open stream
        ends with an "abort" chunk and ``[DONE]``, every waiting non-streaming request with a
        503, and new requests are refused with a 503. Blocks until the loop has stopped."""
        self.loop.stop()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        self.loop.start()
        try:
            yield
        finally:
            await run_in_threadpool(self.loop.stop)

    async def _start_all(
        self, requests: list[tuple[str, str | None, list[int]]], params, options: Options
    ) -> list[RequestStream]:
        """All of a request's prompts in one command to the engine loop, which queues all
        of them or none: a refused prompt leaves nothing queued, not even for a moment."""
        streams = self.loop.submit_all(requests, params)
        try:
            # They are accepted or refused together, with the same error; gather retrieves
            # every future's outcome.
            await asyncio.gather(*(stream.started for stream in streams))
        except asyncio.CancelledError:
            for stream in streams:
                self.loop.abort(stream.request_id)
            raise
        return streams

    def _abort(self, stream: RequestStream) -> None:
        self.loop.abort(stream.request_id)

    async def _compile_constraint(self, constraint: StructuredOutputsParams, param: str) -> None:
        """Compile it in a worker thread (up to tens of milliseconds for a large schema):
        the engine thread's ``add_request`` then finds it in the engine's grammar cache
        instead of making every other client wait for it."""
        if self.engine.grammar is None:  # add_request refuses it, naming the field
            return
        try:
            await run_in_threadpool(self.engine.grammar.compile, constraint)
        except StructuredOutputsError as exc:
            raise protocol.bad_request(f"'{param}': {exc}", param=param) from None

    async def health(self, request: Request) -> Response:
        if not self.loop.healthy:
            error = self.loop.error
            raise APIError(
                503,
                f"the engine loop is not running ({error!r})"
                if error
                else "the engine loop is not running",
                type="server_error",
            )
        if (stalled := self.loop.stalled()) is not None:  # e.g. a scheduler that cannot admit
            raise APIError(
                503, f"the engine is stuck: {stalled}", type="server_error", code="engine_stalled"
            )
        return JSON({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=METRICS_MEDIA_TYPE)


async def _events(stream, renderer: ChoiceRenderer, chunks, usage_chunk):
    """A request's server-sent events: the chunks of each update (each with its choice's
    index; more than one when it completes tool calls), the usage if asked (the tokens of
    every choice), ``[DONE]``.

    However it ends, a stream that started ends with ``data: [DONE]``. An update that ends
    a choice normally (stop, length, or abort when the server shuts down) is a chunk with
    its finish reason; a failed engine step is an error event in OpenAI's shape, as is an
    unexpected error here (logged).
    """
    num_tokens: dict[int, int] = {}  # per choice
    try:
        async for update in stream:
            if update.prompt_logprobs is not None:
                renderer.prompt_logprobs = update.prompt_logprobs
            if update.finish_reason is None and update.error is not None:
                yield protocol.sse(protocol.error_chunk(update.error))
                break
            num_tokens[update.index] = max(
                num_tokens.get(update.index, 0), update.num_output_tokens
            )
            if update.text or update.token_ids or update.finish_reason or renderer.echoes(update):
                for body in chunks(update):
                    if renderer.options.continuous_usage:  # vLLM's: the choice's so far
                        generated = 0 if renderer.options.scores_only else num_tokens[update.index]
                        prompt = renderer.prompt_tokens(update.index)
                        body["usage"] = protocol.usage(prompt, generated)
                    yield protocol.sse(body)
        else:
            if renderer.options.include_usage:
                generated = 0 if renderer.options.scores_only else sum(num_tokens.values())
                usage = protocol.usage(stream.num_prompt_tokens, generated)
                yield protocol.sse(usage_chunk(usage))
    except Exception as exc:
        logger.exception("internal error in the stream of %s", stream.request_id)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        yield protocol.sse(protocol.error_chunk(error))
    yield protocol.sse("[DONE]")


async def _one_event(body: dict):
    """A whole answer as a stream of one event (``best_of > n`` cannot be streamed)."""
    yield protocol.sse(body)
    yield protocol.sse("[DONE]")


def system_fingerprint(engine: LLMEngine) -> str:
    """OpenAI's ``system_fingerprint`` for a server of ``engine``: besides the request, what
    decides its answers -- mie's version, the backend, the model's configuration, the
    weights' format and the KV cache's dtype -- hashed into a short string that is the same
    on every start (and every replica) of the same setup and changes with any of them."""
    identity = {
        "mie": mie.__version__,
        "backend": engine.backend.name,
        "model": dataclasses.asdict(engine.model.config),
        "weights": engine.model.weights.format,
        "kv_cache": engine.kv_cache.dtype.name,
    }
    canonical = json.dumps(identity, sort_keys=True, default=str)
    return "fp_" + hashlib.sha256(canonical.encode()).hexdigest()[:12]


def build_app(engine: LLMEngine, model_dir: str | Path, **settings) -> Starlette:
    """The ASGI app serving ``engine``; ``settings`` are ``OpenAIServer``'s keywords."""
    return OpenAIServer(engine, model_dir, **settings).app()


# -- errors as OpenAI's JSON ------------------------------------------------------------------
def _json_error(error: APIError) -> Response:
    return JSON(error.body(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, exc: APIError) -> Response:
    return _json_error(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404 unknown route, 405 wrong method) in OpenAI's shape."""
    message = f"{exc.detail}: {request.method} {request.url.path}"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    error = APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
    return _json_error(error)
