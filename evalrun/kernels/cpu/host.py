"""Facts about the host CPU, read from /proc/cpuinfo (Linux); None where it cannot be read."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def cpu_flags_line() -> Optional[str]:
    """The CPU's feature line ("flags ..." on x86, "Features ..." on Arm), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return None


def cpu_flags() -> Optional[frozenset[str]]:
    """The CPU's feature flags as a set (e.g. {"avx2", "avx512_bf16", "amx_bf16"}), or None."""
    line = cpu_flags_line()
    return None if line is None else frozenset(line.partition(":")[2].split())
