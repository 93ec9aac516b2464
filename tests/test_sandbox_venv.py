"""The sandbox run from a virtualenv under /tmp (common in CI), which the sandbox's private
tmpfs over /tmp would hide: a program that starts sys.executable must still pass, while
the venv stays read-only and nothing else of the host's /tmp becomes visible.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sandbox_helpers import LEVELS, REPO

# NOTE: the candidate returns what it saw; the check compares it with what the test expects.
RUN_CHILD = """\
import subprocess, sys
def observe():
    child = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True)
    return [child.returncode, child.stdout.strip(), child.stderr[-300:]]
"""
CONFINEMENT = """\
import os, subprocess, sys
def observe():
    child = subprocess.run([sys.executable, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    venv = os.path.dirname(os.path.dirname(sys.executable))   # NOTE: the worker runs -S: sys.prefix is the base
    writes = []
    for path in (os.path.join(venv, "new.txt"), os.path.join(venv, "pyvenv.cfg")):
        try:
            with open(path, "a") as f:
                f.write("pwned")
            writes.append("written")
        except OSError:
            writes.append("refused")
    readonly = [bool(os.statvfs(p).f_flag & os.ST_RDONLY) for p in (venv, os.path.dirname(sys.executable))]
    return {"child_prefix": child.stdout.strip(), "writes": writes, "readonly": readonly,
            "tmp": sorted(os.listdir("/tmp")), "venv_parent": sorted(os.listdir(os.path.dirname(venv)))}
"""
SCRIPT = """
import json, sys
from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
from evalrun.tasks.sandbox.isolation import IsolationUnavailable
cases, levels = json.load(sys.stdin)
out = {}
for level in levels:
    try:
        box = Sandbox(SandboxLimits(timeout=10.0), workers=2, isolation=level)
    except IsolationUnavailable as exc:
        out[level] = "unavailable: " + str(exc)
        continue
    with box:
        results = [box.run(CheckSpec(program, check, "observe")) for program, check in cases[level]]
        out[level] = {"python": sys.executable, "rebound": box.isolation_info()["rebound_paths"],
                      "results": [[r.status, r.error] for r in results]}
print(json.dumps(out))
"""


@pytest.fixture
def tmp_venv(tmp_path: Path):
    """A real venv (system site-packages, no pip) inside /tmp, next to a file of the harness."""
    base = tmp_path if tmp_path.is_relative_to("/tmp") else Path(tempfile.mkdtemp(prefix="evalrun-venv-", dir="/tmp"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    (base / "harness-secret.txt").write_text("not for the sandbox")
    yield venv
    if base != tmp_path:
        shutil.rmtree(base, ignore_errors=True)


def check_equals(expected: object) -> str:
    return f"def check(candidate):\n    seen = candidate()\n    assert seen == {expected!r}, seen\n"


def test_program_starting_sys_executable_passes_from_a_venv_under_tmp(tmp_venv: Path):
    venv_python = str(tmp_venv / "bin" / "python")
    top = tmp_venv.relative_to("/tmp").parts[0]         # the venv's ancestor right under /tmp
    run_child = (RUN_CHILD, check_equals([0, "1", ""]))
    seen_in_sandbox = {"child_prefix": str(tmp_venv), "writes": ["refused", "refused"], "readonly": [True, True],
                       "tmp": sorted(["work", top]), "venv_parent": ["venv"]}
    confinement = (CONFINEMENT, check_equals(seen_in_sandbox))
    cases = {level: [run_child] + ([confinement] if level != "basic" else []) for level in LEVELS}
    proc = subprocess.run([venv_python, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                          input=json.dumps([cases, list(LEVELS)]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    ran = {level: r for level, r in report.items() if not isinstance(r, str)}
    assert ran, report
    for level, r in ran.items():
        assert r["python"] == venv_python
        assert r["results"] == [["passed", None]] * len(cases[level]), (level, r)
        assert r["rebound"] == ([] if level == "basic" else [str(tmp_venv)]), (level, r)
    assert (tmp_venv / "pyvenv.cfg").read_text().count("pwned") == 0
    assert not (tmp_venv / "new.txt").exists()
