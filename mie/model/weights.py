"""A model's weights in the layout the forward pass wants, from a checkpoint or at random.

Checkpoints store each linear layer PyTorch-style as ``(out, in)``; mie converts every tensor
to float32 once, at load, and stores it as ``(in, out)`` C-contiguous so each projection is a
plain ``x @ W``, which BLAS runs fastest at the small row counts of decoding. Projections
that read the same input are fused into one matrix -- q, k and v into ``qkv``, gate and up
into ``gate_up`` -- so a layer makes four matrix products, not seven.

The embedding stays ``(vocab, hidden)``: a row per token serves both the lookup and, as
``x @ embed.T``, the LM head (measured as fast as a transposed copy at Qwen2's vocabulary of
151,936), so tied embeddings cost one array, not two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mie.checkpoint import Checkpoint
from mie.model.config import ModelConfig


@dataclass
class LayerWeights:
    """One decoder layer, float32, matrices ``(in, out)``."""

    input_norm: np.ndarray  # (hidden,)
    qkv: np.ndarray  # (hidden, q_size + 2 * kv_size): q, then k, then v columns
    qkv_bias: np.ndarray | None  # (q_size + 2 * kv_size,), Qwen2 only
    o: np.ndarray  # (q_size, hidden)
    post_norm: np.ndarray  # (hidden,)
    gate_up: np.ndarray  # (hidden, 2 * intermediate): gate, then up columns
    down: np.ndarray  # (intermediate, hidden)


@dataclass
class ModelWeights:
    """All of a model's weights, float32."""

    embed: np.ndarray  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: np.ndarray  # (hidden,)
    lm_head: np.ndarray  # (vocab, hidden); the very same array as ``embed`` when tied


def load_weights(
    checkpoint: Checkpoint, config: ModelConfig, *, allow_non_finite_weights: bool = False
) -> ModelWeights:
    """Read and convert every tensor the config calls for, one tensor at a time.

    Shapes are checked against the config; a missing or misshapen tensor raises
    ``CheckpointError`` naming it. Tensors the model does not use are ignored.

    A tensor holding NaN or infinity also raises ``CheckpointError`` naming it, unless
    ``allow_non_finite_weights``: one such value poisons every output it reaches (a NaN in
    an embedding row, for instance, turns every logit of any prompt using that token into
    NaN), and a checkpoint carrying one is almost always corrupt. The check reads each tensor
    once more as it is converted, a few percent of the load time.
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    require_finite = not allow_non_finite_weights

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return checkpoint.tensor(name, shape, require_finite=require_finite)

    def linear(name: str, out_features: int, in_features: int) -> np.ndarray:
        return np.ascontiguousarray(tensor(name, (out_features, in_features)).T)

    def vector(name: str, size: int) -> np.ndarray:
        return tensor(name, (size,))

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        layers.append(
            LayerWeights(
                input_norm=vector(p + "input_layernorm.weight", hidden),
                qkv=np.hstack(
                    [
                        linear(attn + "q_proj.weight", config.q_size, hidden),
                        linear(attn + "k_proj.weight", config.kv_size, hidden),
                        linear(attn + "v_proj.weight", config.kv_size, hidden),
                    ]
                ),
                qkv_bias=np.concatenate(
                    [
                        vector(attn + "q_proj.bias", config.q_size),
                        vector(attn + "k_proj.bias", config.kv_size),
                        vector(attn + "v_proj.bias", config.kv_size),
                    ]
                )
                if config.qkv_bias
                else None,
                o=linear(attn + "o_proj.weight", hidden, config.q_size),
                post_norm=vector(p + "post_attention_layernorm.weight", hidden),
                gate_up=np.hstack(
                    [
                        linear(p + "mlp.gate_proj.weight", inter, hidden),
                        linear(p + "mlp.up_proj.weight", inter, hidden),
                    ]
                ),
                down=linear(p + "mlp.down_proj.weight", hidden, inter),
            )
        )
    embed = tensor("model.embed_tokens.weight", (config.vocab_size, hidden))
    lm_head = (
        embed
        if config.tie_word_embeddings
        else tensor("lm_head.weight", (config.vocab_size, hidden))
    )
    final_norm = vector("model.norm.weight", hidden)
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.02) -> ModelWeights:
    """Random matrices and biases of standard deviation ``scale``, unit norm weights.

    For benchmarks and tests that need a model of a given shape without any file; the same
    seed gives the same weights. Values are uniform rather than normal because NumPy draws
    uniform float32 about six times faster: a Qwen2-0.5B-shaped model (about 2 GB of
    float32) takes a couple of seconds.
    """
    rng = np.random.default_rng(seed)
    half_width = np.float32(scale * np.sqrt(3.0))  # uniform(-a, a) has std a / sqrt(3)

    def uniform(*shape: int) -> np.ndarray:
        values = rng.random(shape, dtype=np.float32)
        values -= np.float32(0.5)
        values *= 2 * half_width
        return values

    hidden, inter = config.hidden_size, config.intermediate_size
    qkv_size = config.q_size + 2 * config.kv_size
    layers = [
        LayerWeights(
            input_norm=np.ones(hidden, dtype=np.float32),
            qkv=uniform(hidden, qkv_size),
            qkv_bias=uniform(qkv_size) if config.qkv_bias else None,
            o=uniform(config.q_size, hidden),
            post_norm=np.ones(hidden, dtype=np.float32),
            gate_up=uniform(hidden, 2 * inter),
            down=uniform(inter, hidden),
        )
        for _ in range(config.num_layers)
    ]
    embed = uniform(config.vocab_size, hidden)
    lm_head = embed if config.tie_word_embeddings else uniform(config.vocab_size, hidden)
    final_norm = np.ones(hidden, dtype=np.float32)
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
