"""Every engine setting, once: its name, default, type, check and help text.

``EngineConfig`` is what ``LLM(model, **settings)`` and ``LLMEngine(model, **settings)`` build
from their keywords, what the CLI generates its engine flags from (``mie.cli``: each field is
a ``--kebab-case`` flag with this help text and default), and what the driver of
``serve --replicas`` hands to every Ray replica. A setting is added here and nowhere else.

Every value is checked in ``__post_init__``, before a model is loaded or a pool allocated,
and stored as the plain Python value the check returns (``numpy.int64(8)`` becomes ``8``):
so the keyword, the flag and the replica refuse a bad value with the same message. Field names
are vLLM's where vLLM has the setting (``enable_prefix_caching``); mie's older spellings stay
accepted (``ALIASES``).

What is not a plain value stays an ``LLMEngine`` argument: the model (a directory or a built
``Model``) and the tokenizer object; a ``Backend`` object is accepted there too, in place of
its name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from mie.checks import as_int, positive_int, short_repr
from mie.engine.speculative import SpeculativeConfig
from mie.extension import BACKENDS, backend_name
from mie.model.precision import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    check_quantization,
    kv_cache_numpy_dtype,
    resolve_dtype,
)

DEFAULT_CHUNK_BUDGET = 512
"""Tokens per step with chunked prefill unless ``max_num_batched_tokens`` says otherwise
(vLLM's default when it chunks on CPUs of this class). The budget bounds how long one step
-- and so the gap between two tokens of a running stream -- can take: on a 2-core CPU
computing ~270 prompt tokens/s of a Qwen2-0.5B-shaped model, about two seconds; a smaller one
stalls streams less and computes prompts in more, smaller (less efficient) pieces. Without
chunking the budget must hold the longest prompt, so it defaults to the model's context."""

ALIASES = {"prefix_caching": "enable_prefix_caching"}
"""Other accepted spellings of a keyword -> the field it sets."""

Check = Callable[[object, str], Any]


def _positive(value: object, name: str) -> int:
    return positive_int(value, name, limit=None)


def _positive_or_none(value: object, name: str) -> int | None:
    """None: sized from the other settings (see the field's help)."""
    return None if value is None else positive_int(value, name, limit=None)


def _non_negative(value: object, name: str) -> int:
    number = as_int(value)  # NumPy integers too: the same as the Python int
    if number is None or number < 0:
        raise ValueError(f"{name} must be a non-negative int, got {short_repr(value)}")
    return number


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {short_repr(value)}")
    return value


def _dtype(value: object, name: str) -> str:
    resolve_dtype(value, "float32")
    return str(value)


def _quantization(value: object, name: str) -> str | None:
    check_quantization(value)
    return None if value is None else str(value)


def _kv_cache_dtype(value: object, name: str) -> str:
    kv_cache_numpy_dtype(value)
    return str(value)


def _backend(value: object, name: str) -> str | None:
    """A backend's name (``mie.extension.backend_name`` checks it is known and built), or None:
    ``MIE_BACKEND``, else the best one built, decided where the engine is built."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be one of {list(BACKENDS)} or None, got {short_repr(value)}")
    backend_name(value)
    return value


GENERATION_CONFIGS = ("auto", "vllm")


def _generation_config(value: object, name: str) -> str:
    if value not in GENERATION_CONFIGS:
        choices = list(GENERATION_CONFIGS)
        raise ValueError(f"{name} must be one of {choices}, got {short_repr(value)}")
    return str(value)


def setting(default: object, check: Check, help: str, choices: tuple | None = None) -> Any:
    """A field of ``EngineConfig``: its default, the check that refuses a bad value (and
    returns the value to store), its help text (the CLI's), and, for a named choice, the
    values the CLI lists."""
    return field(default=default, metadata={"check": check, "help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings (see the module doc); refused at construction if any is bad."""

    block_size: int = setting(16, _positive, "tokens per KV block")
    num_blocks: int | None = setting(
        None,
        _positive_or_none,
        "KV pool size in blocks (default: as many as kv_cache_memory bytes hold)",
    )
    kv_cache_memory: int = setting(
        1 << 30,  # vLLM on CPU: 4 GiB
        _positive,
        "bytes of KV pool when num_blocks is not given",
    )
    max_num_seqs: int = setting(32, _positive, "most sequences running at once")
    max_num_batched_tokens: int | None = setting(
        None,
        _positive_or_none,
        f"tokens computed per step (default: {DEFAULT_CHUNK_BUDGET} with chunked prefill, "
        "else the model's context length)",
    )
    enable_prefix_caching: bool = setting(
        True,
        _bool,
        "keep the full KV blocks of finished prompts for later requests that start the same way",
    )
    enable_chunked_prefill: bool = setting(
        True,
        _bool,
        "compute prompts in chunks of the step's token budget, so a long prompt never stalls "
        "the streams already decoding (off: whole prompts)",
    )
    seed: int = setting(0, _non_negative, "random seed")
    backend: str | None = setting(
        None, _backend, "allocator, scheduler and kernels (default: the best one built)", BACKENDS
    )
    dtype: str = setting(
        "auto", _dtype, "weight matrices stored as (auto: the checkpoint's own dtype)", DTYPES
    )
    quantization: str | None = setting(
        None,
        _quantization,
        "weight-only quantization at load (int8: llama.cpp's Q8_0, groups of 32 inputs with "
        "float16 scales; int4: llama.cpp's Q4_0, blocks of 32 with float16 scales)",
        tuple(q for q in QUANTIZATIONS if q),
    )
    kv_cache_dtype: str = setting(
        "auto",
        _kv_cache_dtype,
        "KV cache elements (auto: float32; 16 bits hold twice the tokens)",
        KV_CACHE_DTYPES,
    )
    allow_non_finite_weights: bool = setting(
        False, _bool, "load a checkpoint whose weights hold NaN or infinity instead of refusing it"
    )
    refuse_requantization: bool = setting(
        False,
        _bool,
        "refuse a GGUF file holding block types mie does not store (K-quants, IQ...) instead "
        "of requantizing them to int4 / int8 with a warning",
    )
    generation_config: str = setting(
        "auto",
        _generation_config,
        "what a request leaves out samples with (auto: the checkpoint's generation_config.json "
        "advice -- temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens -- as "
        "vLLM reads it; vllm: vLLM's neutral values)",
        GENERATION_CONFIGS,
    )
    speculative_config: SpeculativeConfig | None = setting(
        None,
        SpeculativeConfig.parse,
        'speculative decoding, vLLM\'s keys as JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}, or a '
        'draft model: {"model": DIR, "num_speculative_tokens": 4} (default: off)',
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f.name))

    @property
    def max_samples_per_request(self) -> int:
        """The most sequences one request may hold -- its samples (``best_of``), or a client
        batch's prompts x samples: half the sequence slots, so that no request can take
        every slot and the head of the queue from the requests after it."""
        return max(1, self.max_num_seqs // 2)

    @classmethod
    def from_settings(cls, **settings: object) -> EngineConfig:
        """The config of ``LLMEngine``'s keywords: a field's name or one of its ``ALIASES``.
        An unknown keyword is a ``TypeError`` naming it and the closest settings."""
        names = [f.name for f in fields(cls)]
        given: dict[str, object] = {}
        spelled: dict[str, str] = {}  # field -> the keyword that set it
        for key, value in settings.items():
            name = ALIASES.get(key, key)
            if name not in names:
                close = difflib.get_close_matches(key, [*names, *ALIASES], n=3)
                hint = f" (did you mean {' or '.join(close)}?)" if close else ""
                raise TypeError(
                    f"EngineConfig has no setting {key!r}{hint}; "
                    f"the settings are {', '.join(names)}"
                )
            if name in given:
                raise TypeError(f"engine setting {name} given twice, as {spelled[name]} and {key}")
            given[name], spelled[name] = value, key
        return cls(**given)
