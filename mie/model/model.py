"""The forward pass of a Qwen2 / Llama decoder over the paged KV cache.

One call serves a whole scheduler step: a mixed batch of sequences, each computing a range of
its tokens -- a prompt (or a chunk of one) being prefilled, or the single newest token being
decoded. Each entry is a ``Chunk``::

    Chunk(token_ids, start, num_tokens, block_table)

meaning "compute tokens ``token_ids[start : start + num_tokens]`` at positions ``start ..
start + num_tokens - 1``". ``block_table`` must already hold slots for all of them (its
``num_tokens >= start + num_tokens``), and the K/V of positions ``0 .. start - 1`` must already
be in its blocks (computed earlier, or borrowed from another sequence). A plain 4-tuple works
too. ``Model.forward(chunks)`` returns float32 logits ``(len(chunks), vocab)`` for the last
position of each chunk -- the next-token distribution; ``all_positions=True`` returns every
computed position instead, ``(sum of num_tokens, vocab)`` in chunk order.

How a step runs:

1. Slot mapping, once: every block the new tokens land in is fetched through
   ``BlockTable.writable_block``, which splits shared blocks (copy-on-write) before anyone
   writes; each token's slot is ``block * block_size + offset``.
2. All tokens of all chunks are stacked into one ``(tokens, hidden)`` matrix, so each
   projection is a single matrix product for the whole batch.
3. Per layer: RMSNorm -> fused QKV (+ Qwen2 bias) -> RoPE -> write K/V of the new tokens to
   their slots (one vectorized scatter) -> attention -> O -> residual -> RMSNorm -> SwiGLU
   MLP -> residual. Attention: all single-token chunks together in one ``paged_attention``
   call, each longer chunk in its own causal ``prefill_attention``.
4. Final RMSNorm and the LM head, only on the rows whose logits are wanted.

The KV-cache kernels (``reshape_and_cache``, ``paged_attention``, ``prefill_attention``) come
from a ``mie.backend.Backend``: the NumPy reference or its Cython mirror, chosen by
``mie.backend.select`` unless one is given. The rest is NumPy matrix products.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from operator import index
from typing import NamedTuple

import numpy as np

from mie import memory, ops
from mie.backend import Backend, select
from mie.checkpoint import Checkpoint
from mie.model.config import ModelConfig
from mie.model.kv_cache import kv_view
from mie.model.weights import ModelWeights, load_weights, random_weights


class Chunk(NamedTuple):
    """One sequence's share of a forward call: tokens ``start .. start + num_tokens - 1``."""

    token_ids: Sequence[int]
    start: int
    num_tokens: int
    block_table: memory.BlockTable  # or the fast backend's BlockTable


class Model:
    """A decoder-only transformer (Qwen2 or Llama) computing into a paged KV cache."""

    def __init__(
        self, config: ModelConfig, weights: ModelWeights, backend: Backend | None = None
    ) -> None:
        self.config = config
        self.weights = weights
        self.backend = backend if backend is not None else select()
        self._scale = config.head_dim**-0.5

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        backend: Backend | None = None,
        *,
        allow_non_finite_weights: bool = False,
    ) -> Model:
        """Load a Hugging Face checkpoint directory (``config.json`` + safetensors).

        A weight holding NaN or infinity is refused (``CheckpointError`` naming the tensor)
        unless ``allow_non_finite_weights``; see ``load_weights``.
        """
        config = ModelConfig.from_pretrained(directory)
        checkpoint = Checkpoint(directory)
        weights = load_weights(
            checkpoint, config, allow_non_finite_weights=allow_non_finite_weights
        )
        return cls(config, weights, backend)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, backend: Backend | None = None) -> Model:
        """A model of this shape with random weights, built in memory (no files)."""
        return cls(config, random_weights(config, seed), backend)

    # -- the forward pass -------------------------------------------------------------------
    def forward(self, chunks: Sequence[Chunk | tuple], all_positions: bool = False) -> np.ndarray:
        """Compute ``chunks`` (see the module docstring); write their K/V; return logits."""
        chunks = [Chunk(ids, index(start), index(n), table) for ids, start, n, table in chunks]
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        cfg, w, kernels = self.config, self.weights, self.backend
        table0 = chunks[0].block_table
        for chunk in chunks:
            self._check_chunk(chunk, table0)
        kv = kv_view(table0.pool, cfg, table0.block_size)

        slots = np.concatenate([_writable_slots(chunk) for chunk in chunks])
        token_ids = np.concatenate(
            [np.asarray(c.token_ids[c.start : c.start + c.num_tokens]) for c in chunks]
        )
        positions = np.concatenate([np.arange(c.start, c.start + c.num_tokens) for c in chunks])
        ends = np.cumsum([c.num_tokens for c in chunks])  # row after each chunk's last
        cos, sin = ops.rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        decode_rows = ends[decode] - 1
        decode_tables, decode_lens = _padded_block_tables([chunks[i] for i in decode])
        prefills = [
            (slice(end - c.num_tokens, end), np.asarray(c.block_table.blocks), c.start)
            for c, end in zip(chunks, ends, strict=True)
            if c.num_tokens > 1
        ]

        x = w.embed[token_ids]
        for layer_index, layer in enumerate(w.layers):
            k_cache, v_cache = kv[:, layer_index, 0], kv[:, layer_index, 1]
            h = ops.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = h @ layer.qkv
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q, k, v = np.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=1)
            q = ops.apply_rope(q.reshape(-1, cfg.num_heads, cfg.head_dim), cos, sin)
            k = ops.apply_rope(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            kernels.reshape_and_cache(k, v, k_cache, v_cache, slots)

            attn = np.empty_like(q)
            if decode:
                attn[decode_rows] = kernels.paged_attention(
                    q[decode_rows], k_cache, v_cache, decode_tables, decode_lens, self._scale
                )
            for rows, blocks, start in prefills:
                attn[rows] = kernels.prefill_attention(
                    q[rows], k_cache, v_cache, blocks, start, self._scale
                )
            x = x + attn.reshape(len(x), cfg.q_size) @ layer.o

            h = ops.rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate_up = h @ layer.gate_up
            inter = cfg.intermediate_size
            x = x + ops.swiglu(gate_up[:, :inter], gate_up[:, inter:]) @ layer.down

        wanted = x if all_positions else x[ends - 1]
        return ops.rms_norm(wanted, w.final_norm, cfg.rms_norm_eps) @ w.lm_head.T

    def _check_chunk(self, chunk: Chunk, table0: memory.BlockTable) -> None:
        """Refuse a chunk that cannot be computed, before anything is written."""
        start, n, table = chunk.start, chunk.num_tokens, chunk.block_table
        if not isinstance(table, (memory.BlockTable, self.backend.BlockTable)):
            raise TypeError(f"block_table must be a BlockTable, got {type(table).__name__}")
        if table.pool is not table0.pool or table.block_size != table0.block_size:
            raise ValueError("all chunks of a forward call must share one pool and block size")
        if start < 0 or n < 1:
            raise ValueError(f"chunk start {start} must be >= 0 and num_tokens {n} >= 1")
        if start + n > len(chunk.token_ids):
            raise ValueError(f"chunk wants tokens up to {start + n}, has {len(chunk.token_ids)}")
        if start + n > table.num_tokens:
            raise ValueError(
                f"chunk wants slots up to {start + n}, its block table holds {table.num_tokens}"
            )
        if start + n > self.config.max_position_embeddings:
            raise ValueError(
                f"position {start + n - 1} is beyond the model's "
                f"max_position_embeddings {self.config.max_position_embeddings}"
            )
        ids = np.asarray(chunk.token_ids[start : start + n])
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be ints in [0, {self.config.vocab_size})")


def _writable_slots(chunk: Chunk) -> np.ndarray:
    """Slots of the chunk's tokens, after making every block they fall in writable.

    One ``writable_block`` call per block touched (not per token): it splits a shared block
    (copy-on-write), which may change the block id, so ids are read after all the calls.
    """
    table, bs = chunk.block_table, chunk.block_table.block_size
    first, last = chunk.start, chunk.start + chunk.num_tokens - 1
    for block_index in range(first // bs, last // bs + 1):
        if table.writable_block(max(first, block_index * bs)) is None:
            raise RuntimeError(
                "no free block for copy-on-write; the scheduler must make blocks writable "
                "before the forward pass"
            )
    positions = np.arange(first, last + 1)
    blocks = np.asarray(table.blocks, dtype=np.int64)
    return blocks[positions // bs] * bs + positions % bs


def _padded_block_tables(chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray]:
    """Decode inputs for ``paged_attention``: block tables padded with -1, context lengths."""
    num_blocks = [-(-(c.start + 1) // c.block_table.block_size) for c in chunks]
    tables = np.full((len(chunks), max(num_blocks, default=0)), -1, dtype=np.int32)
    for row, (chunk, n) in enumerate(zip(chunks, num_blocks, strict=True)):
        tables[row, :n] = chunk.block_table.blocks[:n]
    lens = np.array([c.start + 1 for c in chunks], dtype=np.int32)
    return tables, lens
