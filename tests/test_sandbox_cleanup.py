"""No swallowed cleanup failures: a process of a check that cannot be killed makes the check
an error (never "passed"), and the kill helpers verify that the processes are gone.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess

import pytest
from sandbox_helpers import MARK, PROBLEM, he_spec, wait_no_leftovers

from evalrun.tasks.sandbox import procs
from evalrun.tasks.sandbox.sandbox import DEFAULT_BASE_UID
from evalrun.tasks.sandbox.uids import UidLease


def refuse_killpg(pgid: int, sig: int) -> None:
    raise PermissionError(1, "Operation not permitted")


def test_a_failed_group_kill_fails_a_passing_program(box, problems, monkeypatch, caplog):
    p = problems[PROBLEM]
    monkeypatch.setattr(os, "killpg", refuse_killpg)
    with caplog.at_level(logging.ERROR, logger="evalrun.tasks.sandbox.execute"):
        result = box.run(he_spec(p, p["canonical_solution"]))
    monkeypatch.undo()
    assert result.status == "error" and result.error.startswith("cleanup failed: kill_group("), result
    assert "killpg(" in result.error and "Operation not permitted" in result.error
    assert any("killpg(" in r.getMessage() for r in caplog.records)
    assert wait_no_leftovers(box.isolation_info()["sandbox_uids"]) == []
    assert box.run(he_spec(p, p["canonical_solution"])).passed


def test_an_empty_group_is_not_a_failure(box, problems, monkeypatch):
    def gone(pgid: int, sig: int) -> None:
        raise ProcessLookupError(3, "No such process")
    p = problems[PROBLEM]
    monkeypatch.setattr(os, "killpg", gone)
    assert box.run(he_spec(p, p["canonical_solution"])).passed


def test_a_failed_uid_kill_fails_a_passing_program(box, problems, monkeypatch):
    if not box.isolation_info()["uid_dropped"]:
        pytest.skip("the sandbox runs without its own uids here (not root)")
    def survive(uid: int) -> None:
        raise procs.CleanupError(f"uid {uid}: [4242] still running")
    p = problems[PROBLEM]
    monkeypatch.setattr(procs, "kill_uid", survive)
    result = box.run(he_spec(p, p["canonical_solution"]))
    assert result.status == "error" and "[4242] still running" in result.error, result


def test_kill_group_verifies_that_the_group_is_gone(monkeypatch):
    sleeper = subprocess.Popen(["sleep", f"1000.{MARK}5"], start_new_session=True)
    try:
        monkeypatch.setattr(os, "killpg", lambda pgid, sig: None)      # "succeeds" without killing
        with pytest.raises(procs.CleanupError, match=rf"process group {sleeper.pid}: \[{sleeper.pid}\] still running"):
            procs.kill_group(sleeper.pid, timeout=0.2)
        monkeypatch.undo()
        procs.kill_group(sleeper.pid)
        assert procs.live_group_members(sleeper.pid) == []
    finally:
        sleeper.kill()
        assert sleeper.wait() == -signal.SIGKILL


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another uid")
def test_kill_uid_kills_without_our_interpreter():
    """The helper that kills as the sandbox uid must not need to reach our python (a venv
    under a 0700 dir, /root/.pyenv: the uid may not enter them)."""
    lease = UidLease(DEFAULT_BASE_UID, 1)
    uid = lease.uids[0]
    try:
        sleepers = [subprocess.Popen(["sleep", f"1000.{MARK}6"], user=uid, group=uid, extra_groups=[],
                                     start_new_session=True) for _ in range(3)]
        procs.kill_uid(uid)
        assert [s.wait(timeout=5) for s in sleepers] == [-signal.SIGKILL] * 3
        assert procs.live_pids_of_uid(uid) == []
    finally:
        lease.release()
