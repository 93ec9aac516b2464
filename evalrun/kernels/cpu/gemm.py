"""The native float32 GEMM for linears (evalrun/kernels/cpu/csrc/gemm.c), through ctypes.

    pack(weight [N, K])                      -> panels: W in 16-column panels, k-major, zero-padded
    gemm(x [M, K], panels, N, bias, residual) -> residual + (x @ W^T + bias)   [M, N]

Each output is one fused multiply-add chain over k in order, so a row's result is bitwise the
same whatever the number of rows in the call (batch invariance), for every M, the prefill's
thousands of rows and a decode step's one. The reference is F.linear (evalrun/kernels/linear.py).
Columns are split over a persistent pool of torch.get_num_threads() threads.

Needs AVX2 and FMA (checked when the library is built for this CPU); `unavailable_reason()`
says why the native path cannot be used, or None. Where the CPU has AVX-512 the tiles use
512-bit registers (`width()`), with the same chains and so bitwise the same outputs.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from . import huge_pages, native

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {
    "gemm_packed_floats": (_I64, [_I32, _I32]),
    "gemm_pack_f32": (_I32, [_P, _I32, _I32, _P]),
    "gemm_f32": (_I32, [_P, _I32, _I32, _I64, _P, _I32, _P, _P, _P, _I32]),
    "gemm_silu_f32": (_I32, [_P, _I32, _I32, _I64, _P, _I32, _P, _I32]),
    "gemm_silu_supported": (_I32, [_I32, _I32]),
    "gemm_width": (_I32, []),
    "gemm_set_width": (_I32, [_I32]),
}
WIDTHS = (512, 256)                # AVX-512 tiles (where the CPU has them), AVX2 tiles


def _lib() -> Optional[ctypes.CDLL]:
    """The GEMM library, or None (not built here, or built for a CPU without AVX2/FMA)."""
    return native.load("gemm", SIGNATURES, require="gemm_supported")


def unavailable_reason() -> Optional[str]:
    """Why the native GEMM cannot run here, or None when it can."""
    if not native.enabled():
        return "native kernels are disabled (EVALRUN_NATIVE=0)"
    if _lib() is None:
        if native.load("gemm") is None:
            return "the native GEMM did not build (no C compiler, or a build error: see the log)"
        return "this CPU lacks AVX2 and FMA, which the native GEMM needs"
    return None


def available() -> bool:
    return _lib() is not None


def silu_fusable(i: int) -> bool:
    """Whether `gemm_silu` runs for an intermediate size of i (3 rows and more): the AVX2 tiles in use
    and i a multiple of their panel width (a later set_width(512) makes gemm_silu
    return None: the plan's op then takes the GEMM and the SiLU apart, the same bits)."""
    lib = _lib()
    return lib is not None and i > 0 and bool(lib.gemm_silu_supported(3, i))


def width(lib: Optional[ctypes.CDLL] = None) -> int:
    """The register width of the tiles in use: 512 (AVX-512, chosen where the CPU has it) or 256
    (AVX2); `EVALRUN_GEMM_WIDTH=256` keeps an AVX-512 CPU on the AVX2 tiles. 0 when unavailable.
    `lib`: another library built with gemm.c (the decode step's), else the GEMM's own."""
    lib = lib or _lib()
    return 0 if lib is None else lib.gemm_width()


def set_width(bits: int, lib: Optional[ctypes.CDLL] = None) -> int:
    """Use the 512-bit or the 256-bit tiles from now on (outputs are bitwise the same; for
    comparisons). Returns the width in use, which stays 256 where the CPU lacks AVX-512."""
    if bits not in WIDTHS:
        raise ValueError(f"GEMM width {bits} is not one of {WIDTHS}")
    lib = lib or _lib()
    if lib is None:
        raise ValueError(f"the native GEMM is unavailable: {unavailable_reason()}")
    return lib.gemm_set_width(bits)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 CPU -> its panels (a flat float32 tensor)."""
    lib = _lib()
    return pack_into(weight, torch.float32, torch.float32, None if lib is None else lib.gemm_packed_floats,
                     None if lib is None else lib.gemm_pack_f32, "gemm.pack", " (and AVX2/FMA)")


def pack_into(weight: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype, size: Any, pack_fn: Any,
              what: str, needs: str = "") -> torch.Tensor:
    """A [N, K] `dtype` CPU weight packed by a native library's pack_fn(w, N, K, out) into a flat
    out_dtype tensor of size(N, K) elements on huge pages (streamed every decode step); size and
    pack_fn None: the library is unavailable."""
    if pack_fn is None or weight.dtype != dtype or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"{what} takes a {str(dtype).removeprefix('torch.')} CPU [N, K] weight{needs}, got "
                         f"{tuple(weight.shape)} {weight.dtype} {weight.device}")
    n, k = weight.shape
    w = weight.contiguous()
    out = huge_pages.empty((size(n, k),), out_dtype)
    if pack_fn(w.data_ptr(), n, k, out.data_ptr()) != 0:
        raise ValueError(f"{what} cannot take shape {tuple(weight.shape)}")
    return out


def epilogue_operands(bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], m: int,
                      n: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """bias [N] and residual [M, N] as contiguous float32 (or None), checked against the output's shape."""
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
        if bias.shape != (n,):
            raise ValueError(f"bias {tuple(bias.shape)} is not the output's ({n},)")
    if residual is not None:
        residual = residual.to(torch.float32).contiguous()
        if residual.shape != (m, n):
            raise ValueError(f"residual {tuple(residual.shape)} is not the output's {(m, n)}")
    return bias, residual


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, K] rows with contiguous columns (a view where it already is one; also gemm_bf16.py)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    return x


def _rows(x: torch.Tensor, panels: torch.Tensor, n: int, what: str) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The library and x as [M, K] rows with contiguous columns, checked against panels of N rows."""
    lib, x = _lib(), as_rows(x)
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu"
            or panels.numel() != lib.gemm_packed_floats(n, x.shape[1])):
        raise ValueError(f"{what} takes float32 CPU rows [M, K] matching the packed weight's K, got "
                         f"{tuple(x.shape)} {x.dtype} {x.device} for N={n}")
    return lib, x


def row_stride(x: torch.Tensor) -> int:
    """x's row stride; one row: its width (torch may report any row stride for it)."""
    return x.stride(0) if x.shape[0] > 1 else x.shape[1]


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """residual + (x @ W^T + bias) for x [M, K] float32 CPU rows (columns contiguous), W packed by
    `pack`; bias [N] and residual [M, N] float32 or None. Returns a new [M, N] tensor."""
    lib, x = _rows(x, panels, n, "gemm")
    m, k = x.shape
    bias, residual = epilogue_operands(bias, residual, m, n)
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    rc = lib.gemm_f32(x.data_ptr(), m, k, row_stride(x), panels.data_ptr(), n,
                      None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
                      y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm cannot take x {tuple(x.shape)} with N={n}")
    return y


def gemm_silu(x: torch.Tensor, panels: torch.Tensor, i: int) -> Optional[torch.Tensor]:
    """silu(x @ W_gate^T) * (x @ W_up^T) [M, I] for a packed [gate | up] weight of 2I rows, in one
    pass (the [M, 2I] product is never written): bitwise silu_mul of `gemm`'s output. None where
    this path does not apply (AVX-512 tiles in use, 1-2 rows, I not a multiple of 16): the caller
    then makes the two calls."""
    lib, x = _rows(x, panels, 2 * i, "gemm_silu")
    m, k = x.shape
    if not lib.gemm_silu_supported(m, i):
        return None
    out = torch.empty(m, i, dtype=torch.float32)
    rc = lib.gemm_silu_f32(x.data_ptr(), m, k, row_stride(x), panels.data_ptr(), i, out.data_ptr(),
                           torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_silu cannot take x {tuple(x.shape)} with I={i}")
    return out
