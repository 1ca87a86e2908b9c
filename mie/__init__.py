"""mie: a miniature LLM inference serving engine -- a scheduler looping over a paged pool.

The names below are resolved on first use, so ``import mie.memory`` (or any lower layer)
loads that layer alone, not the engine above it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it, lowest layer first.
_EXPORTS = {
    "INVALID_BLOCK": "mie.memory",
    "AllocatorError": "mie.memory",
    "BlockPool": "mie.memory",
    "BlockTable": "mie.memory",
    "Batch": "mie.scheduler",
    "BatchEntry": "mie.scheduler",
    "RequestTooLongError": "mie.scheduler",
    "Scheduler": "mie.scheduler",
    "Sequence": "mie.scheduler",
    "StaticBatchScheduler": "mie.scheduler",
    "StepTrace": "mie.scheduler",
    "CheckpointError": "mie.checkpoint",
    "ConfigError": "mie.model",
    "Model": "mie.model",
    "ModelConfig": "mie.model",
    "InvalidRequestError": "mie.engine.sampling",
    "SamplingParams": "mie.engine.sampling",
    "CompletionOutput": "mie.engine.outputs",
    "Logprob": "mie.engine.outputs",
    "RequestOutput": "mie.engine.outputs",
    "LLMEngine": "mie.engine.llm_engine",
    "StepError": "mie.engine.llm_engine",
    "LLM": "mie.engine.llm",
    "BeamSearchParams": "mie.engine.beam_search",
    "BeamSearchOutput": "mie.engine.beam_search",
    "BeamSearchSequence": "mie.engine.beam_search",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mie' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once resolved, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
