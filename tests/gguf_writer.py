"""Writing a Hugging Face model directory (tests/tiny_models.py) as a llama.cpp GGUF file, the way
llama.cpp's convert_hf_to_gguf.py does, with the `gguf` package: metadata under llama.cpp's keys,
tensors under its names, a llama's q and k permuted for its rope, llama3 rope scaling as
`rope_freqs`, the tokenizer copied from another GGUF file (SmolLM2's, whose vocabulary the tiny
models share).

Written independently of evalrun/engine/gguf.py (its own name table and permutation), so a test
of that reader is not a test of itself.

Types: "F32", "F16", "BF16", "Q8_0" (gguf.quants.quantize) and the k-quants "Q4_K", "Q5_K", "Q6_K",
which gguf-py can de-quantize but not quantize: their blocks are written with random quants and
small scales, so the file's weights are what those blocks decode to (both readers decode the same
bits, which is what a comparison needs).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
from gguf.quants import quantize
from safetensors.numpy import load_file

NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
              "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
              "Q5_K": LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K}
# k-quant blocks of 256 values: bytes, offset of the fp16 scale d, of dmin (None: none), d's range and
# dmin / d (centring a block's values near 0: value = d * scale * q - dmin * min, q up to 15 / 31)
KQUANT_BLOCKS = {"Q4_K": (144, 0, 2, (2e-4, 6e-4), 7.5), "Q5_K": (176, 0, 2, (1e-4, 3e-4), 15.5),
                 "Q6_K": (210, 208, None, (5e-5, 1.5e-4), 0.0)}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def read_tokenizer_fields(gguf_path: Path) -> dict[str, object]:
    """The tokenizer metadata of a GGUF file, to write into others."""
    reader = GGUFReader(gguf_path)
    return {k: reader.fields[k].contents() for k in TOKENIZER_KEYS if k in reader.fields}


def write_gguf(model_dir: Path, out: Path, qtype: str, tokenizer: Optional[dict[str, object]] = None, *,
               embed_qtype: Optional[str] = None, seed: int = 0, arch: Optional[str] = None,
               metadata: Optional[dict[str, int]] = None, extra_tensors: Optional[dict[str, np.ndarray]] = None,
               drop: tuple[str, ...] = ()) -> Path:
    """model_dir (config.json + model.safetensors) as the GGUF file `out`: 1-D tensors in F32, the
    token embedding in `embed_qtype` (default: qtype), every other matrix in `qtype`. No tokenizer:
    a file for the model alone. For bad files: `arch` instead of the config's, more uint32
    `metadata` ({arch}.KEY), `extra_tensors` (HF names), the HF tensors in `drop` left out."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = arch or config["model_type"]
    writer = GGUFWriter(out, arch)
    _write_config(writer, config, arch, FILE_TYPES[qtype])
    for key, value in (metadata or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)
    if tokenizer is not None:
        _write_tokenizer(writer, tokenizer)
    rng = np.random.default_rng(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    if "rope_parameters" in config and config["rope_parameters"].get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_freqs(config)
    for name, value in sorted({**tensors, **(extra_tensors or {})}.items()):
        if name in drop:
            continue
        value = _llama_permute(name, value.astype(np.float32), config) if arch == "llama" else value.astype(np.float32)
        kind = "F32" if value.ndim == 1 else embed_qtype or qtype if "embed_tokens" in name else qtype
        data, raw = _encode(value, kind, rng)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_config(writer: GGUFWriter, config: dict, arch: str, file_type: LlamaFileType) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)


def _write_tokenizer(writer: GGUFWriter, fields: dict[str, object]) -> None:
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(fields["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(fields["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(bool(fields["tokenizer.ggml.add_bos_token"]))
    writer.add_chat_template(fields["tokenizer.chat_template"])


def _gguf_name(name: str) -> str:
    """llama.cpp's name of an HF tensor; a name that is not an HF one (rope_freqs.weight) as it is."""
    base, kind = name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{NAMES[part]}.{kind}"
    return f"{NAMES[base]}.{kind}" if base in NAMES else name


def _llama_permute(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """llama.cpp's converter: per head, rows (i, i + D/2) become (2i, 2i + 1)."""
    if ".q_proj." in name:
        heads = config["num_attention_heads"]
    elif ".k_proj." in name:
        heads = config["num_key_value_heads"]
    else:
        return w
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(config: dict) -> np.ndarray:
    """rope_freqs as llama.cpp's converter computes them for a llama3 rope scaling."""
    rope = config["rope_parameters"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _encode(value: np.ndarray, kind: str,
            rng: np.random.Generator) -> tuple[np.ndarray, Optional[GGMLQuantizationType]]:
    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        return value, None
    if kind == "F16":
        return value.astype(np.float16), None
    if kind not in KQUANT_BLOCKS:
        return quantize(value, qtype), qtype
    block_bytes, d_at, dmin_at, (lo, hi), ratio = KQUANT_BLOCKS[kind]
    rows, cols = value.shape
    assert cols % 256 == 0, f"{kind} rows are 256 values, got {cols}"
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    d = rng.uniform(lo, hi, size=(rows, cols // 256, 1))
    blocks[:, :, d_at:d_at + 2] = d.astype(np.float16).view(np.uint8)
    if dmin_at is not None:
        blocks[:, :, dmin_at:dmin_at + 2] = (d * ratio).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1), qtype
