"""Triton K/V writes into pages (the CUDA path), same contract as
kernels/cache_ops.write_kv_torch for the unquantized formats:

    k, v          [T, Hkv, D]     new keys/values, any dtype, last dim contiguous (views of the
                                  fused QKV projection are fine: rows and heads are strided)
    layer         LayerKV         float pages [P + 1, S, Hkv, D], contiguous
    slot_mapping  [T] int64       page * S + offset of every new token

One program per (token, block of Hkv * D values): the row is cast to the storage dtype
(rounded to nearest even, also under the interpreter) and stored at its slot. A slot of -1 (the
padding rows of a CUDA-graph decode batch, evalrun/engine/cuda_graphs.py) stores nothing, in both kernels.

Quantized formats (q8 / q6 / q4, evalrun/kernels/ref/kv_quant.py's `quantize`) are quantized on write by
`write_kv_quant_triton`, one program per (token, KV head): the head's D values as [D/G, G]
groups, rotated by the same butterfly as the reference (log2 G stages of a + b, a - b, then
times fp32(G^-0.5)), the group's scale max|x| / qmax (IEEE division) rounded to float16 and
bumped one ulp where that rounded it down, codes round-half-even(x / scale) clamped to
[-qmax, qmax] plus the offset, 4-bit codes packed as the reference packs them (byte j of a
group: element j low, element j + G/2 high). The same operations in the same order, so codes
and scales are bitwise the reference's. A group holding a NaN gets a NaN scale (its codes are
unspecified, as the reference's are).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ..kv_format import LayerKV
from .triton_attention import interpreting
from .triton_tiles import cast
from .jit import cdiv, jit_kernels, next_power_of_2

if TYPE_CHECKING:              # the kernel bodies' names, bound by jit_kernels
    import triton.language as tl


def supported(k: torch.Tensor, v: torch.Tensor, layer: LayerKV) -> bool:
    """Unquantized contiguous pages of k's head shape; inputs with a contiguous last dim; one
    device (CUDA, or any under the interpreter)."""
    if layer.fmt.quantized or k.dim() != 3 or k.shape != v.shape:
        return False
    if tuple(layer.k.shape[2:]) != tuple(k.shape[1:]) or layer.v.shape != layer.k.shape:
        return False
    return _inputs_and_pages_ok(k, v, [layer.k, layer.v])


def _inputs_and_pages_ok(k: torch.Tensor, v: torch.Tensor, pages: list[torch.Tensor]) -> bool:
    """What both writes need: k, v with a contiguous last dim, contiguous page tensors, all on one
    device (CUDA, or any under the interpreter)."""
    tensors = [k, v, *pages]
    on_device = interpreting() or all(t.device.type == "cuda" for t in tensors)
    return (on_device and len({t.device for t in tensors}) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and all(t.is_contiguous() for t in pages))


def _write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                  EMULATE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                       # index into [Hkv * D]
    mask = idx < HKV * D
    head = idx // D
    col = idx % D
    slot = tl.load(slot_ptr + t).to(tl.int64)
    mask = mask & (slot >= 0)                                                  # -1: a padding row (no slot)
    k = tl.load(k_ptr + t * k_stride_t + head * k_stride_h + col, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + head * v_stride_h + col, mask=mask)
    tl.store(kc_ptr + slot * (HKV * D) + idx, cast(k, kc_ptr.dtype.element_ty, EMULATE), mask=mask)
    tl.store(vc_ptr + slot * (HKV * D) + idx, cast(v, vc_ptr.dtype.element_ty, EMULATE), mask=mask)


def _rows_to_write(what: str, ok: bool, k: torch.Tensor, layer: LayerKV) -> tuple[int, int, int]:
    """k's (rows, heads, head size) for a write its check accepted (`ok`); else ValueError."""
    if not ok:
        raise ValueError(f"the Triton {what} cannot take k {tuple(k.shape)} {k.device} into a "
                         f"{layer.fmt.name} cache of {tuple(layer.k.shape)} {layer.k.dtype} on {layer.k.device}")
    return tuple(k.shape)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor,
                    block: int = 0) -> None:
    """Store new K/V rows in their slots, cast to the storage dtype (slots are trusted: the
    scheduler hands out slots of allocated pages)."""
    t, hkv, d = _rows_to_write("K/V write", supported(k, v, layer), k, layer)
    if t == 0:
        return
    block = block or min(1024, next_power_of_2(hkv * d))
    kernels()._write_kernel[(t, cdiv(hkv * d, block))](
        k, v, layer.k, layer.v, slot_mapping.to(torch.int64).contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), interpreting(), HKV=hkv, D=d, BLOCK=block)


def _butterfly(x, NG: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """Each row of x [NG, G] through the fast Walsh-Hadamard transform (no normalisation):
    stage h pairs (i, i + h) in blocks of 2h into (a + b, a - b), as kv_quant.rotate."""
    for s in tl.static_range(LOG2G):                 # h = 1 << s
        y = tl.permute(tl.reshape(x, [NG, G >> (s + 1), 2, 1 << s]), [0, 1, 3, 2])     # [NG, G/2h, h, 2]
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [NG, G])
    return x


def _quant_kernel(x_ptr, codes_ptr, scales_ptr, slot_ptr, x_stride_t, x_stride_h, norm,
                  HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr,
                  BITS: tl.constexpr, ROTATE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    NG: tl.constexpr = D // G
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    slot = tl.load(slot_ptr + t).to(tl.int64)
    gi = tl.arange(0, NG)[:, None]
    ok = (gi * 0 + slot) >= 0                         # [NG, 1]; slot -1: a padding row of a CUDA-graph batch
    slot = tl.maximum(slot, 0)
    x = tl.load(x_ptr + t * x_stride_t + head * x_stride_h + gi * G + tl.arange(0, G)[None, :]).to(tl.float32)
    if ROTATE:
        x = _butterfly(x, NG, G, LOG2G) * norm
    exact = tl.div_rn(tl.max(tl.abs(x), axis=1), tl.full([NG], QMAX, tl.float32))            # [NG]
    scale = tl.minimum(exact, 65504.0).to(tl.float16)
    bumped = (scale.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    scale = tl.where((scale.to(tl.float32) < exact) & (scale < 65504.0), bumped, scale)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = tl.where(has_nan, float("nan"), scale.to(tl.float32)).to(tl.float16)
    div = tl.where(scale == 0, 1.0, scale.to(tl.float32))
    y = tl.div_rn(x, tl.broadcast_to(div[:, None], [NG, G]))
    y = (y + 12582912.0) - 12582912.0              # round half to even (|y| <= qmax << 2^22)
    code = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(tl.int32) + (128 if BITS == 8 else 8)
    tl.store(scales_ptr + slot * (HKV * NG) + head * NG + tl.arange(0, NG), scale, mask=tl.reshape(ok, [NG]))
    if BITS == 8:
        tl.store(codes_ptr + slot * (HKV * D) + head * D + gi * G + tl.arange(0, G)[None, :], code.to(tl.uint8),
                 mask=tl.broadcast_to(ok, [NG, G]))
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(code, [NG, 2, G // 2]), [0, 2, 1]))  # elements j, j + G/2
        byte = (lo | (hi << 4)).to(tl.uint8)
        tl.store(codes_ptr + slot * (HKV * D // 2) + head * (D // 2) + gi * (G // 2)
                 + tl.arange(0, G // 2)[None, :], byte, mask=tl.broadcast_to(ok, [NG, G // 2]))


def quant_supported(k: torch.Tensor, v: torch.Tensor, layer: LayerKV) -> bool:
    """Quantized contiguous pages (codes and scales) of k's head shape, head size and group size
    powers of two; inputs with a contiguous last dim; one device (CUDA, or any under the
    interpreter)."""
    fmt = layer.fmt
    if not fmt.quantized or k.dim() != 3 or k.shape != v.shape:
        return False
    hkv, d = k.shape[1:]
    g = fmt.group_size
    if d % g or d & (d - 1) or tuple(layer.k_scale.shape[2:]) != (hkv, d // g):
        return False
    return _inputs_and_pages_ok(k, v, [layer.k, layer.v, layer.k_scale, layer.v_scale])


def write_kv_quant_triton(k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Quantize new K/V rows into their slots' codes and scales (evalrun/kernels/ref/kv_quant.py's quantize,
    bit for bit)."""
    t, hkv, d = _rows_to_write("quantized K/V write", quant_supported(k, v, layer), k, layer)
    if t == 0:
        return
    fmt, slots = layer.fmt, slot_mapping.to(torch.int64).contiguous()
    g = fmt.group_size
    norm = float(torch.tensor(g ** -0.5, dtype=torch.float32))      # the reference multiplies by fp32(G^-0.5)
    for x, bits, codes, scales in ((k, fmt.k_bits, layer.k, layer.k_scale), (v, fmt.v_bits, layer.v, layer.v_scale)):
        kernels()._quant_kernel[(t, hkv)](x, codes, scales, slots, x.stride(0), x.stride(1), norm, HKV=hkv, D=d, G=g,
                                LOG2G=g.bit_length() - 1, BITS=bits, ROTATE=fmt.rotate)


JIT = (cast, _write_kernel, _butterfly, _quant_kernel)


@functools.cache
def kernels() -> Any:
    """This module's kernels, jitted on first use (kernels/cuda/jit.py)."""
    return jit_kernels(globals(), JIT)
