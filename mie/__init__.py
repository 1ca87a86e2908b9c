"""mie: a miniature LLM inference serving engine -- a scheduler looping over a paged pool.

The names below are resolved on first use, so ``import mie.memory`` (or any lower layer)
loads that layer alone, not the engine above it.
"""

from __future__ import annotations

import importlib
import sys

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
    "StructuredOutputsParams": "mie.engine.structured",
    "CompletionOutput": "mie.engine.outputs",
    "Logprob": "mie.engine.outputs",
    "RequestOutput": "mie.engine.outputs",
    "EngineConfig": "mie.engine.config",
    "LLMEngine": "mie.engine.llm_engine",
    "StepError": "mie.engine.llm_engine",
    "LLM": "mie.engine.llm",
    "BeamSearchParams": "mie.engine.beam_search",
    "BeamSearchOutput": "mie.engine.beam_search",
    "BeamSearchSequence": "mie.engine.beam_search",
}

__all__ = [*_EXPORTS, "__version__"]


def lazy_exports(package: str, exports: dict[str, str]):
    """The module-level ``__getattr__`` and ``__dir__`` of a package whose names (``exports``:
    name -> the module defining it) resolve on first use: importing the package loads none
    of the modules behind them, so a lower layer, or one module, can be imported alone.
    ``mie``, ``mie.serve`` and ``mie._fast`` use it."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # once resolved, a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
