"""The local Ray instance's watchdog: a small process of its own session that ends every process of
the instance when the driver goes, however it goes (SIGKILL included).

    Watchdog.start()                 python -I -m evalrun.scale.ray_watchdog, stdin a pipe from the driver
    watchdog.watch(pids)             the instance's root processes (the driver's children ray.init made)
        the watchdog, every 0.25 s:  remembers the roots and all their descendants (pid, start time)
    watchdog.close() / driver death  the pipe's end: it SIGKILLs every remembered process still alive
                                     (the same pid and start time) and exits

Why: Ray gives gcs_server and raylet PR_SET_PDEATHSIG, but its agents (dashboard agent, runtime env
agent) outlive a SIGKILLed driver for a minute or more, retrying the dead GCS (measured here).
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional

POLL_SECONDS = 0.25


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _parents() -> dict[int, int]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def descendants(roots: Iterable[int]) -> set[int]:
    """`roots` and every process below them, as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def children_of(pid: int) -> set[int]:
    return {p for p, ppid in _parents().items() if ppid == pid}


class Watchdog:
    def __init__(self, proc: subprocess.Popen):
        self._proc = proc

    @classmethod
    def start(cls) -> "Watchdog":
        proc = subprocess.Popen([sys.executable, "-I", "-m", "evalrun.scale.ray_watchdog"], stdin=subprocess.PIPE,
                                start_new_session=True)        # no terminal signal reaches it
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pids: Iterable[int]) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write("".join(f"{p}\n" for p in pids).encode())
        self._proc.stdin.flush()

    def close(self, timeout: float = 10.0) -> None:
        """End the watched processes still alive (the instance is stopped already) and the watchdog."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def run(stdin_fd: int = 0) -> None:
    """The watchdog's loop (see the module's diagram)."""
    roots: set[int] = set()
    known: dict[int, str] = {}
    buffered = b""
    while True:
        readable, _, _ = select.select([stdin_fd], [], [], POLL_SECONDS)
        if readable:
            chunk = os.read(stdin_fd, 4096)
            if not chunk:
                break
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            roots.update(int(line) for line in lines if line.strip())
        for pid in descendants(roots) - {os.getpid()}:
            start = _start_time(pid)
            if start is not None:
                known.setdefault(pid, start)
    for pid, start in known.items():
        if _start_time(pid) == start:                  # still the process we saw, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    run()
