"""The schema of the config.json fields evalrun reads: their types and ranges, checked before
anything is derived from them or allocated (engine/config.py ModelConfig.from_dict calls check_config
first; engine/gguf.py checks a GGUF file's metadata with check_field).

A model directory is untrusted input: a value of the wrong type (a string, a list, a bool where a
number belongs), out of range (zero heads, a negative size, a context of 10**12 positions, a NaN
epsilon) or inconsistent (heads that do not divide the hidden size) is one ConfigError naming the
field. Bools are not integers and strings are not numbers here, although Python would take them.
Fields evalrun does not read are not checked (configs carry many).

The upper bounds are far above every released model (the largest known: vocabulary 262,144, hidden
size 18,432, 126 layers, 128 heads, head_dim 256, context 10,485,760) and keep every size evalrun
derives from a config to what a machine can hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

MAX_POSITIONS = 1 << 24
MAX_VOCAB = 1 << 24
MAX_HIDDEN = 1 << 17
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_INTERMEDIATE = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1


class ConfigError(ValueError):
    """A model directory whose config cannot be served by this engine."""


@dataclass(frozen=True)
class Field:
    kind: str                          # "int", "number", "bool", "str", "str_list", "ids", "factors", "rope"
    low: Optional[float] = None        # the smallest value allowed
    high: Optional[float] = None       # the largest
    above_low: bool = False            # `low` itself is not allowed (an epsilon > 0)


def _positive(high: Optional[float] = None) -> Field:
    return Field("number", 0, high, above_low=True)


# config.json's top-level fields; a null value is always allowed (transformers' default applies)
FIELDS: dict[str, Field] = {
    "architectures": Field("str_list"), "model_type": Field("str"),
    "vocab_size": Field("int", 1, MAX_VOCAB), "hidden_size": Field("int", 1, MAX_HIDDEN),
    "num_hidden_layers": Field("int", 1, MAX_LAYERS), "num_attention_heads": Field("int", 1, MAX_HEADS),
    "num_key_value_heads": Field("int", 1, MAX_HEADS), "head_dim": Field("int", 2, MAX_HEAD_DIM),
    "intermediate_size": Field("int", 1, MAX_INTERMEDIATE),
    "max_position_embeddings": Field("int", 1, MAX_POSITIONS),
    "original_max_position_embeddings": Field("int", 1, MAX_POSITIONS),
    "rms_norm_eps": _positive(1.0), "rope_theta": _positive(), "rope_local_base_freq": _positive(),
    "partial_rotary_factor": _positive(1.0), "query_pre_attn_scalar": _positive(),
    "attn_logit_softcapping": Field("number", 0), "final_logit_softcapping": Field("number", 0),
    "sliding_window": Field("int", 0), "max_window_layers": Field("int", 0),
    "sliding_window_pattern": Field("int", 1, MAX_LAYERS), "layer_types": Field("str_list"),
    "tie_word_embeddings": Field("bool"), "attention_bias": Field("bool"), "mlp_bias": Field("bool"),
    "use_sliding_window": Field("bool"), "hidden_act": Field("str"), "hidden_activation": Field("str"),
    "bos_token_id": Field("ids"), "eos_token_id": Field("ids"),
    "rope_scaling": Field("rope"), "rope_parameters": Field("rope"),
}
# the fields of a rope_scaling / rope_parameters object
ROPE_FIELDS: dict[str, Field] = {
    "rope_type": Field("str"), "type": Field("str"), "factor": _positive(), "low_freq_factor": _positive(),
    "high_freq_factor": _positive(), "original_max_position_embeddings": Field("int", 1, MAX_POSITIONS),
    "short_factor": Field("factors"), "long_factor": Field("factors"), "attention_factor": _positive(),
    "rope_theta": _positive(), "partial_rotary_factor": _positive(1.0),
    "beta_fast": Field("number"), "beta_slow": Field("number"), "mscale": Field("number"),
    "mscale_all_dim": Field("number"),
}
ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")    # Gemma 3: a rope object per layer type


def check_config(raw: Any, source: str = "config") -> None:
    """ConfigError naming the first field of `raw` (a config.json dict) whose type or range is wrong."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must hold a JSON object, not {type(raw).__name__}")
    for name, spec in FIELDS.items():
        if raw.get(name) is not None:
            check_field(name, raw[name], f"{source} field {name}", spec)


def check_shapes(raw: Mapping[str, Any], source: str = "config") -> None:
    """The checks between fields (after check_config and the architecture's defaults): the heads
    divide the hidden size where head_dim is not given, the KV heads divide the heads."""
    heads, hidden, kv = raw.get("num_attention_heads"), raw.get("hidden_size"), raw.get("num_key_value_heads")
    if heads is None or hidden is None:
        return                        # a required field's absence is said by ModelConfig.from_dict
    if raw.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{source} field hidden_size ({hidden}) is not a multiple of num_attention_heads "
                          f"({heads}), and no head_dim is given")
    if kv is not None and heads % kv:
        raise ConfigError(f"{source} field num_key_value_heads: num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv})")


def check_field(name: str, value: Any, label: str, spec: Optional[Field] = None) -> None:
    """ConfigError ("{label} must be ...") when `value` does not fit the field `name` (its spec:
    FIELDS[name] unless given)."""
    spec = spec or FIELDS[name]
    if spec.kind == "rope":
        _check_rope(value, label)
    elif spec.kind == "str_list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{label} must be a list of strings, got {_show(value)}")
    elif spec.kind == "ids":
        ids = value if isinstance(value, list) else [value]
        if not all(_is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids):
            raise ConfigError(f"{label} must be a token id (an integer >= 0) or a list of them, got {_show(value)}")
    elif spec.kind == "factors":
        if not isinstance(value, list) or not 0 < len(value) <= MAX_HEAD_DIM \
                or not all(_is_number(f) and f > 0 for f in value):
            raise ConfigError(f"{label} must be a list of at most {MAX_HEAD_DIM} positive numbers, got {_show(value)}")
    elif spec.kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"{label} must be true or false, got {_show(value)}")
    elif spec.kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{label} must be a string, got {_show(value)}")
    elif spec.kind in ("int", "number"):
        _check_number(value, label, spec)


def _check_number(value: Any, label: str, spec: Field) -> None:
    integer = spec.kind == "int"
    noun = "integer" if integer else "number"
    if spec.low is None:
        what = f"an {noun}" if integer else f"a {noun}"
    elif spec.low == 0 and spec.above_low or spec.low == 1 and integer:
        what = f"a positive {noun}"
    else:
        what = f"{'an' if integer else 'a'} {noun} {'>' if spec.above_low else '>='} {_fmt(spec.low)}"
    ok = _is_int(value) if integer else _is_number(value)
    if ok and spec.low is not None:
        ok = value > spec.low if spec.above_low else value >= spec.low
    if not ok:
        raise ConfigError(f"{label} must be {what}, got {_show(value)}")
    if spec.high is not None and value > spec.high:
        raise ConfigError(f"{label} must be at most {_fmt(spec.high)}, got {_show(value)}")


def _check_rope(value: Any, label: str, nested: bool = True) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{label} must be an object, got {_show(value)}")
    for name, item in value.items():
        if item is None:
            continue
        if nested and name in ROPE_LAYER_TYPES:
            _check_rope(item, f"{label}.{name}", nested=False)
        elif name in ROPE_FIELDS:
            check_field(name, item, f"{label}.{name}", ROPE_FIELDS[name])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _show(value: Any) -> str:
    """repr of a value, on one line and at most 80 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."
