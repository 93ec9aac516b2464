"""Keep freed activation memory in the process (glibc malloc on Linux).

torch allocates CPU tensors with posix_memalign. glibc serves the large ones (a prefill chunk's
activations are 2-25 MB) from fresh mmap'ed memory, or trims the heap top back to the OS after a
free, so the next forward writes into unmapped pages again: a 160-question MMLU-shaped run took
~250,000 page faults inside its timing. Two mallopt settings stop that: every allocation under
32 MiB (glibc's largest mmap threshold) comes from the heap, and the heap is trimmed only when over
1 GiB of its top is free. Measured on the Intel Xeon machine: 250,748 -> 14,148 faults per run.

Applied once, when `evalrun` is imported (evalrun/process.py). A user's own malloc settings (GLIBC_TUNABLES with malloc
keys, or the MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ variables) win; EVALRUN_MALLOC_TUNING=0
turns it off. Elsewhere (not glibc) nothing is done.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3          # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20                             # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 1 << 30

applied: bool = False                                  # whether apply() set them in this process


def user_settings() -> bool:
    """Whether the user set glibc's malloc knobs themselves."""
    return ("malloc" in os.environ.get("GLIBC_TUNABLES", "")
            or any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")))


def apply() -> bool:
    """Set the two thresholds once (see the module); returns whether they are set."""
    global applied
    if applied or not sys.platform.startswith("linux") or user_settings():
        return applied
    if os.environ.get("EVALRUN_MALLOC_TUNING", "").strip() == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):     # musl and others: their own malloc
            return False
        applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        applied = False
    return applied
