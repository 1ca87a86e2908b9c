"""RoPE scaling against transformers' own rules, read through mie's config reader.

For random rules (unscaled, linear, dynamic, llama3, yarn) and shapes, a config built by
transformers' ``LlamaConfig`` -- which normalizes the parameters the way checkpoints are
loaded -- is turned into a ``ModelConfig`` by mie, and mie's frequencies are compared with
those transformers' ``ROPE_INIT_FUNCTIONS`` computes from the same config (float32 there,
float64 here). Whole models are compared in tests/test_model_hf.py.
"""

import math

import numpy as np
import pytest
from conftest import require_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import ops
from mie.model import ModelConfig

torch = require_module("torch")
transformers = require_module("transformers")
rope_utils = require_module("transformers.modeling_rope_utils")
llama = require_module("transformers.models.llama.modeling_llama")


@st.composite
def rope_configs(draw):
    """A LlamaConfig with a random RoPE rule, through transformers' own normalization."""
    heads = draw(st.integers(1, 8))
    head_dim = 2 * draw(st.integers(2, 128))  # transformers divides by head_dim - 2 (dynamic)
    max_positions = draw(st.integers(2, 2**20))
    rope = {
        "rope_type": draw(st.sampled_from(["default", "linear", "dynamic", "llama3", "yarn"])),
        "rope_theta": draw(st.floats(2.0, 1e7)),
    }
    if rope["rope_type"] != "default":
        rope["factor"] = draw(st.floats(1.0, 64.0))
    if rope["rope_type"] == "llama3":
        rope["low_freq_factor"] = draw(st.floats(0.25, 4.0))
        rope["high_freq_factor"] = rope["low_freq_factor"] + draw(st.floats(0.25, 8.0))
    if rope["rope_type"] in ("llama3", "yarn") and draw(st.booleans()):
        # else transformers takes max_position_embeddings
        rope["original_max_position_embeddings"] = draw(st.integers(1, max_positions))
    if rope["rope_type"] == "yarn":
        optional = {
            "beta_fast": st.none() | st.just(0) | st.floats(4.0, 64.0),
            "beta_slow": st.none() | st.floats(0.25, 4.0),
            "truncate": st.booleans(),
            "attention_factor": st.none() | st.floats(0.5, 2.0),
            "mscale": st.floats(0.0, 2.0),
            "mscale_all_dim": st.floats(0.0, 2.0),
        }
        for name, values in optional.items():
            if draw(st.booleans()):
                rope[name] = draw(values)
        if rope["rope_theta"] < 1.01:  # yarn divides by ln(rope_theta)
            rope["rope_theta"] += 1.0
    config = transformers.LlamaConfig(
        vocab_size=8,
        hidden_size=heads * head_dim,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
    )
    return config


def transformers_rope(config) -> tuple[np.ndarray, float]:
    """transformers' inverse frequencies and the factor it multiplies cos and sin by."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, scale = llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, scale = rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.numpy(), scale


@settings(deadline=None, max_examples=80)
@given(config=rope_configs())
def test_rope_frequencies_equal_transformers_for_every_rule(config):
    """Within float32's rounding of transformers' side: a few units of 2**-24 of the terms
    it computes with. llama3's and yarn's blends mix the unscaled frequency with the scaled
    one, so their rounding is relative to the unscaled frequency, which can be ``factor``
    times the result (and their ramps subtract nearly equal terms)."""
    mie = ModelConfig.from_hf(config.to_dict())
    expected, expected_scale = transformers_rope(config)
    ours = ops.rope_inv_freq(mie.head_dim, mie.rope_theta, mie.rope_scaling)
    assert ours.dtype == np.float64 and ours.shape == expected.shape
    unscaled = ops.rope_inv_freq(mie.head_dim, mie.rope_theta)
    assert np.all(np.abs(ours - expected) <= 1e-5 * np.maximum(np.abs(expected), unscaled))
    scale = 1.0 if mie.rope_scaling is None else mie.rope_scaling.attention_factor
    assert scale == pytest.approx(expected_scale, rel=1e-12)
    cos, sin = ops.rope_cos_sin(np.array([0, 1]), mie.head_dim, mie.rope_theta, mie.rope_scaling)
    assert np.all(cos[0] == np.float32(scale)) and np.all(sin[0] == 0)


def test_llama3_keeps_fast_frequencies_slows_slow_ones_and_blends_between():
    """Llama 3.2's rule at its own numbers, by hand: wavelengths below 8192 / 4 = 2048
    positions unchanged, above 8192 / 1 divided by 32, between: interpolated."""
    scaling = ops.RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    plain = ops.rope_inv_freq(64, 5e5)
    scaled = ops.rope_inv_freq(64, 5e5, scaling)
    wavelength = 2 * math.pi / plain
    fast, slow = wavelength < 2048, wavelength > 8192
    assert fast.sum() >= 5 and slow.sum() >= 5 and (~fast & ~slow).sum() >= 1
    np.testing.assert_array_equal(scaled[fast], plain[fast])
    np.testing.assert_allclose(scaled[slow], plain[slow] / 32, rtol=1e-15)
    between = ~fast & ~slow
    assert np.all(scaled[between] < plain[between])
    assert np.all(scaled[between] > plain[between] / 32)


def test_dynamic_ntk_is_unscaled_up_to_max_positions_and_not_beyond():
    """Why mie runs ``dynamic`` unscaled and no further than ``max_position_embeddings``:
    transformers' own rotary module gives the unscaled angles for every position below it,
    and once a call reaches past it, new angles for *all* positions, those of keys cached
    earlier included, which a paged cache cannot follow."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0},
    )
    rotary = llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    positions = torch.arange(32)[None]
    cos, sin = rotary(x, positions)
    mie = ModelConfig.from_hf(config.to_dict())
    ours_cos, ours_sin = ops.rope_cos_sin(np.arange(32), 16, mie.rope_theta, mie.rope_scaling)
    np.testing.assert_allclose(cos[0].numpy(), ours_cos, atol=2e-6)
    np.testing.assert_allclose(sin[0].numpy(), ours_sin, atol=2e-6)

    longer_cos, _ = rotary(x, torch.arange(64)[None])  # past max_position_embeddings
    assert not np.allclose(longer_cos[0, :32].numpy(), ours_cos, atol=1e-3)
