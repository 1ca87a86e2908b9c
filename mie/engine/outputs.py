"""What the engine hands back: vLLM's ``RequestOutput`` shape, so callers feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """The generated part of one request."""

    index: int
    text: str  # everything generated so far, detokenized (stop tokens not shown)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's state after a step: its prompt, what it generated, whether it is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False)
