"""Reference compute ops in NumPy (float32): the specification every faster backend matches.

Each op is written for clarity first and vectorized second; the Cython (``mie/_fast``) and
CUDA (``cuda/``) mirrors take exactly these arguments and are tested against these results.

KV caches are the per-layer views of the block pool's arena (see ``mie.model.kv_cache``):
``k_cache`` and ``v_cache`` have shape ``(num_blocks, block_size, num_kv_heads, head_dim)`` and
are usually *strided* (every layer's K and V of one block sit together in that block), so the
ops index them by ``(block, offset)`` pairs and never reshape them.

A token's *slot* is ``block * block_size + offset``: the flat index of its K/V row if all
blocks were laid end to end. Grouped-query attention: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``.

**Cache dtypes** (``KV_CACHE_DTYPES``): a cache is ``float32``, ``float16`` or
``ml_dtypes.bfloat16``, K and V alike; anything else is refused (``TypeError`` naming the three)
before any memory is touched. Queries, new keys and values, and results are float32 whatever the
cache holds; a 16-bit cache only changes what is *stored*:

* ``reshape_and_cache`` rounds each float32 value to the cache's dtype, to nearest with ties to
  even (what NumPy's and ``ml_dtypes``' casts do; new K/V of another dtype are made float32
  first). A finite value too large for the dtype **saturates** to its largest finite value
  (float16: +-65504; bfloat16: +-3.39e38) instead of becoming infinite; infinities and NaN are
  stored as they are (NaN with NumPy's and ``ml_dtypes``' NaN bits). Why saturate rather than
  refuse: the write happens inside a model step, so refusing would fail every sequence of the
  batch over one token's outlier, and an infinite key turns every later score of its sequence
  into NaN; a clamped one only weighs that token a little wrong. (vLLM's fp8 caches saturate
  the same way.)
* ``paged_attention`` and ``prefill_attention`` widen what they read back to float32, which is
  exact, and compute exactly as for a float32 cache holding those values: the only error a
  16-bit cache adds is the rounding of the write (relative 2**-11 for float16, 2**-8 for
  bfloat16, per value).

**Sliding windows** (Mistral's ``sliding_window``): both attention ops take
``sliding_window=w`` (None: full attention). A query at position ``p`` then attends to
positions ``max(0, p - w + 1) .. p`` only -- its own and the ``w - 1`` before it, as
transformers' mask (``kv_idx > q_idx - sliding_window``) says. Blocks wholly before every
query's window are never read, so a block table may name ``INVALID_BLOCK`` (-1) there: that
is how a table whose leading blocks went back to the pool (``BlockTable.release_before``)
looks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mie.checks import (
    check_block_tables,
    check_cache_write,
    check_gqa,
    check_paged_attention_shapes,
    check_sliding_window,
    check_slots,
    first_attended,
)

KV_CACHE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
"""The dtypes a KV cache may have: float32 (exact), float16 and bfloat16 (half the memory)."""


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis (hidden)."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(eps))) * weight


ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")
"""The RoPE scaling rules mie implements (Hugging Face's ``rope_type``), besides none."""
FREQUENCY_FACTORS = "frequency_factors"
"""The rule of GGUF files that store their RoPE scaling as one factor per frequency."""


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past its training context: Hugging Face's ``rope_type``
    and the parameters it reads (the others keep their defaults and are not used).

    * ``linear``: every frequency divided by ``factor`` (positions squeezed ``factor`` times).
    * ``llama3`` (Llama 3.1 / 3.2): frequencies whose wavelength is longer than
      ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
      shorter than ``original_max_position_embeddings / high_freq_factor`` are kept, and the
      ones between are blended linearly in ``original / wavelength``.
    * ``yarn`` (Qwen2.5 / Qwen3 long context): frequencies that turn more than ``beta_fast``
      times over the original context are kept, those turning fewer than ``beta_slow`` times
      are divided by ``factor``, a linear ramp over the dimensions between; and ``cos`` and
      ``sin`` are multiplied by ``attention_factor`` (so attention scores by its square).
    * ``dynamic`` (dynamic NTK): no change. transformers raises the base by the *current*
      sequence length only once that passes ``max_position_embeddings``, and ``Model`` never
      computes a position there (see ``rope_inv_freq``).
    * ``frequency_factors`` (GGUF files): frequency ``i`` divided by ``frequency_factors[i]``,
      one factor per frequency. llama.cpp's converter stores Llama 3's rule this way, as a
      tensor (``rope_freqs.weight``) rather than as its parameters; ``factor`` is then 1.

    ``attention_factor`` is 1 for every rule but ``yarn``, whose config reader resolves
    transformers' default for it (``yarn_attention_factor``).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    frequency_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in (*ROPE_TYPES, FREQUENCY_FACTORS):
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {list(ROPE_TYPES)}")
        factors = self.frequency_factors
        if (self.rope_type == FREQUENCY_FACTORS) != bool(factors) or not all(
            type(f) is float and math.isfinite(f) and f > 0 for f in factors
        ):
            raise ValueError(
                "frequency_factors must be finite positive floats, given exactly with "
                f"rope_type {FREQUENCY_FACTORS!r}"
            )
        positive = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor")
        for name in (*positive, "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if type(value) is not float or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite positive float, got {value!r}")
        if self.factor < 1:  # transformers' rope_config_validation: "a float or int >= 1"
            raise ValueError(
                f"factor must be >= 1 (it stretches the context; below 1 it would squeeze it, "
                f"and a subnormal one makes every frequency inf), got {self.factor!r}"
            )
        with np.errstate(over="ignore", under="ignore"):  # cos and sin are float32 times it
            magnitude = np.float32(self.attention_factor)
        if not (np.isfinite(magnitude) and magnitude > 0):
            raise ValueError(
                f"attention_factor {self.attention_factor!r} is beyond float32's range"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor {self.high_freq_factor} must be greater than "
                f"low_freq_factor {self.low_freq_factor}"
            )
        original = self.original_max_position_embeddings
        if type(original) is not int or not 1 <= original < 2**31:
            raise ValueError(
                f"original_max_position_embeddings must be an int from 1 to {2**31 - 1}, "
                f"got {original!r}"
            )
        if type(self.truncate) is not bool:
            raise ValueError(f"truncate must be true or false, got {self.truncate!r}")


def yarn_attention_factor(
    factor: float, mscale: float | None = None, mscale_all_dim: float | None = None
) -> float:
    """transformers' default ``attention_factor`` for yarn: ``0.1 * ln(factor) + 1`` (1 for a
    factor up to 1), or the ratio of two such terms weighted by ``mscale`` and
    ``mscale_all_dim`` when both are given (DeepSeek's form)."""

    def get_mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """RoPE's ``head_dim / 2`` inverse frequencies (radians per position), float64.

    Unscaled, frequency ``i`` is ``theta ** (-2i / head_dim)``; ``scaling`` then changes them
    as transformers' ``ROPE_INIT_FUNCTIONS`` do (``RopeScaling`` says how). None of these
    rules depends on the sequence, so a key's angles are fixed when it is cached.

    ``dynamic`` is the exception that proves it: transformers recomputes the base from the
    longest position of each forward call once that exceeds ``max_position_embeddings``, so
    a key cached earlier would have been rotated with other angles than the ones its query
    uses later, which a paged cache cannot undo. Below ``max_position_embeddings`` the rule
    leaves the base exactly as it is (``factor * 1 - (factor - 1) = 1``), and ``Model``
    refuses positions beyond it, so here it is the unscaled table.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == FREQUENCY_FACTORS:
        return inv_freq / np.asarray(scaling.frequency_factors, dtype=np.float64)
    original = scaling.original_max_position_embeddings
    if scaling.rope_type == "llama3":  # keep the fast frequencies, slow the slow ones
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        smooth = (original / wavelength - low) / (high - low)  # 0 at the slow end, 1 at the fast
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        return np.where(
            wavelength < original / high,
            inv_freq,
            np.where(wavelength > original / low, inv_freq / scaling.factor, blended),
        )

    # yarn: the dimension at which a frequency turns `rotations` times over the original
    # context, for the fast and slow ends of the ramp (transformers' find_correction_range).
    def dimension(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def rope_cos_sin(
    positions: np.ndarray, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rotary angles for each position: ``cos`` and ``sin``, each ``(tokens, head_dim)``.

    The frequencies are ``rope_inv_freq(head_dim, theta, scaling)``; Hugging Face repeats the
    half-table twice so it lines up with ``rotate_half``. Angles are computed in float64 and
    rounded once, so long positions lose no precision. Both tables are multiplied by the
    scaling's ``attention_factor`` (yarn's; 1 otherwise).
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    magnitude = 1.0 if scaling is None else scaling.attention_factor
    cos, sin = np.cos(angles) * magnitude, np.sin(angles) * magnitude
    return cos.astype(np.float32), sin.astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` (tokens, heads, head_dim) by precomputed angles (tokens, head_dim).

    Hugging Face's rotate-half convention: dimension ``i`` pairs with ``i + head_dim / 2``.
    """
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope(
    x: np.ndarray, positions: np.ndarray, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
    """Rotary position embedding of ``x`` (tokens, heads, head_dim) at ``positions`` (tokens,)."""
    if x.ndim != 3 or len(positions) != x.shape[0]:
        raise ValueError(
            f"rope needs x (tokens, heads, head_dim) and one position per token, got x "
            f"{x.shape} and {len(positions)} positions"
        )
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling)
    return apply_rope(x, cos, sin)


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``; for very negative ``x``, ``exp(-x)`` overflows to inf and gives -0."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The gated MLP activation: ``silu(gate) * up``."""
    return silu(gate) * up


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; ``-inf`` entries get exactly zero weight."""
    shifted = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=-1, keepdims=True)


def reshape_and_cache(
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slot_mapping: np.ndarray,
) -> None:
    """Write new tokens' keys and values (tokens, kv_heads, head_dim) into their slots, in place.

    ``slot_mapping[i]`` is token ``i``'s slot. The caller must have made those blocks
    writable (``BlockTable.writable_block``): this op writes wherever it is told.
    """
    slots = check_cache_write_args(k, v, k_cache, v_cache, slot_mapping)
    blocks, offsets = np.divmod(slots, k_cache.shape[1])
    k_cache[blocks, offsets] = to_cache_dtype(k, k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(v, v_cache.dtype)


def to_cache_dtype(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` as float32, then rounded to ``dtype`` (one of ``KV_CACHE_DTYPES``), saturating.

    Round to nearest, ties to even; a finite value beyond the dtype's largest finite value
    becomes that value (with its sign), not infinity; infinities and NaN stay what they are.
    Clipping before the cast is the same as saturating after it: the values the clip changes
    all round to the largest finite value or overflow.
    """
    x = np.asarray(x, dtype=np.float32)
    if dtype == np.float32:
        return x
    largest = np.float32(ml_dtypes.finfo(dtype).max)  # exact in float32
    with np.errstate(invalid="ignore"):  # casting NaN "warns"; it stays NaN
        return np.where(np.isfinite(x), np.clip(x, -largest, largest), x).astype(dtype)


def _gather_context(cache: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Copy the rows of ``blocks`` (..., n) into a contiguous (..., n * block_size, kvh, hd),
    widened to float32 (exact for every cache dtype; no copy beyond the gather for float32)."""
    gathered = cache[blocks].astype(np.float32, copy=False)  # (..., n, block_size, kvh, hd)
    return gathered.reshape(*blocks.shape[:-1], -1, *cache.shape[2:])


def check_cache_dtype(op: str, k_cache: np.ndarray, v_cache: np.ndarray) -> np.dtype:
    """The caches' common dtype, one of ``KV_CACHE_DTYPES``; ``TypeError`` otherwise."""
    k_dtype, v_dtype = np.asarray(k_cache).dtype, np.asarray(v_cache).dtype
    if k_dtype != v_dtype or k_dtype not in KV_CACHE_DTYPES:
        raise TypeError(
            f"{op}: KV caches must both be float32, float16 or bfloat16 (ml_dtypes.bfloat16), "
            f"got k_cache {k_dtype} and v_cache {v_dtype}"
        )
    return k_dtype


# The argument checks of the KV ops, shared with their Cython mirrors (mie/_fast/ops.pyx) so
# both backends refuse the same inputs with the same messages, before touching any memory; the
# shape checks are mie.checks', which the CUDA wrappers call too.


def check_cache_write_args(k, v, k_cache, v_cache, slot_mapping) -> np.ndarray:
    """``reshape_and_cache``'s slots as int64, after checking dtypes, shapes and range."""
    check_cache_dtype("reshape_and_cache", k_cache, v_cache)
    slots = np.asarray(slot_mapping, dtype=np.int64)
    check_cache_write(k.shape, v.shape, slots.shape, k_cache.shape, v_cache.shape)
    check_slots(slots, k_cache.shape[0], k_cache.shape[1])
    return slots


def check_paged_attention_args(
    q, k_cache, v_cache, block_tables, context_lens, sliding_window=None
):
    """``paged_attention``'s (GQA group, block tables, int64 context lengths, window: 0 for
    none), checked. Blocks before a query's window may be -1 (released)."""
    check_cache_dtype("paged_attention", k_cache, v_cache)
    window = check_sliding_window("paged_attention", sliding_window)
    tables = np.asarray(block_tables)
    lens = np.asarray(context_lens, dtype=np.int64)
    group = check_paged_attention_shapes(
        q.shape, k_cache.shape, v_cache.shape, tables.shape, lens.shape
    )
    if len(lens):
        check_block_tables(tables, lens, k_cache.shape[1], k_cache.shape[0], window)
    return group, tables, lens, window


def check_prefill_attention_args(q, k_cache, v_cache, block_table, start, sliding_window=None):
    """``prefill_attention``'s (GQA group, the int64 blocks the chunk's context spans, window:
    0 for none), checked. Blocks before the first query's window may be -1 (released)."""
    check_cache_dtype("prefill_attention", k_cache, v_cache)
    window = check_sliding_window("prefill_attention", sliding_window)
    n, num_heads, head_dim = q.shape
    group = check_gqa(num_heads, head_dim, k_cache.shape, v_cache.shape)
    block_size = k_cache.shape[1]
    total = start + n
    blocks = np.asarray(block_table, dtype=np.int64)[: -(-total // block_size)]
    if start < 0 or len(blocks) * block_size < total:
        raise ValueError(
            f"prefill_attention: positions {start}..{total - 1} need more than the "
            f"{len(blocks)} blocks of {block_size} in the block table"
        )
    read = blocks[first_attended(start, window) // block_size :]
    if np.any(read < 0) or np.any(blocks >= k_cache.shape[0]):
        raise ValueError("prefill_attention: the block table names a block outside the cache")
    return group, blocks, window


def paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
    sliding_window: int | None = None,
) -> np.ndarray:
    """Decode attention: one query token per sequence over its cached context.

    ``q`` (num_seqs, num_heads, head_dim) is each sequence's newest token, whose own K/V are
    already cached. ``block_tables`` (num_seqs, max_blocks) int32 lists each sequence's
    physical blocks in logical order, padded with -1; ``context_lens`` (num_seqs,) counts the
    tokens in each sequence: its query is position ``context_lens - 1``, and with a
    ``sliding_window`` it sees only the last ``sliding_window`` of them. All sequences are
    gathered into one padded batch and the padding (and what lies before each window) is
    masked, so the whole call is a handful of vectorized NumPy ops.
    Returns (num_seqs, num_heads, head_dim).
    """
    num_seqs, num_heads, head_dim = q.shape
    group, tables, lens, window = check_paged_attention_args(
        q, k_cache, v_cache, block_tables, context_lens, sliding_window
    )
    if num_seqs == 0:
        return np.empty_like(q)
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    # Blocks before every query's window are not gathered (a long windowed generation reads
    # one window, not its whole table); padding and other released entries (-1) point at a
    # real block (NumPy's index -1), and whatever they read is masked out below.
    skipped = int(first_attended(lens - 1, window).min()) // block_size
    keys = _gather_context(k_cache, tables[:, skipped:])  # (S, T, kvh, hd)
    values = _gather_context(v_cache, tables[:, skipped:])
    queries = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = np.matmul(queries, keys.transpose(0, 2, 3, 1)) * np.float32(scale)  # (S,kvh,g,T)
    key_positions = skipped * block_size + np.arange(keys.shape[1])[None, :]
    unseen = (key_positions >= lens[:, None]) | (
        key_positions < first_attended(lens - 1, window)[:, None]
    )  # (S, T)
    scores = np.where(unseen[:, None, None, :], -np.inf, scores)
    out = np.matmul(softmax(scores), values.transpose(0, 2, 1, 3))  # (S, kvh, g, hd)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_table: Sequence[int] | np.ndarray,
    start: int,
    scale: float,
    sliding_window: int | None = None,
) -> np.ndarray:
    """Causal attention for a chunk of one sequence: positions ``start .. start + n - 1``.

    ``q`` is (n, num_heads, head_dim). The K/V of positions ``0 .. start + n - 1`` (a cached
    or borrowed prefix, then this chunk) must already be in the blocks of ``block_table``
    (the sequence's physical block ids in logical order). Query ``i`` sees keys ``0 ..
    start + i``, or with a ``sliding_window`` only ``max(0, start + i - sliding_window + 1)
    .. start + i``. Returns (n, num_heads, head_dim).
    """
    n, num_heads, head_dim = q.shape
    group, blocks, window = check_prefill_attention_args(
        q, k_cache, v_cache, block_table, start, sliding_window
    )
    num_kv_heads = k_cache.shape[2]
    total = start + n
    # From the block of the first query's first key on (the blocks before are never read).
    skipped = int(first_attended(start, window)) // k_cache.shape[1]
    first = skipped * k_cache.shape[1]
    keys = _gather_context(k_cache, blocks[skipped:])[: total - first]  # (T, kvh, hd)
    values = _gather_context(v_cache, blocks[skipped:])[: total - first]
    queries = q.reshape(n, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # (kvh,g,n,hd)
    scores = np.matmul(queries, keys.transpose(1, 2, 0)[:, None]) * np.float32(scale)
    query_positions = (start + np.arange(n))[:, None]
    key_positions = np.arange(first, total)[None, :]
    unseen = (key_positions > query_positions) | (
        key_positions < first_attended(query_positions, window)
    )  # (n, T)
    scores = np.where(unseen, -np.inf, scores)
    out = np.matmul(softmax(scores), values.transpose(1, 0, 2)[:, None])  # (kvh, g, n, hd)
    return out.transpose(2, 0, 1, 3).reshape(n, num_heads, head_dim)
