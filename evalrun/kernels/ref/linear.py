"""Linear layers, torch reference: y = x @ w^T (+ b) (+ residual).

Layouts:
    x       [T, in]    model dtype, row-major
    weight  [out, in]  the checkpoint's layout (the reference reads it)
    panels  the native GEMM's layout of `weight` (kernels/cpu/gemm.py), made once at load
    packed  oneDNN's blocked layout of `weight`, made once at load
    y       [T, out]   x's dtype

A `Linear` carries the kernel it was packed for (`kernel`, chosen once by kernels/linear.py
make_linear): `linear(x, lin)` calls it, with no check per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

SMALL_M = 64


def linear_reference(x: torch.Tensor, lin: "Linear", residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = F.linear(x, lin.weight, lin.bias)
    return y if residual is None else residual + y


def linear_torch(x: torch.Tensor, lin: "Linear", residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, or (w @ x^T)^T for few CPU rows (~1.7x faster than x @ w^T in MKL below 64 rows)."""
    if x.device.type != "cpu" or x.shape[0] > SMALL_M:
        y = F.linear(x, lin.weight, lin.bias)
    else:
        y = torch.mm(lin.weight, x.t()).t()
        y = (y if lin.bias is None else y + lin.bias).contiguous()
    return y if residual is None else residual + y


LinearFn = Callable[[torch.Tensor, "Linear", Optional[torch.Tensor]], torch.Tensor]


@dataclass
class Linear:
    weight: torch.Tensor                    # [out, in]
    bias: Optional[torch.Tensor] = None     # [out]
    packed: Optional[torch.Tensor] = None   # oneDNN layout of weight (CPU float32), or None
    panels: Optional[torch.Tensor] = None   # the native GEMM's layout of weight (CPU float32), or None
    invariant: bool = False                 # batch-invariant (deterministic mode): panels on CPU, Triton on CUDA
    kernel: LinearFn = linear_torch         # what `linear` runs: chosen with the layout, once
    kernel_name: str = "torch"

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


FLT_MIN = torch.finfo(torch.float32).tiny


def _ftz(t: torch.Tensor) -> torch.Tensor:
    """Denormal float32 values as zeros of their sign (FTZ/DAZ)."""
    return torch.where(t.abs() < FLT_MIN, t * 0.0, t)


PAIR_ORDERS = ("odd_first", "even_first", "split16")
AMX_BLOCK_PAIRS = 16                        # k pairs per AMX tile step (one 64-byte A tile row)


def dot_bf16_reference(x: torch.Tensor, weight: torch.Tensor, pair_order: str = "odd_first") -> torch.Tensor:
    """bf16(x) [M, K] @ bf16(weight) [N, K]^T as the bf16 GEMM (kernels/cpu/gemm_bf16.py) computes it:
    float32 sums over the k pairs in order (each product exact, each add rounded to nearest even),
    denormal inputs and sums flushed to zero. `pair_order` says how a pair's products enter:
      "odd_first"   one chain per output, element 2i+1's product then element 2i's: `vdpbf16ps`
                    (measured), the native and emulated paths;
      "even_first"  one chain, element 2i's product then 2i+1's: `tdpbf16ps` as Intel's Intrinsics
                    Guide writes `_tile_dpbf16ps`;
      "split16"     per block of 16 pairs (the last block the rest), the even and the odd products in
                    two chains from +0, their sum then added to the output's sum: `tdpbf16ps` as the
                    SDM's pseudocode writes it.
    (AMX hardware has not been checked against either.) Exact to the bit where no product is
    denormal. Slow (one step per pair): a test reference."""
    if pair_order not in PAIR_ORDERS:
        raise ValueError(f"pair_order {pair_order!r} is not one of {', '.join(PAIR_ORDERS)}")
    xb = _ftz(x.to(torch.bfloat16).float())
    wb = _ftz(weight.to(torch.bfloat16).float())
    if xb.shape[1] % 2:
        xb, wb = torch.nn.functional.pad(xb, (0, 1)), torch.nn.functional.pad(wb, (0, 1))
    acc = torch.zeros(xb.shape[0], wb.shape[0], dtype=torch.float32)       # [M, N]
    if pair_order == "split16":
        return _split_blocks(xb, wb, acc, AMX_BLOCK_PAIRS)
    for i in range(0, xb.shape[1], 2):
        for k in ((i + 1, i) if pair_order == "odd_first" else (i, i + 1)):
            acc = _ftz(acc + xb[:, k, None] * wb[None, :, k])
    return acc


def _split_blocks(xb: torch.Tensor, wb: torch.Tensor, acc: torch.Tensor, block: int) -> torch.Tensor:
    """acc += (even chain + odd chain) per block of `block` pairs, each chain from +0 (FTZ throughout)."""
    for b0 in range(0, xb.shape[1], 2 * block):
        even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
        for i in range(b0, min(b0 + 2 * block, xb.shape[1]), 2):
            even = _ftz(even + xb[:, i, None] * wb[None, :, i])
            odd = _ftz(odd + xb[:, i + 1, None] * wb[None, :, i + 1])
        acc = _ftz(acc + _ftz(even + odd))
    return acc
