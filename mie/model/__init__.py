"""The model: config, weights, the paged KV layout and the forward pass (Qwen2 / Llama)."""

from mie.model.config import ConfigError, ModelConfig
from mie.model.inputs import ForwardInputs, PrefillSegment, prepare_inputs
from mie.model.kv_cache import bytes_per_block, kv_view
from mie.model.model import Model
from mie.model.weights import LayerWeights, Linear, ModelWeights, load_weights, random_weights

__all__ = [
    "ConfigError",
    "ForwardInputs",
    "LayerWeights",
    "Linear",
    "Model",
    "ModelConfig",
    "ModelWeights",
    "PrefillSegment",
    "bytes_per_block",
    "kv_view",
    "load_weights",
    "prepare_inputs",
    "random_weights",
]
