# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython mirror of ``mie.scheduler.prefix_cache.PrefixCache``.

What mirrors what (same names)::

    here                                        reference (mie/scheduler/prefix_cache.py)
    PrefixCache: lookup, count_evictable,       PrefixCache, same methods
      acquire, release, register, evict,
      clear, check_integrity, _forget
    CPrefixCursor (a C struct)                  PrefixCursor
    block_hash (C), py_block_hash               block_hash

The reference is the specification (read it for the *why* of every rule); this mirror has
the same public API and the same observable behaviour -- the same chained hashes, serials,
entries in the same order, the same LRU order and the same refcount changes -- with the
bookkeeping in C arrays indexed by block id:

* an entry's hash, serial, parent serial and token ids live in per-block arrays;
* the registration order (``cached_blocks``, and the order ``clear`` frees blocks in) and the
  LRU order of the evictable blocks are two ``LinkedSet`` s: doubly linked lists threaded
  through per-block arrays, what the reference gets from ``dict`` and ``OrderedDict``;
* the hash of a block is CPython's own ``hash((parent_hash, tuple(token_ids)))``, computed in
  C without building the tuple (``block_hash`` below; the tests compare it with ``hash``).

Token ids are C ``long long``: the scheduler mirror keeps each sequence's ids in a C array.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from libc.string cimport memcmp, memcpy

from mie._fast.memory cimport BlockPool

from mie.scheduler.prefix_cache import ROOT, PrefixCursor

# -- CPython's hash of (parent_hash, (t0, t1, ...)) -----------------------------------------
# tupleobject.c's xxHash-based tuplehash (CPython 3.8+) and longobject.c's int hash
# (|x| mod 2**61 - 1, sign kept, -1 -> -2) for 64-bit builds.
cdef extern from *:
    """
    #define MIE_XXPRIME_1 11400714785074694791ULL
    #define MIE_XXPRIME_2 14029467366897019727ULL
    #define MIE_XXPRIME_5 2870177450012600261ULL
    #define MIE_XXROTATE(x) (((x) << 31) | ((x) >> 33))
    #define MIE_HASH_MODULUS ((1ULL << 61) - 1)
    """
    const unsigned long long MIE_XXPRIME_1
    const unsigned long long MIE_XXPRIME_2
    const unsigned long long MIE_XXPRIME_5
    unsigned long long MIE_XXROTATE(unsigned long long x) noexcept
    const unsigned long long MIE_HASH_MODULUS

# Tests only: keep just these bits of every block hash, so that different blocks collide
# (the reference's tests monkeypatch ``block_hash`` for the same purpose). -1: all bits.
cdef Py_hash_t _hash_mask = -1


def _set_hash_mask(Py_hash_t mask) -> None:
    global _hash_mask
    _hash_mask = mask


cdef inline unsigned long long _int_hash(long long value) noexcept:
    cdef unsigned long long magnitude = <unsigned long long>value
    if value < 0:
        magnitude = 0 - magnitude
    magnitude %= MIE_HASH_MODULUS
    cdef long long h = <long long>magnitude if value >= 0 else -<long long>magnitude
    return <unsigned long long>(-2 if h == -1 else h)


cdef inline unsigned long long _tuple_step(unsigned long long acc, unsigned long long lane) noexcept:
    acc += lane * MIE_XXPRIME_2
    acc = MIE_XXROTATE(acc)
    return acc * MIE_XXPRIME_1


cdef inline unsigned long long _tuple_end(unsigned long long acc, Py_ssize_t n) noexcept:
    acc += <unsigned long long>n ^ (MIE_XXPRIME_5 ^ 3527539ULL)
    return 1546275796ULL if acc == <unsigned long long>-1 else acc


cdef Py_hash_t block_hash(Py_hash_t parent_hash, const long long *token_ids, Py_ssize_t n) noexcept:
    """``hash((parent_hash, tuple(token_ids[:n])))`` (see the reference's ``block_hash``)."""
    cdef unsigned long long chunk = MIE_XXPRIME_5
    cdef Py_ssize_t i
    for i in range(n):
        chunk = _tuple_step(chunk, _int_hash(token_ids[i]))
    chunk = _tuple_end(chunk, n)
    cdef unsigned long long acc = _tuple_step(MIE_XXPRIME_5, _int_hash(parent_hash))
    acc = _tuple_end(_tuple_step(acc, chunk), 2)
    return <Py_hash_t>acc & _hash_mask


def py_block_hash(parent_hash, token_ids) -> int:
    """``block_hash`` from Python: the reference's signature, for the tests."""
    cdef long long[::1] tokens = _as_tokens(token_ids)
    return block_hash(parent_hash, &tokens[0] if tokens.shape[0] else NULL, tokens.shape[0])


cdef long long[::1] _as_tokens(token_ids):
    import numpy as np

    return np.asarray(list(token_ids), dtype=np.int64).reshape(-1)


# -- LinkedSet: an insertion-ordered set of block ids ----------------------------------------
cdef int _set_init(LinkedSet *s, Py_ssize_t capacity) except -1:
    s.prev = <Py_ssize_t *>PyMem_Malloc(capacity * sizeof(Py_ssize_t))
    s.next = <Py_ssize_t *>PyMem_Malloc(capacity * sizeof(Py_ssize_t))
    s.member = <char *>PyMem_Calloc(capacity, 1)
    if s.prev == NULL or s.next == NULL or s.member == NULL:
        raise MemoryError()
    s.head = s.tail = -1
    s.size = 0
    return 0


cdef void _set_free(LinkedSet *s) noexcept:
    PyMem_Free(s.prev)
    PyMem_Free(s.next)
    PyMem_Free(s.member)


cdef void _set_add(LinkedSet *s, Py_ssize_t x) noexcept:
    """Add ``x`` last; a member keeps its place (like assigning an existing dict key)."""
    if s.member[x]:
        return
    s.member[x] = 1
    s.prev[x] = s.tail
    s.next[x] = -1
    if s.tail >= 0:
        s.next[s.tail] = x
    else:
        s.head = x
    s.tail = x
    s.size += 1


cdef void _set_discard(LinkedSet *s, Py_ssize_t x) noexcept:
    if not s.member[x]:
        return
    s.member[x] = 0
    if s.prev[x] >= 0:
        s.next[s.prev[x]] = s.next[x]
    else:
        s.head = s.next[x]
    if s.next[x] >= 0:
        s.prev[s.next[x]] = s.prev[x]
    else:
        s.tail = s.prev[x]
    s.size -= 1


cdef tuple _set_items(LinkedSet *s):
    cdef list items = []
    cdef Py_ssize_t x = s.head
    while x >= 0:
        items.append(x)
        x = s.next[x]
    return tuple(items)


cdef class PrefixCache:
    """Index of computed full blocks by chained hash, with LRU eviction of unused ones."""

    def __cinit__(self, BlockPool pool not None, Py_ssize_t block_size):
        cdef Py_ssize_t n = pool._num_blocks
        self._pool = pool
        self._num_blocks = n
        self._block_size = block_size
        self._by_hash = {}
        self._hash = <Py_hash_t *>PyMem_Malloc(n * sizeof(Py_hash_t))
        self._serial = <long long *>PyMem_Malloc(n * sizeof(long long))
        self._parent_serial = <long long *>PyMem_Malloc(n * sizeof(long long))
        # Token storage per block, allocated when the block is first registered: memory grows
        # with the tokens really cached, like the reference's, not with the pool's capacity
        # (num_blocks x block_size, which may be far larger than any cache ever holds).
        self._tokens = <long long **>PyMem_Calloc(n, sizeof(long long *))
        if not (self._hash and self._serial and self._parent_serial and self._tokens):
            raise MemoryError()
        _set_init(&self._entries, n)
        _set_init(&self._evictable, n)
        self._next_serial = ROOT + 1

    def __dealloc__(self):
        cdef Py_ssize_t block
        PyMem_Free(self._hash)
        PyMem_Free(self._serial)
        PyMem_Free(self._parent_serial)
        if self._tokens != NULL:
            for block in range(self._num_blocks):
                PyMem_Free(self._tokens[block])
            PyMem_Free(self._tokens)
        _set_free(&self._entries)
        _set_free(&self._evictable)

    @property
    def num_cached(self) -> int:
        return self._entries.size

    @property
    def num_evictable(self) -> int:
        return self._evictable.size

    @property
    def cached_blocks(self) -> tuple:
        return _set_items(&self._entries)

    @property
    def evictable_blocks(self) -> tuple:
        """Blocks held by the cache alone, in eviction order (first = evicted next)."""
        return _set_items(&self._evictable)

    # -- the Python API (the reference's signatures) --------------------------------------
    def lookup(self, token_ids, max_blocks) -> tuple:
        """The cached blocks holding the longest prefix of ``token_ids`` (at most
        ``max_blocks`` full blocks), and the cursor after them. Changes nothing."""
        cdef long long[::1] tokens = _as_tokens(token_ids)
        cdef Py_ssize_t usable = min(max_blocks, tokens.shape[0] // self._block_size)
        cdef Py_ssize_t[::1] blocks = _ids(max(usable, 0))
        cdef CPrefixCursor cursor
        cdef Py_ssize_t found = self._lookup(
            &tokens[0] if tokens.shape[0] else NULL, usable, &blocks[0] if usable > 0 else NULL,
            &cursor,
        )
        return [blocks[i] for i in range(found)], _cursor_object(&cursor)

    def count_evictable(self, blocks) -> int:
        return sum(1 for block in blocks if self._evictable.member[self._pool._check_range(block)])

    def acquire(self, blocks) -> None:
        for block in blocks:
            _set_discard(&self._evictable, self._pool._check_range(block))

    def release(self, blocks) -> None:
        for block in blocks:
            self._release_block(self._pool._check_range(block))

    def register(self, cursor, blocks, token_ids, Py_ssize_t num_full):
        """Index a sequence's computed full blocks ``cursor.num_blocks .. num_full - 1``;
        the cursor after them, or None after a hash collision (see the reference)."""
        cdef CPrefixCursor c = CPrefixCursor(cursor.num_blocks, cursor.hash, cursor.serial)
        cdef Py_ssize_t[::1] ids = _ids(len(blocks))
        for i, block in enumerate(blocks):
            ids[i] = self._pool._check_range(block)
        cdef long long[::1] tokens = _as_tokens(token_ids)
        if num_full > ids.shape[0] or num_full * self._block_size > tokens.shape[0]:
            raise ValueError(f"{num_full} full blocks are more than the blocks or tokens given")
        if num_full <= c.num_blocks:
            return _cursor_object(&c)
        if not self._register(&c, &ids[0], &tokens[0], num_full):
            return None
        return _cursor_object(&c)

    def evict(self, Py_ssize_t n) -> None:
        """Return the ``n`` least recently used evictable blocks to the pool's free list."""
        if n > self._evictable.size:
            raise ValueError(f"cannot evict {n} blocks, only {self._evictable.size} evictable")
        self._evict(n)

    def clear(self) -> None:
        """Drop every entry. Blocks still in use stay with their tables."""
        while self._evictable.head >= 0:
            _set_discard(&self._evictable, self._evictable.head)
        while self._entries.head >= 0:
            self._forget(self._entries.head)

    def check_integrity(self) -> None:
        """Index, entries and the evictable set agree with each other and with the pool."""
        if len(self._by_hash) != self._entries.size:
            raise AssertionError("prefix cache: index and entries differ in size")
        cdef Py_ssize_t idle = 0
        for block in _set_items(&self._entries):
            if self._by_hash.get(self._hash[block]) != block:
                raise AssertionError(f"prefix cache: block {block} is not indexed by its hash")
            idle += self._pool._refcounts[block] == 1
        for block in _set_items(&self._evictable):
            if not self._entries.member[block] or self._pool._refcounts[block] != 1:
                raise AssertionError(f"prefix cache: evictable block {block} is in use")
        if idle != self._evictable.size:
            raise AssertionError("prefix cache: a block held by the cache alone is not evictable")

    def __repr__(self) -> str:
        return (
            f"PrefixCache(num_cached={self._entries.size}, "
            f"num_evictable={self._evictable.size})"
        )

    # -- C-level operations (the scheduler's; callers pass valid ids) ---------------------
    cdef Py_ssize_t _lookup(
        self, const long long *token_ids, Py_ssize_t max_blocks, Py_ssize_t *blocks, CPrefixCursor *cursor
    ) except -1:
        """Write the hit's block ids into ``blocks`` and its end into ``cursor``; return how
        many (``token_ids`` must hold ``max_blocks`` full blocks)."""
        cdef Py_ssize_t i, block, bs = self._block_size
        cdef Py_hash_t h
        cdef const long long *chunk
        cursor[0] = CPrefixCursor(0, ROOT, ROOT)
        for i in range(max_blocks):
            chunk = token_ids + i * bs
            h = block_hash(cursor.hash, chunk, bs)
            found = self._by_hash.get(h)
            if found is None:
                break
            block = found
            if (
                memcmp(self._tokens[block], chunk, bs * sizeof(long long))
                or self._parent_serial[block] != cursor.serial
            ):
                break  # a hash collision: not our prefix
            blocks[i] = block
            cursor[0] = CPrefixCursor(i + 1, h, self._serial[block])
        return cursor.num_blocks

    cdef Py_ssize_t _count_evictable(self, const Py_ssize_t *blocks, Py_ssize_t n) noexcept:
        cdef Py_ssize_t i, count = 0
        for i in range(n):
            count += self._evictable.member[blocks[i]]
        return count

    cdef void _acquire(self, const Py_ssize_t *blocks, Py_ssize_t n) noexcept:
        cdef Py_ssize_t i
        for i in range(n):
            _set_discard(&self._evictable, blocks[i])

    cdef void _release_block(self, Py_ssize_t block) noexcept:
        """A holder just let go of ``block`` (after the decref): idle now, it is evictable."""
        if self._entries.member[block] and self._pool._refcounts[block] == 1:
            _set_add(&self._evictable, block)

    cdef bint _register(
        self, CPrefixCursor *cursor, const Py_ssize_t *blocks, const long long *token_ids,
        Py_ssize_t num_full,
    ) except -1:
        """Advance ``cursor`` to ``num_full``, indexing the blocks not cached yet; False
        after a hash collision (the cursor is then meaningless)."""
        cdef Py_ssize_t i, block, bs = self._block_size
        cdef Py_hash_t h
        cdef long long serial
        cdef const long long *chunk
        for i in range(cursor.num_blocks, num_full):
            chunk = token_ids + i * bs
            h = block_hash(cursor.hash, chunk, bs)
            existing = self._by_hash.get(h)
            if existing is None:
                block = blocks[i]
                if self._tokens[block] == NULL:  # first registration of this block
                    self._tokens[block] = <long long *>PyMem_Malloc(bs * sizeof(long long))
                    if self._tokens[block] == NULL:
                        raise MemoryError()
                serial = self._next_serial
                self._next_serial += 1
                self._hash[block] = h
                self._serial[block] = serial
                self._parent_serial[block] = cursor.serial
                memcpy(self._tokens[block], chunk, bs * sizeof(long long))
                _set_add(&self._entries, block)
                self._by_hash[h] = block
                self._pool._refcounts[block] += 1
            else:
                block = existing
                if (
                    memcmp(self._tokens[block], chunk, bs * sizeof(long long))
                    or self._parent_serial[block] != cursor.serial
                ):
                    return False
                serial = self._serial[block]
            cursor[0] = CPrefixCursor(i + 1, h, serial)
        return True

    cdef int _evict(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t block
        for _ in range(n):
            block = self._evictable.head
            _set_discard(&self._evictable, block)
            self._forget(block)
        return 0

    cdef int _forget(self, Py_ssize_t block) except -1:
        """Unindex a block and drop the cache's reference: a reused block keeps no old name."""
        _set_discard(&self._entries, block)
        del self._by_hash[self._hash[block]]
        self._pool._release_one(block)
        return 0


cdef Py_ssize_t[::1] _ids(Py_ssize_t n):
    import numpy as np

    return np.empty(max(n, 1), dtype=np.intp)


cdef object _cursor_object(CPrefixCursor *c):
    return PrefixCursor(c.num_blocks, c.hash, c.serial)
