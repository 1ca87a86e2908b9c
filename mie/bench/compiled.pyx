# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled drivers for ``mie.bench``'s fast-vs-python comparisons.

A benchmark loop written in Python costs the interpreter's time per iteration on top of what
it measures; against a compiled allocator or scheduler that overhead dominates, and the figure
would be the interpreter's. These drivers run the same loops compiled, calling the mirrors at
C level as the fast scheduler does:

* ``simulate`` mirrors ``mie.bench.simulate.simulate`` -- the null-model driver of the
  mechanism simulation -- over ``mie._fast.Scheduler``: same arrivals, same answers, the same
  ``RunResult`` (the tests check it against the reference);
* ``allocate_decref_loop`` is the allocator micro-benchmark's loop over the C interface of
  ``mie._fast.BlockPool`` (the calls the fast scheduler makes).

They live with the benchmarks, not in ``mie._fast``, because they build the benchmarks'
results (``RunResult``, the workload's ``EOS``); the compiled mirrors know nothing of the
benchmarks, as the layers require. ``setup.py`` builds this module with the mirrors.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free

from mie._fast.memory cimport BlockPool
from mie._fast.scheduler cimport Batch, BatchEntry, Scheduler, Sequence

from mie.bench.simulate import RunResult
from mie.bench.workload import EOS
from mie.scheduler.scheduler import RequestTooLongError


def simulate(Scheduler scheduler not None, requests, *, bint record_tokens=False) -> RunResult:
    """Submit each request at its arrival step and step until all are done (see the
    reference for the rules: idle steps skipped, rejected requests counted, not run)."""
    result = RunResult()
    pending = sorted(requests, key=lambda r: r.arrival)  # stable: ties keep workload order
    cdef Py_ssize_t n = len(pending)
    # Per request, by seq_id - first_id (this loop is the only submitter while it runs).
    cdef Py_ssize_t first_id = scheduler._next_seq_id
    cdef long long *output_len = <long long *>PyMem_Calloc(n + 1, sizeof(long long))
    cdef long long *arrival = <long long *>PyMem_Calloc(n + 1, sizeof(long long))
    cdef char *scheduled_before = <char *>PyMem_Calloc(n + 1, 1)
    cdef long long clock = 0, eos = EOS
    cdef Py_ssize_t next_request = 0, i, k, num_out
    cdef Sequence seq
    cdef BatchEntry entry
    cdef Batch batch
    cdef list tokens
    try:
        if output_len == NULL or arrival == NULL or scheduled_before == NULL:
            raise MemoryError()
        while next_request < n or scheduler.waiting or scheduler.running:
            if not (scheduler.waiting or scheduler.running):
                clock = max(clock, pending[next_request].arrival)
            while next_request < n and pending[next_request].arrival <= clock:
                request = pending[next_request]
                next_request += 1
                try:
                    seq = scheduler.submit(request.prompt, request.max_tokens, [EOS])
                except RequestTooLongError as exc:
                    result.rejections.append(str(exc))
                    continue
                output_len[seq.seq_id - first_id] = request.output_len
                arrival[seq.seq_id - first_id] = request.arrival
                if record_tokens:
                    result.arrived_at[seq.seq_id] = len(result.traces)
                    result.token_steps[seq.seq_id] = []
                    result.requests[seq.seq_id] = request
            if not (scheduler.waiting or scheduler.running):
                continue
            batch = scheduler.step()
            tokens = []
            for i in range(len(batch.entries)):
                entry = batch.entries[i]
                seq = entry.seq
                k = seq.seq_id - first_id
                if not scheduled_before[k]:
                    scheduled_before[k] = 1
                    result.queueing.append(clock - arrival[k])
                if entry.start + entry.num_tokens != len(seq.token_ids):
                    continue  # a prompt chunk ending inside the prompt: no token
                if record_tokens:
                    result.token_steps[seq.seq_id].append(len(result.traces))
                # the null model: filler until the request's output length, then EOS
                num_out = len(seq.token_ids) - seq.num_prompt_tokens
                if num_out + 1 >= output_len[k]:
                    tokens.append(eos)
                else:
                    tokens.append((seq.seq_id * 7919 + num_out) % eos)
            result.output_tokens += len(tokens)
            for seq in scheduler.commit(batch, tokens):
                result.latencies.append(clock + 1 - arrival[seq.seq_id - first_id])
                result.completed += 1
            result.traces.append(batch.trace)
            clock += 1
    finally:
        PyMem_Free(output_len)
        PyMem_Free(arrival)
        PyMem_Free(scheduled_before)
    return result


def allocate_decref_loop(BlockPool pool not None, Py_ssize_t pairs) -> None:
    """``pairs`` times: take a block, give it back -- ``decref(allocate())`` in C."""
    if pool._num_free == 0:
        raise ValueError("allocate_decref_loop needs a pool with a free block")
    cdef Py_ssize_t i
    for i in range(pairs):
        pool._release_one(pool._allocate())
