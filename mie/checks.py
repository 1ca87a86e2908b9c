"""Argument checks shared by the reference and its Cython mirrors (the lowest layer).

Both backends must accept and refuse exactly the same inputs with the same errors, so each
rule is written once, here, and called by ``mie.memory``, ``mie.scheduler``, ``mie.model`` and
their mirrors in ``mie._fast``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

MAX_TOKEN_COUNT = 2**61 - 1
"""The most tokens one pool may hold (``num_blocks * block_size``), and the bound of every
token count and size the allocator and the scheduler take.

Far beyond any real pool; it exists so that both backends accept exactly the same inputs: the
Cython mirrors keep counts in C int64s and add up to three of them (a table's tokens, new
tokens, a block size), which stays below 2**63 only if each is below 2**61."""


def check_capacity(num_blocks: int, block_size: int) -> None:
    """Raise ValueError unless a pool of ``num_blocks`` blocks of ``block_size`` tokens holds at
    most ``MAX_TOKEN_COUNT`` tokens (called by both backends' tables and schedulers)."""
    if num_blocks * block_size > MAX_TOKEN_COUNT:
        raise ValueError(
            f"block_size {block_size} x {num_blocks} blocks = {num_blocks * block_size} tokens, "
            f"more than the {MAX_TOKEN_COUNT} (2**61 - 1) a pool may hold"
        )


def check_token_count(n: object, what: str) -> int:
    """``n`` as a Python int if it is a non-negative integer (a count of tokens to append, by
    ``as_int``'s definition), else ValueError."""
    count = as_int(n)
    if count is None or count < 0:
        raise ValueError(f"{what} needs a non-negative int, got {n!r}")
    return count


MAX_TOKEN_ID = 2**63 - 1
"""The largest token id the scheduler takes: ids are stored as int64 (the Cython mirror keeps
them in C arrays; the model's NumPy arrays are int64 too)."""


def positive_int(value: object, name: str, limit: int | None = MAX_TOKEN_COUNT) -> int:
    """``value`` as a Python int if it is an integer (``as_int``) in [1, limit], else
    ValueError naming ``name``.

    Sizes and limits (block size, sequence and token budgets) are bounded so that both
    backends accept the same values: the Cython mirror keeps them in C integers. ``max_tokens``
    is not (``limit=None``): one too large for the scheduler is ``RequestTooLongError``.
    """
    number = as_int(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if limit is not None and number > limit:
        raise ValueError(f"{name} must be a positive int (at most 2**61 - 1), got {value!r}")
    return number


def token_ids(values: Iterable[int], name: str) -> list[int]:
    """``values`` as a list of plain ints, each in [0, MAX_TOKEN_ID]; else ValueError.

    An id is an integer as ``as_int`` defines it (NumPy integers included, bools not).
    """
    tokens = list(values)
    for t in tokens:
        if not is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"{name} must be non-negative ints below 2**63, got {t!r}")
    return [int(t) for t in tokens]


def as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer, else None: the one definition of "an
    integer" for request fields and engine settings.

    A Python int or a NumPy integer of any width and sign counts (``np.uint64(2**64 - 1)`` is
    ``2**64 - 1``); a bool does not (``True`` is no count or seed), nor does a float, even a
    whole one. Converting first means a caller's range checks compare Python ints, which never
    overflow, so ``np.int64(-3)`` is accepted or refused exactly as ``-3`` is.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer by ``as_int``'s definition (NumPy integers are, bools
    are not)."""
    return as_int(value) is not None


def as_float(value: object) -> float | None:
    """``value`` as a Python float if it is a real number (an int, a float, a NumPy integer or
    floating; not a bool), else None; an int too large for a float is +-inf.

    ``float(10**400)`` raises ``OverflowError``; a caller checking ``math.isfinite`` on the
    result instead refuses it with its own message, naming its field, as it refuses ``inf``.
    NaN stays NaN: every range check is false for it.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range (NumPy floats saturate to inf)
        return math.inf if value > 0 else -math.inf


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message need not echo a megabyte
    (a client's, a config file's). An integer too long is told by its number of digits: its
    first digits alone would read as a different number."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digits limit cannot even be printed
        return f"<a {type(value).__name__} too large to print>"
    if len(text) <= limit:
        return text
    if is_int(value):
        return f"an integer of {len(str(abs(int(value))))} digits"
    return text[: limit - 3] + "..."


def check_sliding_window(op: str, sliding_window: object) -> int:
    """The window as an int, 0 for full attention (None); ``ValueError`` unless None or an int
    from 1 to 2**62 (NumPy integers included, bools not). Shared by the reference attention
    and the CUDA wrappers, which stand alone."""
    if sliding_window is None:
        return 0
    if not is_int(sliding_window) or not 1 <= sliding_window <= 2**62:
        raise ValueError(
            f"{op}: sliding_window must be None or an int from 1 to 2**62, got {sliding_window!r}"
        )
    return int(sliding_window)


# -- the KV ops' arguments --------------------------------------------------------------------
# Shared by the reference ops (mie.ops, whose Cython mirror calls them through it) and the CUDA
# wrappers (mie.cuda.ops), so every backend refuses the same shapes with the same messages.
# Shapes are read from ``.shape``, so CUDA device arrays are checked too; what is *in* block
# tables and slot mappings only on host (NumPy) arrays, before a kernel would read it.


def check_gqa(num_heads: int, head_dim: int, k_cache_shape: tuple, v_cache_shape: tuple) -> int:
    """Query heads per KV head, after checking that the caches match, are 4-D (blocks,
    block_size, kv_heads, head_dim), and fit ``num_heads`` query heads of ``head_dim``."""
    k_cache_shape, v_cache_shape = tuple(k_cache_shape), tuple(v_cache_shape)
    if k_cache_shape != v_cache_shape or len(k_cache_shape) != 4:
        raise ValueError(f"k_cache {k_cache_shape} and v_cache {v_cache_shape} must match, 4-D")
    num_kv_heads = k_cache_shape[2]
    if num_heads % num_kv_heads or k_cache_shape[3] != head_dim:
        raise ValueError(
            f"{num_heads} query heads of dim {head_dim} do not fit {num_kv_heads} KV heads "
            f"of dim {k_cache_shape[3]} (num_heads must be a multiple of num_kv_heads)"
        )
    return num_heads // num_kv_heads


def check_cache_write(
    k_shape: tuple, v_shape: tuple, slots_shape: tuple, k_cache_shape: tuple, v_cache_shape: tuple
) -> None:
    """``reshape_and_cache``'s shapes: k and v (tokens, kv_heads, head_dim) alike, one slot
    per token, caches alike whose rows are (kv_heads, head_dim)."""
    k_shape, v_shape, slots_shape = tuple(k_shape), tuple(v_shape), tuple(slots_shape)
    k_cache_shape, v_cache_shape = tuple(k_cache_shape), tuple(v_cache_shape)
    if (
        k_shape != v_shape
        or len(k_shape) != 3
        or slots_shape != k_shape[:1]
        or k_cache_shape != v_cache_shape
        or k_shape[1:] != k_cache_shape[2:]
    ):
        raise ValueError(
            f"reshape_and_cache: k {k_shape}, v {v_shape} and slot_mapping {slots_shape} do not "
            f"fit caches of blocks {k_cache_shape} and {v_cache_shape}"
        )


def check_slots(slots: np.ndarray, num_blocks: int, block_size: int) -> None:
    """Every slot of a host ``slot_mapping`` lies in the cache's ``num_blocks`` blocks."""
    if slots.size and (slots.min() < 0 or slots.max() >= num_blocks * block_size):
        raise ValueError(f"reshape_and_cache: a slot lies outside the {num_blocks} blocks")


def check_paged_attention_shapes(
    q_shape: tuple,
    k_cache_shape: tuple,
    v_cache_shape: tuple,
    tables_shape: tuple,
    lens_shape: tuple,
) -> int:
    """``paged_attention``'s shapes (q (num_seqs, num_heads, head_dim), one block-table row and
    one context length per query); the GQA group."""
    q_shape, tables_shape, lens_shape = tuple(q_shape), tuple(tables_shape), tuple(lens_shape)
    if len(q_shape) != 3:
        raise ValueError(
            f"paged_attention: q must be (num_seqs, num_heads, head_dim), got {q_shape}"
        )
    num_seqs, num_heads, head_dim = q_shape
    group = check_gqa(num_heads, head_dim, k_cache_shape, v_cache_shape)
    if len(tables_shape) != 2 or tables_shape[0] != num_seqs or lens_shape != (num_seqs,):
        raise ValueError(
            f"paged_attention: {num_seqs} queries need block_tables (num_seqs, max_blocks) "
            f"and context_lens (num_seqs,), got {tables_shape} and {lens_shape}"
        )
    return group


def first_attended(position, window: int):
    """The first position a query at ``position`` attends to (``window`` 0: full attention);
    works on ints and NumPy arrays alike."""
    if not window:
        return position * 0
    return np.maximum(position - window + 1, 0)


def check_block_tables(
    tables: np.ndarray, lens: np.ndarray, block_size: int, num_blocks: int, window: int
) -> None:
    """Host block tables (num_seqs >= 1, max_blocks) and int64 context lengths of decode
    attention: each length fits its row, and every block a query reads (from the block of the
    first position in its window, ``window`` 0: all) is in the cache; blocks before a window
    may be -1 (released)."""
    if lens.min() < 1 or lens.max() > tables.shape[1] * block_size:
        raise ValueError(f"paged_attention: context_lens {lens} do not fit the block tables")
    index = np.arange(tables.shape[1])[None, :]
    first_block = first_attended(lens - 1, window)[:, None] // block_size
    read = (index < -(-lens[:, None] // block_size)) & (index >= first_block)
    if np.any((tables < 0) & read) or np.any(tables >= num_blocks):
        raise ValueError("paged_attention: a block table names a block outside the cache")
