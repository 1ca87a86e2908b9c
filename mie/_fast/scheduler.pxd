# C-level interface of the scheduler mirror (mie/_fast/scheduler.pyx), for cimport.

from mie._fast.memory cimport BlockPool, BlockTable
from mie._fast.prefix_cache cimport CPrefixCursor, PrefixCache


cdef class Sequence:
    cdef readonly Py_ssize_t seq_id
    cdef readonly list token_ids  # prompt, then generated tokens
    cdef readonly Py_ssize_t num_prompt_tokens
    cdef readonly Py_ssize_t max_tokens
    cdef readonly frozenset stop_token_ids
    cdef readonly BlockTable table
    cdef readonly bint reuse_prefix  # False: borrows no computed KV (prompt logprobs)
    cdef public Py_ssize_t num_computed
    cdef public object finish_reason
    cdef public Py_ssize_t num_preemptions
    cdef public Py_ssize_t peak_computed
    cdef long long *_tokens  # token_ids as C integers
    cdef Py_ssize_t _capacity
    cdef bint _has_cursor  # False where the reference's cache_cursor is None
    cdef CPrefixCursor _cursor
    # This step's work while it is scheduled (the reference's ``scheduled`` dict).
    cdef bint _scheduled
    cdef Py_ssize_t _start
    cdef Py_ssize_t _num_new
    cdef bint _is_prefill
    cdef tuple _spec  # its proposed tokens (speculative decoding), () for none

    cdef int _append(self, object token_id) except -1
    cdef int _reserve(self, Py_ssize_t capacity) except -1


cdef class BatchEntry:
    cdef readonly Sequence seq
    cdef readonly Py_ssize_t start
    cdef readonly Py_ssize_t num_tokens
    cdef readonly bint is_prefill
    cdef readonly tuple spec_token_ids  # proposed tokens: the entry's last ones


cdef class Batch:
    cdef readonly Py_ssize_t step
    cdef readonly tuple entries
    cdef readonly tuple preempted  # sequences sent back to ``waiting`` by this step
    cdef readonly object trace


cdef class Scheduler:
    cdef readonly Py_ssize_t block_size
    cdef readonly Py_ssize_t max_num_seqs
    cdef readonly Py_ssize_t max_num_batched_tokens
    cdef readonly BlockPool pool
    cdef readonly bint prefix_sharing
    cdef readonly bint enable_chunked_prefill
    cdef readonly object sliding_window  # None or an int (the reference's attribute)
    cdef Py_ssize_t _window  # sliding_window, 0 for None
    cdef PrefixCache _cache  # None without prefix caching
    cdef readonly object waiting  # deque: FCFS; front = next to admit
    cdef readonly list running  # admission order; back = next preemption victim
    cdef readonly object pending_batch  # the uncommitted Batch (check_integrity reads it)
    cdef Py_ssize_t _next_seq_id
    cdef Py_ssize_t _num_steps
    cdef Py_ssize_t _preemptions, _recomputed, _prefix_hits  # this step's, for its trace
    cdef Py_ssize_t *_hits  # scratch: the block ids of a prefix-cache hit

    cdef int _admit(self, list preempted, Py_ssize_t budget) except -1
    cdef Py_ssize_t _continue_prompts(self, list preempted, Py_ssize_t budget) except -1
    cdef Py_ssize_t _slots(self, Py_ssize_t num_blocks, Py_ssize_t split_room) noexcept
    cdef Py_ssize_t _tokens_that_fit(self, BlockTable table) noexcept
    cdef Sequence _longest_running_prefix(self, Sequence seq, Py_ssize_t *length)
    cdef int _borrow(
        self, BlockTable table, const Py_ssize_t *blocks, Py_ssize_t count, Py_ssize_t num_tokens
    ) except -1
    cdef int _decode(self, list preempted, dict proposed) except -1
    cdef void _schedule(
        self, Sequence seq, Py_ssize_t start, Py_ssize_t num_new, bint is_prefill
    ) noexcept
    cdef int _preempt(self, Sequence seq, list preempted) except -1
    cdef Py_ssize_t _num_available(self) noexcept
    cdef Py_ssize_t _blocks_to_write(self, BlockTable table, Py_ssize_t n) noexcept
    cdef bint _grow(self, Sequence seq, Py_ssize_t n) except -1
    cdef int _free(self, Sequence seq) except -1
    cdef int _register_full_blocks(self, Sequence seq) except -1
    cdef Py_ssize_t _released_after(self, Py_ssize_t num_computed) noexcept
    cdef int _release_out_of_window(self, Sequence seq) except -1
    cdef object _trace(
        self, Py_ssize_t prefill_tokens, Py_ssize_t decode_tokens, Py_ssize_t spec_tokens
    )
