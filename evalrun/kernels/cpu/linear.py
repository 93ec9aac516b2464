"""CPU linears on prepacked weights (same signature as kernels/ref/linear.py linear_torch).

    linear_gemm           float32 rows on the native GEMM's panels (kernels/cpu/gemm.py): bias and
                          residual added as each output is stored; bitwise batch-invariant at every M
    linear_gemm_widening  bfloat16/float16 rows of a batch-invariant Linear: rows widened to float32
                          (exact), one float32 FMA chain per output, rounded to the rows' dtype once
    linear_onednn         float32 rows on oneDNN's prepacked weight, the residual add fused as a post-op
    linear_bf16           float32 or bfloat16 rows on the native bf16 GEMM's panels (kernels/cpu/gemm_bf16.py):
                          bf16 products, float32 chains in vdpbf16ps order; bias and residual added in
                          float32, one rounding to the rows' dtype; bitwise batch-invariant at every M
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ref.linear import Linear
from . import gemm, gemm_bf16


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear_gemm(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    if residual is not None and residual.dtype != torch.float32:
        return residual + gemm.gemm(x, lin.panels, lin.weight.shape[0], lin.bias)
    return gemm.gemm(x, lin.panels, lin.weight.shape[0], lin.bias, residual)


def linear_gemm_widening(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of any float dtype: float32 chains, one rounding to x's dtype (float32 rows: linear_gemm)."""
    if x.dtype == torch.float32:
        return linear_gemm(x, lin, residual)
    y = gemm.gemm(x.float(), lin.panels, lin.weight.shape[0], lin.bias).to(x.dtype)
    return y if residual is None else residual + y


def linear_onednn(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    if residual is not None and residual.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(),
                                                         lin.packed, lin.bias, "add")
    y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), lin.packed, lin.bias, "none", [], "")
    return y if residual is None else residual + y


def linear_bf16(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return gemm_bf16.gemm(x, lin.panels, lin.weight.shape[0], lin.bias, residual)
