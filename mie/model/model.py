"""The forward pass of a Llama / Mistral / Qwen2 / Qwen3 decoder over the paged KV cache.

One call serves a whole scheduler step: a mixed batch of sequences, each computing a range of
its tokens -- a prompt being prefilled, or the single newest token being decoded. The engine
first flattens the batch into ``ForwardInputs`` (``mie.model.inputs.prepare_inputs``: token
ids, positions, slot mapping, decode block tables, prefill segments, the rows whose logits are
wanted); ``Model.forward(inputs, kv_cache)`` then starts at the embedding and only computes:

1. All tokens of all sequences are one ``(tokens, hidden)`` matrix, so each projection is a
   single matrix product for the whole batch.
2. Per layer: RMSNorm -> fused QKV (+ Qwen2 bias) -> (Qwen3: RMSNorm of each query and key
   head) -> RoPE (scaled as the config says) -> write K/V of the new tokens to
   their slots (one vectorized scatter) -> attention -> O -> residual -> RMSNorm -> SwiGLU
   MLP -> residual. Attention: all decode rows together in one ``paged_attention`` call, each
   prefill segment in its own causal ``prefill_attention`` -- both over the last
   ``config.sliding_window`` positions only when the model has a window (Mistral), so blocks
   the scheduler released before a sequence's window (-1 in its table) are never read.
3. Final RMSNorm and the LM head, only on the rows whose logits are wanted.

``kv_cache`` is the pool's arena seen as ``(num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim)`` (``mie.model.kv_cache.kv_view``), float32, float16 or bfloat16.
Every kernel comes from ``mie.kernels`` -- the NumPy references (``mie.ops``, ``mie.linear``)
or their Cython mirrors: the matrix products (``matmul``: float32 activations times the
weights in their stored format, float32, bfloat16, float16, int8 or int4, see
``mie.model.weights``) and the three that touch the KV cache (``reshape_and_cache``,
``paged_attention``, ``prefill_attention``), and the norms, RoPE and the activation (float32).
With the compiled kernels the loop of step 2 runs in one call (``Kernels.layer_plan``,
``mie._fast.forward``): the same kernels in the same order, so the same bits, without the
~300 calls through Python a batch-1 step makes.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mie import ops
from mie.checkpoint import Checkpoint
from mie.gguf_file import GGUFFile
from mie.kernels import Kernels, select_kernels
from mie.model.config import ModelConfig, config_from_gguf
from mie.model.gguf_weights import load_gguf_weights, with_rope_factors
from mie.model.inputs import ForwardInputs
from mie.model.precision import check_quantization, resolve_dtype
from mie.model.weights import ModelWeights, load_weights, random_weights


class Model:
    """A decoder-only transformer (Llama, Mistral, Qwen2 or Qwen3) computing into a paged KV
    cache."""

    def __init__(
        self, config: ModelConfig, weights: ModelWeights, kernels: Kernels | None = None
    ) -> None:
        self.config = config
        self.weights = weights
        self.kernels = kernels if kernels is not None else select_kernels()
        self._scale = config.head_dim**-0.5
        self._layer_plan = None  # the kernels' plan of these weights (_layers_in_one_call)
        self._planned_weights = None
        # rows of ops.rope_cos_sin for positions 0.. (_rope); grown when a step goes past them
        self._rope_table = (np.empty((0, config.head_dim), np.float32),) * 2

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        kernels: Kernels | None = None,
        *,
        dtype: str = "auto",
        quantization: str | None = None,
        allow_non_finite_weights: bool = False,
        refuse_requantization: bool = False,
    ) -> Model:
        """Load a Hugging Face checkpoint directory (``config.json`` + safetensors), or a
        GGUF file (``directory`` is then the file: ``mie.model.gguf_weights``).

        ``dtype`` and ``quantization`` choose how the weight matrices are stored
        (``mie.model.precision``; ``"auto"``: as the checkpoint declares). A weight holding
        NaN or infinity is refused (``CheckpointError`` naming the tensor) unless
        ``allow_non_finite_weights``; see ``load_weights``. ``refuse_requantization``: a
        GGUF file holding a block type mie does not store is refused rather than requantized.
        """
        resolve_dtype(dtype, "float32")  # bad values fail before any file is read
        check_quantization(quantization)
        if os.path.isfile(directory):
            file = GGUFFile(directory)
            config = config_from_gguf(file.metadata, file.path)
            # llama.cpp ties the LM head to the embedding when the file has no output matrix.
            tied = "output.weight" not in file.tensors
            config = with_rope_factors(file, dataclasses.replace(config, tie_word_embeddings=tied))
            weights = load_gguf_weights(
                file,
                config,
                dtype=dtype,
                quantization=quantization,
                allow_non_finite_weights=allow_non_finite_weights,
                refuse_requantization=refuse_requantization,
            )
            return cls(config, weights, kernels)
        config = ModelConfig.from_pretrained(directory)
        weights = load_weights(
            Checkpoint(directory),
            config,
            dtype=dtype,
            quantization=quantization,
            allow_non_finite_weights=allow_non_finite_weights,
        )
        return cls(config, weights, kernels)

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        seed: int = 0,
        kernels: Kernels | None = None,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
    ) -> Model:
        """A model of this shape with random weights, built in memory (no files), stored as
        ``dtype`` / ``quantization`` (``random_weights``)."""
        weights = random_weights(config, seed, dtype=dtype, quantization=quantization)
        return cls(config, weights, kernels)

    # -- the forward pass -------------------------------------------------------------------
    def forward(self, inputs: ForwardInputs, kv_cache: np.ndarray) -> np.ndarray:
        """Compute ``inputs`` (see the module docstring), writing their K/V into ``kv_cache``;
        return float32 logits ``(len(inputs.logits_rows), vocab)``."""
        cfg, w, kernels = self.config, self.weights, self.kernels
        matmul = kernels.matmul
        self._check(inputs, kv_cache)
        cos, sin = self._rope(inputs.positions)
        q_size, kv_start = cfg.q_size, cfg.q_size + cfg.kv_size  # q | k | v in a q/k/v row
        decode_rows = inputs.decode_rows
        # a step of decodes only (most steps) reads q and writes attn whole: no gather/scatter
        rows = slice(None) if len(decode_rows) == len(inputs.token_ids) else decode_rows

        x = w.embed.rows(inputs.token_ids, kernels.gather_rows)
        # the compiled kernels may run every layer in one call (the same bits)
        layers = () if self._layers_in_one_call(x, cos, sin, inputs, kv_cache) else w.layers
        for layer_index, layer in enumerate(layers):
            k_cache, v_cache = kv_cache[:, layer_index, 0], kv_cache[:, layer_index, 1]
            h = kernels.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv.product(h, matmul)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            # views into the product (np.split costs 3 us more a layer)
            q, k, v = qkv[:, :q_size], qkv[:, q_size:kv_start], qkv[:, kv_start:]
            q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
            k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:  # Qwen3: each head's vector normalized over head_dim
                q = kernels.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = kernels.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q, k = kernels.apply_rope(q, cos, sin), kernels.apply_rope(k, cos, sin)
            kernels.reshape_and_cache(k, v, k_cache, v_cache, inputs.slot_mapping)

            attn = np.empty_like(q)
            if len(decode_rows):
                attn[rows] = kernels.paged_attention(
                    q[rows],
                    k_cache,
                    v_cache,
                    inputs.decode_block_tables,
                    inputs.decode_context_lens,
                    self._scale,
                    cfg.sliding_window,
                )
            for segment in inputs.prefills:
                attn[segment.rows] = kernels.prefill_attention(
                    q[segment.rows],
                    k_cache,
                    v_cache,
                    segment.block_ids,
                    segment.start,
                    self._scale,
                    cfg.sliding_window,
                )
            x = x + layer.o.product(attn.reshape(len(x), q_size), matmul)

            h = kernels.rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate_up = layer.gate_up.product(h, matmul)
            inter = cfg.intermediate_size
            mlp = kernels.swiglu(gate_up[:, :inter], gate_up[:, inter:])
            x = x + layer.down.product(mlp, matmul)

        wanted = kernels.rms_norm(x[inputs.logits_rows], w.final_norm, cfg.rms_norm_eps)
        return w.lm_head.product(wanted, matmul)

    def _rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``ops.rope_cos_sin(positions, ...)``, as rows of a table of every position up to
        the largest seen, computed once (vLLM's ``cos_sin_cache``): each element is computed
        on its own, so a row is the same bits whichever positions it was computed with, and
        a step looks up its rows instead of computing them (24 us of stories260K's ~250 us
        batch-1 step). The table grows to at least twice its size when a step goes past it,
        never past ``max_position_embeddings`` (which ``_check`` enforces)."""
        cos, sin = self._rope_table
        top = int(positions.max()) + 1
        if top > len(cos):
            cfg = self.config
            size = min(max(top, 2 * len(cos), 256), cfg.max_position_embeddings)
            self._rope_table = ops.rope_cos_sin(
                np.arange(size), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
            )
            cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def _layers_in_one_call(
        self,
        x: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        inputs: ForwardInputs,
        kv_cache: np.ndarray,
    ) -> bool:
        """Run every layer in one call of the compiled kernels (``Kernels.layer_plan``: the
        loop above, in C, the same kernels in the same order, so the same bits), writing the
        hidden states into ``x``: at batch 1 the loop's ~12 calls a layer through Python cost
        about 25 us a layer (mie/_fast/forward.pyx). False when it did not: no such kernels,
        or arguments the plan leaves to the loop (whose kernels then say what is wrong). The
        plan is built at the first step and rebuilt if ``weights`` is replaced."""
        if self.kernels.layer_plan is None:
            return False
        if self._planned_weights is not self.weights:
            self._layer_plan = self.kernels.layer_plan(self.weights.layers, self.config)
            self._planned_weights = self.weights
        return self._layer_plan is not None and self._layer_plan(
            x,
            cos,
            sin,
            kv_cache,
            inputs.slot_mapping,
            inputs.decode_rows,
            inputs.decode_block_tables,
            inputs.decode_context_lens,
            inputs.prefills,
            self._scale,
            self.config.sliding_window,
        )

    def _check(self, inputs: ForwardInputs, kv_cache: np.ndarray) -> None:
        """Refuse inputs this model cannot compute, before anything is written."""
        cfg = self.config
        if kv_cache.ndim != 6 or kv_cache.shape[1:3] != (cfg.num_layers, 2):
            raise ValueError(
                f"kv_cache must be (blocks, {cfg.num_layers} layers, 2, block_size, heads, "
                f"dim), got shape {kv_cache.shape}"
            )
        ids = inputs.token_ids
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must be ints in [0, {cfg.vocab_size})")
        if inputs.positions.max() >= cfg.max_position_embeddings:
            raise ValueError(
                f"position {inputs.positions.max()} is beyond the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
