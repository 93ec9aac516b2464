"""The OpenMP spin default (kernels/__init__.py): every evalrun package sets it before torch loads
libgomp, and a setting of the user's wins. Each case runs in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import sys
order = []
class Recorder:
    def find_spec(self, name, path=None, target=None):
        order.append(name)
sys.meta_path.insert(0, Recorder())
import {pkg}
import os
first = lambda n: order.index(n) if n in order else len(order)
print(first("kernels") < first("torch"), os.environ.get("GOMP_SPINCOUNT"))
"""


def _probe(pkg: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(pkg=pkg)], cwd=ROOT, env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("pkg", ["evalrun.cli", "engine", "tasks", "benchmarks.bench_decode"])
def test_spin_default_is_set_before_torch(pkg):
    assert _probe(pkg) == "True 10000"


def test_user_settings_win():
    assert _probe("engine", GOMP_SPINCOUNT="7") == "True 7"
    assert _probe("engine", OMP_WAIT_POLICY="ACTIVE") == "True None"
