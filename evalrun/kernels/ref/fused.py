"""Element-wise ops of a layer, torch reference: RMSNorm, rope, SiLU(gate) * up, and the per-row
argmax / finiteness of logits. The native versions (kernels/cpu/fused.py) are checked against these.

    x        [T, H]    rows                   rms_norm_reference(x, w, eps) -> [T, H]
    gate_up  [T, 2I]   [gate | up] per row    silu_mul_reference(gate_up)   -> [T, I]
                                              gelu_tanh_mul_reference(gate_up) -> [T, I] (GeGLU)
    qkv      [T, (Hq + 2 Hkv) D]              rope_write_reference -> q, k, v [T, H, D]
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows; float32 weights with 16-bit rows (Gemma's (1 + w)): in float32, rounded once."""
    if w.dtype != x.dtype:
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (may be a strided view); cos/sin [T, D] already gathered at the tokens'
    positions. Returns a new [T, H, D] tensor: x * cos + rotate_half(x) * sin, computed as
    one multiply and two multiply-adds on the halves (no concatenated copy of x). Tables [T, R]
    with R < D: partial rotary (the first R values rotated, the rest passed through)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def rope_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
                         write: Callable[[torch.Tensor, torch.Tensor], None]) -> tuple[torch.Tensor, ...]:
    """Rope on the q and k heads of the fused QKV rows [T, (hq + 2 hkv) D], then write(k, v);
    returns q, k, v ([T, H, D] views)."""
    t, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
    qk = apply_rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    q, k = qk[:, :hq], qk[:, hq:]
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    write(k, v)
    return q, k, v


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


def finite_rows_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x).all(dim=-1)
