"""Drive a scheduler through a workload with a null model; collect its trace and latencies.

The null model computes nothing: it answers each batch entry with a filler token until the
request has produced its workload output length, and then with EOS. So every request runs
exactly to its length, whatever the scheduling, and a run is a faithful count of steps,
tokens and memory -- the mechanisms, without the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mie.bench.workload import EOS, Request
from mie.scheduler import Batch, RequestTooLongError, StepTrace


@dataclass
class RunResult:
    traces: list[StepTrace] = field(default_factory=list)
    latencies: list[int] = field(default_factory=list)  # arrival -> finish, in steps
    queueing: list[int] = field(default_factory=list)  # arrival -> first scheduled, in steps
    output_tokens: int = 0  # tokens the model answered (one per batch entry)
    completed: int = 0
    rejections: list[str] = field(default_factory=list)  # RequestTooLongError messages

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


def null_tokens(batch: Batch, output_len: dict[int, int]) -> list[int]:
    """EOS for an entry whose sequence reaches its length with this token, else filler."""
    tokens = []
    for entry in batch.entries:
        seq = entry.seq
        done = seq.num_output_tokens + 1 >= output_len[seq.seq_id]
        tokens.append(EOS if done else (seq.seq_id * 7919 + seq.num_output_tokens) % EOS)
    return tokens


def simulate(scheduler, requests: list[Request]) -> RunResult:
    """Submit each request at its arrival step and step until all are done.

    Steps where nothing is waiting or running are skipped (the clock jumps to the next
    arrival), so ``steps`` counts only steps with work. Requests the scheduler rejects as
    too long are counted, not run.
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
        if not scheduler.has_unfinished():
            continue
        batch = scheduler.step()
        for entry in batch.entries:
            if entry.seq.seq_id not in first_scheduled:
                first_scheduled.add(entry.seq.seq_id)
                result.queueing.append(clock - arrival[entry.seq.seq_id])
        for seq in scheduler.commit(batch, null_tokens(batch, output_len)):
            result.latencies.append(clock + 1 - arrival[seq.seq_id])
            result.completed += 1
        result.output_tokens += len(batch.entries)
        result.traces.append(batch.trace)
        clock += 1
    return result
