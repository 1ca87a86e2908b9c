"""The engine: a scheduler, a model and a sampler turning requests into tokens, step by step.

One ``step()`` is the whole engine loop in five lines::

    batch = scheduler.step()                                 # admit -> decode (-> preempt)
    logits = model.forward(chunks of batch)                  # one forward for the whole batch
    tokens = [sample(row, its params, its rng) for each]     # one token per sequence
    finished = scheduler.commit(batch, tokens)               # append, stop, reap, cache
    -> RequestOutputs (text deltas via the incremental detokenizer), and the step's trace

``LLMEngine`` is for callers that drive the loop themselves (the HTTP server does);
``mie.LLM`` wraps it for offline batch generation.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mie.backend import Backend, select
from mie.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mie.engine.sampling import InvalidRequestError, SamplingParams, request_rng, sample
from mie.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from mie.model import Model, ModelConfig
from mie.model.kv_cache import bytes_per_block
from mie.model.model import Chunk
from mie.scheduler import StepTrace
from mie.scheduler.sequence import Sequence

logger = logging.getLogger("mie")
if not logger.handlers:  # like vLLM: say what the engine set up, unless the app configured it
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("mie: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB of KV cache unless told otherwise (vLLM CPU: 4 GiB)
DEFAULT_MAX_NUM_SEQS = 32

Prompt = str | list[int] | dict


@dataclass
class EngineStats:
    """Running totals since the engine started (the server's /metrics reads them)."""

    steps: int = 0
    prompt_tokens: int = 0  # prefill tokens computed (recomputation after preemption included)
    generated_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose KV was borrowed instead of computed

    def add(self, trace: StepTrace, num_sampled: int) -> None:
        self.steps += 1
        self.prompt_tokens += trace.num_prefill_tokens
        self.generated_tokens += num_sampled
        self.preemptions += trace.preemptions
        self.recomputed_tokens += trace.recomputed_tokens
        self.prefix_hit_tokens += trace.prefix_hit_tokens


@dataclass
class _Request:
    """The engine's bookkeeping for one request, beside the scheduler's ``Sequence``."""

    request_id: str
    prompt: str | None
    seq: Sequence
    params: SamplingParams
    rng: np.random.Generator
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    text: str = ""

    def output(self) -> RequestOutput:
        seq = self.seq
        completion = CompletionOutput(0, self.text, seq.output_token_ids, seq.finish_reason)
        return RequestOutput(
            self.request_id, self.prompt, seq.prompt_token_ids, [completion],
            seq.finished, self.metrics,
        )  # fmt: skip


class LLMEngine:
    """Requests in, tokens out: continuous batching over a paged KV pool."""

    def __init__(
        self,
        model: str | os.PathLike[str] | Model,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = None,
        prefix_caching: bool = True,
        seed: int = 0,
        backend: str | Backend | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.backend = backend if isinstance(backend, Backend) else select(backend)
        if isinstance(model, Model):
            self.model = model
            self.tokenizer = tokenizer
        else:
            if not Path(model).is_dir():
                raise FileNotFoundError(f"model directory not found: {model}")
            self.model = Model.from_pretrained(model, backend=self.backend)
            self.tokenizer = tokenizer or _optional_tokenizer(model)
        config: ModelConfig = self.model.config
        self.max_model_len = config.max_position_embeddings
        block_bytes = bytes_per_block(config, block_size)
        if num_blocks is None:
            num_blocks = kv_cache_memory // block_bytes
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory {kv_cache_memory} bytes is less than one block "
                    f"({block_bytes} bytes)"
                )
        self.pool = self.backend.BlockPool(num_blocks, block_bytes)
        self.scheduler = self.backend.Scheduler(
            self.pool,
            block_size,
            max_num_seqs,
            max_num_batched_tokens or max(self.max_model_len, max_num_seqs),
            prefix_caching=prefix_caching,
        )
        self.seed = seed
        self.last_trace: StepTrace | None = None
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._arrivals = itertools.count()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB), backend %s",
            num_blocks, block_size, num_blocks * block_size,
            num_blocks * block_bytes / 2**20, self.backend.name,
        )  # fmt: skip

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request and return its id. Invalid input raises, with nothing queued."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
        index = next(self._arrivals)
        request_id = str(index) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._prompt_token_ids(prompt)
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context length {self.max_model_len}"
            )
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.model.config.eos_token_ids)
        seq = self.scheduler.submit(token_ids, params.max_tokens, sorted(stops))
        request = _Request(
            request_id,
            text,
            seq,
            params,
            request_rng(params, self.seed, index),
            IncrementalDetokenizer(self.tokenizer, token_ids) if self.tokenizer else None,
            RequestMetrics(arrival_time=time.perf_counter()),
        )
        self._requests[request_id] = request
        self._by_seq[seq.seq_id] = request
        return request_id

    def _prompt_token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._checked_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer.json: pass token ids")
            return prompt, self._checked_ids(self.tokenizer.encode(prompt))
        return None, self._checked_ids(prompt)

    def _checked_ids(self, token_ids: Iterable[int]) -> list[int]:
        try:
            ids = list(token_ids)
        except TypeError:
            raise InvalidRequestError(
                f"a prompt is a string, a list of token ids or a dict, got {token_ids!r}"
            ) from None
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if unknown or already finished."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return False
        del self._by_seq[request.seq.seq_id]
        self.scheduler.abort(request.seq.seq_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that got a new token (finished ones last)."""
        batch = self.scheduler.step()
        self.last_trace = batch.trace
        self.stats.add(batch.trace, len(batch.entries))
        if not batch.entries:
            self.scheduler.commit(batch, [])
            return []
        chunks = [Chunk(e.seq.token_ids, e.start, e.num_tokens, e.seq.table) for e in batch.entries]
        logits = self.model.forward(chunks)
        requests = [self._by_seq[e.seq.seq_id] for e in batch.entries]
        tokens = [sample(row, r.params, r.rng) for row, r in zip(logits, requests, strict=True)]
        self.scheduler.commit(batch, tokens)
        now = time.perf_counter()
        outputs = []
        for request, token in zip(requests, tokens, strict=True):
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if request.detokenizer is not None:
                request.text += request.detokenizer.add(token)
            if request.seq.finished:
                request.metrics.finished_time = now
                del self._requests[request.request_id]
                del self._by_seq[request.seq.seq_id]
            outputs.append(request.output())
        return outputs


def _optional_tokenizer(model_dir: str | os.PathLike[str]) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships without one (token-id prompts only)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        logger.warning("%s has no tokenizer.json: prompts must be token ids", model_dir)
        return None
    return Tokenizer(model_dir)
