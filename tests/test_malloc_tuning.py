"""evalrun/malloc_tuning.py (applied by `import evalrun`): with glibc, activations under 32 MiB come
from the heap and freed heap memory is kept (no page faults on the next forward's writes); EVALRUN_MALLOC_TUNING=0 and a
user's own malloc settings leave glibc's defaults, which mmap such blocks and trim them on free.
Each case runs in a fresh interpreter (the settings are process-wide), reading glibc's mallinfo2."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import ctypes, json, evalrun, torch
from evalrun import malloc_tuning
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2()
ts = [torch.ones((20 << 20) // 4) for _ in range(10)]
during = libc.mallinfo2()
del ts
after = libc.mallinfo2()
print(json.dumps({"applied": malloc_tuning.applied, "mmapped": during.hblkhd - before.hblkhd,
                  "heap_kept": after.arena - before.arena}))
"""


def _glibc_mallinfo2() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc_mallinfo2(), reason="glibc >= 2.33 (mallinfo2) on Linux only")


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("EVALRUN_MALLOC_TUNING", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_large_activations_come_from_the_heap_and_stay_mapped():
    got = _probe()
    assert got["applied"]
    assert got["mmapped"] == 0                              # ten 20 MiB tensors, none mmap'ed
    assert got["heap_kept"] >= 10 * (20 << 20)              # and their memory kept after the free


@pytest.mark.parametrize("env", [{"EVALRUN_MALLOC_TUNING": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_the_switch_and_the_users_settings_leave_glibcs_defaults(env):
    got = _probe(**env)
    assert not got["applied"]
    assert got["mmapped"] >= 10 * (20 << 20)                # glibc's default: each block mmap'ed ...
    assert got["heap_kept"] < (20 << 20)                    # ... and given back on free
