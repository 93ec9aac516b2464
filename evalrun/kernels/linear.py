"""Linear layers: y = x @ w^T (+ b).

Layouts:
    x       [T, in]    model dtype, row-major
    weight  [out, in]  the checkpoint's layout (the reference reads it)
    panels  the native GEMM's layout of `weight` (evalrun/kernels/gemm.py), made once at load
    packed  oneDNN's blocked layout of `weight`, made once at load (when panels cannot be used)
    y       [T, out]   x's dtype

`linear_reference` is F.linear. CPU float32 paths, chosen once per weight by `linear_backend`:
  native-gemm       evalrun/kernels/csrc/gemm.c (AVX2 + FMA): on the 2-core AVX2 development machine
                    1.1-1.3x oneDNN's speed at 8-256 rows and 1.4-2x at one row, and as fast
                    at 2048 (benchmarks/bench_linear.py); bitwise batch-invariant at every M
  onednn-prepacked  oneDNN's matmul on the prepacked weight (`torch.ops.mkldnn._linear_pointwise`)
  torch             without either, F.linear, or (w @ x^T)^T for few rows (~1.7x faster than
                    x @ w^T in MKL below 64 rows)
`EVALRUN_LINEAR=native|onednn|torch` asks for one (benchmarks compare them); a path that cannot
run here falls back to the next with a logged reason.

Batch-invariant linears (`make_linear(..., invariant=True)`, the engine's deterministic mode): the
native GEMM for every CPU dtype, whatever EVALRUN_LINEAR says. A bfloat16/float16 weight is
widened to float32 panels (exact), the rows are widened (exact), each output is one float32 FMA
chain over k in order (a product of two bf16 values is exact in float32, so this is bf16 inputs
with float32 accumulation, as tensor cores do), and the result is rounded to the rows' dtype
once. No output depends on the other rows of the call, unlike oneDNN's or MKL's bf16 matmuls,
whose blocking changes with the number of rows. On CUDA the same contract is met by
evalrun/kernels/triton_linear.py (one fixed Triton tile shape, float32 accumulation) instead of cuBLAS.
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
    invariant: bool = False                 # batch-invariant (deterministic mode): panels on CPU, Triton on CUDA

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


def linear_backend(device: str | torch.device, dtype: torch.dtype, invariant: bool = False) -> str:
    """What `make_linear` + `linear` run on: "native-gemm" or "onednn-prepacked" (CPU float32,
    in that order of preference), else "torch"; batch-invariant linears "native-gemm" on the CPU
    (any dtype) and "triton-linear" on CUDA."""
    if invariant:
        return "triton-linear" if torch.device(device).type == "cuda" else "native-gemm"
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


def invariant_unavailable_reason(device: str | torch.device) -> Optional[str]:
    """Why batch-invariant linears cannot run on `device`, or None when they can."""
    kind = torch.device(device).type
    if kind == "cuda":
        import importlib.util
        return None if importlib.util.find_spec("triton") else "batch-invariant CUDA linears need triton"
    if kind != "cpu":
        return f"batch-invariant linears are built for the CPU and CUDA, not {kind}"
    reason = gemm.unavailable_reason()
    return None if reason is None else f"batch-invariant linears need the native GEMM: {reason}"


def make_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pack: bool = True,
                invariant: bool = False) -> Linear:
    """A Linear; on CPU in float32 (and `pack`), with the weight prepacked for the backend.
    invariant: the native GEMM's float32 panels for any dtype (ValueError where it cannot run)."""
    packed = panels = None
    if invariant:
        reason = invariant_unavailable_reason(weight.device)
        if reason is not None:
            raise ValueError(reason)
        if weight.device.type == "cuda":
            return Linear(weight.contiguous(), bias, invariant=True)
        return Linear(weight, bias, None, gemm.pack(weight.float()), invariant=True)
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
    post-op), else (w @ x^T)^T for few CPU rows, else F.linear; a batch-invariant Linear on CUDA
    through evalrun/kernels/triton_linear.py."""
    if lin.invariant and x.device.type == "cuda":
        from . import triton_linear                   # imports triton: only on this path
        y = triton_linear.linear_triton(x.reshape(-1, x.shape[-1]).contiguous(), lin.weight, lin.bias)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if residual is None else residual + y
    if lin.panels is not None and x.device.type == "cpu":
        if x.dtype != torch.float32:            # invariant low-precision linear: float32 chains, one rounding
            y = gemm.gemm(x.float(), lin.panels, lin.weight.shape[0], lin.bias).to(x.dtype)
            return y if residual is None else residual + y
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
