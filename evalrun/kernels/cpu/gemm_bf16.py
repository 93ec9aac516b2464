"""The native bfloat16 GEMM for linears (evalrun/kernels/cpu/csrc/gemm_bf16.c), through ctypes.

    pack(weight [N, K])                              -> panels: bf16 pairs of k in 16-column panels
    gemm(x [M, K], panels, N, bias, residual, out_dtype) -> residual + (bf16(x) @ W^T + bias)  [M, N]
    gemm_silu(x [M, K], panels, I, out_dtype)        -> silu(x Wg^T) * (x Wu^T)  [M, I] float32 (or bf16), or None

x is float32 (rounded to bfloat16 in the call, to nearest even) or bfloat16 (rows of an even K read
in place: a norm or gemm_silu that rounds its output to bfloat16 saves the call that rounding, with
the same bits); the products are
exact and accumulate in float32, one chain per output over the k pairs in `vdpbf16ps` order
(the reference: kernels/ref/linear.py dot_bf16_reference), so a row's result is bitwise the same
whatever the number of rows (batch invariance). On a CPU with AVX512_BF16 the tiles are that
instruction (`path()` "native"); elsewhere the same chain in float32 multiplies and adds under
FTZ/DAZ ("emulated": the same bits, slower). `EVALRUN_GEMM_BF16=emulate` forces the emulation.

"amx" (csrc/gemm_bf16_amx.h): AMX-BF16 tiles, off by default and taken only where asked for
(`EVALRUN_GEMM_BF16=amx`, or `set_path("amx")`) and `amx_available()`. Its sums are per tile of 16
pairs in an order Intel documents two ways, neither vdpbf16ps's, and it has not yet run on an AMX
CPU: tests/test_gemm_bf16_amx.py is the check to run on the first one.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native
from .host import cpu_flags
from .gemm import as_rows, epilogue_operands, pack_into, row_stride

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {
    "gemm_bf16_packed_u16": (_I64, [_I32, _I32]),
    "gemm_bf16_pack": (_I32, [_P, _I32, _I32, _P]),
    "gemm_bf16": (_I32, [_P, _I32, _I32, _I32, _I64, _P, _I32, _P, _P, _P, _I32, _I32]),
    "gemm_bf16_native": (_I32, []),
    "gemm_bf16_path": (_I32, []),
    "gemm_bf16_set_path": (_I32, [_I32]),
    "gemm_bf16_amx_available": (_I32, []),
    "gemm_bf16_silu": (_I32, [_P, _I32, _I32, _I32, _I64, _P, _I32, _P, _I32]),
    "gemm_bf16_silu_to": (_I32, [_P, _I32, _I32, _I32, _I64, _P, _I32, _P, _I32, _I32]),
    "gemm_bf16_silu_supported": (_I32, [_I32]),
}
PATHS = {2: "native", 1: "emulated", 3: "amx"}
AMX_FLAGS = ("amx_bf16", "amx_tile")
OUT_DTYPES = (torch.float32, torch.bfloat16)


def _lib() -> Optional[ctypes.CDLL]:
    return native.load("gemm_bf16", SIGNATURES)


def unavailable_reason() -> Optional[str]:
    """Why the bf16 GEMM cannot run here, or None when it can (natively or emulated)."""
    if not native.enabled():
        return "native kernels are disabled (EVALRUN_NATIVE=0)"
    if _lib() is None:
        return "the native bf16 GEMM did not build (no C compiler, or a build error: see the log)"
    return None


def available() -> bool:
    return _lib() is not None


def native_instructions() -> bool:
    """Whether the library was built with AVX512_BF16 (vdpbf16ps) for this CPU."""
    lib = _lib()
    return lib is not None and bool(lib.gemm_bf16_native())


def amx_available() -> bool:
    """Whether the AMX-BF16 tiles can run here: the CPU's amx_bf16 and amx_tile, the OS saving the
    tile state, and (Linux) this process's permission to use it."""
    lib = _lib()
    return lib is not None and bool(lib.gemm_bf16_amx_available())


def amx_unavailable_reason() -> Optional[str]:
    """Why the "amx" path cannot run here, or None when it can."""
    if _lib() is None:
        return unavailable_reason()
    if amx_available():
        return None
    missing = [f for f in AMX_FLAGS if f not in (cpu_flags() or ())]
    if missing:
        return f"needs amx_bf16 (AMX-BF16 tiles); this CPU lacks the flag{'s' if len(missing) > 1 else ''} " \
               f"{', '.join(missing)}"
    return ("the CPU has amx_bf16 but the OS does not let this process use the tile state (XCR0, or Linux's "
            "arch_prctl(ARCH_REQ_XCOMP_PERM) refused, e.g. for a too small sigaltstack)")


def path() -> str:
    """"native" (vdpbf16ps tiles), "emulated" or "amx"; "" when unavailable."""
    lib = _lib()
    return "" if lib is None else PATHS[lib.gemm_bf16_path()]


def set_path(name: str) -> str:
    """Use the "native", the "emulated" (the same bits; for comparisons) or the "amx" tiles from now
    on. Returns the path in use, which stays "emulated" for "native" where the CPU lacks
    AVX512_BF16; "amx" where it cannot run raises ValueError."""
    lib = _lib()
    if lib is None:
        raise ValueError(f"the bf16 GEMM is unavailable: {unavailable_reason()}")
    codes = {v: k for k, v in PATHS.items()}
    if name not in codes:
        raise ValueError(f"bf16 GEMM path {name!r} is not one of {', '.join(codes)}")
    if name == "amx" and not amx_available():
        raise ValueError(f"bf16 GEMM path 'amx' cannot run here: {amx_unavailable_reason()}")
    return PATHS[lib.gemm_bf16_set_path(codes[name])]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bfloat16 CPU -> its panels (a flat int16 tensor of bf16 bits)."""
    lib = _lib()
    return pack_into(weight, torch.bfloat16, torch.int16, None if lib is None else lib.gemm_bf16_packed_u16,
                     None if lib is None else lib.gemm_bf16_pack, "gemm_bf16.pack")


def _rows(x: torch.Tensor, panels: torch.Tensor, n: int, what: str, ok: bool, shape: str) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The library and x as rows [M, K] with unit column stride, checked against the packed weight of N
    outputs (ok: the caller's own condition on its other arguments); ValueError naming them otherwise."""
    lib, x = _lib(), as_rows(x)
    if (lib is None or not ok or x.dtype not in OUT_DTYPES or x.device.type != "cpu"
            or panels.numel() != lib.gemm_bf16_packed_u16(n, x.shape[1])):
        raise ValueError(f"{what} takes float32/bfloat16 CPU rows [M, K] matching the packed weight's K, "
                         f"got {tuple(x.shape)} {x.dtype} {x.device} for {shape}")
    return lib, x


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """residual + (bf16(x) @ W^T + bias) for x [M, K] float32 or bfloat16 CPU rows, W packed by `pack`;
    bias [N] and residual [M, N] taken as float32. Returns a new [M, N] tensor of out_dtype
    (default x's dtype), rounded once at the end."""
    out_dtype = out_dtype or x.dtype
    lib, x = _rows(x, panels, n, "gemm_bf16", out_dtype in OUT_DTYPES, f"N={n}, out {out_dtype}")
    m, k = x.shape
    bias, residual = epilogue_operands(bias, residual, m, n)
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    rc = lib.gemm_bf16(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, row_stride(x), panels.data_ptr(), n,
                       None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
                       y.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_bf16 cannot take x {tuple(x.shape)} with N={n}")
    return y


def silu_fusable(i: int) -> bool:
    """Whether `gemm_silu` runs for an intermediate size of i (AVX-512 tiles, i a multiple of 16, not
    the AMX path)."""
    lib = _lib()
    return lib is not None and i > 0 and bool(lib.gemm_bf16_silu_supported(i))


def gemm_silu(x: torch.Tensor, panels: torch.Tensor, i: int, out_dtype: torch.dtype = torch.float32
              ) -> Optional[torch.Tensor]:
    """silu(bf16(x) @ W_gate^T) * (bf16(x) @ W_up^T) [M, I] for a packed [gate | up] weight of 2I rows,
    in one pass (the [M, 2I] product is never written): bitwise silu_mul_native of `gemm`'s float32
    output, in out_dtype float32 or bfloat16 (those values rounded to nearest even: what a bf16 GEMM
    reading them rounds them to). None where this path does not apply (`silu_fusable`): the caller
    makes the two calls."""
    lib, x = _rows(x, panels, 2 * i, "gemm_bf16.gemm_silu", out_dtype in OUT_DTYPES, f"I={i}, out {out_dtype}")
    if not lib.gemm_bf16_silu_supported(i):
        return None
    m, k = x.shape
    out = torch.empty(m, i, dtype=out_dtype)
    if m == 0:
        return out
    rc = lib.gemm_bf16_silu_to(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, row_stride(x), panels.data_ptr(),
                               i, out.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_bf16.gemm_silu cannot take x {tuple(x.shape)} with I={i}")
    return out
