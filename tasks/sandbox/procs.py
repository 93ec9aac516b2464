"""Finding and killing the processes a check left behind (parent side, Linux /proc)."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time


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


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    found = []
    for name in _pids():
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(name))
    return found


def kill_child(parent_pid: int) -> None:
    """SIGKILL the children of `parent_pid` (which must be ours and unreaped) through pidfds,
    re-checking the parent after opening each, so a reused pid is never signalled."""
    for pid in children_of(parent_pid):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if pid in children_of(parent_pid):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def kill_uid(uid: int, python: str, timeout: float = 5.0) -> bool:
    """Kill every process of `uid`; False if some outlived `timeout`. A helper running as
    `uid` calls kill(-1, SIGKILL): one pass the kernel makes atomic against fork, so a fork
    bomb cannot outrun it. NOTE: only for the sandbox's own slot uids."""
    end = time.monotonic() + timeout
    while live_pids_of_uid(uid):
        if time.monotonic() > end:
            return False
        subprocess.run([python, "-I", "-S", "-c", "import os; os.kill(-1, 9)"], user=uid, group=uid,
                       extra_groups=[], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd="/", env={})
        time.sleep(0.005)
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL a process group. NOTE: call only while its leader is unreaped (no pid reuse)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_exit(pidfd: int, timeout: float) -> bool:
    """Wait until the process behind `pidfd` exits, without reaping it."""
    ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
    return bool(ready)
