"""K/V cache writes, reads and page copies, for every `KVFormat` (torch reference).

Layouts:
    k, v          [T, Hkv, D]     new keys/values of the packed tokens (model dtype)
    layer         LayerKV         one layer's storage (evalrun/kernels/kv_format.py), indexed [page, slot, ...]
    slot_mapping  [T] int64       page * S + offset for every new token
    slots         [L] int64       slots to read, in context order
"""
from __future__ import annotations

import torch

from ..kv_format import LayerKV
from .kv_quant import dequantize, quantize


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *t.shape[2:])                           # [(P+1)*S, ...]


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Store new K/V rows in their slots: cast to the storage dtype, or quantized (only the
    new tokens, the whole packed batch at once)."""
    fmt = layer.fmt
    if not fmt.quantized:
        _flat(layer.k).index_copy_(0, slot_mapping, k.to(layer.k.dtype))
        _flat(layer.v).index_copy_(0, slot_mapping, v.to(layer.v.dtype))
        return
    for x, bits, codes, scales in ((k, fmt.k_bits, layer.k, layer.k_scale), (v, fmt.v_bits, layer.v, layer.v_scale)):
        c, s = quantize(x, bits, fmt.group_size, fmt.rotate)
        _flat(codes).index_copy_(0, slot_mapping, c)
        _flat(scales).index_copy_(0, slot_mapping, s)


def gather_kv(layer: LayerKV, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given slots as [L, Hkv, D] in `dtype`, in the attention domain: the
    stored floats, or the dequantized values (still rotated when the format rotates)."""
    fmt = layer.fmt
    if not fmt.quantized:
        return _flat(layer.k).index_select(0, slots).to(dtype), _flat(layer.v).index_select(0, slots).to(dtype)
    k = dequantize(_flat(layer.k).index_select(0, slots), _flat(layer.k_scale).index_select(0, slots),
                   fmt.k_bits, fmt.group_size)
    v = dequantize(_flat(layer.v).index_select(0, slots), _flat(layer.v_scale).index_select(0, slots),
                   fmt.v_bits, fmt.group_size)
    return k.to(dtype), v.to(dtype)


def copy_page_prefix_torch(layers: list[LayerKV], src_page: int, dst_page: int, num_tokens: int) -> None:
    """Copy the first num_tokens slots of src_page into dst_page in every layer (codes and
    scales together)."""
    for layer in layers:
        for t in layer.tensors():
            t[dst_page, :num_tokens] = t[src_page, :num_tokens]


write_kv = write_kv_torch
copy_page_prefix = copy_page_prefix_torch
