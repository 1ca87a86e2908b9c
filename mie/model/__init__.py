"""The model: config, weights, the paged KV layout and the forward pass (Qwen2 / Llama)."""

from mie.model.config import ConfigError, ModelConfig
from mie.model.kv_cache import bytes_per_block, kv_view
from mie.model.model import Chunk, Model
from mie.model.weights import LayerWeights, ModelWeights, load_weights, random_weights

__all__ = [
    "Chunk",
    "ConfigError",
    "LayerWeights",
    "Model",
    "ModelConfig",
    "ModelWeights",
    "bytes_per_block",
    "kv_view",
    "load_weights",
    "random_weights",
]
