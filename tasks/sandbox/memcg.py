"""A memory and process-count bound per check through a cgroup, where this process can make one.

RLIMIT_AS bounds a worker's address space, but not memory it puts in files: memfd_create, POSIX
shared memory in /dev/shm and a tmpfs are charged to nobody's address space. A memory cgroup
charges every page a process faults in, file pages included, so a check's cgroup bounds all of
its memory; the kernel's OOM killer ends the check's processes when the limit is reached.

    version 2: our own cgroup (/proc/self/cgroup "0::/path") under the cgroup2 mount, when its
               subtree may use the memory controller (cgroup.subtree_control) and we may write it;
               a check's directory gets memory.max (memory.swap.max 0) and pids.max
    version 1: our memory cgroup under the v1 "memory" mount (memory.limit_in_bytes, and
               memory.memsw.limit_in_bytes where swap is accounted) and, where mounted, our pids
               cgroup (pids.max)

The harness makes a check's directories before it starts the launcher and removes them after;
the launcher (trusted) joins them first thing by writing 0 to each `cgroup.procs`, so the worker
it forks, and everything the worker starts, is inside. Where no cgroup can be made (not root, no
delegation) `find_root` says why, and the sandbox falls back to refusing memfd_create and SysV
shared memory (tmpfs mounts are size-capped at the namespace levels).
"""
from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

MOUNTINFO = "/proc/self/mountinfo"
_names = itertools.count()


@dataclass(frozen=True)
class CgroupRoot:
    """Where check cgroups are made: version 1 or 2, and the parent directories (memory, pids)."""
    version: int
    memory_dir: str
    pids_dir: Optional[str]       # v1: the pids hierarchy's directory, None when not mounted; v2: memory_dir

    def describe(self) -> str:
        return f"cgroup v{self.version} ({self.memory_dir})"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every mount."""
    found = []
    with open(MOUNTINFO) as f:
        for line in f:
            left, right = line.split(" - ", 1)
            point = left.split()[4]
            fstype, _source, opts = (right.split() + ["", "", ""])[:3]
            found.append((point.replace("\\040", " "), fstype, set(opts.split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """controller ('' for v2) -> our cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _v1_dir(controller: str, mounts: list[tuple[str, str, set[str]]], own: dict[str, str]) -> Optional[str]:
    for point, fstype, opts in mounts:
        if fstype == "cgroup" and controller in opts and controller in own:
            return os.path.join(point, own[controller].lstrip("/"))
    return None


def _v2_dir(mounts: list[tuple[str, str, set[str]]], own: dict[str, str]) -> Optional[str]:
    for point, fstype, _opts in mounts:
        if fstype == "cgroup2" and "" in own:
            path = os.path.join(point, own[""].lstrip("/"))
            try:
                with open(os.path.join(path, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
            except OSError:
                return None
            return path if "memory" in enabled and "pids" in enabled else None
    return None


def find_root() -> tuple[Optional[CgroupRoot], str]:
    """(where check cgroups can be made, "") or (None, why not). Tries a throw-away child."""
    try:
        mounts, own = _mounts(), _own_paths()
    except (OSError, ValueError) as exc:
        return None, f"cannot read the cgroup mounts ({exc})"
    candidates = []
    v1 = _v1_dir("memory", mounts, own)
    if v1:
        candidates.append(CgroupRoot(1, v1, _v1_dir("pids", mounts, own)))
    v2 = _v2_dir(mounts, own)
    if v2:
        candidates.append(CgroupRoot(2, v2, v2))
    if not candidates:
        return None, "no memory cgroup controller is available to this process (v2 memory+pids not delegated)"
    reasons = []
    for root in candidates:
        try:
            CheckCgroup(root, memory_bytes=64 << 20, max_processes=8).remove()
            return root, ""
        except OSError as exc:
            reasons.append(f"{root.describe()}: {exc.strerror or exc}")
    return None, "cannot make a cgroup: " + "; ".join(reasons)


class CheckCgroup:
    """One check's cgroup directories with their limits; `procs_files` for the launcher to join."""

    def __init__(self, root: CgroupRoot, memory_bytes: int, max_processes: Optional[int]) -> None:
        """max_processes None: no pids bound (v1: no pids cgroup to join; each join costs the
        launcher an RCU grace period, milliseconds)."""
        self.root = root
        name = f"evalrun-sandbox-{os.getpid()}-{next(_names)}"
        self.memory_dir = os.path.join(root.memory_dir, name)
        self.pids_dir = os.path.join(root.pids_dir, name) \
            if root.pids_dir and root.version == 1 and max_processes is not None else None
        self.dirs = [d for d in (self.memory_dir, self.pids_dir) if d]
        made = []
        try:
            for d in self.dirs:
                os.mkdir(d, 0o755)
                made.append(d)
            if root.version == 2:
                self._write(self.memory_dir, "memory.max", memory_bytes)
                self._write(self.memory_dir, "memory.swap.max", 0, optional=True)
                if max_processes is not None:
                    self._write(self.memory_dir, "pids.max", max_processes)
            else:
                self._write(self.memory_dir, "memory.limit_in_bytes", memory_bytes)
                self._write(self.memory_dir, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                if self.pids_dir:
                    self._write(self.pids_dir, "pids.max", max_processes)
        except OSError:
            for d in reversed(made):
                _rmdir(d)
            raise

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the memory limit was hit: the OOM killer ended a process of the cgroup (v1's
        memory.failcnt stays 0 when the charge fails into the OOM killer: oom_control counts it)."""
        try:
            name = "memory.events" if self.root.version == 2 else "memory.oom_control"
            with open(os.path.join(self.memory_dir, name)) as f:
                fields = dict(line.split() for line in f if line.strip())
            return int(fields.get("oom_kill", 0)) > 0 or int(fields.get("max" if self.root.version == 2 else
                                                                              "under_oom", 0)) > 0
        except (OSError, ValueError):
            return False

    def remove(self, timeout_s: float = 2.0) -> None:
        """Kill whatever is left inside, then remove the directories (retried while they drain)."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            while True:
                for pid in _pids(d):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

    @staticmethod
    def _write(d: str, name: str, value: int, optional: bool = False) -> None:
        path = os.path.join(d, name)
        if optional and not os.path.exists(path):
            return
        with open(path, "w") as f:
            f.write(str(value))


def _pids(d: str) -> list[int]:
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _rmdir(d: str) -> None:
    try:
        os.rmdir(d)
    except OSError:
        pass
