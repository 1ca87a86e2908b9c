"""The engine: requests in, tokens out -- scheduler step, model forward, sampling."""

from mie.engine.llm_engine import StepError

__all__ = ["StepError"]
