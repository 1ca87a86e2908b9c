"""``mie.LLM``: offline batch generation, vLLM's API on top of ``LLMEngine``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext

from mie.engine import beam_search as _beam_search
from mie.engine.chat import ChatTemplate, chat_messages
from mie.engine.llm_engine import LLMEngine
from mie.engine.outputs import RequestOutput
from mie.engine.prompts import Prompt, prompt_list
from mie.engine.sampling import InvalidRequestError, SamplingParams
from mie.progress import ProgressBar


class LLM:
    """Load a checkpoint once, then ``generate`` for many prompts with continuous batching.

    ``settings`` are ``LLMEngine``'s: ``EngineConfig``'s fields as keywords (or ``config=``),
    and ``tokenizer``.
    """

    def __init__(self, model: str | os.PathLike[str], **settings: object) -> None:
        self.engine = LLMEngine(model, **settings)
        self.model = model  # where ``chat`` finds the checkpoint's chat template
        self._chat_template: ChatTemplate | None = None  # the checkpoint's, once read
        self.other_outputs: dict[str, RequestOutput] = {}
        """The latest output of each request someone else added to ``engine`` that a
        ``generate`` step produced (outputs are cumulative, so the latest says everything):
        ``generate`` waits for its own requests only and leaves the others running, but the
        step that finishes one returns its output once, so it is kept here for its owner."""

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``: one
        ``RequestOutput`` per prompt, holding ``n`` completions (``SamplingParams.n``; with
        ``best_of > n`` the ``n`` most likely of ``best_of``, best first).

        Every prompt is validated before any is run: one bad prompt raises and nothing runs.
        Requests added to ``engine`` by someone else run alongside, untouched; their outputs
        go to ``other_outputs``. On every exit, by return or by an exception, none of this
        call's requests is left in the engine.
        """
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            if isinstance(sampling_params, str) or not isinstance(sampling_params, Sequence):
                raise InvalidRequestError(
                    f"sampling_params must be SamplingParams or a list of them, got "
                    f"{type(sampling_params).__name__}",
                    field="sampling_params",
                )
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(params)} sampling params for {len(prompts)} prompts",
                    field="sampling_params",
                )
        engine = self.engine
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(prompt, p))
            mine = set(ids)
            with ProgressBar(len(ids), "generate") if use_tqdm else nullcontext() as bar:
                while len(finished) < len(ids):
                    for output in engine.step():
                        if output.request_id not in mine:  # added by someone else
                            self.other_outputs[output.request_id] = output
                        elif output.finished:
                            finished[output.request_id] = output
                            if bar:
                                bar.update(1)
        finally:  # a bad prompt, a failed step, Ctrl-C: leave the engine with none of ours
            for request_id in ids:
                if request_id not in finished:
                    engine.abort_request(request_id)
        return [finished[request_id] for request_id in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` and ``chat`` sample with when given no sampling
        parameters -- the checkpoint's recommended sampling from its
        ``generation_config.json`` (``mie.engine.generation_defaults``), else the defaults."""
        return self.engine.default_sampling_params()

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one conversation (a list of messages) or several (a list of lists),
        as vLLM's ``LLM.chat``: each is rendered by the checkpoint's chat template (or
        ``chat_template``, a Jinja template of your own; mie's plain default for a checkpoint
        without one), encoded as the server encodes a chat (``ChatTemplate.encode``), then
        generated as ``generate`` does; one ``RequestOutput`` per conversation, its
        ``prompt`` the rendered text. The messages take OpenAI's shapes and the options
        are the server's chat fields (docs/serving.md): ``add_generation_prompt``,
        ``continue_final_message`` (end the prompt inside the last message, for the model to
        continue it), ``tools`` (function definitions, for templates that show them),
        ``chat_template_kwargs`` (more template variables, such as Qwen3's
        ``enable_thinking``), ``documents``. Every conversation is rendered before anything
        runs: one the template refuses raises ``InvalidRequestError`` and nothing runs."""
        if self.engine.tokenizer is None:
            raise InvalidRequestError(
                "chat needs the checkpoint's tokenizer (tokenizer.json)", field="messages"
            )
        if chat_template is not None:
            template = ChatTemplate(self.model, self.engine.tokenizer, chat_template)
        else:
            if self._chat_template is None:
                self._chat_template = ChatTemplate(self.model, self.engine.tokenizer)
            template = self._chat_template
        batched = (
            isinstance(messages, Sequence)
            and bool(messages)
            and isinstance(messages[0], Sequence)
            and not isinstance(messages[0], (str, dict))
        )
        prompts = []
        for conversation in messages if batched else [messages]:
            text = template.apply(
                chat_messages(conversation),
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
                documents=documents,
            )
            prompts.append({"prompt": text, "prompt_token_ids": template.encode(text)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: _beam_search.BeamSearchParams,
        use_tqdm: bool = True,
    ) -> list[_beam_search.BeamSearchOutput]:
        """Beam search for every prompt (vLLM's API, transformers' results): each step, every
        running beam is a one-token request of ``generate`` whose prompt borrows the beam's
        blocks from the prefix cache. See ``mie.engine.beam_search``."""
        return _beam_search.beam_search(self.engine, self.generate, prompts, params, use_tqdm)
