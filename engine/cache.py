"""PagedCache: the K/V tensors plus the page pool that addresses them.

Per layer, K and V are [num_pages + 1, page_size, num_kv_heads, head_dim] in the
storage dtype of `mode`. The extra last page is the null page: zeros, never
allocated; padded reads point there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.cache_ops import copy_page_prefix

from .page_pool import PagePool

if TYPE_CHECKING:
    from .model import Model

CACHE_MODES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PagedCache:
    def __init__(self, model: "Model", max_tokens: int = 65536, page_size: int = 256, mode: str = "bf16"):
        if mode == "auto":                                   # the storage of the model's compute dtype
            mode = next(name for name, dt in CACHE_MODES.items() if dt == model.dtype)
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if not isinstance(max_tokens, int) or max_tokens < page_size:
            raise ValueError(f"max_tokens ({max_tokens!r}) must be an integer >= page_size ({page_size})")
        cfg = model.config
        self.mode = mode
        self.page_size = page_size
        self.num_pages = max_tokens // page_size
        self.pool = PagePool(self.num_pages, page_size)
        shape = (self.num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        dtype, device = CACHE_MODES[mode], model.device
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def null_page(self) -> int:
        return self.num_pages

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        copy_page_prefix(self.k + self.v, src_page, dst_page, num_tokens)

    def fill_unused(self, value: float = float("nan")) -> None:
        """Testing aid: poison every slot of every real page (the null page stays zero)."""
        for t in self.k + self.v:
            t[: self.num_pages].fill_(value)

    def defragment(self) -> None:
        """Pack cached pages into the lowest page ids (needs no job running)."""
        plan = self.pool.compaction_plan()
        moves = [(old, new) for old, new in plan.items() if old != new]
        if moves:
            src = torch.tensor([m[0] for m in moves])
            dst = torch.tensor([m[1] for m in moves])
            for t in self.k + self.v:
                t[dst] = t[src]     # advanced indexing gathers src before writing
        self.pool.apply_compaction(plan)
