"""A request's answer, from the engine loop's updates to OpenAI's choice objects.

``Answer`` collects a whole request (``stream: false``): each sample's text, tokens and
log-probabilities, and picks the ``n`` best of ``best_of`` by cumulative log-probability
(vLLM's rule), on the tokens each sample kept (the engine ends a sample at its stop string).
``ChoiceRenderer`` turns a choice, whole or one streamed piece at a time, into a completion
or chat choice: ``echo`` puts the prompt (and its log-probabilities)
before the first piece of each choice, ``max_tokens: 0`` keeps the prompt only, and the
log-probabilities take the endpoint's shape (``protocol.completion_logprobs`` /
``protocol.chat_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mie.engine.outputs import Logprob
from mie.engine.request import most_likely
from mie.serve import protocol
from mie.serve.loop import Update
from mie.serve.protocol import APIError, Options
from mie.serve.tools import ToolCallStream, ToolRequest, wire_calls

TokenText = Callable[[int, Logprob | None], str]  # a token's text, for log-probabilities


@dataclass
class Choice:
    """One sample of a request, as its updates built it."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' log-probabilities (what ``best_of`` ranks by)."""
        pairs = zip(self.token_ids, self.logprobs or [], strict=True)
        return sum(candidates[token].logprob for token, candidates in pairs)


class Answer:
    """Every update of a request, collected: its choices, prompt log-probabilities, error."""

    def __init__(self) -> None:
        self.choices: dict[int, Choice] = {}
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.error: APIError | None = None

    def add(self, update: Update) -> None:
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        if update.error is not None:
            self.error = update.error
        choice = self.choices.setdefault(update.index, Choice(update.index))
        choice.text += update.text
        choice.token_ids.extend(update.token_ids)
        if update.logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(update.logprobs)
        choice.finish_reason = update.finish_reason or choice.finish_reason
        choice.stop_reason = update.stop_reason

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated for all samples (``best_of`` of them: what the server computed)."""
        return sum(len(c.token_ids) for c in self.choices.values())

    def best(self, n: int) -> list[Choice]:
        """The choices to return: all, by index; or, of more than ``n`` samples, the ``n``
        with the highest cumulative log-probability, best first (ties: the lower index)."""
        choices = [self.choices[i] for i in sorted(self.choices)]
        if len(choices) <= n:
            return choices
        return most_likely(choices, n, lambda c: c.cumulative_logprob)


class ChoiceRenderer:
    """OpenAI's choice objects for one request, a whole choice or a streamed piece at a time.

    It remembers, per choice index, whether the prompt was echoed yet and how far the
    completion's ``text_offset`` got, so the pieces of a stream add up to the whole answer.
    """

    def __init__(
        self,
        options: Options,
        prompt_text: str,
        prompt_ids: list[int],
        token_text: TokenText,
        tools: ToolRequest | None = None,
        echoed: str = "",
    ) -> None:
        """``echoed``: text a chat answer starts with (chat's ``echo``: the last message's,
        when it is the assistant's)."""
        self.options = options
        self.prompt_text = prompt_text
        self.prompt_ids = prompt_ids
        self.token_text = token_text
        self.tools = tools if tools is not None and tools.calls else None  # chat's tool calls
        self.echoed = echoed
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._tool_streams: dict[int, ToolCallStream] = {}

    def completion(self, index: int, choice: Choice | Update) -> dict:
        """A completion choice (or chunk choice) for ``choice``'s text and tokens."""
        options = self.options
        text, token_ids = choice.text, list(choice.token_ids)
        logprobs = list(choice.logprobs or [])
        if options.scores_only:  # the one token sampled to finish the prompt is not shown
            text, token_ids, logprobs = "", [], []
        if options.echo and index not in self._echoed:
            self._echoed.add(index)
            text = self.prompt_text + text
            token_ids = self.prompt_ids + token_ids
            logprobs = self._prompt_logprobs() + logprobs
        wire_logprobs = None
        if options.logprobs is not None:
            offset = self._offsets.get(index, 0)
            wire_logprobs = protocol.completion_logprobs(
                token_ids, logprobs, self.token_text, offset
            )
            self._offsets[index] = offset + sum(map(len, wire_logprobs["tokens"]))
        return protocol.completion_choice(
            index, text, self._finish(choice), wire_logprobs, self._stop_reason(choice)
        )

    def prompt_tokens(self, index: int) -> int:
        """The prompt tokens of choice ``index`` (this renderer's one prompt)."""
        return len(self.prompt_ids)

    def echoes(self, update: Update) -> bool:
        """Whether ``update``'s choice still has the prompt to echo (its first chunk)."""
        return self.options.echo and update.index not in self._echoed

    def chat(self, index: int, choice: Choice) -> dict:
        """A whole chat choice for ``choice``'s text and tokens: its tool calls, when the
        request may call tools and the text holds some (``ToolRequest.extract``)."""
        finish, logprobs = self._finish(choice), self._chat_logprobs(choice)
        stop_reason = self._stop_reason(choice)
        extracted = self.tools.extract(choice.text) if self.tools is not None else None
        if extracted is None or not extracted.calls:
            text = self.echoed + choice.text
            return protocol.chat_choice(index, text, finish, logprobs, None, stop_reason)
        finish = self.tools.finish_reason(True, finish)
        calls = wire_calls(extracted)
        content = extracted.content
        if self.echoed:
            content = self.echoed + (content or "")
        return protocol.chat_choice(index, content, finish, logprobs, calls, stop_reason)

    def chat_deltas(self, index: int, update: Update) -> list[dict]:
        """The streamed chat choices for one update: one, or with tool calls, one per delta
        (``ToolCallStream``): content first, then each call's, the finish reason on the last."""
        finish, logprobs = self._finish(update), self._chat_logprobs(update)
        stop_reason = self._stop_reason(update)
        if self.tools is None:
            return [
                protocol.chat_delta_choice(
                    index, update.text, finish, logprobs, stop_reason=stop_reason
                )
            ]
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools))
        content, calls = stream.feed(update.text, finish is not None)
        deltas = ([{"content": content}] if content else []) + [{"tool_calls": [c]} for c in calls]
        choices = [{**protocol.chat_delta_choice(index, ""), "delta": d} for d in deltas or [{}]]
        choices[0]["logprobs"] = logprobs
        choices[-1]["finish_reason"] = self.tools.finish_reason(stream.called, finish)
        choices[-1]["stop_reason"] = stop_reason
        return choices

    def _chat_logprobs(self, choice: Choice | Update) -> dict | None:
        if self.options.logprobs is None:
            return None
        return protocol.chat_logprobs(
            list(choice.token_ids),
            list(choice.logprobs or []),
            self.token_text,
            self.options.logprobs,
        )

    def _finish(self, choice: Choice | Update) -> str | None:
        reason = choice.finish_reason
        if self.options.scores_only and reason is not None and reason != "abort":
            return "length"  # it stopped at max_tokens: 0, whatever the dropped token was
        return reason

    def _stop_reason(self, choice: Choice | Update) -> int | str | None:
        """The stop string or token that ended it (None for a score-only request, which
        shows no token)."""
        return None if self.options.scores_only else choice.stop_reason

    def _prompt_logprobs(self) -> list[dict[int, Logprob] | None]:
        """The prompt's log-probabilities (None for the first token, which has no context)."""
        if self.prompt_logprobs is None:
            return [None] * len(self.prompt_ids)
        return list(self.prompt_logprobs)
