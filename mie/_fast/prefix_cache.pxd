# C-level interface of the prefix-cache mirror, for the scheduler mirror to cimport.

from mie._fast.memory cimport BlockPool


cdef struct CPrefixCursor:
    # mie.scheduler.prefix_cache.PrefixCursor as a C struct
    Py_ssize_t num_blocks
    Py_hash_t hash
    long long serial


cdef struct LinkedSet:
    # An insertion-ordered set of block ids with O(1) add, remove and pop-first: a doubly
    # linked list threaded through per-block arrays (what OrderedDict / dict order give the
    # reference).
    Py_ssize_t *prev
    Py_ssize_t *next
    char *member
    Py_ssize_t head
    Py_ssize_t tail
    Py_ssize_t size


cdef Py_hash_t block_hash(Py_hash_t parent_hash, const long long *token_ids, Py_ssize_t n) noexcept


cdef class PrefixCache:
    cdef BlockPool _pool
    # The pool's block count, kept here for __dealloc__: the garbage collector may have
    # cleared _pool (set it to None) by then, when the cache was freed inside a cycle.
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _block_size
    cdef dict _by_hash  # chained hash -> block id
    # One entry per cached block, indexed by block id.
    cdef Py_hash_t *_hash
    cdef long long *_serial
    cdef long long *_parent_serial
    cdef long long **_tokens  # per block: its block_size token ids, allocated on first use
    cdef LinkedSet _entries  # cached blocks, in registration order
    cdef LinkedSet _evictable  # blocks held by the cache alone, least recently used first
    cdef long long _next_serial

    cdef Py_ssize_t _lookup(
        self, const long long *token_ids, Py_ssize_t max_blocks, Py_ssize_t *blocks, CPrefixCursor *cursor
    ) except -1
    cdef Py_ssize_t _count_evictable(self, const Py_ssize_t *blocks, Py_ssize_t n) noexcept
    cdef void _acquire(self, const Py_ssize_t *blocks, Py_ssize_t n) noexcept
    cdef void _release_block(self, Py_ssize_t block) noexcept
    cdef bint _register(
        self, CPrefixCursor *cursor, const Py_ssize_t *blocks, const long long *token_ids,
        Py_ssize_t num_full,
    ) except -1
    cdef int _evict(self, Py_ssize_t n) except -1
    cdef int _forget(self, Py_ssize_t block) except -1
