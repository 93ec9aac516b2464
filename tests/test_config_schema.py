"""config.json's schema (engine/config_schema.py): every field evalrun reads is checked for its type
and range before anything is derived from it, in one line naming the field; transformers' own
configurations of every supported family (and released models' rope settings) pass unchanged."""
from __future__ import annotations

import json
import math
import os

import pytest

os.environ.setdefault("USE_HUB_KERNELS", "0")

from tiny_models import ARCHS, LLAMA3_ROPE, _arch_classes  # noqa: E402

from evalrun.engine.config import ConfigError, ModelConfig  # noqa: E402
from evalrun.engine.config_schema import MAX_POSITIONS, check_config  # noqa: E402

SMALL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-6}
PHI35_ROPE = {"type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
              "long_factor": [1.5 + i / 48 for i in range(48)]}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_default_configs_pass(arch):
    config_class, _ = _arch_classes(arch)
    raw = json.loads(json.dumps(config_class().to_dict(), default=str))
    check_config(raw)
    ModelConfig.from_dict(raw)


@pytest.mark.parametrize("changes", [
    {"rope_scaling": LLAMA3_ROPE, "eos_token_id": [128001, 128008, 128009], "bos_token_id": None},
    {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
     "rope_scaling": PHI35_ROPE, "original_max_position_embeddings": 4096, "max_position_embeddings": 131072,
     "sliding_window": 262144},
    {"architectures": ["Gemma3ForCausalLM"], "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
     "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 0, "max_window_layers": 21,
     "tie_word_embeddings": True, "rope_theta": 1e6, "rope_scaling": None},
    {"architectures": ["MistralForCausalLM"], "head_dim": None, "sliding_window": None},
    {"max_position_embeddings": MAX_POSITIONS},
])
def test_released_models_settings_pass(changes):
    ModelConfig.from_dict({**SMALL, **changes})


BAD = [
    ({"num_attention_heads": 0}, "config field num_attention_heads must be a positive integer, got 0"),
    ({"num_attention_heads": "4"}, "config field num_attention_heads must be a positive integer, got '4'"),
    ({"num_attention_heads": True}, "config field num_attention_heads must be a positive integer, got True"),
    ({"num_attention_heads": 4.0}, "config field num_attention_heads must be a positive integer, got 4.0"),
    ({"hidden_size": [64]}, "config field hidden_size must be a positive integer, got [64]"),
    ({"num_key_value_heads": 0}, "config field num_key_value_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 3}, "config field num_key_value_heads: num_attention_heads (4) is not a multiple of "
                                 "num_key_value_heads (3)"),
    ({"hidden_size": 66}, "config field hidden_size (66) is not a multiple of num_attention_heads (4), and no "
                          "head_dim is given"),
    ({"head_dim": 1}, "config field head_dim must be an integer >= 2, got 1"),
    ({"head_dim": 1 << 20}, "config field head_dim must be at most 4096, got 1048576"),
    ({"max_position_embeddings": 10**12}, "config field max_position_embeddings must be at most 16777216, got "
                                          "1000000000000"),
    ({"vocab_size": 0}, "config field vocab_size must be a positive integer, got 0"),
    ({"num_hidden_layers": 10**9}, "config field num_hidden_layers must be at most 4096, got 1000000000"),
    ({"intermediate_size": -1}, "config field intermediate_size must be a positive integer, got -1"),
    ({"rms_norm_eps": 0}, "config field rms_norm_eps must be a positive number, got 0"),
    ({"rms_norm_eps": math.inf}, "config field rms_norm_eps must be a positive number, got inf"),
    ({"rms_norm_eps": "1e-6"}, "config field rms_norm_eps must be a positive number, got '1e-6'"),
    ({"rope_theta": -1.0}, "config field rope_theta must be a positive number, got -1.0"),
    ({"rope_theta": math.nan}, "config field rope_theta must be a positive number, got nan"),
    ({"rope_scaling": "linear"}, "config field rope_scaling must be an object, got 'linear'"),
    ({"rope_scaling": {"rope_type": 1}}, "config field rope_scaling.rope_type must be a string, got 1"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}},
     "config field rope_scaling.factor must be a positive number, got 0"),
    ({"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": "256"}},
     "config field rope_scaling.original_max_position_embeddings must be a positive integer, got '256'"),
    ({"rope_scaling": {**LLAMA3_ROPE, "high_freq_factor": 1.0}},
     "llama3 rope scaling needs low_freq_factor (1.0) below high_freq_factor (1.0)"),
    ({"rope_scaling": {**PHI35_ROPE, "short_factor": "abc"}},
     "config field rope_scaling.short_factor must be a list of at most 4096 positive numbers, got 'abc'"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 0}}},
     "config field rope_parameters.full_attention.rope_theta must be a positive number, got 0"),
    ({"tie_word_embeddings": "false"}, "config field tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": 1}, "config field attention_bias must be true or false, got 1"),
    ({"architectures": "LlamaForCausalLM"}, "config field architectures must be a list of strings, got "
                                            "'LlamaForCausalLM'"),
    ({"architectures": [5]}, "config field architectures must be a list of strings, got [5]"),
    ({"model_type": ["llama"]}, "config field model_type must be a string, got ['llama']"),
    ({"hidden_act": None, "hidden_activation": 3}, "config field hidden_activation must be a string, got 3"),
    ({"eos_token_id": "2"}, "config field eos_token_id must be a token id (an integer >= 0) or a list of them"),
    ({"eos_token_id": [2, -1]}, "config field eos_token_id must be a token id (an integer >= 0) or a list of them"),
    ({"layer_types": "full_attention"}, "config field layer_types must be a list of strings"),
    ({"sliding_window_pattern": 0}, "config field sliding_window_pattern must be a positive integer, got 0"),
    ({"query_pre_attn_scalar": 0}, "config field query_pre_attn_scalar must be a positive number, got 0"),
    ({"partial_rotary_factor": 2.0}, "config field partial_rotary_factor must be at most 1, got 2.0"),
    ({"max_window_layers": "x"}, "config field max_window_layers must be an integer >= 0, got 'x'"),
    ({"hidden_size": 10**400}, "config field hidden_size must be at most 131072, got 1000000000"),
]


@pytest.mark.parametrize("changes,message", BAD, ids=[next(iter(c)) + f"-{i}" for i, (c, _) in enumerate(BAD)])
def test_a_bad_field_is_one_line_naming_it(changes, message):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({**SMALL, **changes})
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_not_an_object_is_refused():
    for raw in ([1, 2], "config", None):
        with pytest.raises(ConfigError, match="config must hold a JSON object"):
            ModelConfig.from_dict(raw)


def test_load_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "num_attention_heads": 0}))
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'config.json'}: config field num_attention_heads"):
        ModelConfig.load(tmp_path)
