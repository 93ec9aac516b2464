"""Batch-invariant linear and RMSNorm in Triton: the CUDA half of deterministic mode.

    x       [M, K]   rows (model dtype, or float32 for the LM head), last dim contiguous
    weight  [N, K]   the checkpoint's layout, last dim contiguous
    bias    [N] or None
    y       [M, N]   x's dtype

`linear_triton`: one program per (BLOCK_M rows, BLOCK_N columns) tile, k in BLOCK_K steps in
order, float32 accumulation, and one tile shape whatever M is. cuBLAS chooses its algorithm
(tile, split-K, stream-K) by the problem's shape, so a row's product changes with the number
of rows it shares a call with; here each output is the same sequence of fixed-width dot steps
over k whatever the call (rows beyond M are masked to zero and never mix into a real row), so
a row's result is bitwise the same alone or in any batch. 16-bit inputs multiply on the tensor
cores with float32 accumulation; float32 inputs use the "ieee" dot (no TF32). Its reference is
F.linear (evalrun/kernels/ref/linear.py: linear_reference), to the dtype's rounding.

`rms_norm_triton`: one program per row, the row's sum of squares in float32 over one block of
the whole row (a fixed reduction tree for a given width), then x * rsqrt(mean + eps) * w. Its
reference is F.rms_norm (evalrun/kernels/ref/fused.py: rms_norm_reference).

Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) tl.dot is numpy's matmul, which
misreads bf16 and, through OpenBLAS's 6-row micro-kernels, rounds a row differently by its position
in the tile (the GPU's MMA instructions do not). There the dot is emulated instead: inputs widened
to float32 (exact), products summed over each BLOCK_K step in one fixed order for every output.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..ref.linear import Linear
from .triton_attention import interpreting
from .jit import cdiv, jit_kernels, next_power_of_2

if TYPE_CHECKING:              # the kernel bodies' names, bound by jit_kernels
    import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32      # fixed: the tile shape is part of every output's chain


def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx, sw, sy, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr, EMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sx + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)                 # [BM, BK]
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * sw + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)                 # [BK, BN]
        if EMULATE:                     # the interpreter: the same sums for every row position
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * sy + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows [M, K] and a weight [N, K] of one float dtype, last dims contiguous, on one CUDA
    device (any device under the interpreter)."""
    return (x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and x.dtype == weight.dtype
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(1) == 1
            and weight.stride(1) == 1 and x.device == weight.device and (interpreting() or x.is_cuda))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight^T (+ bias), each row bitwise independent of the others in the call."""
    if not supported(x, weight):
        raise ValueError(f"the batch-invariant Triton linear cannot take x {tuple(x.shape)} {x.dtype} {x.device} "
                         f"with weight {tuple(weight.shape)} {weight.dtype} {weight.device}")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    emulate = interpreting()
    grid = (cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))
    kernels()._linear_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0),
                         y.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, EMULATE=emulate,
                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return y


def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, sx, sy, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=0), H * 1.0) + eps))     # IEEE, not approximate
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sy + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows [T, H] with a contiguous last dim and a weight [H] on x's device (CUDA, or any under
    the interpreter)."""
    return (x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],) and weight.device == x.device
            and (interpreting() or x.is_cuda))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, H] (float32 statistics), in x's dtype."""
    if not rms_norm_supported(x, weight):
        raise ValueError(f"the Triton RMSNorm takes rows [T, H] with a contiguous last dim and a weight [H], "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        kernels()._rms_norm_kernel[(x.shape[0],)](x, weight, y, x.shape[1], x.stride(0), y.stride(0), eps,
                                        BLOCK=next_power_of_2(x.shape[1]))
    return y


def linear_invariant_triton(x: torch.Tensor, lin: Linear, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A batch-invariant Linear on CUDA (kernels/linear.py's kernel for it): rows of any leading shape."""
    y = linear_triton(x.reshape(-1, x.shape[-1]).contiguous(), lin.weight, lin.bias)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if residual is None else residual + y


JIT = (_linear_kernel, _rms_norm_kernel)


@functools.cache
def kernels() -> Any:
    """This module's kernels, jitted on first use (kernels/cuda/jit.py)."""
    return jit_kernels(globals(), JIT)
