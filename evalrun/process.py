"""Process-wide settings that evalrun applies once, when `import evalrun` runs (before torch loads).

    apply_process_settings() -> ProcessSettings   called by evalrun/__init__.py; idempotent

1. OpenMP spin. The native kernels run on their own thread pool (evalrun/kernels/csrc/pool.c). By default
   libgomp's workers, which torch's small ops between those kernels wake, spin for a long while
   after each op (GOMP_SPINCOUNT 300000) and take the cores the pool needs: a short spin made
   decode steps 20-35% faster on a 2-core machine (FIELD_NOTES). libgomp reads the variable once,
   when torch loads it, so it must be set before `import torch`; where torch was imported first,
   one warning line says so (the setting then reaches only child processes). A setting of the
   user's (GOMP_SPINCOUNT or OMP_WAIT_POLICY) wins.
2. glibc malloc thresholds (evalrun/malloc_tuning.py): freed activation memory stays mapped.

Every entry point (the `evalrun` command, `python -m evalrun`, the benchmarks, any
`import evalrun.<package>`) imports this package's __init__ first, whatever the working directory.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from . import malloc_tuning

SPIN_COUNT = "10000"
SET_ENV: dict[str, str] = {}     # what evalrun set in os.environ (benchmarks take it away from peers)


@dataclass(frozen=True)
class ProcessSettings:
    """What apply_process_settings found or did in this process."""
    spin_count: str | None        # GOMP_SPINCOUNT in force for libgomp (None: the user's policy / libgomp's)
    spin_applied: bool            # whether libgomp will read it (False where torch was imported first)
    malloc_tuned: bool            # whether the glibc thresholds are set


_applied: ProcessSettings | None = None


def _set_spin() -> tuple[str | None, bool]:
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return os.environ.get("GOMP_SPINCOUNT"), True                    # the user's setting wins
    os.environ["GOMP_SPINCOUNT"] = SET_ENV["GOMP_SPINCOUNT"] = SPIN_COUNT
    if "torch" in sys.modules:
        print("evalrun: warning: torch was imported before evalrun, so libgomp's spin setting "
              f"(GOMP_SPINCOUNT={SPIN_COUNT}) applies to child processes only; import evalrun first",
              file=sys.stderr)
        return SPIN_COUNT, False
    return SPIN_COUNT, True


def apply_process_settings() -> ProcessSettings:
    """Apply the settings of the module docstring once per process; later calls return the record."""
    global _applied
    if _applied is None:
        spin, spin_applied = _set_spin()
        _applied = ProcessSettings(spin, spin_applied, malloc_tuning.apply())
    return _applied


def current() -> ProcessSettings | None:
    """The record of the settings applied in this process (None before evalrun was imported)."""
    return _applied
