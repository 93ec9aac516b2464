"""Torch reference of the quantized KV cache ops (formats in evalrun/kernels/kv_format.py).

    x        [..., D]                 float vectors (keys or values of some tokens and heads)
    codes    [..., D * bits / 8]      uint8
    scales   [..., D / G]             float16, one per group of G = group_size values

quantize: optionally rotate each group by the orthonormal Walsh-Hadamard matrix H
(x_g -> x_g @ H), then scale = max|x_g| / qmax (qmax 127 for 8 bits, 7 for 4), rounded
*up* to float16 so no code clips (except beyond float16's range, max|x_g| > 65504 * qmax,
where codes clip instead of overflowing), and code = round(x_g / scale). dequantize returns
code * scale in the rotated domain; `rotate` again undoes the rotation (H @ H = I).
Per value the error is at most scale / 2 in the rotated domain, so at most
sqrt(G) * scale / 2 per group in L2 after rotating back.
"""
from __future__ import annotations

import functools

import torch

QMAX = {8: 127, 4: 7}
OFFSET = {8: 128, 4: 8}


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:                                   # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def hadamard(n: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The n x n orthonormal Walsh-Hadamard matrix (n a power of two), float32, symmetric."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Walsh-Hadamard matrix needs a power-of-two size, got {n}")
    return _hadamard_cpu(n).to(device)


def rotate(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each group of group_size values along the last dim times H, as a fast Walsh-Hadamard
    transform (log2(G) butterfly stages of adds and subtracts, float32 result). Element-wise
    ops only, so a row's result never depends on how many rows share the call (a matmul's
    blocking does, and one rounding flip would change a code)."""
    shape = x.shape
    y = x.float().reshape(-1, group_size)                                     # [N, G]
    h = 1
    while h < group_size:                                                     # pairs (i, i + h) in blocks of 2h
        pairs = y.view(-1, group_size // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(-1, group_size)
        h *= 2
    return (y * group_size ** -0.5).reshape(shape)


def quantize(x: torch.Tensor, bits: int, group_size: int, rotation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D * bits / 8] uint8, scales [..., D / G] float16)."""
    qmax = QMAX[bits]
    xr = rotate(x, group_size) if rotation else x.float()
    g = xr.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)      # [..., D/G, G]
    amax = g.abs().amax(dim=-1)                                                  # [..., D/G]
    exact = amax / torch.full_like(amax, qmax)   # a tensor divisor: IEEE division on CUDA too (a scalar
                                                 # one becomes a multiply by its reciprocal there)
    fp16_max = torch.finfo(torch.float16).max
    scale = exact.clamp(max=fp16_max).half()
    short = scale.float() < exact                        # rounded down: bump one ulp (beyond the
    bumped = torch.nextafter(scale, torch.full_like(scale, float("inf")))     # fp16 range: clip)
    scale = torch.where(short & (scale < fp16_max), bumped, scale)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = torch.round(g / divisor[..., None]).clamp_(-qmax, qmax).to(torch.int16) + OFFSET[bits]
    codes = codes.reshape(*x.shape[:-1], x.shape[-1]).to(torch.uint8)
    if bits == 4:                       # byte j of a group: element j low, element j + G/2 high
        halves = codes.reshape(*x.shape[:-1], x.shape[-1] // group_size, 2, group_size // 2)
        codes = (halves[..., 0, :] | (halves[..., 1, :] << 4)).flatten(-2)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """(codes, scales) -> float32 [..., D], still in the rotated domain when it was rotated."""
    if bits == 4:                       # [..., D/G, G/2] bytes -> [..., D/G, G] codes
        g = codes.reshape(*codes.shape[:-1], codes.shape[-1] * 2 // group_size, group_size // 2)
        codes = torch.cat([g & 15, g >> 4], dim=-1).flatten(-2)                 # [..., D]
    d = codes.shape[-1]
    values = codes.to(torch.int16).sub_(OFFSET[bits]).float()
    g = values.reshape(*codes.shape[:-1], d // group_size, group_size)
    return (g * scales.float()[..., None]).reshape(*codes.shape[:-1], d)
