"""ModelConfig: what it reads from config.json, and what it refuses to run."""

import collections
import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mie.checkpoint import CheckpointError
from mie.model import ConfigError, ModelConfig
from mie.ops import RopeScaling

transformers = require_module("transformers")
LlamaConfig, Qwen2Config = transformers.LlamaConfig, transformers.Qwen2Config

# The trained tiny Llama the repository ships.
STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"

# The config.json of Qwen2-0.5B as transformers 4.x wrote it: rope_theta at the top level,
# a sliding_window that use_sliding_window switches off.
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


# The config.json files of the other families' small models, as published (transformers 4).
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 32768,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "vocab_size": 49152,
}


def test_reads_qwen2_0_5b_config():
    config = ModelConfig.from_hf(QWEN2_05B)
    assert config == ModelConfig(
        architecture="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        eos_token_ids=(151643,),
        dtype="bfloat16",  # its torch_dtype: what dtype="auto" loads
    )
    assert config.qkv_bias and config.q_size == 896 and config.kv_size == 128


def test_reads_stories260k_with_generation_config_stop_tokens():
    config = ModelConfig.from_pretrained(STORIES)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "llama",
        5,
        8,
        4,
    )
    assert config.head_dim == 8 and config.tie_word_embeddings and not config.qkv_bias
    assert config.eos_token_ids == (1, 2)  # generation_config.json, not config.json's 2


def test_reads_the_other_families_published_configs():
    """Qwen3-0.6B, Llama-3.2-1B, Mistral-7B-v0.3 and SmolLM2-135M, field by field."""
    qwen3 = ModelConfig.from_hf(QWEN3_06B)
    assert (qwen3.architecture, qwen3.hidden_size, qwen3.num_heads, qwen3.head_dim) == (
        "qwen3",
        1024,
        16,
        128,  # head_dim is not 1024 / 16
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.q_size == 2048
    assert qwen3.rope_scaling is None and qwen3.rope_theta == 1e6
    assert qwen3.tie_word_embeddings and qwen3.eos_token_ids == (151645,)

    llama = ModelConfig.from_hf(LLAMA32_1B)
    assert llama.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert llama.rope_theta == 5e5 and llama.max_position_embeddings == 131072
    assert not llama.qk_norm and not llama.qkv_bias

    mistral = ModelConfig.from_hf(MISTRAL_7B_V03)
    assert (mistral.architecture, mistral.head_dim, mistral.num_kv_heads) == ("mistral", 128, 8)
    assert not mistral.qk_norm and not mistral.qkv_bias and mistral.rope_scaling is None

    smol = ModelConfig.from_hf(SMOLLM2_135M)
    assert (smol.architecture, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (
        "llama",
        9,
        3,
        64,
    )
    assert smol.tie_word_embeddings and smol.rope_theta == 1e5 and smol.rope_scaling is None


@pytest.mark.parametrize(
    ("window", "max_positions"), [(None, 32768), (32768, 32768), (131072, 32768), (8, 8)]
)
def test_mistral_without_a_window_below_its_context_is_full_attention(window, max_positions):
    hf = {**MISTRAL_7B_V03, "sliding_window": window, "max_position_embeddings": max_positions}
    assert ModelConfig.from_hf(hf).architecture == "mistral"


@pytest.mark.parametrize(
    ("window", "max_positions"), [(4096, 32768), (32767, 32768), (1, 32768), (7, 8)]
)
def test_mistral_window_below_its_context_is_read(window, max_positions):
    """Mistral-7B-v0.1's 4096 and any other window shorter than the context is sliding-window
    attention; full attention (above) is None, so the engine never pays for a window."""
    hf = {**MISTRAL_7B_V03, "sliding_window": window, "max_position_embeddings": max_positions}
    assert ModelConfig.from_hf(hf).sliding_window == window


@pytest.mark.parametrize("window", [None, 32768, 131072])
def test_mistral_window_covering_the_context_is_none(window):
    assert ModelConfig.from_hf({**MISTRAL_7B_V03, "sliding_window": window}).sliding_window is None


@pytest.mark.parametrize("window", [0, -4096, 4096.0, True, "4096", 2**31])
def test_mistral_bad_sliding_window_is_refused_naming_it(window):
    with pytest.raises(ConfigError, match="sliding_window must be null or an int"):
        ModelConfig.from_hf({**MISTRAL_7B_V03, "sliding_window": window})


def test_a_model_config_window_is_mistral_only():
    mistral = ModelConfig.from_hf(MISTRAL_7B_V03)
    assert dataclasses.replace(mistral, sliding_window=5).sliding_window == 5
    with pytest.raises(ConfigError, match="sliding_window must be None or an int"):
        dataclasses.replace(mistral, sliding_window=0)
    llama = ModelConfig.from_hf(LLAMA32_1B)
    with pytest.raises(ConfigError, match="only Mistral has a sliding window"):
        dataclasses.replace(llama, sliding_window=5)


def test_sliding_window_is_read_only_for_mistral():
    """Llama has no window; Qwen2 and Qwen3 switch theirs on with use_sliding_window."""
    llama = {**LLAMA32_1B, "sliding_window": 4}
    assert ModelConfig.from_hf(llama).sliding_window is None
    assert ModelConfig.from_hf({**QWEN3_06B, "sliding_window": 4}).sliding_window is None
    with pytest.raises(ConfigError, match="use_sliding_window: Qwen's sliding windows on some"):
        ModelConfig.from_hf({**QWEN3_06B, "sliding_window": 4, "use_sliding_window": True})


LLAMA3_RULE = LLAMA32_1B["rope_scaling"]
# What Qwen2.5 and Qwen3 tell users to add to config.json for contexts past 32,768.
QWEN25_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
YARN_4 = 0.1 * math.log(4.0) + 1  # transformers' default attention factor for factor 4


@pytest.mark.parametrize(
    ("rope", "expected"),
    [
        ({"rope_scaling": LLAMA3_RULE}, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
        # transformers 5's spelling, rope_theta inside
        (
            {"rope_scaling": None, "rope_parameters": {**LLAMA3_RULE, "rope_theta": 5e5}},
            RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
        ),
        # the original context defaults to max_position_embeddings, as in transformers
        (
            {
                "rope_scaling": {
                    k: v for k, v in LLAMA3_RULE.items() if k != "original_max_position_embeddings"
                }
            },
            RopeScaling("llama3", 32.0, 1.0, 4.0, 131072),
        ),
        # the older "type" key, ints where floats are usual
        ({"rope_scaling": {"type": "linear", "factor": 2}}, RopeScaling("linear", 2.0)),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, RopeScaling("dynamic", 4.0)),
        # "rope_type" wins over "type"; partial_rotary_factor 1 is no change
        (
            {
                "rope_scaling": {
                    "type": "dynamic",
                    "rope_type": "linear",
                    "factor": 3.0,
                    "partial_rotary_factor": 1.0,
                }
            },
            RopeScaling("linear", 3.0),
        ),
        ({"rope_scaling": None, "rope_parameters": {"rope_type": "default"}}, None),
        ({"rope_scaling": {}, "rope_parameters": None}, None),
        ({"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}}, None),
        (
            {"rope_scaling": QWEN25_YARN},
            RopeScaling(
                "yarn", 4.0, original_max_position_embeddings=32768, attention_factor=YARN_4
            ),
        ),
        # yarn's defaults as transformers takes them: factor from the two contexts, betas for
        # 0 or null, attention_factor from factor, or from mscale and mscale_all_dim
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": None,
                    "beta_fast": 0,
                    "beta_slow": None,
                    "original_max_position_embeddings": 32768,
                }
            },
            RopeScaling(
                "yarn", 4.0, original_max_position_embeddings=32768, attention_factor=YARN_4
            ),
        ),
        (
            {
                "rope_scaling": {
                    **QWEN25_YARN,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.5,
                    "truncate": False,
                    "beta_fast": 16.0,
                    "beta_slow": 2,
                }
            },
            RopeScaling(
                "yarn",
                4.0,
                original_max_position_embeddings=32768,
                beta_fast=16.0,
                beta_slow=2.0,
                truncate=False,
                attention_factor=YARN_4 / (0.05 * math.log(4.0) + 1),
            ),
        ),
        (
            {"rope_scaling": {**QWEN25_YARN, "attention_factor": 1.5, "mscale": 9.0}},
            RopeScaling("yarn", 4.0, original_max_position_embeddings=32768, attention_factor=1.5),
        ),
    ],
)
def test_rope_scaling_is_read_from_both_spellings(rope, expected):
    config = ModelConfig.from_hf({**LLAMA32_1B, **rope})
    assert config.rope_scaling == expected and config.rope_theta == 5e5


def test_a_non_empty_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    """transformers 5 replaces ``rope_parameters`` by a non-empty ``rope_scaling`` whole:
    even its ``rope_theta`` then comes from the top level (or 10000)."""
    hf = {
        **SMOLLM2_135M,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 7.0},
    }
    config = ModelConfig.from_hf(hf)
    assert config.rope_scaling == RopeScaling("linear", 2.0) and config.rope_theta == 1e5
    transformers_config = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert transformers_config.rope_parameters["rope_type"] == "linear"
    assert transformers_config.rope_parameters["rope_theta"] == 1e5


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"rope_type": "su", "factor": 4.0, "original_max_position_embeddings": 32768},
            "rope_scaling: rope_type 'su' is not supported (not implemented; mie implements "
            "default, linear, dynamic, llama3, yarn)",
        ),
        (
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            "rope_type 'longrope' is not supported (it switches every frequency",
        ),
        (
            {"type": ["linear"], "factor": 2.0},
            "rope_scaling: rope_type ['linear'] is not supported (not a name",
        ),
        ({"rope_type": "linear"}, "rope_scaling: rope_type 'linear' needs 'factor'"),
        ({**LLAMA3_RULE, "high_freq_factor": None}, "high_freq_factor must be a finite"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
            "rope_type 'llama3' needs 'high_freq_factor'",
        ),
        ({"rope_type": "linear", "factor": 0}, "factor must be a finite positive float"),
        ({"rope_type": "linear", "factor": -2.0}, "factor must be a finite positive float"),
        ({"rope_type": "linear", "factor": math.inf}, "factor must be a finite positive float"),
        ({"rope_type": "linear", "factor": math.nan}, "factor must be a finite positive float"),
        ({"rope_type": "linear", "factor": "2"}, "factor must be a finite positive float"),
        ({"rope_type": "linear", "factor": True}, "factor must be a finite positive float"),
        ({"rope_type": "dynamic", "factor": 10**400}, "factor must be a finite positive float"),
        (
            {**LLAMA3_RULE, "low_freq_factor": 4.0},
            "high_freq_factor 4.0 must be greater than low_freq_factor 4.0",
        ),
        ({**LLAMA3_RULE, "low_freq_factor": 0.0}, "low_freq_factor must be a finite positive"),
        ({**LLAMA3_RULE, "original_max_position_embeddings": 0}, "original_max_position_emb"),
        ({**LLAMA3_RULE, "original_max_position_embeddings": 8192.0}, "original_max_position"),
        ({**LLAMA3_RULE, "original_max_position_embeddings": None}, "original_max_position_"),
        (
            {**LLAMA3_RULE, "attention_factor": 0.5},
            "rope_scaling: attention_factor 0.5 is not implemented for rope_type 'llama3'",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
            "partial_rotary_factor 0.5 is not implemented",
        ),
        (
            {"rope_type": "default", "factor": 2.0},
            "factor 2.0 is not implemented for rope_type 'default' (mie reads no parameters)",
        ),
        (
            {**QWEN25_YARN, "low_freq_factor": 1.0},
            "low_freq_factor 1.0 is not implemented for rope_type 'yarn'",
        ),
        (
            {**QWEN25_YARN, "factor": None, "original_max_position_embeddings": 0},
            "factor must be a finite positive float, got None",
        ),
        ({**QWEN25_YARN, "attention_factor": 0.0}, "attention_factor must be a finite positive"),
        ({**QWEN25_YARN, "attention_factor": "1"}, "attention_factor must be a finite positive"),
        ({**QWEN25_YARN, "beta_fast": -32}, "beta_fast must be a finite positive float"),
        ({**QWEN25_YARN, "beta_slow": math.inf}, "beta_slow must be a finite positive float"),
        ({**QWEN25_YARN, "truncate": "yes"}, "truncate must be true or false, got 'yes'"),
        ({**QWEN25_YARN, "mscale": "x", "mscale_all_dim": 1.0}, "mscale must be a finite"),
        (
            {**QWEN25_YARN, "mscale": 1.0, "mscale_all_dim": -1 / (0.1 * math.log(4.0))},
            "rope_scaling: mscale_all_dim -7.2134752044448",
        ),
        (
            {**QWEN25_YARN, "mscale": 1e308, "mscale_all_dim": 1.0},
            "attention_factor 1.21751143713058",
        ),
    ],
)
def test_rope_scaling_it_cannot_compute_is_refused_naming_the_key(rope, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**LLAMA32_1B, "rope_scaling": rope})
    with pytest.raises(
        ConfigError, match=re.escape(message.replace("rope_scaling", "rope_parameters"))
    ):
        ModelConfig.from_hf({**LLAMA32_1B, "rope_scaling": None, "rope_parameters": rope})


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config])
def test_reads_configs_written_by_transformers(tmp_path, config_class):
    hf = config_class(
        vocab_size=99,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=32,
        rope_theta=5e5,
        rms_norm_eps=3e-5,
    )
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        48,
        6,
        3,
        32,
    )
    assert config.rope_theta == 5e5 and config.rms_norm_eps == 3e-5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, "mie runs only"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling: rope_type 'su' is not"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_parameters"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "rope_param"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention"] * 23 + ["sliding_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"hidden_size": 0}, "hidden_size must be an int from 1"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers must be an int from 1"),
        ({"head_dim": 63}, "head_dim must be even"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
        ({"eos_token_id": 151936}, "outside the vocabulary"),
        ({"vocab_size": None}, "vocab_size must be an int from 1"),
    ],
)
def test_refuses_unsupported_or_malformed_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**QWEN2_05B, **change})


def test_refuses_a_missing_field_naming_it():
    config = dict(QWEN2_05B)
    del config["intermediate_size"]
    with pytest.raises(ConfigError, match="missing 'intermediate_size'"):
        ModelConfig.from_hf(config)


def test_from_pretrained_names_the_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**QWEN2_05B, "hidden_act": "relu"}))
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'config.json'}: hidden_act")):
        ModelConfig.from_pretrained(tmp_path)


# -- values the math cannot use: non-finite, degenerate, out of range --------------------------

BAD_VALUES = [
    # (config.json text of the value, key, what the message says)
    ("Infinity", "rms_norm_eps", "rms_norm_eps must be a finite number"),  # json reads it
    ("-Infinity", "rms_norm_eps", "rms_norm_eps must be a finite number"),
    ("NaN", "rms_norm_eps", "rms_norm_eps must be a finite number"),
    ("0", "rms_norm_eps", "rms_norm_eps must be a finite number"),
    ("-1e-06", "rms_norm_eps", "rms_norm_eps must be a finite number"),
    ("1e-50", "rms_norm_eps", "float32 does not round to 0"),  # 0 once added in float32
    ("3e38", "rms_norm_eps", "rms_norm_eps must be a finite number in (0, 1.0]"),
    ("1" + "0" * 400, "rms_norm_eps", "rms_norm_eps"),  # an int too large for a float
    ('"1e-6"', "rms_norm_eps", "rms_norm_eps"),
    ("true", "rms_norm_eps", "rms_norm_eps"),
    ("null", "rms_norm_eps", "rms_norm_eps"),
    ("Infinity", "rope_theta", "rope_theta must be a finite positive number"),
    ("NaN", "rope_theta", "rope_theta must be a finite positive number"),
    ("0", "rope_theta", "rope_theta must be a finite positive number"),
    ("-10000.0", "rope_theta", "rope_theta must be a finite positive number"),
    ("5e-324", "rope_theta", "rope_theta"),  # 1 / theta, the highest frequency, overflows
    ("[10000]", "rope_theta", "rope_theta"),
    ("0", "head_dim", "head_dim must be an int from 1"),  # refused, not recomputed
    ("-64", "head_dim", "head_dim must be an int from 1"),
    ("64.0", "head_dim", "head_dim must be an int from 1"),
    ("true", "head_dim", "head_dim must be an int from 1"),
    ('"64"', "head_dim", "head_dim must be an int from 1"),
    ("0", "vocab_size", "vocab_size must be an int from 1"),
    ("-5", "intermediate_size", "intermediate_size must be an int from 1"),
    ("1" + "0" * 30, "hidden_size", "hidden_size must be an int from 1"),  # overflows int64
    ("2147483648", "vocab_size", "vocab_size must be an int from 1 to 2147483647"),
    ("4.5", "num_attention_heads", "num_attention_heads must be an int from 1"),
    ("0", "num_key_value_heads", "num_key_value_heads must be an int from 1"),
    ("4", "num_key_value_heads", "num_attention_heads 14 is not a multiple of num_key_value_h"),
    ("28", "num_key_value_heads", "num_attention_heads 14 is not a multiple of num_key_value_h"),
    ("false", "num_hidden_layers", "num_hidden_layers must be an int from 1"),
    ("0", "max_position_embeddings", "max_position_embeddings must be an int from 1"),
    ("NaN", "max_position_embeddings", "max_position_embeddings must be an int from 1"),
    ('"false"', "tie_word_embeddings", "tie_word_embeddings must be true or false"),
    ("1", "tie_word_embeddings", "tie_word_embeddings must be true or false"),
    ("-1", "eos_token_id", "eos_token_id -1 is not a token id"),
    ("1.0", "eos_token_id", "eos_token_id 1.0 is not a token id"),
    ("[[2]]", "eos_token_id", "is not a token id"),
    ('["qwen2"]', "model_type", "model_type ['qwen2'] is not supported"),  # unhashable
    ('"llama"', "model_type", "for model_type 'llama' mie runs only LlamaForCausalLM"),
    ("5", "layer_types", "layer_types 5"),
    ('{"rope_theta": 1e4, "rope_type": "linear"}', "rope_parameters", "rope_parameters"),
    ("[1]", "rope_parameters", "rope_parameters"),
]


@pytest.mark.parametrize(
    ("text", "key", "message"), BAD_VALUES, ids=[f"{k}={t[:12]}" for t, k, _ in BAD_VALUES]
)
def test_unusable_values_in_config_json_are_config_errors_naming_file_and_key(
    tmp_path, text, key, message
):
    """Written as JSON text, so ``Infinity`` and ``NaN`` arrive the way a file carries them."""
    body = json.dumps({k: v for k, v in QWEN2_05B.items() if k != key})
    (tmp_path / "config.json").write_text(body[:-1] + f', "{key}": {text}}}')
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_pretrained(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: ")
    assert message in str(info.value) and key in str(info.value)


def test_rope_theta_inside_rope_parameters_is_checked_and_named_there():
    hf = {**QWEN2_05B, "rope_parameters": {"rope_type": "default", "rope_theta": math.inf}}
    with pytest.raises(ConfigError, match=r"rope_parameters\.rope_theta must be a finite"):
        ModelConfig.from_hf(hf)
    hf["rope_parameters"]["rope_theta"] = 5e5
    assert ModelConfig.from_hf(hf).rope_theta == 5e5


def test_head_dim_is_computed_only_when_absent_or_null():
    without = {k: v for k, v in QWEN2_05B.items() if k != "head_dim"}
    assert ModelConfig.from_hf(without).head_dim == 896 // 14
    assert ModelConfig.from_hf({**QWEN2_05B, "head_dim": None}).head_dim == 64
    assert ModelConfig.from_hf({**QWEN2_05B, "head_dim": 128}).head_dim == 128
    # Computed from sizes that leave nothing per head: the message says where 0 came from.
    with pytest.raises(ConfigError, match=r"head_dim \(hidden_size // num_attention_heads\)"):
        ModelConfig.from_hf({**QWEN2_05B, "hidden_size": 13})
    with pytest.raises(
        ConfigError, match=r"head_dim \(hidden_size // num_attention_heads\) must be even"
    ):
        ModelConfig.from_hf({**QWEN2_05B, "hidden_size": 14 * 63})


def test_null_num_key_value_heads_means_one_per_head_as_in_transformers():
    config = ModelConfig.from_hf({**QWEN2_05B, "num_key_value_heads": None})
    assert config.num_kv_heads == config.num_heads == 14


def test_eos_outside_vocabulary_in_generation_config_names_that_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_05B))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [151643, 999999]}')
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'generation_config.json'}: eos")):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "2"}')
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id '2'"):
        ModelConfig.from_pretrained(tmp_path)
    # generation_config.json's ids replace config.json's, which are then not even read.
    (tmp_path / "config.json").write_text(json.dumps({**QWEN2_05B, "eos_token_id": -1}))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 8]}')
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (7, 8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "not a JSON object"),
        ('"qwen2"', "not a JSON object"),
        ('{"vocab_size": 1' + "0" * 5000 + "}", "not valid JSON"),  # past the digits limit
        ('{"vocab_size": 5, "vocab_size": 6}', "repeats the key 'vocab_size'"),
        ("[" * 100_000, "not valid JSON"),  # nesting past the recursion limit
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_config_json_that_is_not_a_json_object_is_a_checkpoint_error(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: {message}")):
        ModelConfig.from_pretrained(tmp_path)


def test_direct_construction_is_checked_too():
    good = ModelConfig.from_hf(QWEN2_05B)
    for field, value in [
        ("rms_norm_eps", math.inf),
        ("rope_theta", math.nan),
        ("head_dim", 0),
        ("vocab_size", 10**5000),  # too large even to print
        ("architecture", ["llama"]),
        ("eos_token_ids", (True,)),
    ]:
        with pytest.raises(ConfigError, match=field):
            dataclasses.replace(good, **{field: value})


# -- generated edits ---------------------------------------------------------------------------

READ_KEYS = [
    "model_type",
    "architectures",
    "hidden_act",
    "rope_scaling",
    "rope_parameters",
    "use_sliding_window",
    "layer_types",
    "attention_bias",
    "mlp_bias",
    "pretraining_tp",
    "num_attention_heads",
    "hidden_size",
    "head_dim",
    "num_key_value_heads",
    "eos_token_id",
    "rope_theta",
    "vocab_size",
    "intermediate_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rope_parameters.rope_theta",
    "sliding_window",
    "rope_scaling.rope_type",
    "rope_scaling.type",
    "rope_scaling.factor",
    "rope_scaling.low_freq_factor",
    "rope_scaling.high_freq_factor",
    "rope_scaling.original_max_position_embeddings",
    "rope_scaling.rope_theta",
    "rope_parameters.rope_type",
    "rope_parameters.factor",
    "rope_parameters.partial_rotary_factor",
    "rope_scaling.attention_factor",
    "rope_scaling.beta_fast",
    "rope_scaling.mscale",
    "rope_scaling.truncate",
]
"""Every config.json key ModelConfig reads (a dot reaches into a nested object)."""

EDGE_VALUES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    7,
    8,
    14,
    63,
    64,
    2**31 - 1,
    2**31,
    10**30,
    -(10**30),
    10**400,
    0.0,
    -0.0,
    8.0,
    0.5,
    1e-6,
    1.5,
    1e-50,
    5e-324,
    3e38,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    "8",
    "",
    "qwen2",
    "llama",
    "silu",
    "default",
    "full_attention",
    [],
    [8],
    {},
    {"a": 1},
]
"""Values at the edges of every check: zero, signs, int limits, float32 and float64 limits,
non-finite floats, bools posing as ints, numbers posing as strings, containers."""

CONFIGS = {
    "qwen2-0.5b": QWEN2_05B,
    "stories260K": json.loads((STORIES / "config.json").read_text()),
    "qwen3-0.6b": QWEN3_06B,
    "llama-3.2-1b": LLAMA32_1B,
    "mistral-7b-v0.3": MISTRAL_7B_V03,
}


def edited(hf: dict, key: str, value: object = None, delete: bool = False) -> dict:
    """A copy of ``hf`` with ``key`` (``a.b`` for nested) set to ``value`` or deleted."""
    hf = json.loads(json.dumps(hf))
    *outer, last = key.split(".")
    target = hf
    for part in outer:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    if delete:
        target.pop(last, None)
    else:
        target[last] = value
    return hf


def check_outcome(hf: dict, keys: list[str]) -> str:
    """``from_hf`` gives a usable config or a ConfigError naming one of the edited keys."""
    try:
        config = ModelConfig.from_hf(hf)
    except ConfigError as exc:
        names = {part for key in keys for part in key.split(".")}
        assert any(name in str(exc) for name in names), (str(exc), keys)
        return "ConfigError"
    sizes = [
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.max_position_embeddings,
    ]
    assert all(type(n) is int and 1 <= n < 2**31 for n in sizes), config
    assert config.num_heads % config.num_kv_heads == 0 and config.head_dim % 2 == 0, config
    assert type(config.rms_norm_eps) is float and type(config.rope_theta) is float, config
    assert math.isfinite(config.rms_norm_eps) and 0 < np.float32(config.rms_norm_eps), config
    assert config.rms_norm_eps <= 1, config
    assert math.isfinite(config.rope_theta) and math.isfinite(1 / config.rope_theta), config
    assert config.rope_theta > 0, config
    assert type(config.tie_word_embeddings) is bool, config
    assert all(type(i) is int and 0 <= i < config.vocab_size for i in config.eos_token_ids)
    assert config.architecture == hf["model_type"], config
    scaling = config.rope_scaling
    assert scaling is None or (
        isinstance(scaling, RopeScaling) and math.isfinite(scaling.factor) and scaling.factor > 0
    ), config
    # Mistral's (transformers' MistralConfig: 4096 when left out), below its context; else
    # full attention
    window = hf.get("sliding_window", 4096 if hf.get("model_type") == "mistral" else None)
    if config.architecture == "mistral" and window is not None:
        expected = window if window < config.max_position_embeddings else None
        assert config.sliding_window == expected, config
    else:
        assert config.sliding_window is None, config
    # ... holding exactly the values the file gave, where it gave them.
    for field, key in [
        ("vocab_size", "vocab_size"),
        ("hidden_size", "hidden_size"),
        ("num_heads", "num_attention_heads"),
        ("head_dim", "head_dim"),
        ("num_kv_heads", "num_key_value_heads"),
        ("num_layers", "num_hidden_layers"),
        ("rms_norm_eps", "rms_norm_eps"),
    ]:
        if hf.get(key) is not None:
            assert getattr(config, field) == hf[key], (field, config)
    return "valid"


@pytest.mark.parametrize("base", CONFIGS, ids=list(CONFIGS))
def test_every_key_at_every_edge_value_gives_a_usable_config_or_a_config_error(base):
    """All ``len(READ_KEYS) x (len(EDGE_VALUES) + 1)`` single edits, deleting the key too."""
    outcomes = collections.Counter()
    for key in READ_KEYS:
        outcomes[check_outcome(edited(CONFIGS[base], key, delete=True), [key])] += 1
        for value in EDGE_VALUES:
            outcomes[check_outcome(edited(CONFIGS[base], key, value), [key])] += 1
    assert outcomes["valid"] > 50 and outcomes["ConfigError"] > 500  # both sides exercised


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats()  # includes inf, -inf, nan, subnormals
    | st.sampled_from(EDGE_VALUES)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=5,
)


@st.composite
def config_edits(draw):
    """One to three keys of a real config (or unknown keys) set to any JSON value, or deleted."""
    hf = CONFIGS[draw(st.sampled_from(sorted(CONFIGS)))]
    keys = draw(
        st.lists(
            st.sampled_from(READ_KEYS) | st.text(max_size=6), min_size=1, max_size=3, unique=True
        )
    )
    for key in keys:
        if draw(st.integers(0, 9)) == 0:
            hf = edited(hf, key, delete=True)
        else:
            hf = edited(hf, key, draw(json_values))
    return hf, keys


@settings(max_examples=300, deadline=None)
@given(edit=config_edits())
def test_edited_configs_give_a_valid_model_config_or_a_config_error_naming_the_key(edit):
    event(check_outcome(*edit))


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edit=config_edits())
def test_edited_config_files_give_a_model_config_or_an_error_naming_the_file(tmp_path, edit):
    """The same through a file: ``json.dumps`` writes ``NaN``/``Infinity`` as Python reads them."""
    hf, _ = edit
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    try:
        ModelConfig.from_pretrained(tmp_path)
    except (ConfigError, CheckpointError) as exc:
        assert str(exc).startswith(f"{path}: ")


# -- rope scaling parameters that load but give NaN logits -----------------------------------
RULES = {  # one legal object per rule; the test varies one float parameter of it
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}
FLOAT_PARAMETERS = {
    "linear": ["factor"],
    "dynamic": ["factor"],
    "llama3": ["factor", "low_freq_factor", "high_freq_factor"],
    "yarn": ["factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"],
}
EXTREME_FLOATS = st.one_of(
    st.sampled_from(
        [
            5e-324,
            1e-310,
            2.2250738585072014e-308,
            1e-300,
            0.5,
            1.0,
            1e300,
            1.7976931348623157e308,
            -5e-324,
        ]
    ),
    st.floats(allow_nan=False, allow_infinity=False),
)


@pytest.mark.parametrize("rule", ["linear", "yarn", "llama3", "dynamic"])
@pytest.mark.parametrize("factor", [5e-324, 1e-310, 0.5, 0.999])
def test_a_rope_factor_below_one_is_refused_naming_the_key(rule, factor):
    for key in ("rope_scaling", "rope_parameters"):
        hf = {**LLAMA32_1B, "rope_scaling": None, key: {**RULES[rule], "factor": factor}}
        with pytest.raises(ConfigError, match=rf"{key}.*factor must be >= 1"):
            ModelConfig.from_hf(hf)


@settings(max_examples=300, deadline=None)
@given(rule=st.sampled_from(sorted(RULES)), data=st.data(), value=EXTREME_FLOATS)
def test_rope_parameters_load_only_with_finite_positive_frequencies(rule, data, value):
    """Any float in any rope parameter: refused naming the key, or a config whose RoPE
    frequencies and cos / sin tables are finite (before: subnormal factors loaded and gave
    NaN logits; yarn's beta_fast 5e-324 raised OverflowError)."""
    name = data.draw(st.sampled_from(FLOAT_PARAMETERS[rule]))
    rope = {**RULES[rule], name: value}
    if name == "mscale":
        rope["mscale_all_dim"] = 1.0
    try:
        config = ModelConfig.from_hf({**LLAMA32_1B, "rope_scaling": rope})
    except ConfigError as exc:
        assert str(exc).startswith("rope_scaling")
        return
    from mie.ops import rope_cos_sin, rope_inv_freq

    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert np.isfinite(inv_freq).all() and (inv_freq > 0).all()
    positions = np.array([0, 1, 4095, config.max_position_embeddings - 1])
    for table in rope_cos_sin(positions, config.head_dim, config.rope_theta, config.rope_scaling):
        assert np.isfinite(table).all()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_key_left_out_means_what_that_familys_transformers_config_assumes(tmp_path, family):
    """``max_position_embeddings`` (Llama 2048, Mistral 131072, Qwen 32768), Mistral's
    ``sliding_window`` (4096) and Qwen3's ``head_dim`` (128) left out of config.json: the
    oracle is transformers' own config class reading the same file."""
    transformers = require_module("transformers")
    hf = {
        "model_type": family,
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf(hf)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)
    window = getattr(theirs, "sliding_window", None) if family == "mistral" else None
    assert ours.sliding_window == window
    assert (ours.max_position_embeddings, ours.head_dim, ours.sliding_window) == {
        "llama": (2048, 16, None),
        "mistral": (131072, 16, 4096),
        "qwen2": (32768, 16, None),
        "qwen3": (32768, 128, None),
    }[family]


@pytest.mark.parametrize("rope_type", ["yarn", "llama3"])
def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path, rope_type):
    """Phi-3's habit: ``original_max_position_embeddings`` beside the rope object, not in it.
    transformers 5 lets the top-level value win for llama3 and yarn; so must mie (it was
    ignored, and the frequencies were another model's). And ``swish`` is ``silu``."""
    transformers = require_module("transformers")
    rope = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 16}
    if rope_type == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    hf = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "rope_parameters": rope,
        "hidden_act": "swish",
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    # transformers settles the value when it builds the model's rotary embedding
    theirs = transformers.AutoModelForCausalLM.from_config(config).config.rope_parameters
    ours = ModelConfig.from_hf(hf).rope_scaling
    assert ours.original_max_position_embeddings == theirs["original_max_position_embeddings"]
    assert ours.original_max_position_embeddings == 64
