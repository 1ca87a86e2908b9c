"""A checkpoint's recommended sampling: what a request leaves out, as vLLM reads it.

Model creators ship their sampling advice in ``generation_config.json`` (Qwen2.5-Instruct:
``temperature`` 0.7, ``top_p`` 0.8, ``top_k`` 20, ``repetition_penalty`` 1.05), and vLLM uses
it by default (``--generation-config auto``): offline, ``LLM.generate`` without sampling
parameters samples with it (``LLM.get_default_sampling_params``); over HTTP, every field a
request leaves out takes the checkpoint's value instead of OpenAI's default, and its
``max_new_tokens`` caps ``max_tokens``. So mie does the same, or else the same request would
sample differently on mie and on vLLM.

vLLM's rule (``ModelConfig.get_diff_sampling_param``): of the file's ``temperature``,
``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (which is
``max_tokens``), only those that differ from transformers' ``GenerationConfig`` defaults
count -- a file saying ``top_k: 50``, transformers' default, changes nothing. Other keys
(``do_sample``, ``eos_token_id``, ...) are not sampling defaults. ``generation_config="vllm"``
(``--generation-config vllm``) ignores the file: vLLM's neutral defaults.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mie.checkpoint import listed, read_json
from mie.engine.sampling import InvalidRequestError, SamplingParams
from mie.model.config import ConfigError

logger = logging.getLogger("mie")

GENERATION_CONFIG = "generation_config.json"
TRANSFORMERS_DEFAULTS = {
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
"""The sampling fields vLLM reads from a generation config, at transformers' defaults (a
value equal to its default is not the model creator's advice, and is not read)."""


def generation_defaults(model: str | Path) -> dict:
    """``SamplingParams`` keywords from ``model``'s ``generation_config.json`` (a checkpoint
    directory's; {} for a GGUF file or a directory without one); a value ``SamplingParams``
    refuses is a ``ConfigError`` naming the file."""
    path = Path(model) / GENERATION_CONFIG
    if not Path(model).is_dir() or not listed(path):
        return {}
    config = read_json(path)
    defaults = {}
    for name, default in TRANSFORMERS_DEFAULTS.items():
        value = config.get(name)
        if value is not None and value != default:
            defaults["max_tokens" if name == "max_new_tokens" else name] = value
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if defaults:
        logger.warning(
            "Sampling defaults from %s: %s (what a request leaves out; generation_config="
            "'vllm' ignores them)",
            path,
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults
