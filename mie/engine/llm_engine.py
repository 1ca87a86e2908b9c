"""The engine: a scheduler, a model and a sampler turning requests into tokens, step by step.

``add_request`` checks a request (its prompt: ``mie.engine.prompts``), builds its record
(``mie.engine.request``) and submits it to the scheduler. One ``step()`` is then the whole
engine loop in five lines::

    batch = scheduler.step()                                 # admit -> decode (-> preempt)
    logits = model.forward(prepare_inputs(batch.entries), kv_cache)  # one forward for all
    tokens = [sample(row, its params, its rng) for each]     # one token per sequence
    finished = scheduler.commit(batch, tokens)               # append, stop, reap, cache
    -> RequestOutputs (text deltas via the incremental detokenizer), and the step's trace

A request is one or more *samples* (``n`` / ``best_of``), each a scheduler ``Sequence`` with
its own generator, text and log-probabilities; the first computes the prompt and the others
are forked from it once it has (see ``_fork``). A sample whose text completes one of its
stop strings (``mie.engine.stop_strings``) leaves the scheduler in that step; a caller with
an ending rule of its own ends one with ``finish_sample``. Log-probabilities, where asked
for, are taken from the raw logits rows (``mie.engine.logprobs``): the sampled tokens', and
the prompt's from every row of the entries of a request that wants them.

``LLMEngine`` is for callers that drive the loop themselves (the HTTP server does);
``mie.LLM`` wraps it for offline batch generation.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mie.backend import Backend, select
from mie.checkpoint import listed
from mie.checks import is_int, short_repr
from mie.engine.config import DEFAULT_CHUNK_BUDGET, EngineConfig
from mie.engine.draft_model import DraftModel
from mie.engine.generation_defaults import generation_defaults
from mie.engine.logprobs import log_softmax, position_logprobs
from mie.engine.outputs import RequestOutput
from mie.engine.prompts import Prompt, prompt_token_ids, prompt_tokens_kept
from mie.engine.request import Request, Sample
from mie.engine.sampling import (
    InvalidRequestError,
    NoDistributionError,
    SamplingParams,
    bad_words_sequences,
    check_something_to_draw,
)
from mie.engine.sampling import sample as sample_token
from mie.engine.speculative import NgramLookup, ProposalPolicy, check_ngram_vocabulary
from mie.engine.structured import GrammarCompiler, StructuredOutputsError, fill_masks
from mie.engine.tokenizer import Tokenizer
from mie.gguf_file import GGUFFile, is_gguf
from mie.kernels_threads import ThreadPolicy
from mie.model import Model
from mie.model.kv_cache import bytes_per_block, kv_view
from mie.scheduler import SchedulerStallError, StepTrace
from mie.scheduler.batch import Batch
from mie.scheduler.sequence import FINISH_ABORT

logger = logging.getLogger("mie")  # a library configures no handler: the CLI does


@dataclass
class EngineStats:
    """Running totals since the engine started (the server's /metrics reads them)."""

    steps: int = 0
    prompt_tokens: int = 0  # prefill tokens computed (recomputation after preemption included)
    generated_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose KV was borrowed instead of computed
    # Speculative decoding (vLLM's names): verifications of proposals, the tokens proposed,
    # the ones accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def add(self, trace: StepTrace, num_sampled: int, num_drafts: int = 0) -> None:
        self.steps += 1
        self.prompt_tokens += trace.num_prefill_tokens
        self.generated_tokens += num_sampled
        self.preemptions += trace.preemptions
        self.recomputed_tokens += trace.recomputed_tokens
        self.prefix_hit_tokens += trace.prefix_hit_tokens
        self.spec_drafts += num_drafts
        self.spec_draft_tokens += trace.spec_tokens
        self.spec_accepted_tokens += trace.accepted_spec_tokens


class LLMEngine:
    """Requests in, tokens out: continuous batching over a paged KV pool."""

    def __init__(
        self,
        model: str | os.PathLike[str] | Model,
        *,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        config: EngineConfig | None = None,
        **settings: object,
    ) -> None:
        """``model``: a checkpoint directory, or a built ``Model`` (whose kernels must be the
        backend's). ``tokenizer``: a ``Tokenizer``, or where one lies (a directory with
        ``tokenizer.json``, or a GGUF file, as vLLM's ``tokenizer=`` path); None: the
        checkpoint's own. The settings are ``EngineConfig``'s, as keywords (``backend`` may
        also be a ``Backend`` object) or as ``config``; every one is checked before anything
        is loaded."""
        backend = settings.get("backend")
        self.config = config = _engine_config(config, settings)
        self.backend = backend if isinstance(backend, Backend) else select(config.backend)
        self.model, self.tokenizer = self._load(model, tokenizer)
        self.max_model_len = self.model.config.max_position_embeddings
        # The checkpoint's recommended sampling (vLLM's diff_sampling_param): SamplingParams
        # keywords for what a request leaves out (mie.engine.generation_defaults).
        self.sampling_defaults = (
            generation_defaults(model)
            if config.generation_config == "auto" and not isinstance(model, Model)
            else {}
        )
        self.kv_cache_dtype = config.kv_cache_dtype
        self.pool, self.kv_cache = self._allocate_kv_cache()
        self.scheduler = self._build_scheduler()
        self.seed = config.seed
        self.max_num_seqs = config.max_num_seqs
        self.speculative = config.speculative_config  # None: one token per decode step
        check_ngram_vocabulary(self.speculative, self.model.config.vocab_size)
        self.draft = self._load_draft()  # None unless the speculative method is draft_model
        self._found_nothing: list[int] = []  # the last _propose's samples whose lookup was empty
        # Steps in which ``_propose`` knows nobody proposes, while these run (``_propose``).
        self._quiet_steps, self._quiet_running = 0, []
        # A request's samples (best_of) run as sequences of their own: at most half the slots,
        # so a request arriving after one with the most samples still finds a free slot.
        self.max_samples_per_request = config.max_samples_per_request
        kernels = self.backend.kernels
        self.thread_policy = ThreadPolicy(kernels.threads, kernels.set_threads)
        self.last_trace: StepTrace | None = None
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, Sample] = {}  # a submitted sample, by its seq_id
        self._num_arrivals = 0  # accepted requests: seeds the unseeded ones
        self._auto_ids = itertools.count()
        self.weight_bytes = self.model.weights.nbytes  # fixed at load: /metrics reads it
        # structured_outputs' grammars, over the tokenizer's vocabulary (None: no tokenizer).
        self.grammar = (
            GrammarCompiler(
                self.tokenizer.to_json(),
                self.model.config.vocab_size,
                self.model.config.eos_token_ids,
            )
            if self.tokenizer is not None
            else None
        )
        self._log_setup()

    def _load(
        self, model: str | os.PathLike[str] | Model, tokenizer: Tokenizer | str | None
    ) -> tuple[Model, Tokenizer | None]:
        """The model (loaded with the backend's kernels, or checked to have them) and its
        tokenizer (the checkpoint's unless one is given)."""
        config = self.config
        if isinstance(tokenizer, (str, os.PathLike)):
            if not (Path(tokenizer).is_dir() or is_gguf(tokenizer)):
                raise FileNotFoundError(
                    f"tokenizer directory (or GGUF file) not found: {tokenizer}"
                )
            tokenizer = Tokenizer(tokenizer)
        elif tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"tokenizer must be a Tokenizer or the path of one, got {type(tokenizer).__name__}"
            )
        if isinstance(model, Model):
            if config.dtype != "auto" or config.quantization is not None:
                raise ValueError(
                    "dtype and quantization apply when loading a checkpoint; this Model "
                    f"already holds {model.weights.format} weights (choose them when "
                    "building it: Model.random(..., dtype=..., quantization=...))"
                )
            if model.kernels.name != self.backend.name:
                raise ValueError(
                    f"this Model computes with the {model.kernels.name} backend's kernels and "
                    f"the engine runs the {self.backend.name} backend: build the Model with "
                    f"the engine's kernels (kernels=select_kernels({self.backend.name!r}), "
                    f"or backend.kernels), or choose backend={model.kernels.name!r}"
                )
            return model, tokenizer
        if not (Path(model).is_dir() or is_gguf(model)):
            raise FileNotFoundError(f"model directory (or GGUF file) not found: {model}")
        loaded = Model.from_pretrained(
            model,
            kernels=self.backend.kernels,
            dtype=config.dtype,
            quantization=config.quantization,
            allow_non_finite_weights=config.allow_non_finite_weights,
            refuse_requantization=config.refuse_requantization,
        )
        return loaded, tokenizer or _optional_tokenizer(model)

    def _load_draft(self) -> DraftModel | None:
        """The draft model of ``speculative_config`` (method "draft_model"), with the engine's
        kernels and a KV pool of as many blocks as the target's; it must share the target's
        vocabulary, or its proposals would be other tokens' ids."""
        spec = self.config.speculative_config
        if spec is None or spec.model is None:
            return None
        if not (Path(spec.model).is_dir() or is_gguf(spec.model)):
            raise FileNotFoundError(f"speculative_config's draft model not found: {spec.model}")
        model = Model.from_pretrained(spec.model, kernels=self.backend.kernels)
        if model.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(
                f"the draft model {spec.model} has a vocabulary of {model.config.vocab_size} "
                f"tokens and the target {self.model.config.vocab_size}: a draft must share the "
                "target's tokenizer"
            )
        return DraftModel(model, self.backend, self.config.block_size, self.pool.num_blocks)

    def _allocate_kv_cache(self) -> tuple[object, np.ndarray]:
        """The paged KV pool -- ``num_blocks`` blocks, else as many as ``kv_cache_memory``
        bytes hold -- and the model's view of it."""
        config, model_config = self.config, self.model.config
        block_bytes = bytes_per_block(model_config, config.block_size, config.kv_cache_dtype)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = config.kv_cache_memory // block_bytes
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory {config.kv_cache_memory} bytes is less than one block "
                    f"({block_bytes} bytes)"
                )
        try:
            pool = self.backend.BlockPool(num_blocks, block_bytes)
        except (MemoryError, ValueError) as exc:  # NumPy: too large for this machine
            raise ValueError(
                f"cannot allocate a KV pool of {num_blocks} blocks x {block_bytes} bytes "
                f"({num_blocks * block_bytes / 2**30:.3g} GiB): {exc}; lower num_blocks, "
                "kv_cache_memory or block_size"
            ) from exc
        return pool, kv_view(pool, model_config, config.block_size, config.kv_cache_dtype)

    def _build_scheduler(self) -> object:
        """The backend's scheduler over the pool. Its step budget defaults to
        ``DEFAULT_CHUNK_BUDGET`` tokens with chunked prefill, else the model's context (a
        whole prompt must fit one step); never below one token per running sequence."""
        config = self.config
        chunk = DEFAULT_CHUNK_BUDGET if config.enable_chunked_prefill else self.max_model_len
        return self.backend.Scheduler(
            self.pool,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens or max(chunk, config.max_num_seqs),
            prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            sliding_window=self.model.config.sliding_window,  # releases blocks out of it
        )

    def _log_setup(self) -> None:
        """One line (at INFO: the CLI's ``-v``) saying what the engine holds."""
        num_blocks, block_size = self.pool.num_blocks, self.config.block_size
        logger.info(
            "Weights: %s, %.1f MiB; KV cache: %s, %d blocks x %d tokens = %d tokens "
            "(%.1f MiB); backend %s",
            self.model.weights.format,
            self.weight_bytes / 2**20,
            self.kv_cache.dtype.name,
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_blocks * self.pool.bytes_per_block / 2**20,
            self.backend.name,
        )

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request and return its id. Invalid input raises, with nothing queued.

        Everything that can fail (the id, the prompt's tokens, the random generator, the
        detokenizer) is built first; only then does the request reach the scheduler, whose
        ``submit`` either queues it or raises with nothing queued. So a rejected request leaves
        the engine exactly as it was, down to the arrival count that seeds unseeded requests.
        """
        params = self.default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"expected SamplingParams, got {type(params).__name__}", field="params"
            )
        if params.best_of > self.max_samples_per_request:
            raise InvalidRequestError(
                f"best_of {params.best_of} (n {params.n}) exceeds this engine's limit of "
                f"{self.max_samples_per_request} samples per request: max(1, max_num_seqs // 2) "
                f"with max_num_seqs {self.max_num_seqs}, so one request cannot take every "
                "batch slot and the head of the queue from the requests after it",
                field="n" if params.best_of == params.n else "best_of",
            )
        request_id = self._new_request_id() if request_id is None else request_id
        if not isinstance(request_id, str):
            raise InvalidRequestError(
                f"request_id must be a str, got {request_id!r}", field="request_id"
            )
        if request_id in self._requests:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use", field="request_id"
            )
        vocab = self.model.config.vocab_size
        keep_last = prompt_tokens_kept(params.truncate_prompt_tokens, self.max_model_len)
        text, token_ids = prompt_token_ids(
            prompt, self.tokenizer, self.max_model_len, vocab, keep_last
        )
        params = self._within_context(params, len(token_ids))
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            if any(t >= vocab for t in ids):
                raise InvalidRequestError(
                    f"{name} token ids must be in the vocabulary [0, {vocab}), got {max(ids)}",
                    field=name,
                )
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.model.config.eos_token_ids)
        tokenizer = self.tokenizer
        encode = tokenizer and functools.partial(tokenizer.encode, add_special_tokens=False)
        bad_words_ids = bad_words_sequences(params.bad_words, encode)
        check_something_to_draw(params, vocab, stops, bad_words_ids)
        if params.stop and tokenizer is None:
            raise InvalidRequestError(
                "stop strings are matched in the detokenized text, and this engine has no "
                "tokenizer (tokenizer.json): use stop_token_ids",
                field="stop",
            )
        self._check_structured_outputs(params)
        request = Request.create(  # compiles the grammar: StructuredOutputsError if it can't
            request_id,
            text,
            token_ids,
            params,
            sorted(stops),
            engine_seed=self.seed,
            arrival=self._num_arrivals,
            tokenizer=self.tokenizer,
            vocab_size=vocab,
            arrival_time=time.perf_counter(),
            grammar=self.grammar,
            bad_words_ids=bad_words_ids,
        )
        self._submit_first(request, request.samples[0])  # raises with nothing queued
        # Nothing below can fail: the request is in.
        self._num_arrivals += 1
        self._requests[request_id] = request
        return request_id

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """A constraint needs the tokenizer (the grammar reads tokens as text) and a token
        that ends the output when the grammar accepts."""
        if params.structured_outputs is None:
            return
        if self.grammar is None:
            raise InvalidRequestError(
                "structured_outputs needs the model's tokenizer (tokenizer.json), and this "
                "engine has none",
                field="structured_outputs",
            )
        if not self.model.config.eos_token_ids:
            raise InvalidRequestError(
                "structured_outputs needs an end-of-sequence token to end the output when the "
                "grammar accepts, and this model's config names none (eos_token_id)",
                field="structured_outputs",
            )

    def default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters samples with: the checkpoint's
        recommended sampling (``sampling_defaults``), else vLLM's defaults."""
        return SamplingParams(**self.sampling_defaults)

    def add_requests(
        self, prompts: list[Prompt], params: SamplingParams | None, request_ids: list[str]
    ) -> None:
        """``add_request`` for several prompts, all or none (a client's batch). If one is
        refused, those already queued are taken back before any step saw them, the engine is
        exactly as it was (down to the arrival count), and the refusal propagates with
        ``prompt_index`` set to the refused prompt's position.

        The batch is one client's: together its prompts' samples are held to one request's
        share of the slots (``max_samples_per_request``), or a batch of many prompts would take
        every slot and the head of the queue, as one request of many samples did."""
        best_of = params.best_of if isinstance(params, SamplingParams) else 1
        if len(prompts) * best_of > self.max_samples_per_request:
            raise InvalidRequestError(
                f"prompt batch of {len(prompts)} prompts x best_of {best_of} is "
                f"{len(prompts) * best_of} samples, over this engine's limit of "
                f"{self.max_samples_per_request} per request (max(1, max_num_seqs // 2) with "
                f"max_num_seqs {self.max_num_seqs}); send the prompts in smaller batches",
                field="prompt",
            )
        arrivals = self._num_arrivals
        for index, (prompt, request_id) in enumerate(zip(prompts, request_ids, strict=True)):
            try:
                self.add_request(prompt, params, request_id)
            except Exception as exc:
                for queued in request_ids[:index]:
                    self.abort_request(queued)
                self._num_arrivals = arrivals
                exc.prompt_index = index
                raise

    def _submit_first(self, request: Request, sample: Sample) -> None:
        """Submit the sample that computes the prompt for the request's others. If the
        request wants its prompt's log-probabilities, it computes every prompt position."""
        sample.seq = self.scheduler.submit(
            request.prompt_token_ids,
            request.params.max_tokens,
            request.stop_token_ids,
            reuse_prefix=request.params.prompt_logprobs is None,
        )
        self._by_seq[sample.seq.seq_id] = sample

    def _fork(self, request: Request) -> None:
        """Submit the other samples once the first has computed the prompt: they borrow its
        KV (every full block; without the prefix cache, the partly filled last block too,
        split by copy-on-write at their first write) and recompute only what follows. They
        can't fail: the first sample, of the same size, was accepted. Samples the caller
        finished before (``finish_sample``) are not submitted at all."""
        for sample in request.samples:
            if sample.seq is None and sample.finish_reason is None:
                sample.seq = self.scheduler.submit(
                    request.prompt_token_ids, request.params.max_tokens, request.stop_token_ids
                )
                self._by_seq[sample.seq.seq_id] = sample
        request.forked = True

    def _new_request_id(self) -> str:
        """The next automatic id: a counter, skipping ids the caller chose themselves."""
        while (request_id := str(next(self._auto_ids))) in self._requests:
            pass
        return request_id

    def _within_context(self, params: SamplingParams, prompt_length: int) -> SamplingParams:
        """``params`` with ``max_tokens`` at most the room the context leaves after the prompt
        (None: all of it), as vLLM's offline engine ends a request at the context's end
        (finish reason "length"). A prompt that fills the whole context still gets its one
        next token, as in vLLM (that token's K/V is never computed); ``min_tokens`` beyond
        the room is refused. (The server refuses prompt + max_tokens beyond the context, as
        vLLM's does: ``mie.serve``.)"""
        room = max(self.max_model_len - prompt_length, 1)  # the prompt fits (prompt_token_ids)
        if params.min_tokens > room:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) exceeds the {room} tokens the model's "
                f"context length {self.max_model_len} leaves after the prompt "
                f"({prompt_length} tokens)",
                field="min_tokens",
            )
        if params.max_tokens is not None and params.max_tokens <= room:
            return params
        return dataclasses.replace(params, max_tokens=room)

    def abort_request(self, request_id: str | Iterable[str]) -> bool:
        """Stop a request (all its samples) now and free its blocks; or several, given an
        iterable of ids (as vLLM's ``abort_request`` takes them). False if none was running
        (unknown or already finished); ``TypeError`` for an id that is not a str."""
        if not isinstance(request_id, str):
            ids = list(request_id) if isinstance(request_id, Iterable) else [request_id]
            if not all(isinstance(i, str) for i in ids):
                raise TypeError(f"request ids are str, got {short_repr(request_id)}")
            return any([self.abort_request(i) for i in ids])
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for sample in request.samples:
            if sample.seq is not None and not sample.seq.finished:
                del self._by_seq[sample.seq.seq_id]
                self.scheduler.abort(sample.seq.seq_id)
        self._forget_stale_drafts()
        return True

    def finish_sample(
        self, request_id: str, index: int, *, text_end: int | None = None
    ) -> RequestOutput | None:
        """Finish sample ``index`` of a request now, as stopped: what a stop string does, for a
        caller with an ending rule of its own.

        The sample's sequence leaves the scheduler at once: its blocks go back to the pool
        (those it shares with its siblings stay with them) and no later step computes it.
        Its finish reason is "stop"; its tokens are those generated so far and its text is
        cut at ``text_end`` characters (None: kept whole), so its ``CompletionOutput`` is what
        the caller's client gets. The other samples carry on unaffected, drawing exactly the
        tokens they would have; the request finishes when its last sample does, and with
        ``best_of > n`` the ``n`` kept are ranked on the tokens each sample ended with.

        Returns the request's output after the change (``finished`` once no sample is left;
        the request is then gone, as after its last step), or None if the request is unknown
        or finished, or the sample already finished. It may come between steps, or while a
        step runs (from its forward pass): that step then gives the sample no token.
        """
        request = self._requests.get(request_id)
        if request is None:
            return None
        if not is_int(index):
            raise InvalidRequestError(f"index must be an int, got {index!r}", field="index")
        if not 0 <= index < len(request.samples):
            raise InvalidRequestError(
                f"index {index} is not a sample of request {request_id!r} "
                f"(it has {len(request.samples)}: best_of)",
                field="index",
            )
        sample = request.samples[index]
        if sample.finished:
            return None
        if text_end is not None and (not is_int(text_end) or not 0 <= text_end <= len(sample.text)):
            raise InvalidRequestError(
                f"text_end must be None or an int in [0, {len(sample.text)}] (the sample's "
                f"text length), got {text_end!r}",
                field="text_end",
            )
        sample.finish_reason = "stop"
        sample.text = sample.text[:text_end]
        request.num_finished += 1
        if sample.seq is not None:
            del self._by_seq[sample.seq.seq_id]
            self.scheduler.abort(sample.seq.seq_id)
            self._forget_stale_drafts()
            if not request.forked:  # it was computing the prompt: the next one takes over
                waiting = [s for s in request.samples if s.seq is None and not s.finished]
                if waiting:
                    self._submit_first(request, waiting[0])
        if request.finished:
            request.metrics.finished_time = time.perf_counter()
            del self._requests[request_id]
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests one of whose samples got a new token, in
        batch order (each ``RequestOutput`` lists all its samples).

        A step is all or nothing. If anything raises between the scheduler's ``step()`` and
        its ``commit()`` -- the forward pass, sampling, detokenization, a KeyboardInterrupt,
        a MemoryError -- the batch is rolled back: every running request goes back to the
        front of the queue to be recomputed, its generator and text as they were, no block
        is lost, and the next ``step()`` carries on as if the failed one never happened. The
        error then propagates: an ``Exception`` as ``StepError`` (it names the requests that
        were in the batch; a server aborts them so a request that always fails cannot wedge
        everyone), anything else (KeyboardInterrupt, SystemExit) unchanged.

        A step that could never make progress -- requests waiting, nothing running, and the
        request at the head of the queue not admissible (``SchedulerStallError``: a scheduler
        defect, which would otherwise repeat the same empty step forever) -- ends that request
        (aborted, its blocks freed, an error logged) and raises ``RequestStalledError``, a
        ``StepError`` naming it: the caller learns which request failed and why, and the next
        ``step()`` carries on with the others.

        Speculative decoding's proposals come before the scheduler's step; one that raises
        (the draft model's forward pass) fails the step the same way, naming the running
        requests, with nothing scheduled yet and the drafts it was computing dropped.
        """
        try:
            proposals = self._propose() if self.speculative is not None else None
        except Exception as exc:
            running = (self._by_seq.get(seq.seq_id) for seq in self.scheduler.running)
            in_batch = dict.fromkeys(s.request.request_id for s in running if s is not None)
            raise StepError(tuple(in_batch), exc) from exc
        try:
            batch = self.scheduler.step(proposals)
        except SchedulerStallError as exc:
            raise self._abort_stalled(exc) from exc
        if not batch.entries:
            self.scheduler.commit(batch, [])
            self._record(batch, [])
            return []
        entries = batch.entries
        owners = [self._by_seq[e.seq.seq_id] for e in entries]
        # An entry whose request wants its prompt's log-probabilities gets all its rows, and
        # so does one with proposals to verify.
        all_positions = [
            s.request.wants_all_positions(e) or bool(e.spec_token_ids)
            for s, e in zip(owners, entries, strict=True)
        ]
        # Only entries reaching the end of their sequence sample: a prompt chunk that ends
        # inside the prompt (chunked prefill) computes K/V and yields no token.
        sampling = [s for s, e in zip(owners, entries, strict=True) if e.samples]
        undo = [s.checkpoint() for s in sampling]
        undo += [
            s.request.checkpoint()
            for s, entry_all_positions in zip(owners, all_positions, strict=True)
            if entry_all_positions
        ]
        try:
            inputs = self.backend.prepare_inputs(entries, all_positions=all_positions)
            with self.thread_policy.step():  # fewer threads while another process crowds
                logits = self.model.forward(inputs, self.kv_cache)
            tokens = self._sample_tokens(entries, owners, all_positions, logits)
        except BaseException as exc:
            for restore in undo:
                restore()
            self.scheduler.rollback(batch)
            if isinstance(exc, GrammarFailedError):  # one request's own grammar: only it fails
                raise StepError((exc.request_id,), exc) from exc
            if isinstance(exc, Exception):
                in_batch = dict.fromkeys(s.request.request_id for s in owners)
                raise StepError(tuple(in_batch), exc) from exc
            raise
        self.scheduler.commit(batch, tokens)
        outputs = self._outputs(batch, sampling, tokens)
        self._forget_stale_drafts()
        return outputs

    def _forget_stale_drafts(self) -> None:
        """The draft model's blocks of sequences no longer running (finished, aborted,
        preempted) go back to its pool: after every commit and every abort, so that an idle
        engine holds none."""
        if self.draft is not None:
            self.draft.forget_all_but({seq.seq_id for seq in self.scheduler.running})

    def _propose(self) -> dict[int, list[int]] | None:
        """Speculative decoding's proposals for the next step, by seq_id: an n-gram lookup
        over each decoding sample's own text, or the draft model's greedy continuation
        (``mie.engine.speculative``), as many tokens as its ``ProposalPolicy`` says and
        ``max_tokens`` leaves room for, cut where its grammar would refuse a token -- and for
        nobody once ``disable_by_batch_size`` sequences decode together. None: no proposals.

        It runs every step, between two forward passes that have pushed the interpreter's
        data out of the core's caches, where each attribute read costs tens of nanoseconds:
        at batch 1 on stories260K asking every sample's policy took 2.2 us of a 145 us step,
        on free text nearly always to hear "not this step". So when every running sequence
        decodes and sits this step out, each for at least ``q`` steps (a sample sitting out
        gains one token a step), the next ``min(q) - 1`` steps ask nobody -- as long as the
        same sequences run (one admitted, preempted or finished ends that: a new one only
        computes its prompt in the step that admits it, so it cannot propose before the
        sequences running have changed). Likewise once ``disable_by_batch_size`` of them
        decode: while the same ones run, no fewer decode (a prompt only becomes a decode),
        and counting them cost a large batch a scan of it every step."""
        config = self.speculative
        self._found_nothing = []
        running = self.scheduler.running
        if self._quiet_steps and running == self._quiet_running:
            self._quiet_steps -= 1
            return None
        self._quiet_steps = 0
        # A sequence decodes next when it has computed all its tokens but the newest.
        if len(running) >= config.disable_by_batch_size:
            decoding = sum(s.num_computed == s.num_tokens - 1 for s in running)
            if decoding >= config.disable_by_batch_size:
                self._quiet_steps, self._quiet_running = math.inf, list(running)
                return None
        proposals, wanted = {}, {}  # seq_id -> tokens; for the draft: (its tokens, how many)
        quiet = None  # the fewest steps any running sequence is known to sit out; 0: none
        for seq in running:
            if seq.num_computed != seq.num_tokens - 1:
                quiet = 0  # a prompt, or a chunk of one: it may decode, and propose, next
                continue
            sample = self._by_seq.get(seq.seq_id)
            if sample is None:
                quiet = 0
                continue
            policy = sample.proposal_policy
            if policy is None:
                policy = sample.proposal_policy = ProposalPolicy(config.num_speculative_tokens)
            generated = seq.num_output_tokens
            # Room for the proposals and the model's own token within max_tokens.
            k = min(policy.next_size(generated), seq.max_tokens - generated - 1)
            sitting_out = policy.steps_sitting_out(generated)
            quiet = sitting_out if quiet is None else min(quiet, sitting_out)
            if k < 1 or sample.finished:
                continue
            if self.draft is not None:
                wanted[seq.seq_id] = (seq.token_ids, k)
                continue
            if sample.ngram_lookup is None:
                lookup = config.prompt_lookup_min, config.prompt_lookup_max
                sample.ngram_lookup = NgramLookup(*lookup)
            tokens = sample.ngram_lookup.propose(seq.token_ids, k)
            if tokens:
                proposals[seq.seq_id] = tokens
            else:  # told once the step has committed (``_record``)
                self._found_nothing.append(seq.seq_id)
        if quiet:
            self._quiet_steps, self._quiet_running = quiet - 1, list(running)
        if wanted:
            proposals = self.draft.propose(wanted)
        for seq_id, tokens in proposals.items():
            matcher = self._by_seq[seq_id].matcher
            if matcher is not None:
                proposals[seq_id] = tokens[: matcher.num_valid(tokens)]
        return {seq_id: tokens for seq_id, tokens in proposals.items() if tokens} or None

    def _abort_stalled(self, stall: SchedulerStallError) -> RequestStalledError:
        """Abort the request whose sequence the scheduler could not admit (``stall.seq_id``,
        the head of its queue) and return the error that tells the caller."""
        request_id = self._by_seq[stall.seq_id].request.request_id
        logger.error("request %r aborted: the scheduler could not admit it: %s", request_id, stall)
        self.abort_request(request_id)
        return RequestStalledError((request_id,), stall)

    def _sample_tokens(
        self, entries, owners: list[Sample], all_positions: list[bool], logits: np.ndarray
    ) -> list[int]:
        """One token per sampling entry, from the last of its logits rows; on the way, the
        prompt log-probabilities of the entries that have all their rows."""
        masks = self._grammar_masks(entries, owners)
        tokens, row = [], 0
        for sample, entry, entry_all_positions in zip(owners, entries, all_positions, strict=True):
            num_rows = entry.num_tokens if entry_all_positions else 1
            rows = logits[row : row + num_rows]
            if entry_all_positions and not entry.spec_token_ids:
                self._record_prompt_logprobs(sample.request, entry, rows)
            row += num_rows
            if not entry.samples:
                continue
            allowed = masks.get(sample.seq.seq_id)
            if sample.seq.finished:  # ended by the caller meanwhile: it draws nothing more
                tokens.append(0)  # (commit skips an aborted sequence)
            elif entry.spec_token_ids:
                tokens.append(self._verify(sample, entry.spec_token_ids, rows, allowed))
            else:
                tokens.append(self._sample(sample, rows[-1], allowed))
        return tokens

    def _verify(
        self,
        sample: Sample,
        proposals: tuple[int, ...],
        rows: np.ndarray,
        allowed: np.ndarray | None,
    ) -> list[int]:
        """The tokens a decode entry with ``proposals`` yields: position by position, the
        sample's token drawn from its row (row ``i`` follows proposal ``i - 1``) exactly as
        plain decoding draws it -- its grammar's mask after the tokens before it, its
        penalties, its sampling knobs, its generator, its log-probabilities -- and the
        proposal accepted when it is that token. The first token that differs from its
        proposal, a stop token, or a token completing a stop string ends the run; after
        ``k`` accepted proposals the last row gives one more. So the tokens are plain
        decoding's, token for token, greedy or sampled (``mie.engine.speculative``)."""
        tokens = []
        stops = set(sample.request.stop_token_ids)
        for i, proposal in enumerate((*proposals, None)):
            if i and sample.matcher is not None:  # the grammar after the tokens accepted
                allowed = sample.matcher.allowed()
                if sample.matcher.error:
                    raise GrammarFailedError(sample, sample.matcher.error)
            token = self._sample(sample, rows[i], allowed, position=i)
            tokens.append(token)
            if token != proposal or token in stops or sample.stopped_by_string:
                break
        return tokens

    @staticmethod
    def _grammar_masks(entries, owners: list[Sample]) -> dict[int, np.ndarray]:
        """The allowed next tokens of every constrained sample drawing a token this step, by
        seq_id: one batched call into the grammar engine rather than one per sample."""
        constrained = [
            s
            for s, e in zip(owners, entries, strict=True)
            if e.samples and s.matcher is not None and not s.seq.finished
        ]
        if not constrained:
            return {}
        masks = fill_masks([s.matcher for s in constrained])
        for sample in constrained:
            error = sample.matcher.error  # llguidance's per-mask work limits, say
            if error:
                raise GrammarFailedError(sample, error)
        return {s.seq.seq_id: mask for s, mask in zip(constrained, masks, strict=True)}

    def _outputs(
        self, batch: Batch, sampling: list[Sample], tokens: list[int | list[int]]
    ) -> list[RequestOutput]:
        """After the commit: speculation's counts, the samples forked whose first has
        computed the prompt, the samples a stop string ended taken out of the scheduler,
        finished samples and requests counted; the outputs of the requests that got a token,
        in batch order."""
        # The samples that drew tokens: not ended by the caller while the step ran.
        pairs = zip(sampling, tokens, strict=True)
        drawn = [(s, t) for s, t in pairs if s.seq.finish_reason != FINISH_ABORT]
        self._record(batch, [t if isinstance(t, list) else [t] for _, t in drawn])
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        for sample, _ in drawn:
            request = sample.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if not request.forked:  # the first sample has computed the prompt
                self._fork(request)
            if sample.stopped_by_string:  # it ends at the token that completed one
                sample.finish_reason = "stop"
                self.scheduler.abort(sample.seq.seq_id)  # no-op if it finished anyway
            if sample.seq.finished:
                del self._by_seq[sample.seq.seq_id]
                request.num_finished += 1
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                del self._requests[request.request_id]
            outputs.append(request.output())
        return outputs

    def _sample(
        self, sample: Sample, raw: np.ndarray, allowed: np.ndarray | None = None, position: int = 0
    ) -> int:
        """The sample's next token from its raw logits row (its grammar's mask first, then
        its history-reading steps), and the token's log-probabilities where they are wanted
        (from the raw row). A constrained sample's matcher moves past the token here, before
        the commit: a failed step rolls it back with the rest (``Sample.checkpoint``).

        The mask is applied by sampling among the ``allowed`` tokens only: the same token,
        bit for bit, as sampling the whole row with every other logit at -inf (the penalties
        leave -inf at -inf; top-k, top-p and min-p never keep a token of probability zero;
        the cumulative sums skip only exact zeros; ties still go to the lower id first), at a
        cost proportional to the allowed tokens instead of the vocabulary: a token the grammar
        forces is a draw among one.

        The token's text is read by the sample's stop strings, if it has any; ``position``
        is how many tokens the sample drew before it in this step (speculative decoding)."""
        params = sample.request.params
        row = raw if sample.penalty_state is None else sample.penalty_state.apply(raw)
        if allowed is not None:
            candidates = np.flatnonzero(allowed)
            if not candidates.size:
                raise GrammarFailedError(sample, "the grammar allows no token")
            row = row[candidates]
        try:
            token = sample_token(row, params, sample.rng)
        except NoDistributionError as exc:  # the step fails (rolled back) naming the request
            raise NoDistributionError(
                f"request {sample.request.request_id!r}, sample {sample.index}: {exc}"
            ) from None
        if allowed is not None:
            token = int(candidates[token])
        if sample.matcher is not None:
            try:
                sample.matcher.consume(token)
            except StructuredOutputsError as exc:
                raise GrammarFailedError(sample, str(exc)) from None
        if sample.cumulative_logprob is not None:
            logprobs = log_softmax(raw)
            sample.cumulative_logprob += float(logprobs[token])
            if sample.logprobs is not None:
                text = sample.detokenizer.peek if sample.detokenizer is not None else None
                sample.logprobs.append(position_logprobs(logprobs, token, params.logprobs, text))
        if sample.detokenizer is not None and (
            params.include_stop_str_in_output or token not in sample.request.stop_token_ids
        ):  # a stop token ends the text unshown
            piece = sample.detokenizer.add(token)
            if sample.stops is not None:
                # No stop string may end in the text of the first min_tokens tokens.
                if sample.seq.num_output_tokens + position < params.min_tokens:
                    sample.stops.protected = len(sample.text) + len(piece)
                sample.stops.feed(piece)
            sample.text += piece
        if sample.penalty_state is not None:  # the next position's penalties count it
            sample.penalty_state.observe(token)
        return token

    def _record_prompt_logprobs(self, request: Request, entry, logits: np.ndarray) -> None:
        """The prompt log-probabilities an entry's rows give: row ``p`` (position
        ``entry.start + p``) predicts prompt token ``entry.start + p + 1``. Positions already
        recorded (a recompute after preemption or a rolled-back step) are skipped, so nothing
        is recorded twice; the first sample never borrows a prefix (``reuse_prefix=False``),
        so nothing is skipped either."""
        done, prompt = request.prompt_logprobs, request.prompt_token_ids
        first = len(done) - 1 - entry.start  # the first row not recorded yet
        if first < 0:
            raise RuntimeError(
                f"prompt positions {len(done)}..{entry.start} were never computed: a request "
                "with prompt_logprobs borrowed a prefix"
            )
        last = min(entry.num_tokens, len(prompt) - 1 - entry.start)  # rows inside the prompt
        if first >= last:
            return
        logprobs = log_softmax(logits[first:last])
        k, detokenizer = request.params.prompt_logprobs, request.prompt_detokenizer
        for i, row in enumerate(logprobs, start=entry.start + first + 1):
            text = detokenizer.peek if detokenizer is not None else None
            done.append(position_logprobs(row, prompt[i], k, text))
            if detokenizer is not None:
                detokenizer.add(prompt[i])

    def _record(self, batch: Batch, drawn: list[list[int]]) -> None:
        """The step's trace and totals; ``drawn``: each sample's tokens this step."""
        trace = batch.trace
        num_drafts = 0
        for seq_id in self._found_nothing:
            sample = self._by_seq.get(seq_id)
            if sample is not None:
                sample.proposal_policy.found_nothing(sample.seq.num_output_tokens)
        if trace.spec_tokens:  # only a step that verified proposals has anything to record
            num_drafts, accepted = self._record_verifications(batch)
            if accepted:  # the scheduler's trace says 0: copying it (~10 us) every step
                # cost free generation, where almost no step accepts anything, 1-2% of its speed
                trace = dataclasses.replace(trace, accepted_spec_tokens=accepted)
        self.last_trace = trace
        self.stats.add(trace, sum(len(tokens) for tokens in drawn), num_drafts)

    def _record_verifications(self, batch: Batch) -> tuple[int, int]:
        """Feed every verification's outcome (proposals verified, accepted) to its sample's
        ``ProposalPolicy`` and its request's metrics; return how many entries verified
        proposals and how many proposals were accepted."""
        num_drafts = accepted = 0
        for entry in batch.entries:
            proposed = len(entry.spec_token_ids)
            if not proposed:
                continue
            num_drafts += 1
            seq = entry.seq
            # The sequence's KV now covers the newest token and the accepted proposals.
            num_accepted = max(0, seq.num_computed - entry.start - 1)
            accepted += num_accepted
            sample = self._by_seq.get(seq.seq_id)
            if sample is not None and sample.proposal_policy is not None:
                sample.proposal_policy.record(proposed, num_accepted, seq.num_output_tokens)
                sample.request.metrics.spec_draft_tokens += proposed
                sample.request.metrics.spec_accepted_tokens += num_accepted
        return num_drafts, accepted


class StepError(RuntimeError):
    """A step failed and was rolled back; ``request_ids`` were in its batch (now re-queued).

    The original exception is the ``__cause__``. The engine is usable: step again to retry,
    or abort the requests first (what the server does).
    """

    def __init__(self, request_ids: tuple[str, ...], cause: BaseException) -> None:
        super().__init__(
            f"engine step failed ({type(cause).__name__}: {cause}); its {len(request_ids)} "
            "requests were rolled back and re-queued"
        )
        self.request_ids = request_ids


class GrammarFailedError(RuntimeError):
    """A sample's grammar matcher failed mid-generation (llguidance's per-step work limits,
    or a token it refused): the step is rolled back and the ``StepError`` names this request
    alone, so a caller aborting the failed requests (the server) spares its batch-mates, which
    were re-queued with the rest of the step."""

    def __init__(self, sample: Sample, error: str) -> None:
        self.request_id = sample.request.request_id
        super().__init__(
            f"request {self.request_id!r}, sample {sample.index}: structured outputs' grammar "
            f"failed: {error}"
        )


class RequestStalledError(StepError):
    """The scheduler could not admit the request at the head of its queue into an idle engine
    (the ``SchedulerStallError`` is the ``__cause__``): every later step would have been the
    same empty one. ``request_ids`` is that one request, which the engine has already aborted;
    the engine is usable and the next ``step()`` goes on with the others."""

    def __init__(self, request_ids: tuple[str, ...], cause: BaseException) -> None:
        RuntimeError.__init__(
            self, f"request {request_ids[0]!r} aborted, it could not be scheduled: {cause}"
        )
        self.request_ids = request_ids


def _engine_config(config: EngineConfig | None, settings: dict[str, object]) -> EngineConfig:
    """``config``, or the config of ``LLMEngine``'s setting keywords (a ``Backend`` object
    stands for its name); not both."""
    if config is None:
        backend = settings.get("backend")
        if isinstance(backend, Backend):
            settings = {**settings, "backend": backend.name}
        return EngineConfig.from_settings(**settings)
    if settings:
        raise TypeError(f"give the settings in config or as keywords, not both: {settings}")
    return config


def _optional_tokenizer(model_dir: str | os.PathLike[str]) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships without one (token-id prompts only):
    a directory without ``tokenizer.json``, a GGUF file without ``tokenizer.ggml.model`` or
    with llama.cpp's ``"no_vocab"`` there."""
    if is_gguf(model_dir):
        metadata = GGUFFile(model_dir).metadata
        if metadata.get("tokenizer.ggml.model", "no_vocab") != "no_vocab":
            return Tokenizer(model_dir, gguf_metadata=metadata)
        logger.warning(
            "%s has no vocabulary (tokenizer.ggml.*): prompts must be token ids", model_dir
        )
        return None
    if not listed(Path(model_dir) / "tokenizer.json"):  # a dangling symlink: TokenizerError
        logger.warning("%s has no tokenizer.json: prompts must be token ids", model_dir)
        return None
    return Tokenizer(model_dir)
