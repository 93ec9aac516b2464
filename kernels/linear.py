"""Linear layers: y = x @ w^T (+ b).

Layouts:
    x       [T, in]    model dtype, row-major
    weight  [out, in]  the checkpoint's layout (the reference reads it)
    packed  oneDNN's blocked layout of `weight`, made once at load (CPU, float32 only)
    y       [T, out]   x's dtype

`linear_reference` is F.linear. The CPU path: oneDNN's matmul on the prepacked weight
(`torch.ops.mkldnn._linear_pointwise`) runs ~1.2-1.3x faster than MKL's sgemm at
prefill sizes (T = 2048) on the AVX2 development machine, and as fast as (w @ x^T)^T at
decode sizes (T = 32); without oneDNN, few rows take (w @ x^T)^T, which runs ~1.7x
faster than x @ w^T in MKL below 64 rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

SMALL_M = 64


@dataclass
class Linear:
    weight: torch.Tensor                    # [out, in]
    bias: Optional[torch.Tensor] = None     # [out]
    packed: Optional[torch.Tensor] = None   # oneDNN layout of weight (CPU float32), or None

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def linear_backend(device: str | torch.device, dtype: torch.dtype) -> str:
    """What `make_linear` + `linear` run on: "onednn-prepacked" (CPU float32) or "torch"."""
    cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    return "onednn-prepacked" if cpu_fp32 and onednn_available() else "torch"


def make_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pack: bool = True) -> Linear:
    """A Linear; on CPU in float32 with oneDNN (and `pack`), with the weight prepacked."""
    packed = None
    if pack and linear_backend(weight.device, weight.dtype) == "onednn-prepacked":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return Linear(weight, bias, packed)


def linear_reference(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = F.linear(x, lin.weight, lin.bias)
    return y if residual is None else residual + y


def linear(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ w^T (+ b) (+ residual). Dispatch: oneDNN on a packed weight (the residual add
    fused as a post-op: one pass over the output instead of two), else (w @ x^T)^T for
    few CPU rows, else F.linear."""
    if lin.packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        if residual is not None and residual.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(),
                                                             lin.packed, lin.bias, "add")
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), lin.packed, lin.bias, "none", [], "")
    elif x.device.type != "cpu" or x.shape[0] > SMALL_M:
        y = F.linear(x, lin.weight, lin.bias)
    else:
        y = torch.mm(lin.weight, x.t()).t()
        y = (y if lin.bias is None else y + lin.bias).contiguous()
    return y if residual is None else residual + y
