"""Issue 13, item 3 (the file half): at the userns level the worker has the caller's uid, and it
read the caller's private files. At the namespace levels the worker now sees a minimal view of the
host: the system's programs and libraries, the interpreter's own directories, /proc and /sys, a few
files of /etc and the harmless device nodes; every other top-level directory (homes, /var, /run,
/srv, the repository, ...) is an empty tmpfs with only the interpreter's paths bound back.

A sample "passes" only if its attack worked: the completion returns the right answer for
HumanEval/0 exactly when it read the planted secret (or saw a device it must not see)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sandbox_helpers import CORRECT_0, FAST, he_spec, open_sandbox, right_only_if

from evalrun.tasks.sandbox import Sandbox
from evalrun.tasks.sandbox.launcher import DEV_LINKS, DEV_NODES, interpreter_error


def _reads(path: str, token: str) -> str:
    return right_only_if(f"""
    ok = False
    try:
        with open({path!r}) as f:
            ok = {token!r} in f.read()
    except OSError:
        pass
    """)


@pytest.fixture(scope="module")
def secrets_planted():
    """Files of the caller the worker must not read: private ones (0700 dir, 0600 file, like a
    home's; and one in the caller's home), a world-readable one in a world-readable directory
    outside the system's (which the namespaces level's other uid could read without the view), and
    one at the top level of the file system when that is writable (e.g. /container_info.json)."""
    token = secrets.token_hex(8)
    var_tmp = "/var/tmp" if os.path.isdir("/var/tmp") else None
    private = Path(tempfile.mkdtemp(prefix="evalrun-private-", dir=var_tmp))
    public = Path(tempfile.mkdtemp(prefix="evalrun-public-", dir=var_tmp))
    os.chmod(private, 0o700)
    os.chmod(public, 0o755)
    planted = {"private": (private / "secret.txt", 0o600), "public": (public / "notes.txt", 0o644)}
    home = Path.home()
    if home.is_dir():
        planted["home"] = (home / f".evalrun-private-{token}", 0o600)
    if os.access("/", os.W_OK):
        planted["top"] = (Path(f"/evalrun-public-{token}.json"), 0o644)
    for path, mode in planted.values():
        path.write_text(f"the secret {token}\n")
        os.chmod(path, mode)
    yield token, {kind: str(path) for kind, (path, _) in planted.items()}
    for path, _ in planted.values():
        path.unlink(missing_ok=True)
    shutil.rmtree(private, ignore_errors=True)
    shutil.rmtree(public, ignore_errors=True)


@pytest.fixture(scope="module", params=("namespaces", "userns"))
def ns_box(request):
    sandbox = open_sandbox(request.param, limits=FAST, workers=2)
    yield sandbox
    sandbox.close()


def test_the_callers_files_are_unreadable(ns_box, secrets_planted, problems):
    token, paths = secrets_planted
    for kind, path in paths.items():
        result = ns_box.run(he_spec(problems["HumanEval/0"], _reads(path, token)))
        assert result.status == "failed", (kind, path, result)


def test_the_world_readable_ones_are_readable_without_the_view(secrets_planted, problems):
    """The attack itself works where there is no view (the basic level), so the test above can fail."""
    token, paths = secrets_planted
    with open_sandbox("basic", limits=FAST, workers=1) as box:
        for kind in ("public", "top"):
            if kind in paths:
                assert box.run(he_spec(problems["HumanEval/0"], _reads(paths[kind], token))).passed, kind


def test_only_harmless_device_nodes_are_visible(ns_box, problems):
    allowed = sorted({os.path.basename(p) for p in [*DEV_NODES, *DEV_LINKS]} | {"shm"})
    attack = f"""
    import os
    ok = sorted(os.listdir("/dev")) != {allowed!r}
    """
    assert ns_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack))).status == "failed"


def test_the_manifest_names_the_hidden_directories(ns_box):
    hidden = ns_box.isolation_info()["host_dirs_hidden"]
    assert "/etc" in hidden and "/dev" in hidden and "/usr" not in hidden
    if os.path.isdir("/var"):
        assert "/var" in hidden


def test_programs_still_run_with_the_interpreter_and_its_libraries(ns_box, problems):
    """The stdlib's C extensions (ssl, hashlib, sqlite3, ctypes) load from the kept directories."""
    attack = """
    import hashlib, json, sqlite3, ssl, ctypes.util, decimal, zlib, datetime
    ok = hashlib.sha256(b"x").hexdigest().startswith("2d71") and sqlite3.connect(":memory:") is not None
    """
    result = ns_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack)))
    assert result.passed, result


def test_dev_fd_and_the_std_streams_lead_to_the_workers_own_fds(ns_box, problems):
    attack = """
    import os
    ok = os.readlink("/dev/stdout") == "/proc/self/fd/1" and "0" in os.listdir("/dev/fd")
    """
    assert ns_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack))).passed


@pytest.fixture
def root_only():
    if os.geteuid() != 0 or shutil.which("mount") is None or shutil.which("unshare") is None:
        pytest.skip("needs root with mount and unshare (as CI runs)")


def test_a_mount_made_later_under_a_hidden_directory_breaks_nothing(ns_box, problems, root_only):
    """Mounts under a covered directory stay listed in the worker's mountinfo but do not resolve;
    one made after the sandbox opened (its probe never saw it) must neither fail every check nor
    show its files."""
    token = secrets.token_hex(8)
    point = Path(tempfile.mkdtemp(prefix="evalrun-mnt-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "evalrun-test", str(point)], check=True)
    try:
        (point / "inside.txt").write_text(f"the secret {token}\n")
        os.chmod(point / "inside.txt", 0o644)
        assert ns_box.run(he_spec(problems["HumanEval/0"], CORRECT_0)).passed
        assert ns_box.run(he_spec(problems["HumanEval/0"], _reads(str(point / "inside.txt"), token))).status == "failed"
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        shutil.rmtree(point, ignore_errors=True)


@pytest.mark.parametrize("level", ["namespaces", "userns"])
def test_an_interpreter_behind_a_top_level_symlink_still_runs(level, problems, root_only, tmp_path_factory):
    """/alias -> var/tmp/real (like /home -> var/home on some distributions), the venv's python at
    /alias/venv/bin/python: the view keeps the real path, so the program can start the interpreter
    again (and the probe, which does the same, lets the level open)."""
    open_sandbox(level, limits=FAST, workers=1).close()         # skips where the level is not available
    real = Path(tempfile.mkdtemp(prefix="evalrun-real-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    os.chmod(real, 0o755)
    alias = Path(f"/evalrun-alias-{secrets.token_hex(6)}")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(real / "venv")], check=True)
        alias.symlink_to(str(real).lstrip("/"))
        attack = f"""
    import subprocess
    ok = subprocess.run([{str(alias / "venv/bin/python")!r}, "-c", "import _csv"]).returncode == 0
    """
        with Sandbox(isolation=level, limits=FAST, workers=1, python=str(alias / "venv/bin/python")) as box:
            assert box.run(he_spec(problems["HumanEval/0"], right_only_if(attack))).passed
    finally:
        alias.unlink(missing_ok=True)
        shutil.rmtree(real, ignore_errors=True)


def test_cover_except_skips_a_dangling_symlink_and_leaks_no_descriptor(tmp_path, root_only):
    """A kept path that is a dangling symlink (e.g. a broken /etc/localtime) brings nothing back
    instead of failing the level; a kept symlink to a file brings back the file."""
    base = Path(tempfile.mkdtemp(prefix="evalrun-cover-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    try:
        (base / "target.txt").write_text("kept\n")
        (base / "dangling").symlink_to(base / "missing")
        (base / "link").symlink_to(base / "target.txt")
        (base / "gone.txt").write_text("hidden\n")
        script = f"""
import json, os
from evalrun.tasks.sandbox import confine
confine.mount(None, "/", None, confine.MS_REC | confine.MS_PRIVATE)
before = len(os.listdir("/proc/self/fd"))
kept = confine.cover_except({str(base)!r}, [{str(base / "dangling")!r}, {str(base / "link")!r}])
print(json.dumps({{"kept": kept, "fds": len(os.listdir("/proc/self/fd")) - before,
                  "names": sorted(os.listdir({str(base)!r})), "link": open({str(base / "link")!r}).read()}}))
"""
        proc = subprocess.run(["unshare", "--mount", sys.executable, "-c", script], capture_output=True, text=True,
                              cwd=str(Path(__file__).resolve().parents[1]))
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out == {"kept": [str(base / "link")], "fds": 0, "names": ["link"], "link": "kept\n"}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_probe_names_an_interpreter_that_cannot_import_its_modules():
    assert interpreter_error(["_csv", "zlib"]) == ""
    assert "_evalrun_no_such_module" in interpreter_error(["_evalrun_no_such_module"])
