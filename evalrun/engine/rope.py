"""Rotary position embedding tables (HF "rotate_half" layout).

inv_freq is computed in float32 exactly as transformers does, so positions in
the thousands give the same angles as the reference.
"""
from __future__ import annotations

import math

import torch

from .config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) after the configured scaling (head_dim: the
    rotary dim where rotation is partial). longrope: its short factors (config.py says why)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.rope_type == "longrope":
        if len(rope.short_factor) != head_dim // 2:
            raise ValueError(f"longrope short_factor has {len(rope.short_factor)} values, the rotary dim "
                             f"{head_dim} needs {head_dim // 2}")
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta ** exponents)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(inv_freq: torch.Tensor, max_positions: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] in float32 (times `scale`: longrope's attention factor)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)          # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)           # [S, D]
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()
