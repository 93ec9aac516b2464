"""Triton K/V writes into pages (the CUDA path), same contract as
kernels/cache_ops.write_kv_torch for the unquantized formats:

    k, v          [T, Hkv, D]     new keys/values, any dtype, last dim contiguous (views of the
                                  fused QKV projection are fine: rows and heads are strided)
    layer         LayerKV         float pages [P + 1, S, Hkv, D], contiguous
    slot_mapping  [T] int64       page * S + offset of every new token

One program per (token, block of Hkv * D values): the row is cast to the storage dtype
(rounded to nearest even, also under the interpreter) and stored at its slot. Quantized
formats are written by the torch reference (quantize on write).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_format import LayerKV
from .triton_attention import cast, interpreting


def supported(k: torch.Tensor, v: torch.Tensor, layer: LayerKV) -> bool:
    """Unquantized contiguous pages of k's head shape; inputs with a contiguous last dim; one
    device (CUDA, or any under the interpreter)."""
    if layer.fmt.quantized or k.dim() != 3 or k.shape != v.shape:
        return False
    if tuple(layer.k.shape[2:]) != tuple(k.shape[1:]) or layer.v.shape != layer.k.shape:
        return False
    tensors = [k, v, layer.k, layer.v]
    on_device = interpreting() or all(t.device.type == "cuda" for t in tensors)
    return (on_device and len({t.device for t in tensors}) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and layer.k.is_contiguous() and layer.v.is_contiguous())


@triton.jit
def _write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                  EMULATE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                       # index into [Hkv * D]
    mask = idx < HKV * D
    head = idx // D
    col = idx % D
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * k_stride_t + head * k_stride_h + col, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + head * v_stride_h + col, mask=mask)
    tl.store(kc_ptr + slot * (HKV * D) + idx, cast(k, kc_ptr.dtype.element_ty, EMULATE), mask=mask)
    tl.store(vc_ptr + slot * (HKV * D) + idx, cast(v, vc_ptr.dtype.element_ty, EMULATE), mask=mask)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor,
                    block: int = 0) -> None:
    """Store new K/V rows in their slots, cast to the storage dtype (slots are trusted: the
    scheduler hands out slots of allocated pages)."""
    if not supported(k, v, layer):
        raise ValueError(f"the Triton K/V write cannot take k {tuple(k.shape)} {k.device} into a "
                         f"{layer.fmt.name} cache of K {tuple(layer.k.shape)} {layer.k.device}")
    t, hkv, d = k.shape
    if t == 0:
        return
    block = block or min(1024, triton.next_power_of_2(hkv * d))
    _write_kernel[(t, triton.cdiv(hkv * d, block))](
        k, v, layer.k, layer.v, slot_mapping.to(torch.int64).contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), interpreting(), HKV=hkv, D=d, BLOCK=block)
