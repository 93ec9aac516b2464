"""Finding and killing the processes a check left behind (parent side, Linux /proc)."""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import time


class CleanupError(RuntimeError):
    """A process of a check could not be killed: the check must not count as passed."""


def _status(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def live_pids_of_uid(uid: int) -> list[int]:
    """Running (not zombie) processes whose real or effective uid is `uid`."""
    found = []
    for name in _pids():
        try:
            status = _status(name)
        except OSError:
            continue
        real, effective = status.get("Uid", "-1 -1").split()[:2]
        if uid in (int(real), int(effective)) and not status.get("State", "").startswith("Z"):
            found.append(int(name))
    return found


def _stat_fields(name: str) -> list[bytes]:
    """/proc/<name>/stat after the command name: state, ppid, pgrp, ..."""
    with open(f"/proc/{name}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    found = []
    for name in _pids():
        try:
            ppid = int(_stat_fields(name)[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(name))
    return found


def live_group_members(pgid: int) -> list[int]:
    """Running (not zombie or dead) processes of process group `pgid`."""
    found = []
    for name in _pids():
        try:
            fields = _stat_fields(name)
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X", b"x"):
                found.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def kill_child(parent_pid: int) -> None:
    """SIGKILL the children of `parent_pid` (which must be ours and unreaped) through pidfds,
    re-checking the parent after opening each, so a reused pid is never signalled."""
    for pid in children_of(parent_pid):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if pid in children_of(parent_pid):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass                        # exited meanwhile
        finally:
            os.close(pidfd)


def kill_uid(uid: int, timeout: float = 5.0) -> None:
    """Kill every process of `uid`; CleanupError if some outlive `timeout`. A helper running
    as `uid` calls kill(-1, SIGKILL): one pass the kernel makes atomic against fork, so a fork
    bomb cannot outrun it. NOTE: only for the sandbox's own slot uids. The helper is the
    system's `kill`, not our interpreter, which `uid` may not be allowed to reach."""
    kill = shutil.which("kill", path=os.defpath)
    end = time.monotonic() + timeout
    while survivors := live_pids_of_uid(uid):
        if kill is None or time.monotonic() > end:
            raise CleanupError(f"uid {uid}: {survivors} still running" + ("" if kill else " (no kill command)"))
        subprocess.run([kill, "-9", "-1"], user=uid, group=uid, extra_groups=[], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", env={})
        time.sleep(0.005)


def kill_group(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL a process group and wait until no member runs; CleanupError if killpg fails
    (other than for an empty group) or a member outlives `timeout`.
    NOTE: call only while its leader is unreaped (no pid reuse)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return                          # no process left in the group
    except OSError as exc:
        raise CleanupError(f"killpg({pgid}, SIGKILL) failed: {exc}") from exc
    end = time.monotonic() + timeout
    while survivors := live_group_members(pgid):
        if time.monotonic() > end:
            raise CleanupError(f"process group {pgid}: {survivors} still running {timeout:g} s after SIGKILL")
        time.sleep(0.005)


def wait_exit(pidfd: int, timeout: float) -> bool:
    """Wait until the process behind `pidfd` exits, without reaping it."""
    ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
    return bool(ready)
