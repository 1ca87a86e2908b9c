"""Drive a scheduler through a workload with a null model; collect its trace and latencies.

The null model computes nothing: it answers each *sampling* batch entry (``entry.samples``:
a decode, or a prefill that reaches the end of its sequence) with a filler token until the
request has produced its workload output length, and then with EOS. A prompt chunk that ends
inside the prompt (chunked prefill) gets no token, exactly as from the real runner. So every
request runs exactly to its length, whatever the scheduling, and a run is a faithful count of
steps, tokens and memory -- the mechanisms, without the arithmetic.

Besides the step traces, a run records when each request arrived and at which step each of
its output tokens came out, so that latencies can be counted in steps *and* in computed
tokens (``RunResult.stalls``, ``RunResult.ttft_tokens``): in a compute-bound engine a step
takes time in proportion to the tokens it computes, so the tokens computed between two
output tokens of a request are a machine-independent stand-in for its inter-token latency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from mie.bench.workload import EOS, WorkloadRequest
from mie.scheduler import Batch, RequestTooLongError, StepTrace


@dataclass
class RunResult:
    traces: list[StepTrace] = field(default_factory=list)
    latencies: list[int] = field(default_factory=list)  # arrival -> finish, in steps
    queueing: list[int] = field(default_factory=list)  # arrival -> first scheduled, in steps
    output_tokens: int = 0  # tokens the model answered (one per sampling entry)
    completed: int = 0
    rejections: list[str] = field(default_factory=list)  # RequestTooLongError messages
    # Per request (by seq_id): the index in ``traces`` of the first step that could serve it
    # (the step run when it arrived), and the index of every step that gave it a token.
    arrived_at: dict[int, int] = field(default_factory=dict)
    token_steps: dict[int, list[int]] = field(default_factory=dict)
    requests: dict[int, WorkloadRequest] = field(default_factory=dict)  # seq_id -> its request

    @property
    def rejected(self) -> int:
        return len(self.rejections)

    @property
    def steps(self) -> int:
        return len(self.traces)

    def total(self, name: str) -> int:
        return sum(getattr(t, name) for t in self.traces)

    def peak(self, name: str) -> int:
        return max((getattr(t, name) for t in self.traces), default=0)

    def mean(self, name: str) -> float:
        return self.total(name) / self.steps if self.steps else 0.0

    def step_tokens(self) -> list[int]:
        """Tokens each step computed (prompt and decode): its cost in a compute-bound engine."""
        return [t.num_prefill_tokens + t.num_decode_tokens for t in self.traces]

    def _computed_through(self) -> list[int]:
        """``[0, tokens through step 0, through step 1, ...]``: cumulative step tokens."""
        return [0, *accumulate(self.step_tokens())]

    def stalls(self) -> list[int]:
        """For every two consecutive output tokens of a request: the tokens the engine
        computed from the step after the first to the step that gave the second, inclusive."""
        through = self._computed_through()
        return [
            through[b + 1] - through[a + 1]
            for steps in self.token_steps.values()
            for a, b in zip(steps[:-1], steps[1:], strict=True)
        ]

    def ttft_steps(self, seq_ids: list[int] | None = None) -> list[int]:
        """Per request (default: all that produced a token): steps from its arrival to the
        step that gave its first token, inclusive."""
        return [self.token_steps[i][0] - self.arrived_at[i] + 1 for i in self._started(seq_ids)]

    def ttft_tokens(self, seq_ids: list[int] | None = None) -> list[int]:
        """Per request (default: all that produced a token): tokens the engine computed from
        its arrival to its first token, inclusive (its own prompt, and everything else those
        steps computed)."""
        through = self._computed_through()
        return [
            through[self.token_steps[i][0] + 1] - through[self.arrived_at[i]]
            for i in self._started(seq_ids)
        ]

    def _started(self, seq_ids: list[int] | None) -> list[int]:
        ids = self.token_steps if seq_ids is None else seq_ids
        return [i for i in ids if self.token_steps[i]]


def null_tokens(batch: Batch, output_len: dict[int, int]) -> list[int]:
    """One token per sampling entry, in order: EOS for an entry whose sequence reaches its
    length with this token, else filler. Non-sampling entries (a prompt chunk that ends
    inside the prompt) get none, as ``Scheduler.commit`` expects."""
    tokens = []
    for entry in batch.entries:
        if not entry.samples:
            continue
        seq = entry.seq
        done = seq.num_output_tokens + 1 >= output_len[seq.seq_id]
        tokens.append(EOS if done else (seq.seq_id * 7919 + seq.num_output_tokens) % EOS)
    return tokens


def simulate(
    scheduler, requests: list[WorkloadRequest], *, record_tokens: bool = False
) -> RunResult:
    """Submit each request at its arrival step and step until all are done.

    Steps where nothing is waiting or running are skipped (the clock jumps to the next
    arrival), so ``steps`` counts only steps with work. Requests the scheduler rejects as
    too long are counted, not run. ``record_tokens`` also records each request's arrival and
    the step of each of its tokens (``arrived_at``, ``token_steps``, ``requests``: what
    ``stalls`` and the TTFTs read); off by default, since bookkeeping per output token would
    be a good part of what the fast-backend benchmark times.
    """
    result = RunResult()
    pending = sorted(requests, key=lambda r: r.arrival)  # stable: ties keep workload order
    output_len: dict[int, int] = {}
    arrival: dict[int, int] = {}
    first_scheduled: set[int] = set()
    clock, next_request = 0, 0
    while next_request < len(pending) or scheduler.has_unfinished():
        if not scheduler.has_unfinished():
            clock = max(clock, pending[next_request].arrival)
        while next_request < len(pending) and pending[next_request].arrival <= clock:
            request = pending[next_request]
            next_request += 1
            try:
                seq = scheduler.submit(request.prompt, request.max_tokens, [EOS])
            except RequestTooLongError as exc:
                result.rejections.append(str(exc))
                continue
            output_len[seq.seq_id] = request.output_len
            arrival[seq.seq_id] = request.arrival
            if record_tokens:
                result.arrived_at[seq.seq_id] = result.steps
                result.token_steps[seq.seq_id] = []
                result.requests[seq.seq_id] = request
        if not scheduler.has_unfinished():
            continue
        batch = scheduler.step()
        # Before commit: ``entry.samples`` compares with the sequence's length, which grows.
        result.output_tokens += batch.num_sampling
        for entry in batch.entries:
            if entry.seq.seq_id not in first_scheduled:
                first_scheduled.add(entry.seq.seq_id)
                result.queueing.append(clock - arrival[entry.seq.seq_id])
            if record_tokens and entry.samples:
                result.token_steps[entry.seq.seq_id].append(result.steps)
        for seq in scheduler.commit(batch, null_tokens(batch, output_len)):
            result.latencies.append(clock + 1 - arrival[seq.seq_id])
            result.completed += 1
        result.traces.append(batch.trace)
        clock += 1
    return result
