# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython mirror of ``mie.scheduler.Scheduler``: the whole step loop, not just its leaves.

What mirrors what (same names; checks from ``mie.checks``, ``check_request_fits`` and
``check_integrity`` from the reference)::

    here                                        reference
    Sequence                                    mie/scheduler/sequence.py  Sequence
    BatchEntry, Batch                           mie/scheduler/batch.py     BatchEntry, Batch
    Scheduler: submit, abort, step, commit,     mie/scheduler/scheduler.py Scheduler,
      rollback, clear_prefix_cache,               same methods
      check_integrity, pending_batch
    Scheduler._admit (with _plan inlined),      Scheduler._admit, _plan, _borrow, _decode,
      _borrow, _decode, _continue_prompts,        _continue_prompts, _slots,
      _slots, _tokens_that_fit, _preempt,         _tokens_that_fit, _preempt, _grow, _free,
      _grow, _free, _blocks_to_write,             _blocks_to_write, _num_available,
      _num_available, _register_full_blocks,      _register_full_blocks, _trace,
      _trace, _longest_running_prefix,            _longest_running_prefix,
      _released_after, _release_out_of_window     _released_after, _release_out_of_window
    step's stall: the reference's exception     SchedulerStallError, stall_error
    step's proposals, commit's answers: the     _checked_proposals, _checked_answers
      reference's checks (plus a C fast path
      for plain answers without proposals)
    _checked_token_ids                          mie/checks.py token_ids (plus a C fast path)

The reference (``mie/scheduler/scheduler.py``) is the specification -- read it for the *why*
of every rule. This mirror has the same public API and the same observable behaviour: the same
admissions (strict FCFS, prefix borrowing from running sequences or the prefix cache), the
same decode slot reservations, LIFO victims, block ids, refcounts, free-list and LRU orders,
``Batch`` entries, ``StepTrace`` rows, finished sequences and errors (the reference's own
validation helpers and messages). What changes is where the work runs:

* admission, decode and preemption loop over ``running`` in C and touch the allocator through
  its C interface (``mie/_fast/memory.pxd``): ``_append`` for new slots, the refcount and
  free-list arrays for borrowing and releasing; only the rare copy-on-write split goes
  through ``BlockTable.writable_block``;
* the prefix cache is ``mie._fast.prefix_cache.PrefixCache`` (C arrays, CPython's hash
  computed in C), called at C level;
* a ``Sequence`` keeps its token ids twice: the public ``token_ids`` list and a C array the
  prefix comparisons and block hashes read (``append_token`` writes both);
* "scheduled this step" is a flag on the sequence rather than a dict, and ``BatchEntry``
  objects are only built for the entries that survive the step.

Restrictions (see docs/fast.md): it needs a fast ``BlockPool``; ``StaticBatchScheduler`` and
``ContiguousScheduler`` have no mirror. Inputs are checked by the reference's own helpers, whose
bounds (token ids below 2**63, sizes and the pool's capacity below 2**61) keep every value and
every sum this file computes inside C integers, so both backends accept the same inputs.
"""

cimport cython
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc

from mie._fast.memory cimport NO_BLOCK, BlockPool, BlockTable
from mie._fast.prefix_cache cimport CPrefixCursor, PrefixCache

from collections import deque

from mie.checks import check_capacity, is_int, positive_int, token_ids
from mie.scheduler.prefix_cache import ROOT, PrefixCursor
from mie.scheduler.integrity import check_integrity
from mie.scheduler.scheduler import (
    RequestTooLongError, SchedulerStallError, _checked_answers, _checked_proposals,
    check_request_fits, stall_error,
)
from mie.scheduler.sequence import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from mie.scheduler.trace import StepTrace

__all__ = [
    "Batch", "BatchEntry", "RequestTooLongError", "Scheduler", "SchedulerStallError", "Sequence",
]


cdef list _checked_token_ids(object values, str name):
    """The reference's ``_token_ids`` (same values accepted, same errors), with a C fast path
    for a list or tuple of plain ints in [0, 2**63 - 1], the range both backends take."""
    cdef Py_ssize_t i
    cdef int overflow = 0
    if type(values) is list or type(values) is tuple:
        for i in range(len(values)):
            item = values[i]
            if type(item) is not int or PyLong_AsLongLongAndOverflow(item, &overflow) < 0:
                break  # negative, or overflowed (-1): the reference path says which
        else:
            return list(values)
    return token_ids(values, name)


cdef list _plain_answers(tuple entries, object next_tokens):
    """``commit``'s answers when they are one plain int in [0, 2**63 - 1] per sampling entry
    and no entry carries proposals: the list of those tokens; None for anything else, which
    the reference's ``_checked_answers`` then takes (and accepts or refuses)."""
    cdef Py_ssize_t i, num_sampling = 0
    cdef int overflow = 0
    cdef BatchEntry entry
    if type(next_tokens) is not list and type(next_tokens) is not tuple:
        return None
    for entry in entries:
        if entry.spec_token_ids:
            return None
        num_sampling += entry.start + entry.num_tokens == len(entry.seq.token_ids)
    if len(next_tokens) != num_sampling:
        return None
    for i in range(num_sampling):
        item = next_tokens[i]
        if type(item) is not int or PyLong_AsLongLongAndOverflow(item, &overflow) < 0:
            return None
    return list(next_tokens)


cdef object _step_trace(dict fields):
    """``StepTrace(**fields)`` without the generated ``__init__`` of the frozen dataclass,
    whose 15 ``object.__setattr__`` calls cost more than the rest of a step: its fields live
    in the instance ``__dict__``, so filling that in one go makes the very same object (the
    tests compare every row with the reference's)."""
    trace = object.__new__(StepTrace)
    object.__setattr__(trace, "__dict__", fields)
    return trace


cdef inline Py_ssize_t _blocks_for(Py_ssize_t num_tokens, Py_ssize_t block_size) noexcept:
    return (num_tokens + block_size - 1) // block_size


cdef inline bint _same_blocks(const Py_ssize_t *a, const Py_ssize_t *b, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        if a[i] != b[i]:
            return False
    return True


# -- Sequence ---------------------------------------------------------------------------------
cdef class Sequence:
    """One request: prompt + generated token ids, stop conditions, and its ``BlockTable``
    (see ``mie.scheduler.sequence.Sequence``; ``table`` must be a fast ``BlockTable``)."""

    def __init__(
        self, Py_ssize_t seq_id, prompt_token_ids, Py_ssize_t max_tokens, stop_token_ids,
        BlockTable table not None, bint reuse_prefix=True,
    ):
        tokens = list(prompt_token_ids)
        self._reserve(len(tokens) + 1)
        cdef Py_ssize_t i
        for i in range(len(tokens)):
            self._tokens[i] = tokens[i]
        self.seq_id = seq_id
        self.token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.table = table
        self.reuse_prefix = reuse_prefix
        self._has_cursor = True
        self._cursor = CPrefixCursor(0, ROOT, ROOT)
        self._spec = ()

    def __dealloc__(self):
        PyMem_Free(self._tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_kv_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cache_cursor(self):
        """How far this sequence's full blocks are known to the prefix cache (a
        ``PrefixCursor``), or None once a hash collision stopped the chain."""
        if not self._has_cursor:
            return None
        return PrefixCursor(self._cursor.num_blocks, self._cursor.hash, self._cursor.serial)

    @cache_cursor.setter
    def cache_cursor(self, cursor):
        self._has_cursor = cursor is not None
        if cursor is not None:
            self._cursor = CPrefixCursor(cursor.num_blocks, cursor.hash, cursor.serial)

    def append_token(self, token_id) -> None:
        """Add a generated token and apply the stop conditions (stop ids first, then length)."""
        self._append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}/{self.max_tokens}, "
            f"computed={self.num_computed}, finish_reason={self.finish_reason!r})"
        )

    cdef int _append(self, object token_id) except -1:
        cdef Py_ssize_t n = len(self.token_ids)
        self._reserve(n + 1)
        self._tokens[n] = token_id  # first: an id that does not fit changes nothing
        self.token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            self.finish_reason = FINISH_STOP
        elif n + 1 - self.num_prompt_tokens >= self.max_tokens:
            self.finish_reason = FINISH_LENGTH
        return 0

    cdef int _reserve(self, Py_ssize_t capacity) except -1:
        if capacity <= self._capacity:
            return 0
        capacity = max(capacity, 2 * self._capacity)
        cdef long long *grown = <long long *>PyMem_Realloc(
            self._tokens, capacity * sizeof(long long)
        )
        if grown == NULL:
            raise MemoryError()
        self._tokens = grown
        self._capacity = capacity
        return 0


# -- Batch ------------------------------------------------------------------------------------
@cython.freelist(128)  # one per running sequence per step: recycle the memory
cdef class BatchEntry:
    """Compute tokens ``start .. start + num_tokens - 1`` of ``seq`` and answer one next token
    (see ``mie.scheduler.batch.BatchEntry``); with ``spec_token_ids``, proposed tokens that are
    its last ones, the runner verifies them too (speculative decoding)."""

    def __init__(self, Sequence seq not None, Py_ssize_t start, Py_ssize_t num_tokens,
                 bint is_prefill, tuple spec_token_ids not None=()):
        self.seq, self.start, self.num_tokens, self.is_prefill = seq, start, num_tokens, is_prefill
        self.spec_token_ids = spec_token_ids

    @property
    def token_ids(self) -> list:
        cdef Py_ssize_t end = self.start + self.num_tokens - len(self.spec_token_ids)
        return self.seq.token_ids[self.start : end] + list(self.spec_token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens - len(self.spec_token_ids) == len(self.seq.token_ids)

    def _fields(self) -> tuple:
        return (self.seq, self.start, self.num_tokens, self.is_prefill, self.spec_token_ids)

    def __eq__(self, other):
        if type(other) is not BatchEntry:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"BatchEntry(seq={self.seq!r}, start={self.start}, num_tokens={self.num_tokens}, "
            f"is_prefill={self.is_prefill!r}, spec_token_ids={self.spec_token_ids!r})"
        )


cdef class Batch:
    """One step's work, in ``running`` order (see ``mie.scheduler.batch.Batch``)."""

    def __init__(self, Py_ssize_t step, tuple entries, tuple preempted, trace):
        self.step, self.entries, self.preempted, self.trace = step, entries, preempted, trace

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_sampling(self) -> int:
        return sum(e.samples for e in self.entries)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if e.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if not e.is_prefill)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens the entries carry for verification (speculative decoding)."""
        return sum(len(e.spec_token_ids) for e in self.entries)

    def __repr__(self) -> str:
        return (
            f"Batch(step={self.step}, entries={self.entries!r}, preempted={self.preempted!r}, "
            f"trace={self.trace!r})"
        )


# -- Scheduler --------------------------------------------------------------------------------
cdef class Scheduler:
    """Continuous batching over a fast ``BlockPool`` (see ``mie.scheduler.Scheduler``)."""

    def __init__(
        self, pool, block_size, max_num_seqs, max_num_batched_tokens, *,
        prefix_sharing=True, prefix_caching=False, enable_chunked_prefill=False,
        sliding_window=None,
    ):
        self.block_size = positive_int(block_size, "block_size")
        if sliding_window is not None:
            sliding_window = positive_int(sliding_window, "sliding_window")
        self.sliding_window = sliding_window
        self._window = 0 if sliding_window is None else sliding_window
        self.max_num_seqs = positive_int(max_num_seqs, "max_num_seqs")
        self.max_num_batched_tokens = positive_int(
            max_num_batched_tokens, "max_num_batched_tokens"
        )
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({max_num_seqs}): every running sequence decodes every step"
            )
        if prefix_caching and not prefix_sharing:
            raise ValueError("prefix_caching=True needs prefix_sharing=True")
        if not isinstance(pool, BlockPool):
            raise TypeError(f"the fast Scheduler needs a fast BlockPool (mie._fast), got {pool!r}")
        check_capacity(pool.num_blocks, self.block_size)
        self.pool = pool
        self.prefix_sharing = prefix_sharing
        self.enable_chunked_prefill = enable_chunked_prefill
        self._cache = PrefixCache(pool, block_size) if prefix_caching else None
        self.waiting = deque()
        self.running = []
        self.pending_batch = None
        PyMem_Free(self._hits)
        self._hits = <Py_ssize_t *>PyMem_Malloc(self.pool._num_blocks * sizeof(Py_ssize_t))
        if self._hits == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self._hits)

    @property
    def prefix_cache(self):
        return self._cache

    @property
    def num_steps(self) -> int:
        return self._num_steps

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- requests -------------------------------------------------------------------------
    def submit(self, prompt_token_ids, max_tokens, stop_token_ids=(), *, reuse_prefix=True
               ) -> Sequence:
        """Queue a request; raises ``RequestTooLongError`` (or ValueError) with nothing queued
        if it could never run. ``reuse_prefix=False``: compute the whole prompt, borrowing
        nothing (see the reference)."""
        if not isinstance(reuse_prefix, bool):
            raise ValueError(f"reuse_prefix must be a bool, got {reuse_prefix!r}")
        prompt = _checked_token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        # Too many max_tokens for the pool is RequestTooLongError, below.
        max_tokens = positive_int(max_tokens, "max_tokens", limit=None)
        stops = _checked_token_ids(stop_token_ids, "stop_token_ids")
        check_request_fits(self, len(prompt), max_tokens)  # the reference's checks and messages
        table = BlockTable(self.pool, self.block_size)
        seq = Sequence(self._next_seq_id, prompt, max_tokens, stops, table, reuse_prefix)
        self._next_seq_id += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id) -> bool:
        """Remove a request from wherever it is and free its blocks now. False if it already
        finished or was aborted; KeyError for an id never handed out."""
        if not is_int(seq_id):
            raise KeyError(f"seq_id must be an int, got {seq_id!r}")
        if not 0 <= seq_id < self._next_seq_id:
            raise KeyError(f"no request with seq_id {seq_id} was ever submitted")
        cdef Sequence seq
        for i in range(len(self.running)):
            seq = self.running[i]
            if seq.seq_id == seq_id:
                del self.running[i]
                self._free(seq)
                seq.finish_reason = FINISH_ABORT
                return True
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.finish_reason = FINISH_ABORT
                return True
        return False

    def clear_prefix_cache(self) -> None:
        """Forget every cached block; idle ones return to the free list."""
        if self._cache is None:
            return
        self._cache.clear()
        cdef Sequence seq
        for seq in self.running:
            seq._has_cursor = False  # its chain's entries are gone

    # -- one step -------------------------------------------------------------------------
    def step(self, proposals=None) -> Batch:
        """Decode, continue prompts, admit; return the work for the model runner.
        ``proposals``: seq_id -> tokens proposed to follow that sequence's newest token
        (speculative decoding; ignored for a sequence not decoding this step). Raises
        ``SchedulerStallError``, with nothing changed, where requests wait, nothing runs and
        none could be admitted (see the reference)."""
        if self.pending_batch is not None:
            raise RuntimeError("step() called again before commit() of the previous batch")
        cdef dict proposed = _checked_proposals(proposals)
        self._preemptions = self._recomputed = self._prefix_hits = 0
        cdef list preempted = []
        cdef Sequence seq
        self._decode(preempted, proposed)
        cdef Py_ssize_t budget = self.max_num_batched_tokens
        for seq in self.running:
            if seq._scheduled:  # a decode: its newest token and its proposals
                budget -= seq._num_new
        if self.enable_chunked_prefill:
            budget = self._continue_prompts(preempted, budget)
        self._admit(preempted, budget)
        if self.waiting and not self.running and not preempted:
            # nothing ran, so nothing was scheduled or changed, and nothing ever will be
            raise stall_error(self)
        cdef list entries = []
        cdef BatchEntry entry
        cdef Py_ssize_t prefill_tokens = 0, decode_tokens = 0, spec_tokens = 0
        for seq in self.running:
            if not seq._scheduled:
                continue
            seq._scheduled = False
            entry = BatchEntry.__new__(BatchEntry)
            entry.seq, entry.start, entry.num_tokens = seq, seq._start, seq._num_new
            entry.is_prefill = seq._is_prefill
            entry.spec_token_ids = seq._spec
            entries.append(entry)
            if seq._is_prefill:
                prefill_tokens += seq._num_new
            else:
                decode_tokens += seq._num_new
                spec_tokens += len(seq._spec)
        trace = self._trace(prefill_tokens, decode_tokens, spec_tokens)
        batch = Batch(self._num_steps, tuple(entries), tuple(preempted), trace)
        self.pending_batch = batch
        self._num_steps += 1
        return batch

    cdef int _admit(self, list preempted, Py_ssize_t budget) except -1:
        if not self.waiting or preempted:
            return 0
        cdef Py_ssize_t bs = self.block_size
        cdef Sequence seq, source
        cdef Py_ssize_t n, num_cached, num_blocks, num_new, num_hits, num_revived, available
        cdef Py_ssize_t common, released
        cdef CPrefixCursor cursor
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = len(seq.token_ids)
            # plan: what admitting it takes, before anything changes
            num_hits = num_revived = 0
            source = None
            cursor = CPrefixCursor(0, ROOT, ROOT)
            if not seq.reuse_prefix:
                num_cached = 0
                num_blocks = _blocks_for(n, bs)
            elif self._cache is not None:
                num_hits = self._cache._lookup(seq._tokens, (n - 1) // bs, self._hits, &cursor)
                num_cached = num_hits * bs
                # idle cached blocks it borrows and keeps leave the reusable reserve, like
                # fresh ones; those wholly before its window are given back at once, idle and
                # evictable again (the reference's _plan and _released_after)
                released = self._released_after(num_cached)
                num_revived = self._cache._count_evictable(
                    self._hits + released, num_hits - released
                )
                num_blocks = _blocks_for(n, bs) - num_hits + num_revived
                if num_hits == (n - 1) // bs and (n - 1) % bs:
                    # a running sequence holding these blocks may lend the partly filled one
                    # after them too (the reference's _plan)
                    source = self._longest_running_prefix(seq, &common)
                    if common > num_cached and _same_blocks(source.table._blocks, self._hits,
                                                            num_hits):
                        num_cached, num_blocks = common, _blocks_for(n, bs) - num_hits
                        num_hits = num_revived = 0  # borrowed from ``source``, not the cache
                    else:
                        source = None
            else:
                num_cached = 0
                if self.prefix_sharing:
                    source = self._longest_running_prefix(seq, &num_cached)
                num_blocks = _blocks_for(n, bs) - num_cached // bs
            num_new = n - num_cached
            if self.enable_chunked_prefill:  # as much as the budget allows, memory holds
                available = self._num_available() - num_revived
                num_new = min(num_new, budget, self._slots(available, (bs - num_cached % bs) % bs))
                if num_new < 1:
                    return 0
            elif num_new > budget or num_blocks > self._num_available():
                return 0
            self.waiting.popleft()
            # borrow, then grow
            if num_hits:
                self._borrow(seq.table, self._hits, num_hits, num_cached)
                self._cache._acquire(self._hits, num_hits)
            elif source is not None:
                self._borrow(seq.table, source.table._blocks, _blocks_for(num_cached, bs),
                             num_cached)
            seq.num_computed = num_cached
            seq._has_cursor = True
            seq._cursor = cursor
            self._release_out_of_window(seq)
            if not self._grow(seq, num_new):
                raise AssertionError("admission was planned to fit")
            self.running.append(seq)
            self._schedule(seq, num_cached, num_new, True)
            budget -= num_new
            self._prefix_hits += num_cached
            self._recomputed += max(0, min(n, seq.peak_computed) - num_cached)
        return 0

    cdef Sequence _longest_running_prefix(self, Sequence seq, Py_ssize_t *length):
        """The running sequence sharing the longest computed prefix with ``seq`` (capped at
        ``seq.num_tokens - 1``); its length goes to ``length``."""
        cdef Sequence other, best = None
        cdef Py_ssize_t k, limit, best_len = 0
        cdef Py_ssize_t cap = len(seq.token_ids) - 1
        for other in self.running:
            if other.table._num_released:  # its first blocks are gone: nothing to lend
                continue
            limit = min(cap, other.num_computed)
            k = 0
            while k < limit and seq._tokens[k] == other._tokens[k]:
                k += 1
            if k > best_len:
                best, best_len = other, k
        length[0] = best_len
        return best

    cdef int _borrow(
        self, BlockTable table, const Py_ssize_t *blocks, Py_ssize_t count, Py_ssize_t num_tokens
    ) except -1:
        """Share ``blocks`` as the (empty) table's first ``num_tokens`` tokens: what
        ``borrow_blocks`` / ``borrow_prefix`` do, on ids known to be held."""
        cdef Py_ssize_t i
        table._reserve(count)
        for i in range(count):
            table._blocks[i] = blocks[i]
            self.pool._refcounts[blocks[i]] += 1
        table._num_blocks = count
        table.num_tokens = num_tokens
        return 0

    cdef int _decode(self, list preempted, dict proposed) except -1:
        """A slot for the newest token of every decoding sequence, preempting LIFO when memory
        is out; and slots for its proposals, as many as the budget left after everyone's one
        token, its ``max_tokens`` and the memory allow, never preempting for them."""
        cdef Py_ssize_t i = 0, num_spec
        cdef Py_ssize_t spare = self.max_num_batched_tokens
        cdef Sequence seq, victim
        cdef tuple spec
        for seq in self.running:
            spare -= seq.num_computed == len(seq.token_ids) - 1
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_computed < len(seq.token_ids) - 1:  # inside its prompt: step 2's work
                i += 1
                continue
            if proposed:
                spec = proposed.get(seq.seq_id, ())
                # the tokens after the accepted ones: at most max_tokens - generated, one of
                # which is the model's own
                num_spec = min(spare, seq.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens)
                               - 1)
                spec = spec[: max(0, num_spec)]
                if spec and self._grow(seq, 1 + len(spec)):
                    self._schedule(seq, seq.num_computed, 1 + len(spec), False)
                    seq._spec = spec
                    spare -= len(spec)
                    i += 1
                    continue
            while True:
                if self._grow(seq, 1):
                    self._schedule(seq, seq.num_computed, 1, False)
                    i += 1
                    break
                victim = self.running[len(self.running) - 1]
                self._preempt(victim, preempted)
                if victim is seq:
                    break  # no victim was left: the requester itself went back
        return 0

    cdef Py_ssize_t _continue_prompts(self, list preempted, Py_ssize_t budget) except -1:
        """The next chunk of every running sequence still inside its prompt; the budget left."""
        cdef Py_ssize_t i = 0, num_new
        cdef Sequence seq, victim
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq._scheduled:  # decoding this step
                i += 1
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed, budget)
            num_new = min(num_new, max(1, self._tokens_that_fit(seq.table)))
            while True:
                if self._grow(seq, num_new):
                    self._schedule(seq, seq.num_computed, num_new, True)
                    budget -= num_new
                    i += 1
                    break
                victim = self.running[len(self.running) - 1]
                self._preempt(victim, preempted)
                if victim is seq:
                    break
        return budget

    cdef Py_ssize_t _slots(self, Py_ssize_t num_blocks, Py_ssize_t split_room) noexcept:
        """Token slots ``num_blocks`` available blocks give behind a shared last block with
        ``split_room`` free slots (splitting it takes one of them)."""
        if split_room:
            return split_room + (num_blocks - 1) * self.block_size if num_blocks > 0 else 0
        return num_blocks * self.block_size

    cdef Py_ssize_t _tokens_that_fit(self, BlockTable table) noexcept:
        """Tokens ``table`` can grow by with the blocks available now."""
        cdef Py_ssize_t room = (self.block_size - table.num_tokens % self.block_size) % self.block_size
        if room and self.pool._refcounts[table._blocks[table._num_blocks - 1]] > 1:
            return self._slots(self._num_available(), room)
        return room + self._slots(self._num_available(), 0)

    cdef void _schedule(
        self, Sequence seq, Py_ssize_t start, Py_ssize_t num_new, bint is_prefill
    ) noexcept:
        seq._scheduled = True
        seq._start, seq._num_new, seq._is_prefill = start, num_new, is_prefill
        seq._spec = ()

    cdef int _preempt(self, Sequence seq, list preempted) except -1:
        """Drop ``seq``'s blocks, keep its tokens, put it back at the front of ``waiting``."""
        self.running.pop()
        seq._scheduled = False
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        preempted.append(seq)
        self._preemptions += 1
        return 0

    # -- memory ---------------------------------------------------------------------------
    cdef Py_ssize_t _num_available(self) noexcept:
        """Blocks an allocation can get: free ones, and idle cached ones it may evict."""
        cdef Py_ssize_t cached = self._cache._evictable.size if self._cache is not None else 0
        return self.pool._num_free + cached

    cdef Py_ssize_t _blocks_to_write(self, BlockTable table, Py_ssize_t n) noexcept:
        """Blocks that appending ``n`` tokens to ``table`` and making them writable takes."""
        cdef Py_ssize_t cost = table._blocks_needed(n)
        if (
            table.num_tokens % self.block_size
            and self.pool._refcounts[table._blocks[table._num_blocks - 1]] > 1
        ):
            cost += 1  # the shared, partly filled last block is split (copy-on-write)
        return cost

    cdef bint _grow(self, Sequence seq, Py_ssize_t n) except -1:
        """Reserve slots for ``n`` more tokens, all in writable blocks; False, with nothing
        changed, if the memory isn't there (see the reference)."""
        cdef BlockTable table = seq.table
        cdef Py_ssize_t cost = self._blocks_to_write(table, n)
        if cost > self._num_available():
            return False
        if cost > self.pool._num_free:
            self._cache._evict(cost - self.pool._num_free)
        cdef Py_ssize_t start = table.num_tokens
        table._append(n)
        if self.pool._refcounts[table._blocks[start // self.block_size]] > 1:
            table.writable_block(start)
        return True

    cdef int _free(self, Sequence seq) except -1:
        """Release all of ``seq``'s blocks, last first (finish, abort, preemption); cached
        blocks only the cache holds now become evictable in that order."""
        cdef BlockTable table = seq.table
        cdef Py_ssize_t block
        while table._num_blocks > table._num_released:
            table._num_blocks -= 1
            block = table._blocks[table._num_blocks]
            self.pool._release_one(block)
            if self._cache is not None:
                self._cache._release_block(block)
        table._num_blocks = table._num_released = 0
        table.num_tokens = 0
        seq._has_cursor = True
        seq._cursor = CPrefixCursor(0, ROOT, ROOT)
        return 0

    cdef Py_ssize_t _released_after(self, Py_ssize_t num_computed) noexcept:
        """Leading blocks a sequence that has computed ``num_computed`` tokens no longer
        holds: those wholly before its window (0 without one; see the reference)."""
        if not self._window or num_computed < self._window:
            return 0
        return (num_computed - self._window + 1) // self.block_size

    cdef int _release_out_of_window(self, Sequence seq) except -1:
        """Give back ``seq``'s blocks wholly before its window (``BlockTable.release_before``
        in C); cached ones the cache alone holds now become evictable, last released first."""
        if not self._window or seq.num_computed < self._window:
            return 0
        cdef BlockTable table = seq.table
        cdef Py_ssize_t first = table._num_released, i
        cdef Py_ssize_t end = (seq.num_computed - self._window + 1) // self.block_size
        for i in range(first, end):
            self.pool._release_one(table._blocks[i])
        if self._cache is not None:
            for i in range(end - 1, first - 1, -1):
                self._cache._release_block(table._blocks[i])
        for i in range(first, end):
            table._blocks[i] = NO_BLOCK
        if end > first:
            table._num_released = end
        return 0

    # -- the runner's answer ----------------------------------------------------------------
    def commit(self, batch, next_tokens) -> list:
        """Take the runner's next token for each entry of the last ``step()``'s batch; return
        the sequences that finished (already reaped: out of ``running``, blocks released).

        For an entry with proposals the answer may be a list: the accepted proposals, then the
        model's next token; the rejected ones' slots are cut off its table (see the reference).
        Raises ValueError, with nothing changed, for another batch or a wrong token list.
        """
        if batch is not self.pending_batch:
            raise ValueError("commit() takes the batch the last step() returned, exactly once")
        cdef tuple entries = (<Batch>batch).entries
        # one token per sampling entry (the C fast path), else the reference's tuples
        cdef list tokens = _plain_answers(entries, next_tokens)
        cdef list answers = _checked_answers(batch, next_tokens) if tokens is None else None
        self.pending_batch = None
        cdef list finished = []
        cdef BatchEntry entry
        cdef Sequence seq
        cdef Py_ssize_t i, t = 0, num_computed
        cdef tuple answer
        cdef bint samples
        for i in range(len(entries)):
            entry = entries[i]
            seq = entry.seq
            samples = (entry.start + entry.num_tokens - len(entry.spec_token_ids)
                       == len(seq.token_ids))
            t += samples
            if seq.finish_reason is not None and seq.finish_reason == FINISH_ABORT:
                continue  # aborted between step() and commit()
            answer = (answers[t - 1] if answers is not None else (tokens[t - 1],)) if samples else ()
            num_computed = entry.start + entry.num_tokens
            if entry.spec_token_ids:  # KV of the newest token and the accepted proposals
                num_computed -= len(entry.spec_token_ids) - (len(answer) - 1)  # the rejected
                seq.table.truncate(num_computed)
            # tokens first: the blocks holding the accepted proposals are registered by them
            for token in answer:
                seq._append(token)
                if seq.finish_reason is not None:  # a stop among the accepted: drop the rest
                    finished.append(seq)
                    break
            seq.num_computed = min(num_computed, len(seq.token_ids))  # none past such a stop
            seq.peak_computed = max(seq.peak_computed, seq.num_computed)
            self._register_full_blocks(seq)  # before the window releases any of them
            self._release_out_of_window(seq)
        if finished:
            self.running[:] = [s for s in self.running if (<Sequence>s).finish_reason is None]
            for seq in finished:
                self._free(seq)
        return finished

    def rollback(self, batch) -> list:
        """Undo the last ``step()`` when its runner failed: every running sequence goes back
        to the front of ``waiting``, in order, to be recomputed (see the reference)."""
        if batch is not self.pending_batch:
            raise ValueError("rollback() takes the batch the last step() returned, exactly once")
        self.pending_batch = None
        cdef list requeued = list(self.running)
        cdef Sequence seq
        while self.running:
            seq = self.running.pop()
            self._free(seq)
            seq.num_computed = 0
            self.waiting.appendleft(seq)
        return requeued

    cdef int _register_full_blocks(self, Sequence seq) except -1:
        cdef Py_ssize_t num_full = seq.num_computed // self.block_size
        if self._cache is None or not seq._has_cursor or seq._cursor.num_blocks >= num_full:
            return 0
        if not self._cache._register(&seq._cursor, seq.table._blocks, seq._tokens, num_full):
            seq._has_cursor = False
        return 0

    # -- observation ----------------------------------------------------------------------
    cdef object _trace(
        self, Py_ssize_t prefill_tokens, Py_ssize_t decode_tokens, Py_ssize_t spec_tokens
    ):
        cdef Py_ssize_t cached = self._cache._evictable.size if self._cache is not None else 0
        cdef Py_ssize_t held = self.pool._num_blocks - self.pool._num_free - cached
        cdef Py_ssize_t listed = 0, kv_tokens = 0
        cdef Sequence seq
        for seq in self.running:  # released leading blocks are neither listed nor KV
            listed += seq.table._num_blocks - seq.table._num_released
            kv_tokens += seq.table.num_tokens - seq.table._num_released * self.block_size
        cdef Py_ssize_t reserved = held * self.block_size
        cdef Py_ssize_t capacity = self.pool._num_blocks * self.block_size
        return _step_trace({
            "step": self._num_steps,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_prefill_tokens": prefill_tokens,
            "num_decode_tokens": decode_tokens,
            "utilization": <double>reserved / capacity,
            "reserved_tokens": reserved,
            "capacity_tokens": capacity,
            "kv_tokens": kv_tokens,
            "internal_fragmentation": listed * self.block_size - kv_tokens,
            "sharing_saved_fraction": 1 - <double>held / listed if listed else 0.0,
            "cached_blocks": cached,
            "preemptions": self._preemptions,
            "recomputed_tokens": self._recomputed,
            "prefix_hit_tokens": self._prefix_hits,
            "spec_tokens": spec_tokens,
            "accepted_spec_tokens": 0,  # the engine's to fill in once it has verified them
        })

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant holds: the reference's own checks
        (``mie.scheduler.integrity.check_integrity``), run on this scheduler's public state."""
        check_integrity(self)
