"""One check: spawn launcher (worker) and checker, watch them, clean up, classify.

    parent ──stdin: job──────────▶ launcher/worker ──stdout+stderr──▶ parent (byte cap)
    parent ──stdin: nonce, test──▶ checker
    checker ──requests pipe──▶ worker ──replies pipe──▶ checker ──verdict pipe──▶ parent
    parent holds the lifeline's write end: closing it makes the launcher end the worker.

NOTE: every pipe end is created close-on-exec and handed only to its one child through
pass_fds; the worker never holds the verdict pipe or the nonce. The worker gets its program only
after the checker's first byte (READY) says the checker is non-dumpable, and the parent is
non-dumpable from the Sandbox's start: a worker of the same uid (the basic level without root)
cannot read either's memory for the nonce or open their pipes through /proc.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import procs
from .isolation import NAMESPACE_WORKDIR, Isolation, check_cgroup, launcher_argv, launcher_config, worker_env
from .memcg import CheckCgroup
from .codec import READY
from .sources import PYTHON_FLAGS, checker_source
from .spec import CheckSpec, ExecResult, SandboxLimits

_VERDICT_BYTES = 1 << 20
_EXIT_GRACE_S = 2.0
_REAP_TIMEOUT_S = 5.0
_log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What the parent observed; `classify` turns it into an ExecResult."""
    verdict: Optional[dict] = None
    timed_out: bool = False
    output_exceeded: bool = False
    aborted: bool = False
    worker_code: Optional[int] = None      # launcher's exit status (128 + n: signal n)
    checker_code: Optional[int] = None
    memory_limit_hit: bool = False         # the check's memory cgroup hit its limit (memcg.py)
    launcher_killed: bool = False          # a signal ended the launcher before the harness stopped it
    cleanup_errors: list[str] = field(default_factory=list)   # processes that could not be killed


def classify(outcome: Outcome, nonce: str, limits: SandboxLimits, exec_time: float) -> ExecResult:
    """The status rules: a failed cleanup is an error whatever the verdict; then a
    nonce-matching "passed" verdict wins; then timeout, output cap, missing verdict, the
    worker's death, and finally the checker's own verdict."""
    if outcome.cleanup_errors:
        return ExecResult("error", exec_time, ("cleanup failed: " + "; ".join(outcome.cleanup_errors))[:1000])
    if outcome.launcher_killed:     # its cleanup never ran: what the program started may have escaped
        return ExecResult("error", exec_time, f"the sandbox's launcher was killed during the check "
                                              f"(signal {-(outcome.worker_code or 0)})")
    verdict = outcome.verdict
    if verdict is not None and verdict.get("status") == "passed":
        if hmac.compare_digest(str(verdict.get("nonce")).encode(), nonce.encode()):
            return ExecResult("passed", exec_time)
        return ExecResult("error", exec_time, "verdict nonce mismatch")
    if outcome.aborted:
        return ExecResult("error", exec_time, "sandbox closed")
    if outcome.timed_out:
        return ExecResult("timeout", exec_time, f"timed out after {limits.timeout:g} s")
    if outcome.output_exceeded:
        return ExecResult("killed", exec_time, "output limit exceeded")
    if verdict is None:
        return ExecResult("error", exec_time, f"checker exited with code {outcome.checker_code} without a verdict")
    if verdict.get("worker_gone"):
        if outcome.memory_limit_hit:
            return ExecResult("killed", exec_time,
                              f"memory limit exceeded (memory cgroup: {limits.memory_mb} MB above the interpreter)")
        return _worker_death(outcome.worker_code, exec_time)
    if verdict.get("status") in ("failed", "error"):
        return ExecResult(verdict["status"], exec_time, str(verdict.get("error"))[:1000])
    return ExecResult("error", exec_time, "malformed verdict")


def _worker_death(code: Optional[int], exec_time: float) -> ExecResult:
    if code is None:
        return ExecResult("error", exec_time, "worker closed the connection")
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    if signum == signal.SIGXCPU:
        return ExecResult("timeout", exec_time, "CPU time limit exceeded")
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return ExecResult("killed", exec_time, f"worker killed by {name}")
    return ExecResult("error", exec_time, f"worker exited with code {code} before returning")


class CheckRun:
    """Runs one CheckSpec in one slot. `run()` once; `abort()` from any thread."""

    def __init__(self, spec: CheckSpec, limits: SandboxLimits, iso: Isolation, python: str,
                 uid: Optional[int], hidden: tuple[str, ...] = ()) -> None:
        self.spec, self.limits, self.iso, self.python, self.uid = spec, limits, iso, python, uid
        self.hidden = hidden
        self.nonce = secrets.token_hex(16)
        self.outcome = Outcome()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        self._fds: dict[str, int] = {}           # parent-held pipe ends still open
        self._worker: Optional[subprocess.Popen] = None
        self._checker: Optional[subprocess.Popen] = None
        self._workdir: Optional[str] = None
        self._cgroup: Optional[CheckCgroup] = None
        self._adopting: Optional[threading.Thread] = None   # moves the launcher into the cgroup early
        self._pending: dict[int, tuple[subprocess.Popen, memoryview]] = {}   # stdin data still to send

    def abort(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")

    def run(self) -> ExecResult:
        start = time.monotonic()
        try:
            self._start()
            self._watch(start + self.limits.timeout)
        except OSError as exc:          # e.g. EAGAIN from fork under load
            return ExecResult("error", time.monotonic() - start, f"could not run the check: {exc}")
        finally:
            exec_time = time.monotonic() - start
            self._stop()
        return classify(self.outcome, self.nonce, self.limits, exec_time)

    def _start(self) -> None:
        (req_r, req_w), (rep_r, rep_w), (life_r, life_w), (ver_r, ver_w), (out_r, out_w) = \
            [os.pipe() for _ in range(5)]
        self._fds = {"lifeline": life_w, "verdict": ver_r, "output": out_r}
        child_ends = [req_r, req_w, rep_r, rep_w, life_r, ver_w, out_w]
        try:
            self._spawn_worker((req_r, rep_w, life_r), out_w)
            self._spawn_checker((req_w, rep_r, ver_w))
        finally:
            for fd in child_ends:
                os.close(fd)

    def _spawn_worker(self, fds: tuple[int, int, int], out_w: int) -> None:
        if self.iso.level == "basic":
            self._workdir = tempfile.mkdtemp(prefix="evalrun-sandbox-")
            if self.uid is not None:
                os.chown(self._workdir, self.uid, self.uid)
        workdir = self._workdir or NAMESPACE_WORKDIR
        self._cgroup = check_cgroup(self.iso.cgroup, self.limits, self.iso.drops_uid, self.iso.level)
        cfg = launcher_config("run", self.iso.level, self.uid, workdir, self.limits, fds, self.iso.ro_skip,
                              self._cgroup, self.hidden)
        self._worker = subprocess.Popen(
            launcher_argv(self.iso.level, self.python, cfg), stdin=subprocess.PIPE, stdout=out_w, stderr=out_w,
            pass_fds=fds, env=worker_env(workdir), cwd="/", start_new_session=True)
        self._fds["worker_pidfd"] = os.pidfd_open(self._worker.pid)
        if self._cgroup is not None:
            adopting = threading.Thread(target=self._cgroup.adopt, args=(self._worker.pid,), daemon=True)
            try:
                adopting.start()
                self._adopting = adopting       # only a started thread is joined by _stop
            except RuntimeError:                # no thread to be had: the launcher joins by itself
                pass
        job = {"program": self.spec.program, "entry_point": self.spec.entry_point, "names": list(self.spec.names)}
        self._pending[self._worker.stdin.fileno()] = (self._worker, memoryview(json.dumps(job).encode()))

    def _spawn_checker(self, fds: tuple[int, int, int]) -> None:
        cfg = {"fd_requests": fds[0], "fd_replies": fds[1], "fd_verdict": fds[2], "parent_pid": os.getpid()}
        self._checker = subprocess.Popen(
            [self.python, *PYTHON_FLAGS, "-c", checker_source(), json.dumps(cfg)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=fds,
            env=worker_env("/"), cwd="/", start_new_session=True)
        self._fds["checker_pidfd"] = os.pidfd_open(self._checker.pid)
        message = {"nonce": self.nonce, "check_source": self.spec.check_source, "entry_point": self.spec.entry_point,
                   "names": list(self.spec.names)}
        self._pending[self._checker.stdin.fileno()] = (self._checker, memoryview(json.dumps(message).encode()))

    def _watch(self, deadline: float) -> None:
        """Pump the pipes until a verdict decides the check, or the deadline/output cap hits."""
        sel = selectors.DefaultSelector()
        held = self._worker.stdin.fileno() if self._worker is not None and self._worker.stdin else -1
        for fd in self._pending:
            os.set_blocking(fd, False)
            if fd != held:              # the worker's program waits for the checker's READY
                sel.register(fd, selectors.EVENT_WRITE, "stdin")
        for role in ("output", "verdict", "worker_pidfd"):
            sel.register(self._fds[role], selectors.EVENT_READ, role)
        sel.register(self._wake_r, selectors.EVENT_READ, "abort")
        verdict, output_bytes, worker_exited = bytearray(), 0, False
        try:
            while not self._decided(verdict, worker_exited):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.outcome.timed_out = True
                    return
                for key, _ in sel.select(left):
                    if key.data == "stdin":
                        self._write_pending(sel, key.fd)
                    elif key.data == "abort":
                        self.outcome.aborted = True
                        return
                    elif key.data == "worker_pidfd":
                        worker_exited = True
                        sel.unregister(key.fd)
                    elif key.data == "output":
                        output_bytes += self._drain(sel, key.fd, "output", None)
                        if output_bytes > self.limits.output_bytes:
                            self.outcome.output_exceeded = True
                            return
                    else:
                        self._drain(sel, key.fd, "verdict", verdict)
                        if held >= 0 and verdict[:1] == READY and held in self._pending:
                            sel.register(held, selectors.EVENT_WRITE, "stdin")
                            held = -1
        finally:
            sel.close()

    def _decided(self, verdict: bytearray, worker_exited: bool) -> bool:
        """Decided once the checker closed the verdict pipe, unless its verdict is that the
        worker went away: then also wait for the worker's exit status (to say why)."""
        if "verdict" in self._fds:
            return False
        data = bytes(verdict[1:] if verdict[:1] == READY else verdict)
        if self.outcome.verdict is None and data:
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
            self.outcome.verdict = parsed if isinstance(parsed, dict) else {}
        gone = bool(self.outcome.verdict and self.outcome.verdict.get("worker_gone"))
        return worker_exited or not gone

    def _write_pending(self, sel: selectors.BaseSelector, fd: int) -> None:
        proc, data = self._pending[fd]
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            return
        except OSError:                 # the child is gone: nothing more to write
            data = data[:0]
        self._pending[fd] = (proc, data)
        if not data:
            sel.unregister(fd)
            del self._pending[fd]
            proc.stdin.close()

    def _drain(self, sel: selectors.BaseSelector, fd: int, role: str, keep: Optional[bytearray]) -> int:
        data = os.read(fd, 1 << 16)
        if not data:
            sel.unregister(fd)
            os.close(self._fds.pop(role))
        elif keep is not None and len(keep) < _VERDICT_BYTES:
            keep += data
        return len(data)

    def _stop(self) -> None:
        """Kill and reap everything of this check. NOTE: groups are killed before reaping.
        What cannot be killed is logged and recorded in the outcome (the check cannot pass)."""
        if self._adopting is not None:
            self._adopting.join()       # NOTE: before any reaping, so the pids it moves are still ours
        pidfd = self._fds.get("worker_pidfd")
        ended_early = pidfd is not None and procs.wait_exit(pidfd, 0.0)   # before we told it to end
        lifeline = self._fds.pop("lifeline", None)
        if lifeline is not None:
            os.close(lifeline)          # the launcher ends the worker and exits
        for name in ("verdict", "output"):
            if name in self._fds:
                os.close(self._fds.pop(name))
        if self._worker is not None and self.iso.level != "basic":
            self._kill(procs.kill_child, self._worker.pid)   # PID 1 of the namespace: the kernel kills the rest
        if self._checker is not None:
            self.outcome.checker_code = self._reap(self._checker, "checker_pidfd", 0.0)
        if self._worker is not None:
            self.outcome.worker_code = self._reap(self._worker, "worker_pidfd", _EXIT_GRACE_S)
            # NOTE: the launcher exits with a status (the worker's); only a signal gives a negative one
            self.outcome.launcher_killed = ended_early and (self.outcome.worker_code or 0) < 0
        if self.uid is not None:
            self._kill(procs.kill_uid, self.uid)
        if self._cgroup is not None:
            self.outcome.memory_limit_hit = self._cgroup.oom_killed()
            try:
                self._cgroup.remove()
            except OSError as exc:
                self._kill_failed(f"cgroup {self._cgroup.memory_dir}: {exc}")
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _reap(self, proc: subprocess.Popen, pidfd_name: str, grace: float) -> Optional[int]:
        """Give `proc` `grace` seconds to exit, kill its process group, reap it; its exit code."""
        pidfd = self._fds.pop(pidfd_name, None)
        if pidfd is not None:
            procs.wait_exit(pidfd, grace)
            os.close(pidfd)
        self._kill(procs.kill_group, proc.pid)
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
        try:
            return proc.wait(timeout=_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill_failed(f"pid {proc.pid} still running after SIGKILL")
            return None

    def _kill(self, kill: Callable[[int], None], target: int) -> None:
        try:
            kill(target)
        except (procs.CleanupError, OSError) as exc:
            self._kill_failed(f"{kill.__name__}({target}): {exc}")

    def _kill_failed(self, message: str) -> None:
        _log.error("sandbox: %s", message)
        self.outcome.cleanup_errors.append(message)
