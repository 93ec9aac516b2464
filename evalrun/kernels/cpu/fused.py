"""Fused element-wise ops of a layer: RMSNorm, and SiLU(gate) * up over the fused gate/up
projection's output.

    x        [T, H]    float32 rows           rms_norm(x, w, eps) -> [T, H]
    gate_up  [T, 2I]   [gate | up] per row    silu_mul(gate_up)   -> [T, I]
    qkv      [T, (Hq + 2 Hkv) D] float32      rope_write_native   -> q [T, Hq, D] float32; k, v into
                                              float32 / bfloat16 / float16 pages [P + 1, S, Hkv, D]

`rms_norm_reference` / `silu_mul_reference` (kernels/ref/fused.py) are the torch references; the native
versions (evalrun/kernels/cpu/csrc/fused_ops.c) make one pass over each row instead of several torch ops
(~130 us of torch dispatch per RMSNorm of 32 x 576 on the 2-core development machine). Each
row is computed alone in a fixed order, so a row's result is bitwise the same whatever else
is in the batch; the native path is used for every row count (a dispatch on the batch size
would break that).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ..ref.fused import argmax_reference, finite_rows_reference
from . import native

PARALLEL_ELEMENTS = 1 << 16          # below this a second thread costs more than it saves


_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {
    "rms_norm_f32": (_I32, [_P, _P, _P, _I32, _I32, ctypes.c_float, _I32]),
    "rms_norm_f32_bf16": (_I32, [_P, _P, _P, _I32, _I32, ctypes.c_float, _I32]),
    "silu_mul_f32": (_I32, [_P, _P, _I32, _I32, _I32]),
    "gelu_tanh_mul_f32": (_I32, [_P, _P, _I32, _I32, _I32]),
    "argmax_rows_f32": (_I32, [_P, _I32, _I32, _P, _I32]),
    "finite_rows_f32": (_I32, [_P, _I32, _I32, _P, _I32]),
    "argmax_finite_rows_f32": (_I32, [_P, _I32, _I32, _P, _P, _I32]),
    "rope_write_f32": (_I32, [_P, _I64, _P, _P, _I32, _I32, _I32, _I32, _P, _I64, _P, _P, _P]),
    "rope_write_kind": (_I32, [_P, _I64, _P, _P, _I32, _I32, _I32, _I32, _P, _I64, _P, _P, _I32, _P]),
    "rope_write_part": (_I32, [_P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _P, _I64, _P, _P, _I32, _P]),
}
PAGE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # csrc/kv_load.h KIND_F32, KIND_BF16, KIND_F16


def _lib() -> Optional[ctypes.CDLL]:
    return native.load("fused_ops", SIGNATURES)


_handle: Optional[ctypes.CDLL] = None


def _ready() -> Optional[ctypes.CDLL]:
    """The loaded library, looked up once (the callers run ~100 times per decode step; whether
    to use the native ops at all is decided by `available()` when a backend is made)."""
    global _handle
    if _handle is None:
        _handle = _lib()
    return _handle


def available() -> bool:
    return _lib() is not None


def supported(x: torch.Tensor) -> bool:
    """2-D float32 CPU rows (the native ops' only layout)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2


def num_threads(elements: int, rows: int) -> int:
    """Threads for an element-wise pass over `rows` rows of `elements` values in all."""
    return 1 if elements < PARALLEL_ELEMENTS else max(1, min(torch.get_num_threads(), rows, 64))


def rms_norm_native(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """RMSNorm of float32 rows; out_dtype bfloat16: its values rounded to nearest even (the rows a bf16
    GEMM reads, with the bits it would round them to)."""
    lib = _ready()
    if (lib is None or not supported(x) or w.dtype != torch.float32 or w.shape != (x.shape[1],)
            or out_dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"rms_norm_native takes float32 CPU rows [T, H] and weights [H] to float32 or bfloat16, "
                         f"got {tuple(x.shape)} {x.dtype} {x.device}, {tuple(w.shape)} {w.dtype} to {out_dtype}")
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype)
    t, h = x.shape
    fn = lib.rms_norm_f32 if out_dtype == torch.float32 else lib.rms_norm_f32_bf16
    if fn(x.data_ptr(), w.data_ptr(), out.data_ptr(), t, h, eps, num_threads(t * h, t)) != 0:
        raise ValueError(f"rms_norm_native cannot take shape {tuple(x.shape)}")
    return out


def silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated("silu_mul", gate_up)


def gelu_tanh_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up (GeGLU), as gelu_tanh_mul_reference."""
    return _gated("gelu_tanh_mul", gate_up)


def _gated(op: str, gate_up: torch.Tensor) -> torch.Tensor:
    lib = _ready()
    if lib is None or not supported(gate_up) or gate_up.shape[1] % 2:
        raise ValueError(f"{op}_native takes float32 CPU rows [T, 2I], got {tuple(gate_up.shape)} "
                         f"{gate_up.dtype} {gate_up.device}")
    gate_up = gate_up.contiguous()
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=torch.float32)
    if getattr(lib, f"{op}_f32")(gate_up.data_ptr(), out.data_ptr(), t, i, num_threads(t * i, t)) != 0:
        raise ValueError(f"{op}_native cannot take shape {tuple(gate_up.shape)}")
    return out


def rope_write_supported(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """float32 CPU rows whose columns are contiguous, float32 tables, float32 / bfloat16 / float16
    CPU pages."""
    return (supported(qkv) and qkv.stride(1) == 1 and cos.dtype == torch.float32 and k_cache.dtype in PAGE_KINDS
            and k_cache.device.type == "cpu")


def rope_write_native(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """As rope_write_reference in one pass, with float32 qkv rows and float32, bfloat16 or float16
    pages ([P + 1, S, Hkv, D], the kind from k_cache's dtype): returns the rotated q [T, hq, D]
    (float32); k (rotated) and v go straight into their slots, computed in float32 and rounded
    once to the pages' dtype (to nearest even, as .to(dtype)). Tables [T, R] with R < D: partial
    rotary (the first R values of each head rotated, the rest passed through)."""
    lib = _ready()
    t, d, rot = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv), cos.shape[-1]
    if (lib is None or not rope_write_supported(qkv, cos, k_cache) or qkv.shape[1] != (hq + 2 * hkv) * d
            or sin.dtype != torch.float32 or cos.shape != (t, rot) or sin.shape != (t, rot) or rot > d
            or slot_mapping.numel() != t):
        raise ValueError(f"rope_write_native cannot take qkv {tuple(qkv.shape)} {qkv.dtype}, tables "
                         f"{tuple(cos.shape)} {cos.dtype}, {slot_mapping.numel()} slots with a {k_cache.dtype} cache")
    if (k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"cache pages {tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} "
                         f"{v_cache.dtype} do not hold {hkv} heads of {d}")
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q = torch.empty(t, hq, d, dtype=torch.float32)
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.rope_write_part(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), t, hq, hkv, d, rot,
                             slots.data_ptr(), n_slots, k_cache.data_ptr(), v_cache.data_ptr(),
                             PAGE_KINDS[k_cache.dtype], q.data_ptr())
    if rc != 0:
        raise ValueError(f"slot mapping outside the cache's {n_slots} slots, or odd rotary dim {rot}")
    return q


def _per_row(name: str, x: torch.Tensor, dtype: torch.dtype, reference, min_cols: int) -> torch.Tensor:
    """One value per row of [T, V] through the native `name`, or `reference(x)` where it cannot run
    (not float32 CPU rows, fewer than min_cols columns, no library)."""
    if not supported(x) or x.shape[1] < min_cols:
        return reference(x)
    lib = _ready()                                # only float32 CPU rows load (and build) the library
    if lib is None:
        return reference(x)
    x = x.contiguous()
    t, v = x.shape
    out = torch.empty(t, dtype=dtype)
    if getattr(lib, name)(x.data_ptr(), t, v, out.data_ptr(), num_threads(t * v, t)) != 0:
        return reference(x)
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for [T, V] rows: the first index on ties, a row's first NaN
    if it has one. Float32 CPU rows go through the native pass (rows split over the threads;
    torch's reduction runs ~1.9 ms on 32 x 49,152 logits here); anything else through torch."""
    return _per_row("argmax_rows_f32", logits, torch.int64, argmax_reference, 1)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.isfinite(x).all(dim=-1) for [T, V] rows (bool [T]): whether a row has no NaN and no
    Inf. Float32 CPU rows go through the native pass on the shared pool, anything else through
    torch."""
    out = _per_row("finite_rows_f32", x, torch.uint8, finite_rows_reference, 0)
    return out if out.dtype == torch.bool else out.bool()


def argmax_finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax_rows(logits), finite_rows(logits)) in one visit of each row: float32 CPU rows
    natively (the finite check brings a row into L2, the argmax reads it there: one pass over the
    [T, V] logits from memory instead of two), anything else the two calls."""
    lib = _ready() if supported(logits) and logits.shape[1] >= 1 else None
    if lib is None:
        return argmax_rows(logits), finite_rows(logits)
    x = logits.contiguous()
    t, v = x.shape
    top, ok = torch.empty(t, dtype=torch.int64), torch.empty(t, dtype=torch.uint8)
    if lib.argmax_finite_rows_f32(x.data_ptr(), t, v, top.data_ptr(), ok.data_ptr(), num_threads(t * v, t)) != 0:
        return argmax_rows(logits), finite_rows(logits)
    return top, ok.bool()
