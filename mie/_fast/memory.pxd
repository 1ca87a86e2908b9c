# C-level interface of the allocator mirror, for other mie/_fast modules to cimport (the
# scheduler mirror calls these without going through Python attribute lookups).

cdef enum:
    NO_BLOCK = -1  # mie.memory.INVALID_BLOCK, as a C constant


cdef class BlockPool:
    cdef readonly object arena
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _bytes_per_block
    cdef Py_ssize_t _num_free
    cdef Py_ssize_t *_refcounts
    cdef Py_ssize_t *_free  # the LIFO stack: bottom at index 0, top at _num_free - 1
    cdef unsigned char *_data  # the arena's bytes; the arena is never reallocated
    cdef object __weakref__

    cdef Py_ssize_t _allocate(self) noexcept
    cdef void _release_one(self, Py_ssize_t block) noexcept
    cdef Py_ssize_t _check_range(self, object block) except -1
    cdef Py_ssize_t _check_held(self, object block, str operation) except -1
    cdef object _view(self, Py_ssize_t block)


cdef class BlockTable:
    cdef readonly BlockPool pool
    cdef readonly Py_ssize_t block_size
    cdef readonly Py_ssize_t num_tokens
    cdef Py_ssize_t *_blocks
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _num_released  # leading entries of _blocks that are NO_BLOCK
    cdef Py_ssize_t _capacity
    cdef object __weakref__

    cdef Py_ssize_t _blocks_needed(self, Py_ssize_t n) noexcept
    cdef int _reserve(self, Py_ssize_t capacity) except -1
    cdef bint _append(self, Py_ssize_t n) except -1
