"""Model configuration parsed from a Hugging Face `config.json`.

Supports the Llama family, each as transformers computes it: LlamaForCausalLM (llama3 rope
scaling, tied embeddings, `attention_bias` on q, k, v and o, `mlp_bias`), MistralForCausalLM and
Qwen2ForCausalLM (q/k/v bias) with their sliding windows, Qwen3ForCausalLM (per-head q/k RMSNorm
before rope), Gemma2ForCausalLM (four (1 + w) norms per layer, GeGLU with tanh GELU, scaled
embeddings, attention and final-logit soft-capping, query_pre_attn_scalar, alternating sliding
layers) and Gemma3ForCausalLM (the text model: Gemma 2's layer plus q/k norms, `layer_types`, a
rope base of its own for the sliding layers), Olmo2ForCausalLM (norms after the sublayers only, q/k
norms over the whole projections), Phi3ForCausalLM (Phi-3 / 3.5: fused qkv_proj and gate_up_proj,
partial rotary, `longrope` with its short factors: a longrope model is served up to its
original_max_position_embeddings, the context its short factors cover, where transformers computes
every sequence with them; longer prompts are skipped, reported as not fitting the model's context). Both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the transformers 5
key (`rope_parameters`) are read.

Anything that would change the model's maths and is not implemented (another architecture, a
mixture of experts, latent attention, soft-capping outside Gemma, partial rotary outside Phi-3, an
unknown layer type ...) is refused here, before any weight is read, with one line naming it
(ConfigError): never silently ignored. A key a config leaves out takes the default transformers'
configuration class of that architecture gives it (ARCH_DEFAULTS), not a generic one.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .config_schema import ConfigError, check_config, check_shapes
from .model_files import read_json_object

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM")
BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM"}
GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# where `attention_bias` gives q, k, v and o biases (transformers' Mistral and Phi-3 ignore it, Qwen2
# always has q/k/v biases and no o bias), and `mlp_bias` counts only for Llama
ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM")
# activations of the gated MLP: transformers' ACT2FN name -> ours
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# families refused with their reason (the name is matched as a prefix of the architecture)
REFUSED_FAMILIES = {
    "Mixtral": "a mixture-of-experts model", "Qwen2Moe": "a mixture-of-experts model",
    "Qwen3Moe": "a mixture-of-experts model", "DeepseekV2": "a mixture-of-experts model with latent attention (MLA)",
    "DeepseekV3": "a mixture-of-experts model with latent attention (MLA)", "OlmoeFor": "a mixture-of-experts model",
    "Gemma3ForConditionalGeneration": "a multimodal checkpoint (vision tower and text model)",
    "Llama4": "a mixture-of-experts multimodal model", "Qwen2VL": "a multimodal checkpoint",
    "Qwen2_5_VL": "a multimodal checkpoint", "LlavaFor": "a multimodal checkpoint",
}
# config fields whose non-neutral values change the maths and are not implemented: field -> neutral values
UNIMPLEMENTED_FIELDS = {
    "num_local_experts": (None, 0, 1), "num_experts": (None, 0, 1), "n_routed_experts": (None, 0),
    "kv_lora_rank": (None, 0), "q_lora_rank": (None, 0),
    "attn_logit_softcapping": (None, 0, 0.0), "final_logit_softcapping": (None, 0, 0.0),
    "partial_rotary_factor": (None, 1, 1.0), "attention_chunk_size": (None, 0),
    "vision_config": (None,), "pretraining_tp": (None, 1), "use_bidirectional_attention": (None, False),
}
# ... of which these are implemented for these architectures
IMPLEMENTED_FIELDS = {"attn_logit_softcapping": GEMMAS, "final_logit_softcapping": GEMMAS,
                      "partial_rotary_factor": ("Phi3ForCausalLM",)}
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' defaults (configuration_*.py) for the keys whose default differs from the generic
# one below (max_position_embeddings 2048, rms_norm_eps 1e-6, no window, head_dim hidden / heads, ...)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "MistralForCausalLM": {"sliding_window": 4096, "max_position_embeddings": 131072, "num_key_value_heads": 8},
    "Qwen2ForCausalLM": {"sliding_window": 4096, "max_window_layers": 28, "max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"sliding_window": 4096, "max_window_layers": 28, "max_position_embeddings": 32768,
                         "head_dim": 128},
    "Gemma2ForCausalLM": {"sliding_window": 4096, "head_dim": 256, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
                          "max_position_embeddings": 8192, "tie_word_embeddings": True, "num_key_value_heads": 4},
    "Gemma3ForCausalLM": {"sliding_window": 4096, "head_dim": 256, "query_pre_attn_scalar": 256,
                          "max_position_embeddings": 131072, "tie_word_embeddings": True, "num_key_value_heads": 4},
    "Olmo2ForCausalLM": {"rms_norm_eps": 1e-5},
    "Phi3ForCausalLM": {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096,
                        "max_position_embeddings": 4096},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None
    short_factor: tuple[float, ...] = ()       # longrope: per frequency divisors (the short ones: see the module)
    attention_factor: float = 1.0              # longrope: cos and sin times this

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not (self.theta > 0 and self.factor > 0):
            raise ConfigError(f"invalid rope parameters: theta={self.theta}, factor={self.factor}")
        if self.rope_type in ("llama3", "longrope") and self.original_max_position_embeddings is None:
            raise ConfigError(f"{self.rope_type} rope scaling needs original_max_position_embeddings")
        if self.rope_type == "longrope" and not self.short_factor:
            raise ConfigError("longrope rope scaling needs short_factor")
        if self.rope_type == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"llama3 rope scaling needs low_freq_factor ({self.low_freq_factor}) below "
                              f"high_freq_factor ({self.high_freq_factor})")


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
    o_bias: bool = False                   # o_proj has a bias (Llama attention_bias)
    mlp_bias: bool = False                 # gate, up and down projections have biases (Llama mlp_bias)
    qk_norm: str = ""                      # RMSNorm of q and k before rope: "head" each head (Qwen3, Gemma 3),
                                           # "proj" the whole projection (OLMo 2), "" none
    # per layer: the sliding window W of its attention (a query at position t attends the keys at
    # positions t - W < p <= t, as transformers' sliding_window_overlay), 0 for full attention;
    # () means every layer is full
    layer_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"               # the gated MLP's activation: "silu" or "gelu_tanh"
    norm_offset: bool = False              # RMSNorm weights are used as (1 + w) (Gemma)
    # where a layer's norms sit: "pre" before each sublayer (Llama), "sandwich" before and after
    # each (Gemma's four), "post" after each only (OLMo 2)
    norm_layout: str = "pre"
    embed_scale: float = 1.0               # embeddings times this, rounded to the model dtype (Gemma: sqrt(hidden))
    attn_scale: Optional[float] = None     # scores' scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0              # attention soft-capping c: s -> c tanh(s / c) (0: none)
    final_softcap: float = 0.0             # the same on the final logits
    local_rope: Optional["RopeConfig"] = None   # the sliding layers' rope (Gemma 3), None: `rope` everywhere
    rotary_dim: int = 0                    # values of each head rope rotates (partial rotary, Phi-3); 0: head_dim
    fused_proj: bool = False               # qkv_proj and gate_up_proj stored fused (Phi-3)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def layer_rope(self, layer: int) -> int:
        """Which rope table layer `layer` reads: 0 `rope`, 1 `local_rope` (the sliding layers' own)."""
        return 1 if self.local_rope is not None and self.window(layer) else 0

    def window(self, layer: int) -> int:
        """The sliding window of layer `layer` (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def windowed(self) -> bool:
        return any(self.layer_windows)

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
        if self.layer_windows and (len(self.layer_windows) != self.num_layers
                                   or any(not isinstance(w, int) or w < 0 for w in self.layer_windows)):
            raise ConfigError(f"layer windows must be {self.num_layers} integers >= 0, got {self.layer_windows!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """The config of a config.json dict; ConfigError (one line naming the field) for a field of the
        wrong type or range (engine/config_schema.py, checked before anything is derived from it) or
        for a model evalrun does not run."""
        check_config(raw)
        arch = _architecture(raw)
        raw = {**ARCH_DEFAULTS.get(arch, {}), **raw}         # a key set to null stays null
        check_shapes(raw)
        gemma = arch in GEMMAS
        act = (raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh") if gemma \
            else raw.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"unsupported hidden activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
        _refuse_unimplemented(raw, arch)
        heads = _req(raw, "num_attention_heads")
        hidden = _req(raw, "hidden_size")
        attention_bias = bool(raw.get("attention_bias", False))
        rope = _rope(raw, "full_attention" if arch == "Gemma3ForCausalLM" else None)
        context = _context(raw, rope)
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
            max_seq_len=context,
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or (attention_bias and arch in ATTENTION_BIAS),
            bos_token_id=_first_id(raw.get("bos_token_id")),
            eos_token_id=_first_id(raw.get("eos_token_id")),
            o_bias=attention_bias and arch in ATTENTION_BIAS,
            mlp_bias=arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
            qk_norm="head" if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM") else
                    "proj" if arch == "Olmo2ForCausalLM" else "",
            layer_windows=_layer_windows(raw, arch, _req(raw, "num_hidden_layers"), context),
            hidden_act=ACTIVATIONS[act],
            norm_offset=gemma,
            norm_layout="sandwich" if gemma else "post" if arch == "Olmo2ForCausalLM" else "pre",
            embed_scale=float(hidden) ** 0.5 if gemma else 1.0,
            attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
            final_softcap=float(raw.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
            local_rope=_rope(raw, "sliding_attention") if arch == "Gemma3ForCausalLM" else None,
            rotary_dim=_rotary_dim(raw, hidden // heads if not raw.get("head_dim") else raw["head_dim"]),
            fused_proj=arch == "Phi3ForCausalLM",
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        """from_dict of the directory's config.json, read as engine/model_files.py reads a model's
        files (a link out of the directory, a non-file, a non-object or malformed JSON: ConfigError)."""
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model directory not found: {model_dir}")
        if not os.path.lexists(path):
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        raw = read_json_object(Path(model_dir), path, ConfigError)
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


def _req(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json lacks the required field {key!r}")
    return raw[key]


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    for arch in archs:
        for prefix, what in REFUSED_FAMILIES.items():
            if arch.startswith(prefix):
                raise ConfigError(f"unsupported architecture {arch}: {what}, which evalrun does not run; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if not archs and raw.get("model_type") in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[raw["model_type"]]
    found = ", ".join(archs) or repr(raw.get("model_type"))
    raise ConfigError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _refuse_unimplemented(raw: dict[str, Any], arch: str) -> None:
    """A config field set to a value that changes the maths in a way evalrun does not implement."""
    rope_params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    for name, neutral in UNIMPLEMENTED_FIELDS.items():
        value = raw.get(name, rope_params.get(name))
        if value not in neutral and arch not in IMPLEMENTED_FIELDS.get(name, ()):
            raise ConfigError(f"config.json sets {name}={value!r}, which changes the model's maths and is not "
                              f"implemented for {arch}; evalrun refuses rather than compute something else")


def _layer_windows(raw: dict[str, Any], arch: str, num_layers: int, context: int) -> tuple[int, ...]:
    """Per layer sliding window (0: full attention), as transformers decides it for `arch`:
    Mistral windows every layer when `sliding_window` is set (its model ignores `layer_types`);
    Qwen2/Qwen3 window the layers `layer_types` names sliding (by default those from
    `max_window_layers` on) when `use_sliding_window` is true; Gemma 2 / 3 the layers `layer_types`
    names sliding (by default every other one / five of each six); Llama has no window. A window
    of at least the model's context is no window (Phi-3.5's 262144 over 131072 positions)."""
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    if arch in ("LlamaForCausalLM", "Olmo2ForCausalLM") or window is None:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"config.json sliding_window must be a positive integer, got {window!r}")
    types = raw.get("layer_types")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):     # every layer when set (layer_types ignored)
        types = ["sliding_attention"] * num_layers
    elif types is None and arch in GEMMAS:
        every = 2 if arch == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    elif types is None:
        first = int(raw.get("max_window_layers", num_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"config.json layer_types must list {num_layers} layer types, got {types!r}")
    unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"config.json layer_types has {', '.join(map(repr, unknown))}, which evalrun does not "
                          f"implement (known: {', '.join(LAYER_TYPES)})")
    windows = tuple(window if t == "sliding_attention" and window < context else 0 for t in types)
    return windows if any(windows) else ()


def _rope(raw: dict[str, Any], layer_type: Optional[str] = None) -> RopeConfig:
    """The rope of the config; layer_type: Gemma 3's per layer type ("full_attention": the global
    base, 1e6 by default, with `rope_scaling`; "sliding_attention": `rope_local_base_freq`, 1e4)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    default_theta = 10000.0
    if layer_type is not None:
        params = dict(params.get(layer_type) or {}) if layer_type in params else {}
        if layer_type == "sliding_attention":
            scaling, default_theta = {}, float(raw.get("rope_local_base_freq", 10000.0))
        else:
            default_theta = float(raw.get("rope_theta") or 1_000_000.0)
    params = {**scaling, **params}
    theta = params.get("rope_theta", default_theta if layer_type else raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type in ("su", "yarn") and params.get("short_factor") else rope_type
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=_original_context(raw, params),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        attention_factor=_longrope_attention(raw, params) if rope_type == "longrope" else 1.0,
    )


def _longrope_attention(raw: dict[str, Any], params: dict[str, Any]) -> float:
    """longrope's cos / sin scale: `attention_factor`, else sqrt(1 + ln(factor) / ln(original)) with
    factor from the config or max_position_embeddings / original_max_position_embeddings."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if not original:
        return 1.0
    if original < 2:
        raise ConfigError(f"longrope rope scaling needs original_max_position_embeddings >= 2, got {original}")
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _rotary_dim(raw: dict[str, Any], head_dim: int) -> int:
    """int(head_dim * partial_rotary_factor) (top level or in rope_parameters), 0 for the whole head."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    dim = int(head_dim * factor)
    if factor == 1.0:
        return 0
    if not 0.0 < factor < 1.0 or dim < 2 or dim % 2:
        raise ConfigError(f"partial_rotary_factor {factor} gives a rotary dim of {dim} of head_dim {head_dim}: "
                          "it must be an even number of at least 2")
    return dim


def _original_context(raw: dict[str, Any], params: dict[str, Any]) -> Optional[int]:
    """The pretraining context of a scaled rope, as transformers resolves it: the config's top-level
    original_max_position_embeddings first (Phi-3 saves it there), then the rope's own, then
    max_position_embeddings."""
    value = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    return int(value or raw.get("max_position_embeddings", 2048))


def _context(raw: dict[str, Any], rope: "RopeConfig") -> int:
    """max_position_embeddings, or for longrope the original context its short factors cover."""
    limit = int(raw.get("max_position_embeddings", 2048))
    if rope.rope_type == "longrope" and rope.original_max_position_embeddings:
        limit = min(limit, rope.original_max_position_embeddings)
    return limit


def _first_id(value: Any) -> Optional[int]:
    if isinstance(value, list):
        return value[0] if value else None
    return value
