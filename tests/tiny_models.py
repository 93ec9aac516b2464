"""Tiny random-weight transformers checkpoints for fast, exact engine tests.

Weights are drawn with a larger spread than transformers' default init (std 0.02) so that
logits are far from uniform and greedy decoding has clear winners. Saved in float32.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "phi3")

WEIGHT_STD = 0.1  # linear weights and biases inside the layers
LOGIT_STD = 3.0  # target std of the logits: embedding / lm_head std = LOGIT_STD / sqrt(hidden)
NORM_STD = 0.1  # RMSNorm weights ~ N(1, NORM_STD)
SHARD_SIZE = "1MB"  # small enough that every tiny model is split into several shards

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


# A llama3 rope scaling whose original context (256) short prompts already exceed.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

def make_tiny_model(
    path: Path,
    arch: str = "llama",
    *,
    vocab_size: int = 49152,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_scaling: Optional[dict[str, Any]] = None,
    max_position_embeddings: int = 2048,
    sharded: bool = False,
    seed: int = 0,
    tokenizer_from: Optional[Path] = None,
    head_dim: Optional[int] = None,
    extra_config: Optional[dict[str, Any]] = None,
) -> Path:
    """Build a random-weight `arch` model and save it as an HF directory at `path`.

    arch: "llama" (LlamaForCausalLM), "mistral" (MistralForCausalLM, no sliding window)
    "qwen2" (Qwen2ForCausalLM, with q/k/v biases), "qwen3" (Qwen3ForCausalLM, q/k norms), "gemma2"
    (Gemma2ForCausalLM), "gemma3" (Gemma3ForCausalLM, the text model) or "olmo2" (Olmo2ForCausalLM) or "phi3" (Phi3ForCausalLM); head_dim defaults to
    hidden_size / num_heads for every arch (Gemma's configs default to 256).
    `extra_config`: more config fields (attention_bias, mlp_bias, sliding_window, use_sliding_window,
    max_window_layers, ...), applied last; every 1-D weight (norm gains, biases) is randomised. `rope_scaling` is the HF dict, e.g.
    {"rope_type": "llama3", "factor": 8.0, ...}; transformers 5 writes it into config.json
    as `rope_parameters` (together with `rope_theta`). `tokenizer_from` copies tokenizer
    files and generation_config.json from an HF directory (e.g. the SmolLM2 one).
    """
    config_cls, model_cls = _arch_classes(arch)
    config_kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        bos_token_id=1,  # SmolLM2's <|im_start|> / <|im_end|>
        eos_token_id=2,
    )
    if rope_scaling is not None:
        config_kwargs["rope_scaling"] = dict(rope_scaling)
    if arch == "mistral":
        config_kwargs["sliding_window"] = None
    config_kwargs["head_dim"] = head_dim or hidden_size // num_heads
    config_kwargs.update(extra_config or {})
    config = config_cls(**config_kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _spread_init(model, vocab_std=LOGIT_STD / hidden_size**0.5)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    max_shard_size = SHARD_SIZE if sharded else "50GB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer_from is not None:
        _copy_tokenizer(Path(tokenizer_from), path)
    return path


def _arch_classes(arch: str) -> tuple[type, type]:
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    return classes[arch]


@torch.no_grad()
def _spread_init(model: torch.nn.Module, vocab_std: float) -> None:
    # NOTE: named_parameters() yields a tied lm_head/embedding weight once.
    for name, param in model.named_parameters():
        if param.ndim == 1 and name.endswith("norm.weight"):
            param.normal_(1.0, NORM_STD)
        elif param.ndim == 1:  # biases: a dropped one shows
            param.normal_(0.0, WEIGHT_STD)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            param.normal_(0.0, vocab_std)
        else:  # linear weights, q/k/v biases
            param.normal_(0.0, WEIGHT_STD)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"no tokenizer.json in {src}")
    for name in copied:
        shutil.copyfile(src / name, dst / name)


EOS_CHANNEL = 0  # the hidden dimension that rig_eos_trigger reserves for its EOS signal
TRIGGER_NORM = 100.0  # the trigger token's embedding: TRIGGER_NORM * e[EOS_CHANNEL]
EOS_LOGIT_SCALE = 10.0  # lm_head[eos] = EOS_LOGIT_SCALE * e[EOS_CHANNEL]


@torch.no_grad()
def rig_eos_trigger(model: torch.nn.Module, eos_token_id: int, trigger_token: Optional[int] = None) -> None:
    """Rig a random llama-family HF model in place so that greedy decoding emits
    `eos_token_id` right after `trigger_token` is fed in, and never otherwise.

    NOTE: one hidden dimension c = EOS_CHANNEL is cleared in every embedding row, every
    o_proj / down_proj output row and every lm_head column, so the residual stream's
    dimension c is exactly the input token's embedding[c] at every position:

        embedding[t, c] = 0 (t != trigger)    ->  h[c] = 0  ->  logit[eos] = 0 exactly,
                                                  below the max of the other ~N(0, 3) logits
        embedding[trigger] = 100 * e_c        ->  h ~ 100 * e_c + O(1)  ->  after the final
                                                  RMSNorm h[c] ~ sqrt(hidden), other dims ~ 0,
                                                  so logit[eos] ~ 10 * sqrt(hidden) wins

    Only the trigger row differs between trigger_token=None and trigger_token=t, so the two
    models agree exactly on every position before t is first fed in.
    """
    if model.config.tie_word_embeddings:
        raise ValueError("rig_eos_trigger needs separate embedding and lm_head weights")
    c = EOS_CHANNEL
    embed = model.get_input_embeddings().weight  # [V, H]
    head = model.get_output_embeddings().weight  # [V, H]
    embed[:, c] = 0.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[c, :] = 0.0  # [H_out, H_in]: nothing writes dimension c
        layer.mlp.down_proj.weight[c, :] = 0.0
    head[:, c] = 0.0
    head[eos_token_id, :] = 0.0
    head[eos_token_id, c] = EOS_LOGIT_SCALE
    if trigger_token is not None:
        embed[trigger_token, :] = 0.0
        embed[trigger_token, c] = TRIGGER_NORM


def save_tiny_model(model: torch.nn.Module, path: Path, tokenizer_from: Optional[Path] = None) -> Path:
    """Save an (edited) HF model as a float32 HF directory, with tokenizer files copied
    from `tokenizer_from` as in make_tiny_model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_from is not None:
        _copy_tokenizer(Path(tokenizer_from), path)
    return path
