"""Model configuration parsed from a Hugging Face `config.json`.

Supports the Llama family: LlamaForCausalLM (incl. llama3 rope scaling, tied
embeddings), MistralForCausalLM and Qwen2ForCausalLM (qkv bias). Both the
transformers 4 keys (`rope_theta`, `rope_scaling`) and the transformers 5 key
(`rope_parameters`) are read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A model directory whose config cannot be served by this engine."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not (self.theta > 0 and self.factor > 0):
            raise ConfigError(f"invalid rope parameters: theta={self.theta}, factor={self.factor}")
        if self.rope_type == "llama3" and self.original_max_position_embeddings is None:
            raise ConfigError("llama3 rope scaling needs original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_seq_len: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        heads = _req(raw, "num_attention_heads")
        hidden = _req(raw, "hidden_size")
        return cls(
            architecture=arch,
            vocab_size=_req(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=_req(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=_req(raw, "intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_seq_len=_max_seq_len(raw, arch),
            rope=_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            bos_token_id=_first_id(raw.get("bos_token_id")),
            eos_token_id=_first_id(raw.get("eos_token_id")),
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model directory not found: {model_dir}")
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)


def _req(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json lacks the required field {key!r}")
    return raw[key]


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and raw.get("model_type") in by_type:
        return by_type[raw["model_type"]]
    found = ", ".join(archs) or repr(raw.get("model_type"))
    raise ConfigError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _max_seq_len(raw: dict[str, Any], arch: str) -> int:
    """NOTE: sliding-window attention is not implemented; a model that uses it is
    served only up to its window, where full attention is exact."""
    limit = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", arch == "MistralForCausalLM")
    if window and uses_window:
        limit = min(limit, int(window))
    return limit


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _first_id(value: Any) -> Optional[int]:
    if isinstance(value, list):
        return value[0] if value else None
    return value
