"""flash-attn's paged attention (CUDA), for the FlashAttnKernels backend (kernels/backend.py).

    q            [T, Hq, D]   fp16 / bf16 packed queries of the whole batch (decode rows and prefill chunks)
    layer.k, .v  [P + 1, S, Hkv, D]  an unquantized cache of q's dtype, S a multiple of PAGE_MULTIPLE
    page_table   [B, max_pages] int32, passed as flash-attn's `block_table`

One `flash_attn_varlen_func` call for the batch. Causal with fewer queries than keys aligns the
queries to the end of their context (query i of a sequence with q_len queries and L keys sits at
position L - q_len + i), as the pages hold. flash-attn chooses its split of long contexts by the
batch's size, so deterministic mode does not use it. Untested on a GPU here: its tests run against
a stand-in module.
"""
from __future__ import annotations

import importlib.util
import inspect
from typing import Any, Callable, Optional

import torch

from ..attention import AttentionMetadata
from ..kv_format import KVFormat, LayerKV

PAGE_MULTIPLE = 256


def available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def load() -> Any:
    """The flash_attn module (an optional dependency); ImportError where it takes no block_table."""
    import flash_attn
    if "block_table" not in inspect.signature(flash_attn.flash_attn_varlen_func).parameters:
        raise ImportError(f"flash_attn {getattr(flash_attn, '__version__', '?')} takes no block_table "
                          "(paged KV needs flash-attn 2.5 or later)")
    return flash_attn


def usable(fmt: KVFormat, dtype: torch.dtype, page_size: int, head_dim: int) -> bool:
    """An unquantized fp16/bf16 cache of the model's dtype, pages a multiple of 256 slots, head size
    a multiple of 8 up to 256 (the caller checks the device and the heads)."""
    return (not fmt.quantized and fmt.dtype == dtype and dtype in (torch.float16, torch.bfloat16)
            and page_size % PAGE_MULTIPLE == 0 and head_dim % 8 == 0 and head_dim <= 256)


def attention_op(flash: Any) -> Callable[..., torch.Tensor]:
    """The plan's attention op over `flash` (the module, or a stand-in with its signature)."""
    def attention(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> torch.Tensor:
        return flash.flash_attn_varlen_func(
            q, layer.k, layer.v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.page_table)
    return attention
