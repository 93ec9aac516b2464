"""K/V cache writes and page copies.

Layouts:
    k, v          [T, Hkv, D]          new keys/values of the packed tokens (model dtype)
    k_cache       [P + 1, S, Hkv, D]   one layer's pages (storage dtype: fp32/bf16/fp16)
    slot_mapping  [T] int64            page * S + offset for every new token
"""
from __future__ import annotations

import torch


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Reference: scatter new K/V rows into their slots (casting to the storage dtype)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def copy_page_prefix_torch(caches: list[torch.Tensor], src_page: int, dst_page: int, num_tokens: int) -> None:
    """Copy the first num_tokens slots of src_page into dst_page in every given layer tensor."""
    for cache in caches:
        cache[dst_page, :num_tokens] = cache[src_page, :num_tokens]


write_kv = write_kv_torch
copy_page_prefix = copy_page_prefix_torch
