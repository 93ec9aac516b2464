"""A llama.cpp GGUF file as a model: its config from the metadata, its weights de-quantized once at load.

    path.gguf ──open_gguf──► GGUFFile (metadata, tensor index; nothing de-quantized)
                 ├─ model_config(): the config.json dict llama.cpp's keys describe → ModelConfig.from_dict
                 │                  (every refusal rule of config.py applies)
                 └─ GGUFWeights: the WeightReader interface (has, get, names) under the HF names the
                                 engine reads; each tensor de-quantized (gguf.quants.dequantize, float32)
                                 when it is read, then cast to the compute dtype

Architectures: llama, qwen2, qwen3 (a Mistral converted by llama.cpp is a `llama` file). llama.cpp
stores a llama file's q and k projections permuted for its rope layout; GGUFWeights undoes that as
transformers does (see `_unpermute`). A tensor the engine did not read is refused
(GGUFWeights.check_all_read): a part of the model evalrun does not implement is never ignored.
Llama 3 rope scaling is stored as per-frequency factors (`rope_freqs.weight`); `_llama3_rope` finds
the rope_scaling that gives exactly those factors, or refuses the file.

Needs the `gguf` package (an optional dependency, imported where used).
"""
from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .config import ConfigError, ModelConfig
from .config_schema import FIELDS, Field, check_field
from .model_files import check_model_file
from .weights import WeightsError

GGUF_SUFFIX = ".gguf"
# GGUF `general.architecture` -> the transformers class whose maths the file's model has
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# `{arch}.KEY` -> config.json field (the keys transformers' GGUF loader and llama.cpp agree on)
CONFIG_KEYS = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings", "rope.freq_base": "rope_theta", "vocab_size": "vocab_size",
    "expert_count": "num_local_experts",           # a Mixtral is a `llama` file with experts: refused by config.py
}
REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
# `{arch}.KEY` -> the schema its value must fit (engine/config_schema.py), besides CONFIG_KEYS' fields
METADATA_FIELDS = {
    "attention.key_length": FIELDS["head_dim"], "attention.value_length": FIELDS["head_dim"],
    "rope.dimension_count": FIELDS["head_dim"], "rope.scaling.type": Field("str"),
    "rope.scaling.factor": Field("number", 0, None, above_low=True),
    "rope.scale_linear": Field("number", 0, None, above_low=True),
}
# GGUF tensor names (without `.weight`/`.bias`) -> the HF names the engine reads
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"       # llama 3 rope scaling: read into the config, not a weight
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_BIG_ARRAY = 4096                      # metadata arrays longer than this are kept as their length ...
_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


class GGUFError(WeightsError):
    """A .gguf file that cannot be read, or holds something evalrun does not run; the message names the file."""


def is_gguf(path: "str | Path") -> bool:
    """Whether `path` names a GGUF file (by its suffix; it may not exist: open_gguf says so)."""
    path = Path(path)
    return path.suffix.lower() == GGUF_SUFFIX and not path.is_dir()


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    a name outside the tables is returned as it is."""
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m and m[2] in LAYER_TENSORS:
        return f"model.layers.{m[1]}.{LAYER_TENSORS[m[2]]}.{m[3]}"
    base, _, kind = gguf_name.rpartition(".")
    return f"{GLOBAL_TENSORS[base]}.{kind}" if base in GLOBAL_TENSORS else gguf_name


def gguf_name(name: str) -> str:
    """The GGUF name of an HF tensor name (the inverse of hf_name)."""
    m = _HF_LAYER_NAME.fullmatch(name)
    layer_parts = {v: k for k, v in LAYER_TENSORS.items()}
    if m and m[2] in layer_parts:
        return f"blk.{m[1]}.{layer_parts[m[2]]}.{m[3]}"
    base, _, kind = name.rpartition(".")
    global_parts = {v: k for k, v in GLOBAL_TENSORS.items()}
    return f"{global_parts[base]}.{kind}" if base in global_parts else name


@dataclass
class GGUFFile:
    """An opened GGUF file: its metadata (scalars; long arrays as their length) and its tensors by
    GGUF name (gguf.ReaderTensor: type, shape, a view of the mapped bytes)."""
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def shape(self, name: str) -> tuple[int, ...]:
        """The numpy shape of a tensor (GGUF lists dimensions fastest first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def config_dict(self) -> dict[str, Any]:
        """The config.json dict this file's metadata describes (see CONFIG_KEYS)."""
        arch = self.architecture
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{self.path}: GGUF architecture {arch!r} is not supported; "
                              f"supported: {', '.join(ARCHITECTURES)}")
        missing = [f"{arch}.{k}" for k in REQUIRED_KEYS if f"{arch}.{k}" not in self.metadata]
        if missing:
            raise GGUFError(f"{self.path}: GGUF metadata lacks {', '.join(missing)}")
        self._check_metadata(arch)
        raw: dict[str, Any] = {"architectures": [ARCHITECTURES[arch]], "model_type": arch}
        raw.update({field: self.metadata[f"{arch}.{key}"] for key, field in CONFIG_KEYS.items()
                    if f"{arch}.{key}" in self.metadata})
        raw["num_key_value_heads"] = self._one_kv_head_count(raw.get("num_key_value_heads"))
        if "vocab_size" not in raw:            # older files: the vocabulary's length, else the embedding's rows
            embed = self.shape("token_embd.weight")[0] if "token_embd.weight" in self.tensors else None
            raw["vocab_size"] = self.metadata.get("tokenizer.ggml.tokens") or embed
        raw.update(self._head_dim(arch, raw))
        raw.update(self._rope(arch, raw))
        raw["tie_word_embeddings"] = "output.weight" not in self.tensors
        # biases: llama.cpp writes them only where the model has them (Qwen2's q/k/v always)
        raw["attention_bias"] = arch != "qwen2" and any(".attn_q.bias" in n for n in self.tensors)
        raw["mlp_bias"] = any(re.search(r"\.ffn_(gate|up|down)\.bias$", n) for n in self.tensors)
        raw["bos_token_id"] = self.metadata.get("tokenizer.ggml.bos_token_id")
        raw["eos_token_id"] = self.metadata.get("tokenizer.ggml.eos_token_id")
        return raw

    def model_config(self) -> ModelConfig:
        """ModelConfig.from_dict of config_dict(), its refusals naming this file."""
        try:
            return ModelConfig.from_dict(self.config_dict())
        except ConfigError as exc:
            message = str(exc).replace("config.json ", "the GGUF metadata ")
            raise ConfigError(message if str(self.path) in message else f"{self.path}: {message}") from None

    def _check_metadata(self, arch: str) -> None:
        """ConfigError naming the metadata key whose value is of the wrong type or range (the schema of
        the config.json field it stands for), before anything is computed from it."""
        specs = {**{key: FIELDS[field] for key, field in CONFIG_KEYS.items() if field in FIELDS}, **METADATA_FIELDS}
        for key, spec in specs.items():
            value = self.metadata.get(f"{arch}.{key}")
            per_layer = key == "attention.head_count_kv" and isinstance(value, list) and value
            for item in value if per_layer else [value]:        # head_count_kv may be one per layer
                if item is not None:
                    check_field(key, item, f"{self.path}: GGUF metadata {arch}.{key}", spec)
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            if self.metadata.get(key) is not None:
                check_field("bos_token_id", self.metadata[key], f"{self.path}: GGUF metadata {key}")

    def _one_kv_head_count(self, value: Any) -> Any:
        """head_count_kv may be a per-layer array: one count is all the engine runs."""
        if not isinstance(value, list):
            return value
        if len(set(value)) != 1:
            raise ConfigError(f"{self.path}: the layers have different KV head counts {sorted(set(value))}, "
                              "which evalrun does not implement")
        return value[0]

    def _head_dim(self, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        """head_dim from attention.key_length (else hidden / heads); a rope over fewer dimensions is refused."""
        meta, heads = self.metadata, raw["num_attention_heads"]
        head_dim = meta.get(f"{arch}.attention.key_length") or raw["hidden_size"] // heads
        value_dim = meta.get(f"{arch}.attention.value_length", head_dim)
        if value_dim != head_dim:
            raise ConfigError(f"{self.path}: key length {head_dim} and value length {value_dim} differ, "
                              "which evalrun does not implement")
        rope_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
        if rope_dims != head_dim:       # llama.cpp's partial rope is not transformers' (pairs differ)
            raise ConfigError(f"{self.path}: rope over {rope_dims} of the head's {head_dim} dimensions, which "
                              "evalrun does not read from GGUF files")
        return {"head_dim": head_dim}

    def _rope(self, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        """rope_scaling from rope.scaling.* (or the older rope.scale_linear) and rope_freqs.weight;
        a type other than linear is passed on for config.py to refuse."""
        meta = self.metadata
        kind = str(meta.get(f"{arch}.rope.scaling.type", "none"))
        factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
        if kind == "none" and factor not in (None, 1.0):
            kind = "linear"
        if ROPE_FREQS in self.tensors:
            if kind != "none":
                raise ConfigError(f"{self.path}: both rope.scaling.type {kind!r} and {ROPE_FREQS}")
            scaling = _llama3_rope(self, raw)
            return {"rope_scaling": scaling} if scaling else {}
        if kind == "none":
            return {}
        return {"rope_scaling": {"rope_type": kind, **({"factor": float(factor)} if factor is not None else {})}}

    def describe(self) -> dict[str, Any]:
        """What the manifest records of the file's quantization: `general.file_type` (llama.cpp's name,
        e.g. "Q4_K_M"; None if the file has none) and the count of tensors per type."""
        from gguf import LlamaFileType

        file_type = self.metadata.get("general.file_type")
        guessed = isinstance(file_type, int) and bool(file_type & LlamaFileType.GUESSED)   # a flag llama.cpp may add
        try:
            name: Optional[str] = LlamaFileType(file_type & ~LlamaFileType.GUESSED).name.removeprefix("MOSTLY_")
            name += " (guessed)" if guessed else ""
        except (ValueError, TypeError):
            name = None if file_type is None else f"unknown ({file_type})"
        counts = Counter(t.tensor_type.name for t in self.tensors.values())
        return {"file": self.path.name, "architecture": self.architecture, "file_type": name,
                "tensor_types": dict(sorted(counts.items()))}


def open_gguf(path: "str | Path") -> GGUFFile:
    """Open a GGUF file (its header and tensor index; no tensor is read). FileNotFoundError if it is
    missing, GGUFError if it is not a GGUF file or is truncated."""
    path = Path(path)
    real = check_gguf_file(path)
    try:
        from gguf import GGUFReader
        from gguf.constants import GGUFValueType
    except ImportError as exc:
        raise GGUFError(f"reading {path} needs the gguf package ({exc}): pip install 'evalrun[demo]'") from None
    with os.fdopen(os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(real)
    except Exception as exc:  # noqa: BLE001 - a damaged file fails the reader in many ways (ValueError, IndexError ...)
        raise GGUFError(f"{path}: a damaged GGUF file, probably truncated ({type(exc).__name__}: {exc}): copy or "
                        "download it again") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > real.stat().st_size:
        raise GGUFError(f"{path}: truncated ({real.stat().st_size} bytes, its tensors end at byte {end}): "
                        "copy or download it again")
    metadata = {}
    for key, field in reader.fields.items():
        is_array = field.types[0] == GGUFValueType.ARRAY
        long = is_array and (len(field.data) > _BIG_ARRAY or key in _VOCABULARY)    # ... and the vocabulary
        metadata[key] = len(field.data) if long else field.contents()
    return GGUFFile(path, metadata, {t.name: t for t in reader.tensors})


def check_gguf_file(path: Path) -> Path:
    """The real path of the GGUF file `path`, checked as every model file is (engine/model_files.py,
    the file's folder as its model directory): FileNotFoundError if it is missing, GGUFError if it is
    a link (a hub-cache snapshot's link into its blobs/ excepted) or not a regular file."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return check_model_file(path.parent, path, GGUFError, "GGUF file")


def load_gguf(path: "str | Path", dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, "GGUFWeights"]:
    """The config and the weight reader of a GGUF file (Model.load's GGUF branch)."""
    file = open_gguf(path)
    config = file.model_config()
    return config, GGUFWeights(file, config, dtype, device)


class GGUFWeights:
    """WeightReader's interface over a GGUF file: tensors by HF name, de-quantized when read."""

    def __init__(self, file: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.file = file
        self.dtype = dtype
        self.device = device
        self.files = {hf_name(n): n for n in file.tensors if n != ROPE_FREQS}    # HF name -> GGUF name
        self.unread = set(self.files)
        # llama files hold q and k permuted for llama.cpp's rope: rows per head of each
        self.permuted = ({"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
                         if file.architecture == "llama" else {})
        self._last: Optional[tuple[str, torch.Tensor]] = None   # a tied embedding is read twice in a row

    def has(self, name: str) -> bool:
        return name in self.files

    def names(self) -> Iterator[str]:
        return iter(self.files)

    def get(self, name: str, shape: tuple[int, ...], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        path = self.file.path
        if name not in self.files:
            raise WeightsError(f"{path}: no tensor {gguf_name(name)!r} (the engine's {name}; the file has "
                               f"{len(self.file.tensors)} tensors)")
        source = self.files[name]
        if self.file.shape(source) != tuple(shape):
            raise WeightsError(f"{path}: tensor {source!r} has shape {self.file.shape(source)}, "
                               f"the config implies {tuple(shape)}")
        self.unread.discard(name)
        if self._last is not None and self._last[0] == name:
            return self._last[1].to(device=self.device, dtype=dtype or self.dtype, copy=True)
        w = dequantize(self.file, source)
        permuted = next((heads for part, heads in self.permuted.items() if f".{part}." in name), None)
        if permuted is not None:
            w = _unpermute(w, permuted)
        self._last = (name, w)
        return w.to(device=self.device, dtype=dtype or self.dtype)

    def check_all_read(self) -> None:
        """GGUFError naming the tensors the engine did not read: the model has parts evalrun does not
        implement, and ignoring them would compute another model."""
        if self.unread:
            names = sorted(self.files[n] for n in self.unread)
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise GGUFError(f"{self.file.path}: holds tensors evalrun does not use ({', '.join(names[:5])}{more}): "
                            "the model has parts evalrun does not implement; refusing rather than ignoring them")


def dequantize(file: GGUFFile, source: str) -> torch.Tensor:
    """One tensor of the file as float32 [shape] (gguf.quants.dequantize; F32 is copied out of the mapping)."""
    from gguf.quants import dequantize as gguf_dequantize

    t = file.tensors[source]
    try:
        values = gguf_dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"{file.path}: tensor {source!r} is of type {t.tensor_type.name}, which the gguf "
                        "package cannot de-quantize") from None
    values = np.asarray(values, dtype=np.float32).reshape(file.shape(source))
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (weight [heads * D, H] or bias [heads * D]).

    Per head, HF rotates the pairs (i, i + D/2) (rotate_half); llama.cpp rotates (2i, 2i + 1), so its
    converter moved HF row  half * D/2 + i  to row  2i + half:

        GGUF rows of a head  [x0 y0 x1 y1 ... ]   view [D/2, 2]  transpose  [2, D/2]  ->  [x0 x1 ... y0 y1 ...]
    """
    rest = w.shape[1:]
    return w.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)   # [heads, 2, D/2, *rest] flattened


def _llama3_rope(file: GGUFFile, raw: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The llama3 rope_scaling whose per-frequency factors are the file's rope_freqs (None where they
    are all 1), else ConfigError.

    llama.cpp's converter stores, per frequency of wavelength w, 1 where w < L / high, `factor` where
    w > L / low, else 1 / ((1 - s) / factor + s) with s = (L / w - low) / (high - low), as float32.
    (L, low, high) scaled together give the same factors, so low = 1 and the smooth band's points fix
    L and high (a least-squares line through s = (L / w - 1) / (high - 1)); with fewer than two band
    points, high = 4 (every Llama 3) and L lies between the classes. The fit is checked by recomputing."""
    stored = dequantize(file, ROPE_FREQS).double().numpy()                          # [D/2]
    if not (np.all(np.isfinite(stored)) and np.all(stored > 0)):
        raise ConfigError(f"{file.path}: its {ROPE_FREQS} hold values that are not positive finite numbers")
    head_dim, theta = raw["head_dim"], float(raw.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(stored.max())
    if np.all(stored == 1.0):
        return None
    band = (stored > 1 + 1e-6) & (stored < factor * (1 - 1e-6))
    if band.sum() >= 2:
        s = (1 / stored[band] - 1 / factor) / (1 - 1 / factor)
        # old_len / w - s * (high - 1) = 1   for each band point: solve for (old_len, high - 1)
        (old_len, span), *_ = np.linalg.lstsq(np.stack([1 / wavelen[band], -s], axis=1), np.ones_like(s), rcond=None)
        high = 1 + span
    else:
        high = 4.0
        ones, full = wavelen[stored <= 1 + 1e-6], wavelen[stored >= factor * (1 - 1e-6)]
        lo = ones.max() * high if ones.size else 1.0
        hi = full.min() if full.size else 2 * lo
        s = (1 / stored[band] - 1 / factor) / (1 - 1 / factor)
        old_len = float((3 * s[0] + 1) * wavelen[band][0]) if band.any() else math.sqrt(lo * hi)
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(round(high, 6)),
            "original_max_position_embeddings": _round_near(old_len)}
    if factor > 1 and np.allclose(stored, _llama3_factors(wavelen, rope), rtol=1e-5, atol=0):
        return rope
    raise ConfigError(f"{file.path}: its {ROPE_FREQS} are not the factors of a llama3 rope scaling; refusing "
                      "rather than computing another rope")


def _llama3_factors(wavelen: np.ndarray, rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 rope_scaling (float32, as its converter writes them)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    smooth = (old_len / wavelen - low) / (high - low)
    blend = np.where(wavelen > old_len / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen < old_len / high, 1.0, blend).astype(np.float32)


def _round_near(x: float) -> "int | float":
    """x as an integer where it is one to fit precision (a context length), else x."""
    return int(round(x)) if abs(x - round(x)) <= 1e-4 * abs(x) else float(x)
