"""ModelConfig: what it reads from config.json, and what it refuses to run."""

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen2Config

from mie.checkpoint import CheckpointError
from mie.model import ConfigError, ModelConfig

# shared/ lies beside the repository, here and in CI.
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"

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
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, "mie runs only"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "rope_param"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"layer_types": ["full_attention"] * 23 + ["sliding_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"num_hidden_layers": 2.0}, "num_layers must be a positive int"),
        ({"head_dim": 63}, "head_dim must be even"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
        ({"eos_token_id": 151936}, "outside the vocabulary"),
        ({"vocab_size": None}, "vocab_size must be a positive int"),
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
    with pytest.raises(ConfigError, match=f"{tmp_path}: hidden_act 'relu'"):
        ModelConfig.from_pretrained(tmp_path)
