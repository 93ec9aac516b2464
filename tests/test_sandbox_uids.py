"""Sandbox uid leases exclude each other across processes through one machine-wide lock
directory, and fail loudly, naming it, when it cannot be used safely (no silent fallback).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sandbox_helpers import REPO

from evalrun.tasks.sandbox.uids import LOCK_DIR, UidLease, UidLockDirError

BASE_UID = 61000          # NOTE: not the Sandbox default, so running sandboxes do not shift the result
LEASE_IN_CHILD = f"""
import json
from evalrun.tasks.sandbox.uids import UidLease
print(json.dumps(UidLease({BASE_UID}, 2).uids))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="uids are leased only by root")
def test_leases_exclude_each_other_across_processes_whatever_their_tmpdir(tmp_path):
    lease = UidLease(BASE_UID, 2)
    try:
        child = subprocess.run([sys.executable, "-c", LEASE_IN_CHILD], cwd=REPO, capture_output=True, text=True,
                               timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)}, check=True)
        other = json.loads(child.stdout)
        assert len(lease.uids) == len(other) == 2
        assert set(lease.uids).isdisjoint(other), (lease.uids, other)
    finally:
        lease.release()
    assert os.path.isdir(LOCK_DIR)


@pytest.mark.parametrize("problem", ["not a directory", "others write", "owned by uid"])
def test_an_unsafe_lock_dir_fails_naming_it(tmp_path, problem):
    path = tmp_path / "locks"
    if problem == "not a directory":
        path.write_text("")
    else:
        path.mkdir(mode=0o700)
    if problem == "others write":
        os.chmod(path, 0o777)
    if problem == "owned by uid":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another uid")
        os.chown(path, 65534, 65534)
    with pytest.raises(UidLockDirError, match=f"lock directory {path} is not safe to use: .*{problem}"):
        UidLease(BASE_UID, 1, lock_dir=str(path))


def test_a_lock_dir_that_cannot_be_created_fails_naming_it(tmp_path):
    path = tmp_path / "file" / "locks"
    (tmp_path / "file").write_text("")
    with pytest.raises(UidLockDirError, match=f"lock directory {path} cannot be created"):
        UidLease(BASE_UID, 1, lock_dir=str(path))


def test_a_safe_lock_dir_leases_distinct_uids(tmp_path):
    path = tmp_path / "locks"
    first = UidLease(BASE_UID, 2, lock_dir=str(path))
    second = UidLease(BASE_UID, 1, lock_dir=str(path))
    assert (first.uids, second.uids) == ([BASE_UID, BASE_UID + 1], [BASE_UID + 2])
    first.release()
    assert UidLease(BASE_UID, 1, lock_dir=str(path)).uids == [BASE_UID]
