"""PagedCache: the K/V storage of every layer plus the page pool that addresses it.

Per layer one `LayerKV` in the cache's `KVFormat` (evalrun/kernels/kv_format.py): float K/V
[num_pages + 1, page_size, num_kv_heads, head_dim] for fp32/bf16/fp16, or uint8 codes plus
float16 scales for q8/q6/q4. The extra last page is the null page: zeros, never
allocated; padded reads point there.

Size it in tokens (`max_tokens`) or in bytes (`max_memory`, null page and window store
included): the same memory holds ~3.5x the tokens in q4 that it holds in fp16.

Quantized formats with a recent-token window (evalrun/kernels/kv_format.py) also keep a small
exact store of `max_jobs` job blocks; at most that many jobs run at once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from evalrun.kernels.kv_format import KV_FORMATS, KVFormat, LayerKV, kv_format

from .config import ModelConfig
from .page_pool import PagePool

CACHE_MODES = KV_FORMATS
DEFAULT_MAX_TOKENS = 65536
DEFAULT_WINDOW_JOBS = 64     # running jobs a windowed format keeps an exact block for


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


def resolve_format(mode: "str | KVFormat", page_size: int, window: Optional[int] = None) -> KVFormat:
    """The format a cache of this mode and page size uses: `window` overrides the format's
    recent-token window; a mode name's default one is fitted to the page (gcd), an explicit one
    (or a KVFormat's) must tile it."""
    fmt = kv_format(mode, window)
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    if window is None and isinstance(mode, str) and fmt.window and page_size % fmt.window:
        fmt = kv_format(fmt, math.gcd(fmt.window, page_size))
    fmt.check_page_size(page_size)
    return fmt


@dataclass(frozen=True)
class CachePlan:
    """What a cache of these settings allocates (computed from the model's config alone)."""
    format: KVFormat
    page_size: int
    num_pages: int
    window_slots: int            # running jobs the window store holds (0: no window)
    bytes_per_token: int         # page storage of one token over all layers
    window_bytes_per_job: int

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def memory_bytes(self) -> int:
        return ((self.num_pages + 1) * self.page_size * self.bytes_per_token
                + self.window_slots * self.window_bytes_per_job)


def plan_cache(cfg: ModelConfig, mode: "str | KVFormat", page_size: int = 256, max_tokens: Optional[int] = None,
               max_memory: Optional[int] = None, max_jobs: Optional[int] = None,
               window: Optional[int] = None) -> CachePlan:
    """Size a cache; ValueError names what is wrong. The default window (a format's own) is
    fitted to the page (gcd); the number of window slots is max_jobs (default
    DEFAULT_WINDOW_JOBS), at most the pages (a running job holds one) and, by default when
    sized by memory, at most 1/16 of it."""
    fmt = resolve_format(mode, page_size, window)
    fmt.check_head_dim(cfg.head_dim)
    if max_jobs is not None and (not isinstance(max_jobs, int) or max_jobs < 1):
        raise ValueError(f"max_jobs must be None or an integer >= 1, got {max_jobs!r}")
    per_token = fmt.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    per_job = fmt.window_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    slots = (max_jobs or DEFAULT_WINDOW_JOBS) if fmt.window else 0
    if max_memory is not None:
        if max_tokens is not None:
            raise ValueError("give the cache size as max_tokens or as max_memory, not both")
        if fmt.window and max_jobs is None:
            slots = max(1, min(slots, max_memory // 16 // per_job))
        if slots * per_job >= max_memory:
            raise ValueError(f"cache memory of {max_memory} bytes is too small: in mode {fmt.name} the "
                             f"exact window of {fmt.window} tokens for {slots} running jobs "
                             f"alone takes {slots * per_job} bytes")
        try:
            num_pages = pages_for_memory(max_memory - slots * per_job, page_size, per_token, fmt.name)
        except ValueError as exc:
            if not slots:
                raise
            raise ValueError(f"{exc} (of the {max_memory} bytes given, the exact window of {fmt.window} tokens "
                             f"for {slots} running jobs takes {slots * per_job})") from None
    else:
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < page_size:
            raise ValueError(f"max_tokens ({max_tokens!r}) must be an integer >= page_size ({page_size})")
        num_pages = max_tokens // page_size
    slots = min(slots, num_pages)          # a running job holds a page: more slots are never used
    return CachePlan(fmt, page_size, num_pages, slots, per_token, per_job)


class PagedCache:
    def __init__(self, model: Any, max_tokens: Optional[int] = None, page_size: int = 256,
                 mode: "str | KVFormat" = "bf16", max_memory: Optional[int] = None,
                 max_jobs: Optional[int] = None, window: Optional[int] = None):
        """Sized by `plan_cache`. max_jobs: running jobs the recent-token window store holds
        (windowed formats), the limit on running jobs. window: overrides the format's.
        model: the Model whose K/V this holds (its config, dtype, device, and `kernel_plan`, which
        resolves the kernels every op on this cache runs: `self.kernels`)."""
        if mode == "auto":
            mode = auto_cache_mode(model.dtype)
        cfg = model.config
        plan = plan_cache(cfg, mode, page_size, max_tokens, max_memory, max_jobs, window)
        fmt = plan.format
        self.plan = plan
        self.num_pages = plan.num_pages
        self.window_slots = plan.window_slots
        self.format = fmt
        self.mode = fmt.name
        self.page_size = page_size
        self.kernels = model.kernel_plan(fmt, page_size)      # the KernelPlan of every op on these pages
        self.pool = PagePool(self.num_pages, page_size)
        self.layers = [LayerKV.allocate(fmt, self.num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                                        model.device, self.window_slots) for _ in range(cfg.num_layers)]

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

    @property
    def window(self) -> int:
        return self.format.window

    def prefault(self) -> float:
        """Write every page once (zeros) so the OS maps the cache's memory now, not on each page's
        first write during a run; returns the seconds it took. The pages are left unwritten at
        construction (LayerKV.allocate): lazily only the memory a run uses is ever mapped, which
        suits short runs; a first write costs a page fault, ~0.5 GB/s on 2 MiB pages measured on
        one machine (evalrun/kernels/cpu/huge_pages.py), ~1 s of a 4,096-token decode benchmark. Peers that
        zero their KV cache at start (vLLM) pay this before their timings; the benchmarks call it
        before theirs. Contents are never read before a token is written, so nothing changes."""
        start = time.perf_counter()
        for layer in self.layers:
            for t in layer.tensors():
                t.zero_()
        return time.perf_counter() - start

    def memory_bytes(self) -> int:
        """Bytes of every allocated storage tensor (codes, scales, the null page, the window store)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def window_memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.window_tensors())

    def bytes_per_token(self) -> float:
        """Page storage over the slots allocated (the null page's included): scales count, the
        per-job window store does not (window_memory_bytes())."""
        return sum(layer.page_bytes() for layer in self.layers) / ((self.num_pages + 1) * self.page_size)

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        self.kernels.copy_page_prefix(self.layers, src_page, dst_page, num_tokens)

    def fill_unused(self, value: float = float("nan")) -> None:
        """Testing aid: poison every slot of every real page (the null page stays zero);
        quantized formats poison the scales, so any read of a stale slot gives NaN; so is the
        whole window store."""
        for layer in self.layers:
            for t in layer.data_tensors():
                t[: self.num_pages].fill_(value)
            for t in layer.window_tensors():
                t.fill_(value)

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
