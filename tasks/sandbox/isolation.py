"""Which isolation level this machine allows, found by probing the real launcher once.

    "namespaces"  root: unshare mount/net/pid/ipc/uts; read-only mounts, tmpfs /tmp, own uid per slot
    "userns"      unprivileged user namespace: the same namespaces, but the uid cannot be dropped
    "basic"       no unshare: rlimits, own session, own uid per slot when root; network and
                  file system are NOT isolated
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from .sources import PYTHON_FLAGS, launcher_source
from .spec import SandboxLimits

LEVELS = ("namespaces", "userns", "basic")
NAMESPACE_WORKDIR = "/tmp/work"
_UNSHARE = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--mount-proc", "--kill-child")
_PROBE_TIMEOUT_S = 30.0


class IsolationUnavailable(RuntimeError):
    """The requested isolation level does not work on this machine."""


@dataclass(frozen=True)
class Isolation:
    level: str
    drops_uid: bool                  # each slot runs as its own uid (we are root)
    ro_skip: tuple[str, ...] = ()    # mounts the probe could not make read-only
    info: dict[str, Any] = field(default_factory=dict)


def launcher_argv(level: str, python: str, cfg: dict) -> list[str]:
    """The command that starts the launcher (under unshare at the namespace levels)."""
    cmd = [python, *PYTHON_FLAGS, "-c", launcher_source(), json.dumps(cfg)]
    if level == "namespaces":
        return ["unshare", *_UNSHARE, *cmd]
    if level == "userns":
        return ["unshare", "--user", "--map-root-user", *_UNSHARE, *cmd]
    return cmd


def worker_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def launcher_config(mode: str, level: str, uid: Optional[int], workdir: str, limits: SandboxLimits,
                    fds: tuple[int, int, int], ro_skip: Optional[tuple[str, ...]]) -> dict:
    """The launcher's argv[1]; `fds` = (requests read end, replies write end, lifeline read end)."""
    return {"mode": mode, "level": level, "uid": uid, "workdir": workdir, "ro_skip": ro_skip,
            "tmpfs_mb": max(16, 4 * limits.file_size_mb), "deadline_s": limits.timeout + 5.0,
            "limits": {"cpu_s": limits.cpu_seconds, "memory_mb": limits.memory_mb,
                       "file_size_mb": limits.file_size_mb, "max_processes": limits.max_processes},
            "fd_requests": fds[0], "fd_replies": fds[1], "fd_lifeline": fds[2]}


def probe(level: str, python: str, limits: SandboxLimits, uid: Optional[int]) -> dict:
    """Run the launcher in probe mode at `level`; its report, or IsolationUnavailable."""
    if level != "basic" and shutil.which("unshare") is None:
        raise IsolationUnavailable(f"{level}: the unshare command is not installed")
    workdir = NAMESPACE_WORKDIR if level != "basic" else tempfile.mkdtemp(prefix="evalrun-probe-")
    pipes = [os.pipe() for _ in range(3)]
    fds = (pipes[0][0], pipes[1][1], pipes[2][0])
    try:
        if level == "basic" and uid is not None:
            os.chown(workdir, uid, uid)
        cfg = launcher_config("probe", level, uid, workdir, limits, fds, None)
        proc = subprocess.run(launcher_argv(level, python, cfg), stdin=subprocess.DEVNULL, capture_output=True,
                              pass_fds=fds, env=worker_env(workdir), timeout=_PROBE_TIMEOUT_S,
                              start_new_session=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise IsolationUnavailable(f"{level}: {exc}") from None
    finally:
        for fd in (fd for pair in pipes for fd in pair):
            os.close(fd)
        if level == "basic":
            shutil.rmtree(workdir, ignore_errors=True)
    return _parse_probe(level, proc)


def _parse_probe(level: str, proc: subprocess.CompletedProcess) -> dict:
    lines = proc.stdout.decode(errors="replace").strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise IsolationUnavailable(f"{level}: {tail[0]}") from None
    if not report.get("ok"):
        raise IsolationUnavailable(f"{level}: {report.get('error')}")
    return report


def detect(requested: str, python: str, limits: SandboxLimits, probe_uid: Optional[int]) -> Isolation:
    """Probe `requested` (or, for "auto", the strongest level that works); `probe_uid` is a
    sandbox uid to probe with (None when not root)."""
    if requested != "auto" and requested not in LEVELS:
        raise ValueError(f"isolation must be 'auto' or one of {LEVELS}, got {requested!r}")
    if requested == "auto":
        candidates = LEVELS if probe_uid is not None else LEVELS[1:]
    else:
        candidates = (requested,)
    failures = []
    for level in candidates:
        uid = None if level == "userns" else probe_uid
        try:
            report = probe(level, python, limits, uid)
        except IsolationUnavailable as exc:
            failures.append(str(exc))
            continue
        iso = Isolation(level, uid is not None, tuple(report.get("ro_failed", ())))
        return Isolation(iso.level, iso.drops_uid, iso.ro_skip, describe(iso, report, limits, uid, failures))
    raise IsolationUnavailable("; ".join(failures))


def describe(iso: Isolation, report: dict, limits: SandboxLimits, uid: Optional[int],
             failures: list[str]) -> dict[str, Any]:
    """isolation_info(): what the probe showed the worker gets (JSON-able)."""
    namespaced = iso.level != "basic"
    notes = [f"not available: {f}" for f in failures]
    if not namespaced:
        notes.append("network and file system are NOT isolated (no unshare)")
    if not iso.drops_uid and os.geteuid() == 0:
        notes.append("the worker runs as (k)uid 0, for which the kernel does not enforce RLIMIT_NPROC: "
                     "a fork bomb is bounded only by the timeout")
    elif not iso.drops_uid:
        notes.append("the worker keeps the caller's uid: RLIMIT_NPROC counts all of the caller's processes"
                     + ("" if namespaced else "; it can signal and ptrace the caller's processes"))
    if report.get("kept_dac_read_search"):
        notes.append("the interpreter is unreachable for the sandbox uid: the worker keeps "
                     "CAP_DAC_READ_SEARCH (it can read any file)")
    if report.get("ro_failed"):
        notes.append(f"could not make read-only: {', '.join(report['ro_failed'])}")
    if report.get("seccomp_error"):
        notes.append(f"no seccomp filter ({report['seccomp_error']}): the worker can create Unix, netlink and "
                     "vsock sockets (a host's Unix sockets are reachable) and use the kernel keyrings")
    return {"level": iso.level, "network_isolated": namespaced and set(report["interfaces"]) <= {"lo"},
            "pid_namespace": bool(report.get("pid_namespace")), "readonly_fs": bool(report["root_readonly"]),
            "uid_dropped": uid is not None and report["uid"] == uid, "capabilities_dropped": report["cap_eff"] == 0,
            "exposed_paths": report.get("exposed", []), "rebound_paths": report.get("rebound", []),
            "seccomp_denied": report.get("seccomp_denied", []),
            "rlimits": {"cpu_seconds": limits.cpu_seconds, "address_space_mb_above_interpreter": limits.memory_mb,
                        "file_size_mb": limits.file_size_mb, "max_processes": report["nproc"], "core": 0},
            "wall_timeout_s": limits.timeout, "output_bytes": limits.output_bytes, "notes": notes}
