"""Which kernel each linear runs, chosen once when its weight is packed (at load).

`make_linear` packs a weight for one kernel and stores that kernel on the `Linear`
(kernels/ref/linear.py); `linear(x, lin)` calls it, with no check per call. CPU float32 kernels,
in order of preference (`linear_backend`):
  native-gemm       kernels/cpu/csrc/gemm.c (AVX2 + FMA): on the 2-core AVX2 development machine
                    1.1-1.3x oneDNN's speed at 8-256 rows and 1.4-2x at one row, and as fast
                    at 2048 (benchmarks/bench_linear.py); bitwise batch-invariant at every M
  onednn-prepacked  oneDNN's matmul on the prepacked weight (`torch.ops.mkldnn._linear_pointwise`)
  torch             without either, F.linear, or (w @ x^T)^T for few rows
`EVALRUN_LINEAR=native|onednn|torch` asks for one (benchmarks compare them); a kernel that cannot
run here is replaced by the next when the weight is packed, with a logged reason.

CPU bfloat16 kernel:
  native-bf16       kernels/cpu/csrc/gemm_bf16.c: bf16 weight panels, rows rounded to bf16, products
                    accumulated in float32 in `vdpbf16ps` order (AVX512_BF16) — batch-invariant by
                    construction, so deterministic mode costs nothing in bf16. The default where the
                    CPU has AVX512_BF16; elsewhere bf16 linears are torch's (emulated bf16), and the
                    bf16 GEMM's emulated tiles (the same bits, slower) serve deterministic mode.

Batch-invariant linears (`make_linear(..., invariant=True)`, the engine's deterministic mode): the
bf16 GEMM for bfloat16 weights (native or emulated: the same bits on every CPU), the float32
native GEMM for the other CPU dtypes, whatever EVALRUN_LINEAR says. A bfloat16/float16 weight is
widened to float32 panels (exact), the rows are widened (exact), each output is one float32 FMA
chain over k in order (a product of two bf16 values is exact in float32, so this is bf16 inputs
with float32 accumulation, as tensor cores do), and the result is rounded to the rows' dtype
once. No output depends on the other rows of the call, unlike oneDNN's or MKL's bf16 matmuls,
whose blocking changes with the number of rows. On CUDA the same contract is met by
kernels/cuda/triton_linear.py (one fixed Triton tile shape, float32 accumulation) instead of cuBLAS.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

import torch

from .cpu import gemm, gemm_bf16, native
from .cpu.linear import (linear_bf16, linear_gemm, linear_gemm_widening, linear_onednn, onednn_available,
                         onednn_pack)
from .cuda.triton_linear import linear_invariant_triton
from .ref.linear import Linear, linear_reference

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "Linear", "invariant_unavailable_reason", "linear", "linear_backend", "linear_reference",
           "make_linear", "onednn_available"]

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
        if torch.device(device).type == "cuda":
            return "triton-linear"
        return "native-bf16" if dtype == torch.bfloat16 and gemm_bf16.available() else "native-gemm"
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "torch"
    choice = os.environ.get("EVALRUN_LINEAR", "").strip().lower() or "native"
    if choice not in BACKENDS:
        _note_once(f"EVALRUN_LINEAR={choice!r} is not one of {', '.join(BACKENDS)}: using the default")
        choice = "native"
    if dtype == torch.bfloat16:
        return "native-bf16" if choice == "native" and gemm_bf16.native_instructions() else "torch"
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
        return None if importlib.util.find_spec("triton") else "batch-invariant CUDA linears need triton"
    if kind != "cpu":
        return f"batch-invariant linears are built for the CPU and CUDA, not {kind}"
    reason = gemm.unavailable_reason()
    return None if reason is None else f"batch-invariant linears need the native GEMM: {reason}"


def make_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pack: bool = True,
                invariant: bool = False) -> Linear:
    """A Linear packed for its kernel; on CPU in float32 (and `pack`) the native GEMM's or oneDNN's
    layout, in bfloat16 the bf16 GEMM's where linear_backend picks it. invariant: the bf16 GEMM for
    bfloat16, the native GEMM's float32 panels for the other dtypes, or the Triton linear on CUDA
    (ValueError where none can run)."""
    if invariant:
        reason = invariant_unavailable_reason(weight.device)
        if reason is not None:
            raise ValueError(reason)
    backend = linear_backend(weight.device, weight.dtype, invariant) if pack or invariant else "torch"
    if backend == "native-bf16":                   # batch-invariant by construction, invariant or not
        return Linear(weight, bias, panels=gemm_bf16.pack(weight), invariant=True, kernel=linear_bf16,
                      kernel_name=backend)
    if backend == "triton-linear":
        return Linear(weight.contiguous(), bias, invariant=True, kernel=linear_invariant_triton, kernel_name=backend)
    if invariant:                                  # native-gemm on float32 panels, rows widened
        return Linear(weight, bias, None, gemm.pack(weight.float()), invariant=True, kernel=linear_gemm_widening,
                      kernel_name=backend)
    if backend == "native-gemm":
        return Linear(weight, bias, panels=gemm.pack(weight), kernel=linear_gemm, kernel_name=backend)
    if backend == "onednn-prepacked":
        return Linear(weight, bias, packed=onednn_pack(weight), kernel=linear_onednn, kernel_name=backend)
    return Linear(weight, bias)


def linear(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None,
           out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x @ w^T (+ b) (+ residual) through the kernel `lin` was packed for. out_dtype (default x's): the
    result's dtype, where the rows come rounded for the bf16 GEMM (bfloat16) but the stream is float32;
    other kernels take such rows widened (exact)."""
    if out_dtype is None or out_dtype == x.dtype:
        return lin.kernel(x, lin, residual)
    if lin.kernel is linear_bf16:
        return gemm_bf16.gemm(x, lin.panels, lin.weight.shape[0], lin.bias, residual, out_dtype)
    return lin.kernel(x.to(out_dtype), lin, residual)
