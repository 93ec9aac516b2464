"""A memory and process-count bound per check through a cgroup, where this process can make one.

RLIMIT_AS bounds a worker's address space, but not memory it puts in files: memfd_create, POSIX
shared memory in /dev/shm and a tmpfs are charged to nobody's address space. A memory cgroup
charges every page a process faults in, file pages included, so a check's cgroup bounds all of
its memory; the kernel's OOM killer ends the check's processes when the limit is reached.

    version 2: our own cgroup (/proc/self/cgroup "0::/path") under the cgroup2 mount, when it
               enables the memory and pids controllers for its children (cgroup.subtree_control)
               and we may write it. NOTE: cgroup v2's "no internal processes" rule lets a cgroup
               that holds processes do that only at the root (e.g. a container's own root
               cgroup), so a harness in a delegated non-root cgroup falls back; a check's
               directory gets memory.max (memory.swap.max 0) and pids.max
    version 1: our memory cgroup under the v1 "memory" mount (memory.limit_in_bytes, and
               memory.memsw.limit_in_bytes where swap is accounted) and, where mounted, our pids
               cgroup (pids.max)

The harness makes a check's directories before it starts the launcher and removes them after;
the launcher (trusted) joins them first thing by writing 0 to each `cgroup.procs`, so the worker
it forks, and everything the worker starts, is inside. Where no cgroup can be made (not root, no
delegation) `find_root` says why, and the sandbox falls back to refusing memfd_create, socketpair
and the SysV and POSIX IPC objects (seccomp.py; tmpfs mounts are size-capped at the namespace levels).
"""
from __future__ import annotations

import itertools
import os
import re
import secrets
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

    def swap_bounded(self) -> bool:
        """Whether a check's pages cannot escape its limit into swap: no swap is on, or the
        hierarchy has the swap limit file (v2 memory.swap.max, v1 memory.memsw.limit_in_bytes)."""
        name = "memory.swap.max" if self.version == 2 else "memory.memsw.limit_in_bytes"
        return not swap_on() or os.path.exists(os.path.join(self.memory_dir, name))


def swap_on() -> bool:
    try:
        with open("/proc/swaps") as f:
            return len(f.read().strip().splitlines()) > 1
    except OSError:
        return False


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root within its hierarchy, mount point, fs type, super options) of every mount."""
    found = []
    with open(MOUNTINFO) as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields = left.split()
            fstype, _source, opts = (right.split() + ["", "", ""])[:3]
            found.append((_unescape(fields[3]), _unescape(fields[4]), fstype, set(opts.split(","))))
    return found


def _under_mount(point: str, mount_root: str, own: str) -> Optional[str]:
    """Our cgroup `own` (a path in the hierarchy) as a directory under a mount of that hierarchy's
    `mount_root` (a container may see only its own subtree), or None when it is not below it."""
    rel = os.path.relpath(own, mount_root)
    return None if rel == ".." or rel.startswith("../") else os.path.normpath(os.path.join(point, rel))


def _own_paths() -> dict[str, str]:
    """controller ('' for v2) -> our cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _v1_dir(controller: str, mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str]) -> Optional[str]:
    for root, point, fstype, opts in mounts:
        if fstype == "cgroup" and controller in opts and controller in own:
            return _under_mount(point, root, own[controller])
    return None


def _v2_dir(mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str]) -> Optional[str]:
    for root, point, fstype, _opts in mounts:
        if fstype == "cgroup2" and "" in own:
            path = _under_mount(point, root, own[""])
            if path is None:
                return None
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
        return None, ("no memory cgroup controller is available to this process (v1 not mounted; v2: its cgroup does "
                      "not enable memory and pids for children)")
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
        # the random part: a harness that crashed may have left directories of its pid
        name = f"evalrun-sandbox-{os.getpid()}-{next(_names)}-{secrets.token_hex(3)}"
        self.memory_dir = os.path.join(root.memory_dir, name)
        separate_pids = root.pids_dir is not None and root.version == 1 and max_processes is not None
        self.pids_dir = os.path.join(root.pids_dir, name) if separate_pids else None
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

    def adopt(self, pid: int) -> None:
        """Move process `pid`, then its children (`unshare --fork`'s launcher, if it has forked by
        then), into the cgroup, from the harness while the launcher's interpreter starts: the first
        move waits an RCU grace period (10-20 ms), which then overlaps that start instead of
        following it. Best effort: the launcher joins by itself whatever this did not move."""
        try:
            for path in self.procs_files:
                _write_pid(path, pid)
            for child in _children(pid):       # read after the (slow) first move: forked by now
                for path in self.procs_files:
                    # NOTE: a child that exited and was reaped could have its pid reused; checked
                    # just before each write (a reuse in between needs a wrap of the pid space)
                    if _parent(child) != pid:
                        return
                    _write_pid(path, child)
        except OSError:
            pass                               # gone, or not ours to move: the launcher joins

    def oom_killed(self) -> bool:
        """Whether the OOM killer ended a process of the cgroup (its memory limit was hit). The
        counter is oom_kill (v2 memory.events, v1 memory.oom_control): v2's "max" also counts
        reclaim at the limit, and v1's memory.failcnt stays 0 when the charge goes to the killer."""
        name = "memory.events" if self.root.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.memory_dir, name)) as f:
                fields = dict(line.split() for line in f if line.strip())
            return int(fields.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def remove(self, timeout_s: float = 2.0) -> None:
        """Kill whatever is left inside, then remove the directories (retried while they drain);
        every directory is tried, the first failure raised after."""
        deadline, errors = time.monotonic() + timeout_s, []
        for d in self.dirs:
            try:
                _drain_and_remove(d, deadline)
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    @staticmethod
    def _write(d: str, name: str, value: int, optional: bool = False) -> None:
        path = os.path.join(d, name)
        if optional and not os.path.exists(path):
            return
        with open(path, "w") as f:
            f.write(str(value))


def _drain_and_remove(d: str, deadline: float) -> None:
    kill_file = os.path.join(d, "cgroup.kill")          # v2 (5.14+): the kernel kills every member, no pid races
    while True:
        if os.path.exists(kill_file):
            try:
                with open(kill_file, "w") as f:
                    f.write("1")
            except OSError:
                pass
        else:
            for pid in _pids(d):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _pids(d: str) -> list[int]:
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _write_pid(procs_file: str, pid: int) -> None:
    with open(procs_file, "w") as f:
        f.write(str(pid))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _parent(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _rmdir(d: str) -> None:
    try:
        os.rmdir(d)
    except OSError:
        pass
