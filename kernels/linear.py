"""Linear layers: y = x @ w^T (+ b).

Layouts:
    x       [T, in]    model dtype, row-major
    weight  [out, in]  the checkpoint's layout (the reference reads it)
    panels  the native GEMM's layout of `weight` (kernels/gemm.py), made once at load
    packed  oneDNN's blocked layout of `weight`, made once at load (when panels cannot be used)
    y       [T, out]   x's dtype

`linear_reference` is F.linear. CPU float32 paths, chosen once per weight by `linear_backend`:
  native-gemm       kernels/csrc/gemm.c (AVX2 + FMA): on the 2-core AVX2 development machine
                    1.1-1.3x oneDNN's speed at 8-256 rows and 1.4-2x at one row, and as fast
                    at 2048 (benchmarks/bench_linear.py); bitwise batch-invariant at every M
  onednn-prepacked  oneDNN's matmul on the prepacked weight (`torch.ops.mkldnn._linear_pointwise`)
  torch             without either, F.linear, or (w @ x^T)^T for few rows (~1.7x faster than
                    x @ w^T in MKL below 64 rows)
`EVALRUN_LINEAR=native|onednn|torch` asks for one (benchmarks compare them); a path that cannot
run here falls back to the next with a logged reason.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import gemm, native

log = logging.getLogger(__name__)

SMALL_M = 64


@dataclass
class Linear:
    weight: torch.Tensor                    # [out, in]
    bias: Optional[torch.Tensor] = None     # [out]
    packed: Optional[torch.Tensor] = None   # oneDNN layout of weight (CPU float32), or None
    panels: Optional[torch.Tensor] = None   # the native GEMM's layout of weight (CPU float32), or None

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


BACKENDS = ("native", "onednn", "torch")
_logged: set[str] = set()


def _note_once(msg: str, quiet: bool = False) -> None:
    """Log msg once per process; at info level when the user chose it (quiet)."""
    if msg not in _logged:
        _logged.add(msg)
        (log.info if quiet else log.warning)(msg)


def linear_backend(device: str | torch.device, dtype: torch.dtype) -> str:
    """What `make_linear` + `linear` run on: "native-gemm" or "onednn-prepacked" (CPU float32,
    in that order of preference), else "torch"."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "torch"
    choice = os.environ.get("EVALRUN_LINEAR", "").strip().lower() or "native"
    if choice not in BACKENDS:
        _note_once(f"EVALRUN_LINEAR={choice!r} is not one of {', '.join(BACKENDS)}: using the default")
        choice = "native"
    if choice == "native":
        reason = gemm.unavailable_reason()
        if reason is None:
            asked = os.environ.get("EVALRUN_GEMM_WIDTH")
            if asked is not None and asked not in ("256", "512"):
                _note_once(f"EVALRUN_GEMM_WIDTH={asked!r} is not 256 or 512: "
                           f"the GEMM uses {gemm.width()}-bit tiles")
            return "native-gemm"
        _note_once(f"float32 linears: {reason}; using oneDNN or torch instead", quiet=not native.enabled())
        choice = "onednn"
    if choice == "onednn" and onednn_available():
        return "onednn-prepacked"
    return "torch"


def make_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pack: bool = True) -> Linear:
    """A Linear; on CPU in float32 (and `pack`), with the weight prepacked for the backend."""
    packed = panels = None
    backend = linear_backend(weight.device, weight.dtype) if pack else "torch"
    if backend == "native-gemm":
        panels = gemm.pack(weight)
    elif backend == "onednn-prepacked":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return Linear(weight, bias, packed, panels)


def linear_reference(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = F.linear(x, lin.weight, lin.bias)
    return y if residual is None else residual + y


def linear(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ w^T (+ b) (+ residual). Dispatch: the native GEMM on its panels (bias and residual
    added as each output is stored), oneDNN on a packed weight (the residual add fused as a
    post-op), else (w @ x^T)^T for few CPU rows, else F.linear."""
    if lin.panels is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        if residual is not None and residual.dtype != torch.float32:
            return residual + gemm.gemm(x, lin.panels, lin.weight.shape[0], lin.bias)
        return gemm.gemm(x, lin.panels, lin.weight.shape[0], lin.bias, residual)
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
