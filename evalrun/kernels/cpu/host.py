"""Facts about the host CPU, read from /proc/cpuinfo (Linux); None where it cannot be read.

`EVALRUN_NATIVE_EMULATE=avx512_bf16` (tests and kernel work on CPUs without AVX-512) adds the
AVX-512 flags the native kernels are then built for (csrc/emulate_avx512.h, through SIMDe) to an
x86 CPU's line: everything that chooses by the flags (kernel paths, `--dtype auto`) then takes the
choices of an AVX-512 BF16 CPU, on emulated instructions (correct, slow).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

EMULATE_ENV = "EVALRUN_NATIVE_EMULATE"
# the emulations there are, and the flags each adds to the CPU's
EMULATIONS = {"avx512_bf16": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")}
_warned: set[str] = set()


def emulation() -> Optional[str]:
    """The emulated instruction set asked for by EVALRUN_NATIVE_EMULATE, or None (unset, empty, or
    not an x86 CPU; an unknown name is ignored with a warning)."""
    return _emulation(_cpuinfo_flags_line()) if os.environ.get(EMULATE_ENV) else None


def _emulation(line: Optional[str]) -> Optional[str]:
    """emulation() for the CPU's feature line `line`."""
    name = os.environ.get(EMULATE_ENV, "")
    if not name:
        return None
    if name not in EMULATIONS:
        if name not in _warned:                 # once per name, not once per flags lookup
            _warned.add(name)
            log.warning("%s=%s ignored: the emulations are %s", EMULATE_ENV, name, ", ".join(EMULATIONS))
        return None
    return name if line is not None and line.startswith("flags") and " avx2" in line else None


def _cpuinfo_flags_line() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return None


def cpu_flags_line() -> Optional[str]:
    """The CPU's feature line ("flags ..." on x86, "Features ..." on Arm), or None; with an
    emulation (see the module's text), the emulated flags appended."""
    line = _cpuinfo_flags_line()
    name = _emulation(line)
    if line is None or name is None:
        return line
    have = set(line.partition(":")[2].split())
    return line + "".join(f" {flag}" for flag in EMULATIONS[name] if flag not in have)


def cpu_flags() -> Optional[frozenset[str]]:
    """The CPU's feature flags as a set (e.g. {"avx2", "avx512_bf16", "amx_bf16"}), or None."""
    line = cpu_flags_line()
    return None if line is None else frozenset(line.partition(":")[2].split())
