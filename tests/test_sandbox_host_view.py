"""Issue 13, item 3 (the file half): at the userns level the worker has the caller's uid, and it
read the caller's private files. At the namespace levels the worker now sees a minimal view of the
host: the system's programs and libraries, the interpreter's own directories, /proc and /sys, a few
files of /etc and the harmless device nodes; every other top-level directory (homes, /var, /run,
/srv, the repository, ...) is an empty tmpfs with only the interpreter's paths bound back.

A sample "passes" only if its attack worked: the completion returns the right answer for
HumanEval/0 exactly when it read the planted secret (or saw a device it must not see)."""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
from sandbox_helpers import FAST, he_spec, open_sandbox, right_only_if

from tasks.sandbox.launcher import DEV_NODES


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
    """Private files of the caller: one in a directory outside the system's (0700 dir, 0600 file,
    like a home's), one in the caller's home when that is not the interpreter's."""
    token = secrets.token_hex(8)
    base = Path(tempfile.mkdtemp(prefix="evalrun-private-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    os.chmod(base, 0o700)
    planted = [base / "secret.txt"]
    home = Path.home()
    if home.is_dir():
        planted.append(home / f".evalrun-private-{token}")
    for path in planted:
        path.write_text(f"the secret {token}\n")
        os.chmod(path, 0o600)
    yield token, [str(p) for p in planted]
    for path in planted:
        path.unlink(missing_ok=True)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module", params=("namespaces", "userns"))
def ns_box(request):
    sandbox = open_sandbox(request.param, limits=FAST, workers=2)
    yield sandbox
    sandbox.close()


def test_the_callers_private_files_are_unreadable(ns_box, secrets_planted, problems):
    token, paths = secrets_planted
    for path in paths:
        result = ns_box.run(he_spec(problems["HumanEval/0"], _reads(path, token)))
        assert result.status == "failed", (path, result)


def test_only_harmless_device_nodes_are_visible(ns_box, problems):
    allowed = sorted({os.path.basename(p) for p in DEV_NODES} | {"shm"})
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
