"""mie: a miniature LLM inference serving engine -- a scheduler looping over a paged pool."""

from mie.checkpoint import CheckpointError
from mie.engine.llm import LLM
from mie.engine.llm_engine import LLMEngine, StepError
from mie.engine.outputs import CompletionOutput, RequestOutput
from mie.engine.sampling import InvalidRequestError, SamplingParams
from mie.memory import INVALID_BLOCK, AllocatorError, BlockPool, BlockTable
from mie.model import Chunk, ConfigError, Model, ModelConfig
from mie.scheduler import (
    Batch,
    BatchEntry,
    RequestTooLongError,
    Scheduler,
    Sequence,
    StaticBatchScheduler,
    StepTrace,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "InvalidRequestError",
    "INVALID_BLOCK",
    "AllocatorError",
    "Batch",
    "BatchEntry",
    "BlockPool",
    "BlockTable",
    "CheckpointError",
    "Chunk",
    "ConfigError",
    "Model",
    "ModelConfig",
    "RequestTooLongError",
    "Scheduler",
    "Sequence",
    "StaticBatchScheduler",
    "StepError",
    "StepTrace",
    "__version__",
]
