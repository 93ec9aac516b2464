"""Large CPU buffers on transparent huge pages: the KV cache's pages and the packed weights.

    empty(shape, dtype) -> torch.empty, but (Linux, >= 2 MiB, CPU) its data starts on a 2 MiB
                           boundary and the range is advised MADV_HUGEPAGE before anything touches it

A decode step streams the whole KV cache and every weight once; on 4 KiB pages that is a TLB miss
(a page walk) every 4 KiB. Where the kernel's THP mode is `madvise` (the common default) a buffer
is only backed by 2 MiB pages when asked; under `always` it would be anyway and `never` ignores it.
The advice changes nothing but the backing: contents, layout and results are identical.
EVALRUN_HUGE_PAGES=0 turns it off (for A/B runs). Elsewhere (not Linux, small buffers, GPU) this is
plain torch.empty.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from typing import Optional, Sequence

import torch

HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14                    # linux/mman-common.h
_libc: Optional[ctypes.CDLL] = None


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("EVALRUN_HUGE_PAGES", "1") != "0"


def _madvise(address: int, length: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise(address, length, MADV_HUGEPAGE) == 0


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """An uninitialised contiguous tensor, on huge pages where that applies (see the module)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not enabled():
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    # its own anonymous mapping, never touched: memory from malloc may be heap that earlier tensors
    # already faulted in on 4 KiB pages (evalrun/kernels/malloc_tuning.py keeps freed heap), which the advice
    # does not convert; the tensor keeps the mapping alive, and it is unmapped with the tensor
    raw = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                           dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    region = raw[start:start + nbytes]
    _madvise(region.data_ptr(), nbytes)              # advice only: where refused, 4 KiB pages as before
    return region.view(dtype).view(tuple(shape))
