"""PagedCache: the K/V storage of every layer plus the page pool that addresses it.

Per layer one `LayerKV` in the cache's `KVFormat` (kernels/kv_format.py): float K/V
[num_pages + 1, page_size, num_kv_heads, head_dim] for fp32/bf16/fp16, or uint8 codes plus
float16 scales for q8/q6/q4. The extra last page is the null page: zeros, never
allocated; padded reads point there.

Size it in tokens (`max_tokens`) or in bytes (`max_memory`, null page included): the same
memory holds ~3.5x the tokens in q4 that it holds in fp16.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from kernels.kv_format import KV_FORMATS, KVFormat, LayerKV, kv_format

from .page_pool import PagePool

if TYPE_CHECKING:
    from .model import Model

CACHE_MODES = KV_FORMATS
DEFAULT_MAX_TOKENS = 65536


def auto_cache_mode(dtype: torch.dtype) -> str:
    """The unquantized mode that stores `dtype` as it is."""
    return next(name for name, f in KV_FORMATS.items() if not f.quantized and f.dtype == dtype)


def pages_for_memory(max_memory: int, page_size: int, bytes_per_token: int, mode: str) -> int:
    """Real pages that fit in max_memory bytes beside the null page; ValueError if none does."""
    page_bytes = page_size * bytes_per_token
    num_pages = max_memory // page_bytes - 1
    if num_pages < 1:
        raise ValueError(f"cache memory of {max_memory} bytes is too small: in mode {mode} one page of "
                         f"{page_size} tokens takes {page_bytes} bytes, and the cache needs at least "
                         f"two (one page plus the null page, {2 * page_bytes} bytes)")
    return num_pages


class PagedCache:
    def __init__(self, model: "Model", max_tokens: Optional[int] = None, page_size: int = 256,
                 mode: "str | KVFormat" = "bf16", max_memory: Optional[int] = None):
        if mode == "auto":
            mode = auto_cache_mode(model.dtype)
        fmt = kv_format(mode)
        cfg = model.config
        fmt.check_head_dim(cfg.head_dim)
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        per_token = fmt.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        if max_memory is not None:
            if max_tokens is not None:
                raise ValueError("give the cache size as max_tokens or as max_memory, not both")
            self.num_pages = pages_for_memory(max_memory, page_size, per_token, fmt.name)
        else:
            max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
            if not isinstance(max_tokens, int) or max_tokens < page_size:
                raise ValueError(f"max_tokens ({max_tokens!r}) must be an integer >= page_size ({page_size})")
            self.num_pages = max_tokens // page_size
        self.format = fmt
        self.mode = fmt.name
        self.page_size = page_size
        self.kernels = model.kernels
        self.pool = PagePool(self.num_pages, page_size)
        self.layers = [LayerKV.allocate(fmt, self.num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                                        model.device) for _ in range(cfg.num_layers)]

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def null_page(self) -> int:
        return self.num_pages

    @property
    def k(self) -> list[torch.Tensor]:
        """Per layer the K storage (floats, or codes)."""
        return [layer.k for layer in self.layers]

    @property
    def v(self) -> list[torch.Tensor]:
        return [layer.v for layer in self.layers]

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]

    def memory_bytes(self) -> int:
        """Bytes of every allocated storage tensor (codes, scales, the null page)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """memory_bytes() over the slots allocated (the null page's included): scales count."""
        return self.memory_bytes() / ((self.num_pages + 1) * self.page_size)

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        self.kernels.copy_page_prefix(self.layers, src_page, dst_page, num_tokens)

    def fill_unused(self, value: float = float("nan")) -> None:
        """Testing aid: poison every slot of every real page (the null page stays zero);
        quantized formats poison the scales, so any read of a stale slot gives NaN."""
        for layer in self.layers:
            for t in layer.data_tensors():
                t[: self.num_pages].fill_(value)

    def defragment(self) -> None:
        """Pack cached pages into the lowest page ids (needs no job running)."""
        plan = self.pool.compaction_plan()
        moves = [(old, new) for old, new in plan.items() if old != new]
        if moves:
            src = torch.tensor([m[0] for m in moves])
            dst = torch.tensor([m[1] for m in moves])
            for layer in self.layers:
                for t in layer.tensors():
                    t[dst] = t[src]     # advanced indexing gathers src before writing
        self.pool.apply_compaction(plan)
