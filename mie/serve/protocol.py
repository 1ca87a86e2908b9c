"""The OpenAI wire format: request bodies in (validated), JSON responses and SSE chunks out.

Everything here is plain data in, plain data out, so it is independent of the HTTP stack
and of the engine. Every problem with a request is an ``APIError`` carrying the HTTP status
and OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

from mie.checks import as_float, is_int
from mie.checks import short_repr as _show
from mie.engine.beam_search import BeamSearchParams
from mie.engine.chat import chat_messages
from mie.engine.sampling import InvalidRequestError, SamplingParams
from mie.engine.stop_strings import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from mie.engine.structured import KINDS, StructuredOutputsError, StructuredOutputsParams

MAX_MESSAGE_SHOWN = 1000  # an error message is cut here: it may quote the client's input

# Fields of OpenAI's API that mie does not implement: accepted only at their no-op values,
# so a client that relies on one gets a clear 400 instead of a silently different answer.
# (``functions`` and ``function_call`` are the deprecated spelling of ``tools``.)
UNSUPPORTED = {
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    # vLLM's extensions that would change the answer, which mie does not implement: only
    # their defaults (ignoring another value would answer a question the client did not ask).
    "spaces_between_special_tokens": (True,),
    "logits_processors": (),
}
# Chat's fields that completions do not have (tool calls need a chat template's turns).
COMPLETION_UNSUPPORTED = {"tools": ([],), "tool_choice": ("none",)}
# Completions' fields that chat completions do not have (OpenAI's chat API has neither), and
# vLLM's chat extension mie does not implement: a template of the client's own (vLLM too
# refuses it unless started with --trust-request-chat-template).
CHAT_UNSUPPORTED = {
    "best_of": (1,),
    "chat_template": (),
}
# vLLM's former names of ``structured_outputs``' fields, which clients still send.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

# n and best_of: OpenAI caps n at 128. Each sample is a sequence in the batch: the engine
# refuses best_of above half its max_num_seqs (InvalidRequestError, a 400 naming the limit).
MAX_CHOICES = 128
LOGPROB_FLOOR = -9999.0  # -inf is not JSON: OpenAI's (and vLLM's) stand-in for it


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE_SHOWN:
            message = message[: MAX_MESSAGE_SHOWN - 3] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def engine_refusal(exc: Exception, prompt_index: int | None = None) -> APIError:
    """The engine refused a request (``InvalidRequestError``, ``RequestTooLongError``): a 400,
    naming the field the refusal names (``InvalidRequestError.field``: ``logit_bias`` ids
    outside the vocabulary, ``stop_token_ids``, a batch too large for ``prompt``...).
    ``prompt_index``: the refused prompt of a batch, which the message names (``prompt`` is
    the field, unless the engine named another)."""
    message = str(exc) or type(exc).__name__
    error = APIError(400, message, param=getattr(exc, "field", None))
    return error if prompt_index is None else in_batch(error, prompt_index)


def in_batch(error: APIError, prompt_index: int) -> APIError:
    """A refusal of one prompt of a batch: the message names the prompt, and ``param`` is
    ``prompt`` unless the refusal named another field."""
    return APIError(
        error.status,
        f"prompt[{prompt_index}]: {error.message}",
        type=error.type,
        param=error.param or "prompt",
        code=error.code,
        headers=error.headers,
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- requests ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """What a completion or chat request asks for, besides its prompt or messages: the
    sampling, as the client asked for it (``SamplingParams``, checked by its own rules), and
    what only the server does (streaming, echo, choosing the best samples)."""

    # The client's n and best_of; its max_tokens is the request's, or a stand-in until the
    # endpoint's default is known (``sampling_params`` builds the engine's parameters).
    sampling: SamplingParams
    max_tokens: int | None  # None: the endpoint's default; 0: echo the prompt only
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    # the counts so far (its choice's tokens) instead of usage: null.
    continuous_usage: bool = False
    echo: bool = False  # completions: the prompt (and its log-probabilities) first
    # chat's echo (vLLM's): an answer continuing an assistant message (continue_final_message)
    # starts with that message's text.
    echo_last_message: bool = False
    # The request field the sampling's ``structured_outputs`` came from (``response_format``,
    # ``structured_outputs``, ``tool_choice``): what a 400 about the constraint names.
    constraint_param: str | None = None
    # The request field the prompt came from (chat's: ``messages``): what a 400 about the
    # prompt names.
    prompt_param: str = "prompt"
    # vLLM's add_special_tokens: whether a text prompt gets the tokenizer's special tokens
    # (BOS); completions default to yes; chat's None: only for mie's default template, since
    # a checkpoint's template writes its own (``ChatTemplate.encode``).
    add_special_tokens: bool | None = None
    # vLLM's prompt_logprobs: the answer lists the prompt's (``wire_prompt_logprobs``).
    prompt_logprobs: bool = False
    # vLLM's return_tokens_as_token_ids: log-probabilities spell every token "token_id:<id>"
    # (for clients that must tell apart tokens whose texts are alike, or not valid text).
    tokens_as_ids: bool = False
    # vLLM's use_beam_search: n is the beam width (``sampling`` then holds one greedy sample,
    # checked by its rules for everything beam search leaves at the defaults), and
    # length_penalty ranks the finished beams. None: no beam search.
    beam_width: int | None = None
    length_penalty: float = 1.0
    # The checkpoint's max_new_tokens (vLLM caps every request's max_tokens with it); None: none.
    max_tokens_cap: int | None = None

    @property
    def n(self) -> int:
        """Choices returned."""
        return self.sampling.n if self.beam_width is None else self.beam_width

    @property
    def best_of(self) -> int:
        """Samples generated (>= n); the n with the highest log-probability win."""
        return self.sampling.best_of if self.beam_width is None else self.beam_width

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token (chat: top_logprobs); None: none."""
        return self.sampling.logprobs

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt's log-probabilities, nothing generated."""
        return self.max_tokens == 0

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters for this request (``default_max_tokens``: the endpoint's,
        used when the request gives none; ``min_tokens`` above it is a 400 naming it).

        The engine runs all ``best_of`` samples as ``n`` and the server picks the ``n`` best
        (``answers.Answer.best``), on the tokens each sample kept, as the engine ranks them.
        Picking needs each token's log-probability, so ``best_of > n`` asks for them
        (``logprobs=0``: the token's own). A score-only request (``max_tokens: 0``) still
        samples one token (the engine needs one to finish the prompt), which the server
        drops.
        """
        max_tokens = self._max_tokens(default_max_tokens)
        logprobs = self.logprobs
        if logprobs is None and self.best_of > self.n:
            logprobs = 0
        with _sampling_refused():
            return replace(
                self.sampling,
                n=self.best_of,
                best_of=None,
                max_tokens=max(max_tokens, 1),
                logprobs=logprobs,
            )

    def _max_tokens(self, default_max_tokens: int) -> int:
        """The request's ``max_tokens`` (``default_max_tokens``: the endpoint's, when it gives
        none), capped by the checkpoint's ``max_new_tokens`` (as vLLM's ``get_max_tokens``);
        0 (score the prompt) stays 0."""
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if self.max_tokens_cap is not None and max_tokens:
            max_tokens = min(max_tokens, self.max_tokens_cap)
        return max_tokens

    def beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """The search's parameters (vLLM's ``to_beam_search_params``: n, max_tokens,
        ignore_eos, temperature -- which, as in vLLM, changes nothing -- and
        length_penalty); their refusal is a 400 naming the request's field."""
        max_tokens = self._max_tokens(default_max_tokens)
        with _sampling_refused(renamed={"beam_width": "n"}):
            return BeamSearchParams(
                beam_width=self.n,
                max_tokens=max_tokens,
                ignore_eos=self.sampling.ignore_eos,
                temperature=self.sampling.temperature,
                length_penalty=self.length_penalty,
            )


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying why it is not one.

    ``json.loads`` refuses input in more ways than ``JSONDecodeError``: invalid UTF-8 is a
    ``UnicodeDecodeError``, an integer of more than 4300 digits a plain ``ValueError``
    (Python's int-parsing limit), and arrays nested a few thousand deep a ``RecursionError``.
    All of them are the client's malformed body.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise bad_request(f"malformed JSON body: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def parse_options(
    body: dict, model_name: str, *, chat: bool, defaults: dict | None = None
) -> Options:
    """Check the model name, every field's JSON type and OpenAI's own rules, then build the
    request's ``SamplingParams``: its refusal of a value is a 400 naming the field (its
    ``InvalidRequestError.field``), so each sampling rule is written once, there.

    Checked here only what HTTP alone has: JSON types, OpenAI's fields and spellings (stop
    strings, ``echo``, ``max_tokens: 0``, chat's ``top_logprobs``, ``logit_bias``' string
    keys) and the caps of a request over HTTP (``MAX_CHOICES``, ``MAX_STOP_STRINGS``).

    ``defaults``: the checkpoint's recommended sampling (``LLMEngine.sampling_defaults``,
    vLLM's ``default_sampling_params``): a field the request leaves out takes its value
    instead of OpenAI's default, and its ``max_tokens`` caps the request's.
    """
    defaults = defaults or {}
    check_model(body, model_name)
    unsupported = {**UNSUPPORTED, **(CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED)}
    for name, allowed in unsupported.items():
        value = body.get(name)
        if value is not None and not any(_same_json(value, a) for a in allowed):
            raise bad_request(f"'{name}' is not supported by mie (got {_show(value)})", param=name)
    echo = _field(body, "echo", bool, "a boolean", default=False)
    echo_last_message, echo = chat and echo, echo and not chat
    # chat's newer name wins when given (null counts as absent, as for every field)
    given = chat and body.get("max_completion_tokens") is not None
    max_tokens_name = "max_completion_tokens" if given else "max_tokens"
    max_tokens = _field(body, max_tokens_name, int, "an integer")
    if max_tokens is not None and max_tokens < 1 and not (echo and max_tokens == 0):
        raise bad_request(
            f"'{max_tokens_name}' must be at least 1 (0 only with 'echo', to "
            f"score the prompt), got {_show(max_tokens)}",
            param=max_tokens_name,
        )
    min_tokens = _field(body, "min_tokens", int, "an integer", default=0)
    if max_tokens == 0 and min_tokens:
        raise bad_request(
            f"'min_tokens' must be 0 when 'max_tokens' is 0 (the prompt is only "
            f"scored), got {_show(min_tokens)}",
            param="min_tokens",
        )
    stream = _field(body, "stream", bool, "a boolean", default=False)
    stream_options = _field(body, "stream_options", dict, "an object", default={})
    include_usage = _field(stream_options, "include_usage", bool, "a boolean", default=False)
    continuous = "continuous_usage_stats"
    continuous_usage = _field(stream_options, continuous, bool, "a boolean", default=False)
    n = _field(body, "n", int, "an integer", default=1)
    best_of = _field(body, "best_of", int, "an integer", default=n)
    for name, value in (("n", n), ("best_of", best_of)):
        if value > MAX_CHOICES:
            raise bad_request(
                f"'{name}' must be at most {MAX_CHOICES}, got {_show(value)}", param=name
            )
    logprobs = _chat_logprobs(body) if chat else _field(body, "logprobs", int, "an integer")
    prompt_logprobs = _prompt_logprobs(body, echo, stream)
    constraint, constraint_param = structured_outputs(body)
    beam_search = _field(body, "use_beam_search", bool, "a boolean", default=False)
    length_penalty = _number(body, "length_penalty", default=1.0)
    with _sampling_refused(renamed={"logprobs": "top_logprobs"} if chat else {}):
        sampling = SamplingParams(
            n=1 if beam_search else n,
            best_of=1 if beam_search else best_of,
            temperature=_number(body, "temperature", default=defaults.get("temperature", 1.0)),
            top_k=_field(body, "top_k", int, "an integer", default=defaults.get("top_k", -1)),
            top_p=_number(body, "top_p", default=defaults.get("top_p", 1.0)),
            min_p=_number(body, "min_p", default=defaults.get("min_p", 0.0)),
            # The endpoint's default max_tokens is known only with the prompt (chat: the
            # context left): ``sampling_params`` checks min_tokens against it.
            max_tokens=max_tokens or max(min_tokens, 1),
            min_tokens=min_tokens,
            seed=_field(body, "seed", int, "an integer"),
            stop=_stop_strings(body),
            include_stop_str_in_output=_field(
                body, "include_stop_str_in_output", bool, "a boolean", default=False
            ),
            skip_special_tokens=_field(
                body, "skip_special_tokens", bool, "a boolean", default=True
            ),
            truncate_prompt_tokens=_field(body, "truncate_prompt_tokens", int, "an integer"),
            stop_token_ids=_field(body, "stop_token_ids", list, "a list of integers", default=[]),
            ignore_eos=_field(body, "ignore_eos", bool, "a boolean", default=False),
            presence_penalty=_number(body, "presence_penalty", default=0.0),
            frequency_penalty=_number(body, "frequency_penalty", default=0.0),
            repetition_penalty=_number(
                body, "repetition_penalty", default=defaults.get("repetition_penalty", 1.0)
            ),
            logit_bias=_logit_bias(body),
            allowed_token_ids=_field(body, "allowed_token_ids", list, "a list of integers"),
            bad_words=_field(body, "bad_words", list, "a list of strings", default=[]),
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else prompt_logprobs,
            structured_outputs=constraint,
        )
    if beam_search:
        _check_beam_search(sampling, n, best_of, echo, constraint_param)
    return Options(
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous_usage,
        echo=echo,
        echo_last_message=echo_last_message,
        constraint_param=constraint_param,
        prompt_param="messages" if chat else "prompt",
        prompt_logprobs=prompt_logprobs is not None,
        add_special_tokens=_field(
            body, "add_special_tokens", bool, "a boolean", default=None if chat else True
        ),
        tokens_as_ids=_field(body, "return_tokens_as_token_ids", bool, "a boolean", default=False),
        beam_width=n if beam_search else None,
        length_penalty=length_penalty,
        max_tokens_cap=defaults.get("max_tokens"),
    )


def _check_beam_search(
    sampling: SamplingParams,
    n: int,
    best_of: int,
    echo: bool,
    constraint_param: str | None,
) -> None:
    """With ``use_beam_search`` a request takes what vLLM's beam search reads -- ``n`` (the
    beam width), ``max_tokens``, ``ignore_eos``, ``temperature``, ``length_penalty`` --
    and what only shapes the prompt (``truncate_prompt_tokens``, ``seed``, which draws
    nothing here); every other field that would change the answer must keep its default:
    the search ranks raw log-probabilities and knows no stop string, penalty or grammar, and
    vLLM's silently ignoring them would answer a question the client did not ask."""
    if best_of != n:
        raise bad_request(
            f"'best_of' must equal 'n' (the beam width) with 'use_beam_search', got {best_of}",
            param="best_of",
        )
    if echo:
        raise bad_request("'echo' is not supported with 'use_beam_search'", param="echo")
    kept = ("n", "best_of", "max_tokens", "ignore_eos", "temperature", "seed")
    plain = SamplingParams(
        truncate_prompt_tokens=sampling.truncate_prompt_tokens,
        **{name: getattr(sampling, name) for name in kept},
    )
    wire = {"structured_outputs": constraint_param or "structured_outputs"}
    for f in fields(SamplingParams):
        if getattr(sampling, f.name) != getattr(plain, f.name):
            param = wire.get(f.name, f.name)
            raise bad_request(f"'{param}' is not supported with 'use_beam_search'", param=param)


def check_model(body: dict, model_name: str, *, required: bool = True) -> None:
    """``model`` names the model served; any other is OpenAI's and vLLM's 404 (``required``
    False: it may be left out, as on vLLM's ``/tokenize`` and ``/detokenize``)."""
    model = _field(body, "model", str, "a string", required=required, default=model_name)
    if model != model_name:
        raise APIError(
            404,
            f"the model {_show(model)} does not exist; this server serves '{model_name}'",
            param="model",
            code="model_not_found",
        )


def parse_tokenize(body: dict, model_name: str) -> tuple[str | None, bool | None]:
    """vLLM's ``POST /tokenize`` body: a ``prompt`` or chat ``messages`` (parsed by
    ``parse_messages``, rendered as chat completions render them, ``tools`` included) ->
    (the prompt, or None for messages; ``add_special_tokens``: by default true for a prompt,
    None for messages, the template's choice)."""
    check_model(body, model_name, required=False)
    if body.get("return_token_strs") not in (None, False):
        raise bad_request(
            f"'return_token_strs' is not supported by mie (got {_show(body['return_token_strs'])})",
            param="return_token_strs",
        )
    add_special_tokens = _field(body, "add_special_tokens", bool, "a boolean")
    if "messages" in body:
        if "prompt" in body:
            raise bad_request("give either 'prompt' or 'messages', not both", param="prompt")
        return None, add_special_tokens
    prompt = _field(body, "prompt", str, "a string", required=True)
    _check_unicode(prompt, "prompt")
    return prompt, True if add_special_tokens is None else add_special_tokens


def parse_detokenize(body: dict, model_name: str, vocab_size: int) -> list[int]:
    """vLLM's ``POST /detokenize`` body: ``tokens``, ids of the vocabulary."""
    check_model(body, model_name, required=False)
    tokens = _field(body, "tokens", list, "a list of integers", required=True)
    for t in tokens:
        if not (is_int(t) and 0 <= t < vocab_size):
            raise bad_request(
                f"'tokens' must be token ids in [0, {vocab_size}), got {_show(t)}",
                param="tokens",
            )
    return tokens


def structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """What the output must match, and the field that asked: OpenAI's ``response_format``
    (``text``: nothing; ``json_object``; ``json_schema`` with its ``name`` and ``schema``, any
    JSON when the schema is left out) or vLLM's ``structured_outputs`` (``StructuredOutputsParams``'
    fields; or the same as vLLM's older top-level ``guided_json``, ``guided_regex``...,
    ``GUIDED``). Beside a ``response_format``, ``structured_outputs`` may only set the JSON's
    whitespace (``whitespace_pattern``, ``disable_any_whitespace``), as in vLLM; two
    constraints are a 400. Whether the constraint compiles is checked before queueing
    (``OpenAIServer._compile_constraint``)."""
    response_format = _field(body, "response_format", dict, "an object")
    extra = _field(body, "structured_outputs", dict, "an object", default={})
    param = "structured_outputs"
    if guided := [name for name in GUIDED if body.get(name) is not None]:
        if extra:
            raise bad_request(
                f"give either 'structured_outputs' or {_show(guided[0])}, not both",
                param=guided[0],
            )
        extra, param = {GUIDED[name]: body[name] for name in guided}, guided[0]
    known = {f.name for f in fields(StructuredOutputsParams)}
    if unknown := sorted(set(extra) - known):
        raise bad_request(
            f"'structured_outputs' has unknown fields {', '.join(map(_show, unknown))}; "
            f"known: {', '.join(sorted(known))}",
            param="structured_outputs",
        )
    from_format = _response_format(response_format) if response_format is not None else {}
    if not from_format:
        if not extra and body.get("structured_outputs") is None:
            return None, None
        return _constraint(param, **extra), param  # {} alone: no kind, a 400 as in vLLM
    if kinds := sorted(set(extra) & set(KINDS)):
        raise bad_request(
            f"give either 'response_format' or '{param}' {', '.join(kinds)}, not both",
            param=param,
        )
    return _constraint("response_format", **from_format, **extra), "response_format"


def _response_format(response_format: dict) -> dict:
    """``response_format`` as ``StructuredOutputsParams``' fields ({} for ``text``)."""
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(
            f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, "
            f"got {_show(kind)}",
            param="response_format",
        )
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request(
            "'response_format.json_schema' must be an object with a 'name' (a non-empty "
            "string) and a 'schema'",
            param="response_format",
        )
    schema = spec.get("schema", {})  # none given: any JSON (vLLM's reading)
    if not isinstance(schema, dict):
        raise bad_request(
            f"'response_format.json_schema.schema' must be a JSON schema (an object), got "
            f"{_json_type(schema)}",
            param="response_format",
        )
    return {"json": schema}


def _constraint(param: str, **fields_) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**fields_)``, its refusal a 400 naming ``param``."""
    try:
        return StructuredOutputsParams(**fields_)
    except StructuredOutputsError as exc:
        raise bad_request(f"'{param}': {exc}", param=param) from None


@contextmanager
def _sampling_refused(renamed: dict[str, str] | None = None) -> Iterator[None]:
    """``SamplingParams``' refusal as a 400 naming its field (``param``), under the wire's name
    where it differs (chat's ``top_logprobs`` is ``logprobs``)."""
    try:
        yield
    except InvalidRequestError as exc:
        param = (renamed or {}).get(exc.field, exc.field)
        raise bad_request(str(exc), param=param) from None


def _stop_strings(body: dict) -> tuple[str, ...]:
    """``stop``: a string or a list of them, within the engine's caps (``MAX_STOP_STRINGS``,
    ``MAX_STOP_LENGTH``: its thread matches them after every step), refused over HTTP with
    OpenAI's shape (``code: stop_limit``)."""
    stop = _field(body, "stop", (str, list), "a string or a list of strings", default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(
            f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
            param="stop",
            code="stop_limit",
        )
    for s in stop:
        if len(s) > MAX_STOP_LENGTH:
            raise bad_request(
                f"a stop string has {len(s)} characters; at most {MAX_STOP_LENGTH} are allowed",
                param="stop",
                code="stop_limit",
            )
        _check_unicode(s, "stop")
    return tuple(stop)


def _prompt_logprobs(body: dict, echo: bool, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs`` (the top k of every prompt position, in vLLM's shape): not
    streamed (vLLM refuses it too), and not beside ``echo``, whose log-probabilities already
    cover the prompt in OpenAI's shape."""
    k = _field(body, "prompt_logprobs", int, "an integer")
    if k is not None and (stream or echo):
        raise bad_request(
            f"'prompt_logprobs' cannot be combined with '{'stream' if stream else 'echo'}'"
            + ("" if stream else " (echo with logprobs gives the prompt's log-probabilities)"),
            param="prompt_logprobs",
        )
    return k


def wire_prompt_logprobs(prompt_logprobs: list) -> list:
    """vLLM's ``prompt_logprobs`` shape: per prompt position None (the first: nothing precedes
    it) or ``{token id: {"logprob", "rank", "decoded_token"}}``, the token there and the top
    k alternatives."""
    return [
        None
        if candidates is None
        else {
            str(t): {"logprob": _logprob(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in candidates.items()
        }
        for candidates in prompt_logprobs
    ]


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (alternatives, which need it)."""
    wanted = _field(body, "logprobs", bool, "a boolean", default=False)
    top = _field(body, "top_logprobs", int, "an integer")
    if top and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(body: dict) -> dict[int, object] | None:
    """OpenAI's ``logit_bias``: token ids as JSON object keys (strings) -> a bias, which
    ``SamplingParams`` checks; whether an id is in the vocabulary the engine checks (it knows
    the model's)."""
    bias = _field(body, "logit_bias", dict, "an object of token id -> bias", default={})
    parsed = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise bad_request(
                f"'logit_bias' keys must be token ids, got {_show(key)}", param="logit_bias"
            )
        parsed[int(key)] = value
    return parsed or None


def parse_prompts(
    body: dict, samples_per_prompt: int = 1, max_samples: int = MAX_CHOICES
) -> list[str | list[int]]:
    """A completion's prompts: one string or list of token ids, or a batch -- a list of
    strings or a list of token-id lists (OpenAI's and vLLM's forms; lm-eval sends batches).

    Every prompt is checked here, before any is queued, so a bad one is a 400 naming
    ``prompt`` with nothing run. A batch is one engine request per prompt, each with
    ``best_of`` samples; together they are bounded like one request's samples:
    ``max_samples``, the engine's ``max_samples_per_request`` (at most ``MAX_CHOICES``), so a
    batch can take no more of the engine than one request may.
    """
    prompt = _field(
        body,
        "prompt",
        (str, list),
        "a string, a list of token ids, or a list of strings or of token-id lists",
        required=True,
    )
    if isinstance(prompt, str) or not prompt or all(is_int(t) for t in prompt):
        prompts = [prompt]  # one prompt (an empty one is refused below)
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        prompts = prompt
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of "
            "strings or of token-id lists",
            param="prompt",
        )
    samples = len(prompts) * samples_per_prompt
    limit = min(max_samples, MAX_CHOICES)
    if len(prompts) > 1 and samples > limit:  # one prompt's samples: the engine's own check
        why = (
            "half the engine's sequence slots, as one request may hold"
            if max_samples < MAX_CHOICES
            else "OpenAI's cap on a request's choices"
        )
        raise bad_request(
            f"'prompt' has {len(prompts)} prompts of {samples_per_prompt} sample(s) each: "
            f"{samples} samples; at most {limit} are allowed per request ({why})",
            param="prompt",
            code="prompt_limit",
        )
    for i, one in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not one:
            raise bad_request(f"'{where}' is empty", param="prompt")
        if isinstance(one, str):
            _check_unicode(one, "prompt")
        elif not all(is_int(t) for t in one):
            raise bad_request(f"'{where}' must be a string or a list of token ids", param="prompt")
    return prompts


def chat_template_options(body: dict) -> dict:
    """vLLM's chat extensions that shape the prompt, as ``ChatTemplate.apply``'s keywords:
    ``add_generation_prompt`` (default true), ``continue_final_message`` (default false: true
    ends the prompt inside the last message, to be continued) and ``chat_template_kwargs``
    (more template variables, such as Qwen3's ``enable_thinking``)."""
    return {
        "add_generation_prompt": _field(
            body, "add_generation_prompt", bool, "a boolean", default=True
        ),
        "continue_final_message": _field(
            body, "continue_final_message", bool, "a boolean", default=False
        ),
        "template_kwargs": _field(body, "chat_template_kwargs", dict, "an object", default={}),
        "documents": _documents(body),
    }


def _documents(body: dict) -> list[dict] | None:
    """vLLM's ``documents``: objects of strings (``{"title", "text"}``) for templates that
    show retrieved texts to the model."""
    documents = _field(body, "documents", list, "a list of objects")
    for i, document in enumerate(documents or []):
        if not (isinstance(document, dict) and all(isinstance(v, str) for v in document.values())):
            raise bad_request(
                f"documents[{i}] must be an object of strings, got {_show(document)}",
                param="documents",
            )
    return documents


def parse_messages(body: dict) -> list[dict]:
    """``messages`` as the chat template reads them (``mie.engine.chat.chat_messages``, which
    ``LLM.chat`` shares): a 400 naming the part at fault."""
    messages = _field(body, "messages", list, "a list of messages", required=True)
    try:
        return chat_messages(messages)
    except InvalidRequestError as exc:
        raise engine_refusal(exc) from None


def _field(body: dict, name: str, kind, what: str, *, default=None, required: bool = False):
    """``body[name]`` if present and of JSON type ``kind`` (null counts as absent)."""
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"'{name}' is required", param=name)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(_is_json_kind(value, k) for k in kinds):
        raise bad_request(f"'{name}' must be {what}, got {_json_type(value)}", param=name)
    return value


def _number(body: dict, name: str, *, default: float) -> float:
    """A number field as a float: an integer too large for a float is a 400, not an
    ``OverflowError``."""
    value = _field(body, name, float, "a number", default=default)
    try:
        return float(value)
    except OverflowError:
        raise bad_request(f"'{name}' is out of range, got {_show(value)}", param=name) from None


def _check_unicode(text: str, param: str) -> None:
    """Text must be encodable: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no
    tokenizer (or UTF-8 encoder) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"'{param}' is not valid Unicode: a lone surrogate {text[exc.start]!r} at "
            f"character {exc.start}",
            param=param,
        ) from None


def _is_json_kind(value: object, kind: type) -> bool:
    if kind is int:
        return is_int(value)
    if kind is float:
        return as_float(value) is not None
    return isinstance(value, kind)


def _same_json(a: object, b: object) -> bool:
    """Equal as JSON values: 0 == 0.0, but False != 0."""
    if _is_json_kind(a, float) and _is_json_kind(b, float):
        return a == b
    return type(a) is type(b) and a == b


def _json_type(value: object) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return names.get(type(value), type(value).__name__)


# -- responses --------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    request_id, created, model, choices: list[dict], usage_, *, fingerprint: str | None = None
) -> dict:
    """A whole ``text_completion`` (``stream: false``)."""
    return _envelope(request_id, "text_completion", created, model, choices, usage_, fingerprint)


def completion_choice(
    index, text, finish_reason, logprobs: dict | None = None, stop_reason: int | str | None = None
) -> dict:
    """One completion choice, whole or a streamed piece (the new text, and the finish reason
    at the end). ``stop_reason`` is vLLM's: with "stop", the stop string or stop token id
    that ended the choice (null for EOS)."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion_chunk(
    request_id,
    created,
    model,
    choice: dict,
    *,
    fingerprint: str | None = None,
    include_usage: bool = False,
) -> dict:
    """One streamed piece of one choice of a completion (``include_usage``: with ``usage:
    null``, as OpenAI sends it on every chunk before the last when the usage is asked for)."""
    body = _envelope(request_id, "text_completion", created, model, [choice], None, fingerprint)
    return {**body, "usage": None} if include_usage else body


def chat_completion(
    request_id, created, model, choices: list[dict], usage_, *, fingerprint: str | None = None
) -> dict:
    """A whole ``chat.completion`` (``stream: false``)."""
    return _envelope(request_id, "chat.completion", created, model, choices, usage_, fingerprint)


def chat_choice(
    index,
    text,
    finish_reason,
    logprobs: dict | None = None,
    tool_calls: list | None = None,
    stop_reason: int | str | None = None,
) -> dict:
    """A whole chat choice. ``refusal`` is OpenAI's field for a model's refusal to answer:
    mie's models never refuse, so it is always null (clients read it unconditionally).
    ``tool_calls``: the calls the answer makes (``tool_call``s), when it makes any;
    ``stop_reason`` as in ``completion_choice``."""
    message = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_delta_choice(
    index,
    text,
    finish_reason=None,
    logprobs: dict | None = None,
    role: str | None = None,
    stop_reason: int | str | None = None,
) -> dict:
    """A streamed chat choice: the first delta of each choice carries the role (and, as
    OpenAI's does, ``refusal: null``); ``stop_reason`` as in ``completion_choice``."""
    if role:
        delta = {"role": role, "content": text, "refusal": None}
    else:
        delta = {"content": text} if text else {}
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    """One call of a chat answer's ``tool_calls``: ``arguments`` is a JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_deltas(index: int, call_id: str, name: str, arguments: str) -> list[dict]:
    """A streamed call, OpenAI's way: its first delta names it (id, type, name, no arguments
    yet), the next carries arguments (further ones, more of them: a client appends them)."""
    first = {"index": index, **tool_call(call_id, name, "")}
    return [first] + ([{"index": index, "function": {"arguments": arguments}}] if arguments else [])


def chat_chunk(
    request_id,
    created,
    model,
    choice: dict,
    *,
    fingerprint: str | None = None,
    include_usage: bool = False,
) -> dict:
    """One streamed ``chat.completion.chunk`` of one choice (``include_usage``: with ``usage:
    null``, see ``completion_chunk``)."""
    body = _envelope(
        request_id, "chat.completion.chunk", created, model, [choice], None, fingerprint
    )
    return {**body, "usage": None} if include_usage else body


def completion_logprobs(token_ids: list[int], logprobs: list, token_text, offset: int = 0) -> dict:
    """Completions' (legacy) shape: per token its text, log-probability, the alternatives as
    ``{text: logprob}`` (the token itself and the top k, most likely first) and its
    ``text_offset``, counted in token texts from ``offset`` (vLLM's rule).

    ``logprobs[i]`` is the engine's ``{token id: Logprob}`` for ``token_ids[i]``, or None for
    a token with no context (the prompt's first): then its log-probability is null.
    ``token_text(token_id, Logprob | None)`` spells a token: its text in context, so the
    texts add up to the text and ``text_offset`` points into it. No two alternatives share
    a key (``distinct_texts``).
    """
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, candidates in zip(token_ids, logprobs, strict=True):
        own = None if candidates is None else candidates[token_id]
        token = token_text(token_id, own)
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if candidates is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_logprob(own))
        keys = distinct_texts(token_id, candidates, token_text)
        top_logprobs.append({keys[t]: _logprob(lp) for t, lp in _ranked(candidates)})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def distinct_texts(token_id: int, candidates: dict, token_text) -> dict[int, str]:
    """A key per candidate of one position for ``top_logprobs``: its text, unless taken.

    Texts in context tell almost all tokens apart (``▁c`` is " c", ``c`` is "c"), not all:
    byte-fallback tokens that leave a character unfinished are all "", so is a skipped
    special token, and two spellings may decode alike. A dict keyed by text would keep one
    value of the two -- a wrong answer, which the client cannot detect. So the token at the
    position claims its text first (it is ``tokens[i]``: ``top_logprobs[i][tokens[i]]`` is
    its own log-probability, and it never looks like the most likely token when it is not),
    then the others, most likely first (ties: the lower id); a token whose text is taken
    is spelled ``token_id:<id>``, as vLLM spells every token with
    ``return_tokens_as_token_ids`` (``#2``, ``#3``... appended in the unlikely case that a
    token's text is that string already).
    """
    keys: dict[int, str] = {}
    taken: set[str] = set()
    for t in [token_id] + [t for t, _ in _ranked(candidates) if t != token_id]:
        key = token_text(t, candidates[t])
        if key in taken:
            key = spelled = f"token_id:{t}"
            suffix = 1
            while key in taken:
                suffix += 1
                key = f"{spelled}#{suffix}"
        keys[t] = key
        taken.add(key)
    return keys


def chat_logprobs(token_ids: list[int], logprobs: list, token_text, top: int) -> dict:
    """Chat's shape: ``{"content": [{token, logprob, bytes, top_logprobs: [the top ``top``
    alternatives, most likely first, each {token, logprob, bytes}]}]}``. Each ``token`` is
    its text in context and ``bytes`` that text's UTF-8; alternatives are a list, not keys,
    so two that share a text both keep it (unlike ``distinct_texts``' keys)."""

    def entry(token_id: int, logprob) -> dict:
        token = token_text(token_id, logprob)
        return {
            "token": token,
            "logprob": _logprob(logprob),
            "bytes": list(token.encode("utf-8", "replace")),
        }

    content = []
    for token_id, candidates in zip(token_ids, logprobs, strict=True):
        alternatives = [entry(t, lp) for t, lp in _ranked(candidates)[:top]]
        content.append({**entry(token_id, candidates[token_id]), "top_logprobs": alternatives})
    return {"content": content}


def _ranked(candidates: dict) -> list:
    """A token's candidates, most likely first (ties: the lower token id)."""
    return sorted(candidates.items(), key=lambda item: (-item[1].logprob, item[0]))


def _logprob(logprob) -> float:
    """A ``Logprob``'s value for JSON: -inf (a token the model rules out) as -9999."""
    return max(float(logprob.logprob), LOGPROB_FLOOR)


def usage_chunk(
    request_id, created, model, object_: str, usage_: dict, *, fingerprint: str | None = None
) -> dict:
    """The last streamed chunk when ``stream_options.include_usage``: no choices, the usage."""
    return _envelope(request_id, object_, created, model, [], usage_, fingerprint)


def _envelope(
    request_id, object_, created, model, choices, usage_=None, fingerprint: str | None = None
) -> dict:
    """What every response object and chunk has: ``created`` is the response's own time (every
    chunk of a stream shares it), ``system_fingerprint`` the server's (``app.fingerprint``)."""
    body = {
        "id": request_id,
        "object": object_,
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_chunk(error: APIError) -> dict:
    """A streamed error, in OpenAI's shape: ``{"error": {...}}`` (the ``openai`` client raises
    ``APIError`` on it); ``[DONE]`` follows."""
    return error.body()


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` ends a stream)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
