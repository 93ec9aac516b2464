"""Issue 13, item 2: memory a candidate puts in files. RLIMIT_AS bounded `bytearray`, but 48 memfd
files of 16 MB (768 MB under a 64 MB limit) were written and held in the host's shared memory until
the wall timeout. Each check now runs in its own memory (and pids) cgroup where one can be made, so
file pages are charged to it; without a cgroup the worker's seccomp filter refuses memfd_create
and shmget, and /tmp and /dev/shm are size-capped tmpfs at the namespace levels.

Both paths are tested at every level this machine provides: the cgroup (CI runs as root, with
cgroup v1 here) and the fallback (memory_cgroup="off", and a harness without root, which cannot
make a cgroup). A sample "passes" only if its attack worked: the completion returns the right
answer for HumanEval/0 exactly when it held all 768 MB."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sandbox_helpers import MEMORY_BOXES, open_memory_box, REPO, he_spec, right_only_if

from evalrun.tasks.sandbox import SandboxLimits
from evalrun.tasks.sandbox.memcg import CheckCgroup, find_root

LIMITS = SandboxLimits(timeout=10.0, memory_mb=64)
NOBODY = 65534

# 48 x 16 MB written a MB at a time (the 1 MB buffer stays far below RLIMIT_AS)
MEMFD_FLOOD = """
import os
chunk, held = b"x" * (1 << 20), []
ok = False
try:
    for i in range(48):
        fd = os.memfd_create(f"m{i}")
        for j in range(16):
            os.write(fd, chunk)
        held.append(fd)
    ok = True
except OSError:
    pass
"""

SHM_FLOOD = """
import os
chunk, ok = b"x" * (1 << 20), False
base = "/dev/shm/evalrun-flood-" + str(os.getpid())
try:
    for i in range(48):
        with open(f"{base}-{i}", "wb") as f:
            for j in range(16):
                f.write(chunk)
    ok = True
except OSError:
    pass
finally:
    for i in range(48):
        try:
            os.unlink(f"{base}-{i}")
        except OSError:
            pass
"""


@pytest.fixture(scope="module", params=MEMORY_BOXES, ids=lambda p: f"{p[0]}-cgroup-{p[1]}")
def mem_box(request):
    sandbox = open_memory_box(*request.param, LIMITS)
    yield sandbox
    sandbox.close()


def test_the_manifest_says_which_memory_bound_is_in_force(mem_box):
    bound = mem_box.isolation_info()["memory_bound"]
    denied = mem_box.isolation_info()["seccomp_denied"]
    if bound["kind"].startswith("cgroup"):
        assert bound["limit_mb"] == LIMITS.memory_mb + 64
        # a pids bound where RLIMIT_NPROC holds none (the worker keeps its uid)
        info = mem_box.isolation_info()
        launchers = 1 if info["level"] == "basic" else 2        # the launcher, and unshare at the namespace levels
        assert bound["pids_max"] == (None if info["uid_dropped"] else LIMITS.max_processes + launchers)
        assert "memfd_create" not in denied
    else:
        assert bound["kind"] == "seccomp" and bound["no_cgroup_because"]
        assert "memfd_create" in denied and "shmget" in denied


def test_memfd_flood_is_bounded(mem_box, problems):
    result = mem_box.run(he_spec(problems["HumanEval/0"], right_only_if(MEMFD_FLOOD)))
    assert not result.passed, result
    if mem_box.isolation_info()["memory_bound"]["kind"].startswith("cgroup"):
        assert result.status == "killed" and "memory limit exceeded" in result.error, result
    else:
        assert result.status == "failed", result          # memfd_create refused: the wrong answer


def test_shm_flood_is_bounded(mem_box, problems):
    info = mem_box.isolation_info()
    if info["level"] == "basic" and info["memory_bound"]["kind"] == "seccomp":
        assert any("/dev/shm" in note for note in info["notes"])   # the hole is stated, not hidden
        pytest.skip("basic level without a cgroup: the host's /dev/shm is bounded per file only (stated in notes)")
    try:
        result = mem_box.run(he_spec(problems["HumanEval/0"], right_only_if(SHM_FLOOD)))
    finally:        # at the basic level the killed worker's files stay in the host's /dev/shm (stated in notes)
        for name in os.listdir("/dev/shm"):
            if name.startswith("evalrun-flood-"):
                os.unlink(os.path.join("/dev/shm", name))
    assert not result.passed, result


def test_a_check_within_the_limit_still_passes(mem_box, problems):
    """32 MB of ordinary memory fits both RLIMIT_AS and the cgroup: the bound is not set too tight."""
    result = mem_box.run(he_spec(problems["HumanEval/0"], right_only_if("ok = len(bytearray(32 << 20)) > 0\n")))
    assert result.passed, result


def test_no_cgroup_is_left_behind(mem_box, problems):
    root = find_root()[0]
    if root is None or mem_box.isolation_info()["memory_bound"]["kind"] == "seccomp":
        pytest.skip("no cgroup in use")
    mem_box.run(he_spec(problems["HumanEval/0"], right_only_if(MEMFD_FLOOD)))
    for parent in filter(None, (root.memory_dir, root.pids_dir)):
        assert not [d for d in os.listdir(parent) if d.startswith(f"evalrun-sandbox-{os.getpid()}-")], parent


def test_a_harness_without_root_cannot_make_a_cgroup_and_says_why(tmp_path):
    """The fallback's trigger on this machine: an unprivileged harness (cgroup v1, no delegation)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("runs as another user: needs root and setpriv")
    script = ("import json, sys; sys.path.insert(0, sys.argv[1])\n"
              "from evalrun.tasks.sandbox.memcg import find_root\n"
              "root, why = find_root(); print(json.dumps([root is None, why]))")
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                           sys.executable, "-c", script, str(REPO)],
                          capture_output=True, text=True, timeout=60, cwd="/")
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
        pytest.skip(f"the unprivileged user cannot run this interpreter: {proc.stderr[-300:]}")
    none, why = json.loads(proc.stdout.strip().splitlines()[-1])
    assert none and why, proc.stdout


def test_adopt_moves_a_process_and_the_child_it_forked():
    """The harness moves the launcher (or `unshare --fork` and the launcher it forked) into the
    check's cgroup while its interpreter starts; whatever it moved is a member."""
    root = find_root()[0]
    if root is None:
        pytest.skip(f"no cgroup can be made here: {find_root()[1]}")
    cgroup = CheckCgroup(root, 256 << 20, None)
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while not Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split():
            assert time.monotonic() < deadline, "sh did not fork"
            time.sleep(0.01)
        child = int(Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()[0])
        cgroup.adopt(parent.pid)
        for procs in cgroup.procs_files:
            members = Path(procs).read_text().split()
            assert str(parent.pid) in members and str(child) in members, (procs, members)
    finally:
        parent.kill()
        parent.wait()
        cgroup.remove()
    assert not any(os.path.exists(d) for d in cgroup.dirs)
