"""Native CPU quantize-on-write and Hadamard rotation (evalrun/kernels/cpu/csrc/kv_quant.c): the same
signatures and, bit for bit, the same results as the torch references `ref/kv_quant.py rotate`
and `ref/cache_ops.py write_kv_torch` (tests compare them). Each is one C pass over the new rows
instead of ~20 torch ops per layer, which at decode time is most of what a quantized cache
costs beyond an unquantized one.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native
from ..kv_format import LayerKV


_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {
    "rotate_groups": (_I32, [_P, _I64, _I32, ctypes.c_float]),
    "quantize_write": (_I32, [_P, _I64, _I32, _P, _P, _P, _I32, _I32, _I32, ctypes.c_float]),
    "quantize_supported": (_I32, []),
}


def _lib() -> Optional[ctypes.CDLL]:
    return native.load("kv_quant", SIGNATURES)


def available() -> bool:
    """The rotation is available (the library built)."""
    return _lib() is not None


def quantize_available() -> bool:
    """Quantize-on-write runs natively (the library built with F16C)."""
    lib = _lib()
    return lib is not None and bool(lib.quantize_supported())


def rotate_native(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """As kv_quant.rotate: [..., D] -> float32 [..., D], each group of group_size times H.
    ValueError where it cannot run (the kernel plan picks it only where it can: no fallback here)."""
    lib = _lib()
    if lib is None or x.device.type != "cpu" or x.shape[-1] % group_size:
        raise ValueError(f"rotate_native takes CPU rows whose last dim is a multiple of {group_size} (and the "
                         f"library built), got {tuple(x.shape)} on {x.device}")
    y = x.float().contiguous().clone() if x.dtype == torch.float32 else x.float().contiguous()
    if lib.rotate_groups(y.data_ptr(), y.numel() // group_size, group_size, group_size ** -0.5):
        raise ValueError(f"rotate_native cannot rotate groups of {group_size}")
    return y


def write_kv_native(k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
    """As cache_ops.write_kv_torch, quantizing in C: code formats on CPU with F16C (the kernel
    plan picks it only there); ValueError for anything else, never another path."""
    fmt = layer.fmt
    if not fmt.quantized or not quantize_available() or k.device.type != "cpu" or \
            not all(t.is_contiguous() for t in layer.tensors()):
        raise ValueError(f"write_kv_native writes quantized contiguous CPU pages with F16C, got cache mode "
                         f"{fmt.name} on {k.device} (quantize available: {quantize_available()})")
    t = k.shape[0]
    if k.shape != (t, layer.num_kv_heads, layer.head_dim) or v.shape != k.shape or slot_mapping.shape != (t,):
        raise ValueError(f"write_kv: K {tuple(k.shape)} / V {tuple(v.shape)} / slots {tuple(slot_mapping.shape)} "
                         f"do not fit a cache of {layer.num_kv_heads} KV heads of {layer.head_dim}")
    slots = slot_mapping.to(torch.int64).contiguous()
    if t and (int(slots.min()) < 0 or int(slots.max()) >= layer.k.shape[0] * layer.k.shape[1]):
        raise ValueError(f"slot ids must lie in [0, {layer.k.shape[0] * layer.k.shape[1]})")
    w = k.shape[1] * k.shape[2]
    lib = _lib()
    for x, bits, codes, scales in ((k, fmt.k_bits, layer.k, layer.k_scale), (v, fmt.v_bits, layer.v, layer.v_scale)):
        xf = x.float().contiguous()
        rc = lib.quantize_write(xf.data_ptr(), t, w, slots.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                bits, fmt.group_size, int(fmt.rotate), fmt.group_size ** -0.5)
        if rc:
            raise ValueError(f"write_kv_native cannot quantize rows of {w} values in groups of {fmt.group_size}")
