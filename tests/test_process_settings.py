"""The process settings of evalrun/process.py: `import evalrun` (which every entry point and every
evalrun.* package runs first) sets libgomp's spin before torch loads and tunes glibc malloc,
whatever the working directory; a setting of the user's wins; torch imported first gets one warning
line. Also: no module of this project is importable under a bare top-level name (engine, tasks,
kernels, results), so Hugging Face's `kernels` package is the one `import kernels` finds.
Each case runs in a fresh interpreter."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EVALRUN_MALLOC_TUNING", "GLIBC_TUNABLES",
                "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
PROBE = """
import sys
order = []
class Recorder:
    def find_spec(self, name, path=None, target=None):
        order.append(name)
sys.meta_path.insert(0, Recorder())
import {pkg}
import ctypes, json, os, torch
from evalrun import process
first = lambda n: order.index(n) if n in order else len(order)
mmapped = None
try:
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblkhd
    block = torch.ones((20 << 20) // 4)                  # 20 MiB: glibc's default would mmap it
    mmapped = libc.mallinfo2().hblkhd - before
except (OSError, AttributeError):
    pass
print(json.dumps({{"evalrun_before_torch": first("evalrun") < first("torch"),
                  "spin": os.environ.get("GOMP_SPINCOUNT"), "record": process.current().__dict__,
                  "mmapped": mmapped, "modules": sorted(n for n in sys.modules if n.split(".")[0] in
                                                        ("engine", "tasks", "kernels", "results"))}}))
"""


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


def _run(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS_ENV}
    base.pop("PYTHONPATH", None)                          # what the install gives, nothing more
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**base, **env}, capture_output=True,
                          text=True, timeout=180)


def _probe(pkg: str, cwd: Path, **env: str) -> dict:
    out = _run(PROBE.format(pkg=pkg), cwd, **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pkg", ["evalrun.commands.cli", "evalrun.engine", "evalrun.tasks", "evalrun.kernels.cpu.gemm",
                                 "evalrun.results"])
def test_settings_are_in_force_when_started_outside_the_checkout(pkg, tmp_path):
    got = _probe(pkg, tmp_path)
    assert got["evalrun_before_torch"]
    assert got["spin"] == "10000"
    assert got["record"] == {"spin_count": "10000", "spin_applied": True, "malloc_tuned": _glibc()}
    if _glibc():
        assert got["mmapped"] == 0                        # the 20 MiB block came from the heap
    assert got["modules"] == [] or all(m == "kernels" or m.startswith("kernels.") for m in got["modules"])


def test_benchmarks_apply_them_too():
    got = _probe("benchmarks.bench_decode", ROOT)          # run from the checkout, as the benchmarks are
    assert got["evalrun_before_torch"] and got["spin"] == "10000" and got["record"]["spin_applied"]


def test_user_settings_win(tmp_path):
    got = _probe("evalrun.engine", tmp_path, GOMP_SPINCOUNT="7")
    assert got["spin"] == "7" and got["record"]["spin_count"] == "7"
    got = _probe("evalrun.engine", tmp_path, OMP_WAIT_POLICY="ACTIVE")
    assert got["spin"] is None and got["record"]["spin_count"] is None


def test_torch_imported_first_gets_one_warning_line(tmp_path):
    out = _run("import torch, evalrun, os; print(os.environ['GOMP_SPINCOUNT'], evalrun.process.current().spin_applied)",
               tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["10000", "False"]        # set for child processes, not for this libgomp
    warnings = [line for line in out.stderr.splitlines() if "evalrun" in line]
    assert len(warnings) == 1 and "torch was imported before evalrun" in warnings[0], out.stderr
    quiet = _run("import torch, evalrun", tmp_path, OMP_WAIT_POLICY="PASSIVE")   # the user's choice: no warning
    assert quiet.returncode == 0 and "evalrun" not in quiet.stderr, quiet.stderr


@pytest.mark.parametrize("cwd", ["checkout", "elsewhere"])
def test_no_project_module_under_a_bare_top_level_name(cwd, tmp_path):
    where = ROOT if cwd == "checkout" else tmp_path
    code = ("import importlib.util, json\n"
            "specs = {n: importlib.util.find_spec(n) for n in ('engine', 'tasks', 'kernels', 'results')}\n"
            "print(json.dumps({n: None if s is None else [s.origin, list(s.submodule_search_locations or [])]"
            " for n, s in specs.items()}))")
    out = _run(code, where)
    assert out.returncode == 0, out.stderr
    for name, spec in json.loads(out.stdout).items():
        if spec is None:
            continue
        origin, locations = spec
        assert not any(str(p).startswith(str(ROOT)) for p in [origin or "", *locations]), (name, spec)
