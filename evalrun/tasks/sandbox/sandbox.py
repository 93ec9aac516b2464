"""Sandbox: run CheckSpecs, each in two fresh interpreters, a few at a time.

Design (why two processes): the program under test is untrusted, and anything inside its
process can be found and forged by it (frames, gc, open pipes). So it runs in a confined
*worker* that only answers calls to its entry point, while the tests run in a separate
trusted *checker* that alone can write the verdict, with a nonce the worker never sees:

    Sandbox.run(spec) -> CheckRun (execute.py)
        launcher -> worker (launcher.py, worker.py)    confined per isolation.py
        checker (checker.py)                            plain `python -I`, non-dumpable
        verdict pipe -> parent: "passed" counts only with the nonce

Neither child is a fork of this (torch-loaded) process: both start a fresh `python -I -S`.
The launcher stays as a trusted supervisor (PID 1 of the worker's PID namespace) and
forks the worker from itself, so untrusted code never runs as PID 1 or with its
lifeline; the worker is that same small interpreter, not a second start.
"""
from __future__ import annotations

import concurrent.futures
import copy
import os
import queue
import sys
import threading
from typing import Any, Iterable, Optional

from .confine import PR_SET_DUMPABLE, prctl
from .execute import CheckRun
from .isolation import detect
from .spec import CheckSpec, ExecResult, SandboxLimits
from .uids import UidLease

DEFAULT_BASE_UID = 62000


class Sandbox:
    """Runs checks; thread-safe; a context manager whose close() kills anything left.

    isolation: "auto" (strongest that works here), "namespaces", "userns" or "basic"
    (a forced level that does not work raises IsolationUnavailable). When root, each of the
    `workers` slots runs as its own uid from `base_uid` up (skipping uids that another
    Sandbox holds). memory_cgroup: "auto" gives each check a memory and pids cgroup where one can
    be made (memcg.py); "off" never does, and the worker's seccomp filter refuses memfd_create,
    socketpair and the IPC objects instead (the fallback of machines without cgroups; seccomp.py says
    what it refuses at each level). hidden_paths: files and directories a
    program must not read (the problems' data and tests); at the namespace levels each is covered in
    the worker's mount namespace (a file by /dev/null, a directory by an empty read-only tmpfs); the
    basic level has no file system isolation, and isolation_info() says they stay readable there."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), workers: int = 4, isolation: str = "auto",
                 python: str = sys.executable, base_uid: int = DEFAULT_BASE_UID, memory_cgroup: str = "auto",
                 hidden_paths: Iterable[str] = ()) -> None:
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        self.limits, self.workers, self.python = limits, workers, python
        if isinstance(hidden_paths, (str, bytes)):
            raise TypeError("hidden_paths must be an iterable of paths, not one string")
        self.hidden_paths = tuple(sorted({os.path.realpath(p) for p in hidden_paths}))
        # This process holds every check's nonce and verdict pipe: non-dumpable, its /proc/<pid>/mem
        # and /proc/<pid>/fd are closed to processes of the same uid (a worker at the basic level).
        prctl(PR_SET_DUMPABLE, 0)
        self._lease: Optional[UidLease] = UidLease(base_uid, workers) if os.geteuid() == 0 else None
        try:
            self._iso = detect(isolation, python, limits, self._lease.uids[0] if self._lease else None, memory_cgroup,
                               self.hidden_paths)
        except BaseException:
            self._release_uids()
            raise
        if not self._iso.drops_uid:
            self._release_uids()
        self._one_at_a_time = self._iso.level == "basic" and not self._iso.drops_uid and workers > 1
        if self._one_at_a_time:
            # Same uid as us and no PID namespace: a worker could open another check's worker and
            # checker through /proc and answer for them. One check at a time leaves only its own.
            workers = self.workers = 1
        self._uids: tuple[int, ...] = tuple(self._lease.uids) if self._lease else ()
        self._slots: queue.SimpleQueue[Optional[int]] = queue.SimpleQueue()
        for i in range(workers):
            self._slots.put(self._uids[i] if self._uids else None)
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        self._lock = threading.Condition()
        self._active: set[CheckRun] = set()
        self._closed = False

    def isolation_info(self) -> dict[str, Any]:
        """JSON-able: level, network_isolated, pid_namespace, readonly_fs, uid_dropped,
        rlimits, notes (what is NOT isolated and why), sandbox_uids, for the run manifest."""
        info = copy.deepcopy(self._iso.info)
        info["sandbox_uids"] = list(self._uids)
        info["harness_non_dumpable"] = info["checker_non_dumpable"] = True   # before any program runs
        info["workers"] = self.workers
        info["hidden_paths"] = list(self.hidden_paths)
        info["hidden_paths_readable"] = bool(self.hidden_paths) and self._iso.level == "basic"
        if info["hidden_paths_readable"]:
            info["notes"] = list(info.get("notes", [])) + [
                "the problems' data and tests stay readable to programs at the basic level (no mount namespace "
                "to hide them in): " + ", ".join(self.hidden_paths)]
        if self._one_at_a_time:
            info["notes"] = list(info.get("notes", [])) + [
                "checks run one at a time: at the basic level without root every worker has the harness's "
                "uid and no PID namespace, so concurrent workers could reach each other's checks via /proc"]
        return info

    def run(self, spec: CheckSpec) -> ExecResult:
        """Run one check and return when every process of it is gone (blocking)."""
        if not isinstance(spec, CheckSpec):
            raise TypeError(f"spec must be a CheckSpec, got {type(spec).__name__}")
        uid = self._slots.get()
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("Sandbox is closed")
                check = CheckRun(spec, self.limits, self._iso, self.python, uid, self.hidden_paths)
                self._active.add(check)
            try:
                return check.run()
            finally:
                with self._lock:
                    self._active.discard(check)
                    self._lock.notify_all()
        finally:
            self._slots.put(uid)

    def submit(self, spec: CheckSpec) -> concurrent.futures.Future:
        """Run a check on the pool (`workers` at a time); a Future of its ExecResult."""
        with self._lock:
            if self._closed:
                raise RuntimeError("Sandbox is closed")
            return self._executor.submit(self.run, spec)

    def close(self) -> None:
        """Cancel queued checks, end running ones (status "error"), wait for their cleanup."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for check in self._active:
                check.abort()
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:                 # checks run() directly from other threads
            self._lock.wait_for(lambda: not self._active)
        self._release_uids()

    def _release_uids(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
