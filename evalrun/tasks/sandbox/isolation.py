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

from .memcg import CgroupRoot, CheckCgroup, find_root
from .sources import PYTHON_FLAGS, launcher_source
from .spec import SandboxLimits

LEVELS = ("namespaces", "userns", "basic")
NAMESPACE_WORKDIR = "/tmp/work"
_UNSHARE = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--mount-proc", "--kill-child")
_PROBE_TIMEOUT_S = 30.0
CGROUP_OVERHEAD_MB = 64     # the launcher's and a fresh worker interpreter's own pages, on top of memory_mb


class IsolationUnavailable(RuntimeError):
    """The requested isolation level does not work on this machine."""


@dataclass(frozen=True)
class Isolation:
    level: str
    drops_uid: bool                  # each slot runs as its own uid (we are root)
    ro_skip: tuple[str, ...] = ()    # mounts the probe could not make read-only
    info: dict[str, Any] = field(default_factory=dict)
    cgroup: Optional[CgroupRoot] = None   # each check gets a memory/pids cgroup under this (memcg.py)


def check_cgroup(root: Optional[CgroupRoot], limits: SandboxLimits, drops_uid: bool,
                 level: str) -> Optional[CheckCgroup]:
    """A check's cgroup under `root` with the limits' memory bound (None without root), and a process
    bound where RLIMIT_NPROC does not hold one (the worker keeps uid 0 or the caller's uid)."""
    if root is None:
        return None
    return CheckCgroup(root, (limits.memory_mb + CGROUP_OVERHEAD_MB) << 20,
                       None if drops_uid else pids_max(limits, level))


def pids_max(limits: SandboxLimits, level: str) -> int:
    # and the launcher, and at the namespace levels the unshare that forked it (the harness moves
    # unshare in early, so that the launcher it forks starts inside: CheckCgroup.adopt)
    return limits.max_processes + (1 if level == "basic" else 2)


def memory_bound(iso: Isolation, limits: SandboxLimits, why_not: str, report: dict) -> dict[str, Any]:
    """How a check's memory is bounded beyond RLIMIT_AS (isolation_info()["memory_bound"])."""
    no_filter = f"NOT refused: no seccomp filter ({report['seccomp_error']})" if report.get("seccomp_error") else ""
    sockets = no_filter or socket_bound(iso, report)
    if iso.cgroup is not None:
        return {"kind": f"cgroup v{iso.cgroup.version}", "limit_mb": limits.memory_mb + CGROUP_OVERHEAD_MB,
                "pids_max": pids_max(limits, iso.level) if iso.cgroup.pids_dir and not iso.drops_uid else None,
                "swap": "bounded" if iso.cgroup.swap_bounded() else "NOT bounded: pages can go to swap (swap is on "
                        "and the kernel does not account it per cgroup)",
                "memfd_and_shm": "charged to the check's cgroup; memfd_secret refused" + (
                    "" if iso.level != "basic" else "; shmget, msgget, semget and mq_open refused (no IPC namespace: "
                                                    "the objects would outlive the check)"),
                "socket_buffers": "socketpair buffers charged to the check's cgroup; " + sockets}
    refused = no_filter or "memfd_create, memfd_secret, shmget, msgget, semget and mq_open refused"
    return {"kind": "seccomp", "limit_mb": None, "pids_max": None,
            "memfd_and_shm": refused + ("; /tmp and /dev/shm are size-capped tmpfs" if iso.level != "basic" else ""),
            "socket_buffers": no_filter or "socketpair refused; " + sockets,
            "no_cgroup_because": why_not}


def socket_bound(iso: Isolation, report: dict) -> str:
    """Why no other socket can hold buffers: the families the filter refuses, and the loopback."""
    if iso.level == "basic":
        return "socket() refused for every family (no network namespace)"
    reach = "its loopback is UP: TCP/UDP buffers over it are NOT bounded" if report.get("loopback_reachable") \
        else "the network namespace's loopback is down: nothing to send over"
    return f"socket() refused for every family but AF_INET and AF_INET6; {reach}"


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
                    fds: tuple[int, int, int], ro_skip: Optional[tuple[str, ...]],
                    cgroup: Optional[CheckCgroup] = None, hidden: tuple[str, ...] = ()) -> dict:
    """The launcher's argv[1]; `fds` = (requests read end, replies write end, lifeline read end);
    `hidden`: paths to cover at the namespace levels."""
    return {"mode": mode, "level": level, "uid": uid, "workdir": workdir, "ro_skip": ro_skip,
            "cgroup_procs": cgroup.procs_files if cgroup else [], "hidden": list(hidden),
            "tmpfs_mb": max(16, 4 * limits.file_size_mb), "deadline_s": limits.timeout + 5.0,
            "limits": {"cpu_s": limits.cpu_seconds, "memory_mb": limits.memory_mb,
                       "file_size_mb": limits.file_size_mb, "max_processes": limits.max_processes},
            "fd_requests": fds[0], "fd_replies": fds[1], "fd_lifeline": fds[2]}


def probe(level: str, python: str, limits: SandboxLimits, uid: Optional[int],
          cgroup_root: Optional[CgroupRoot] = None, hidden: tuple[str, ...] = ()) -> dict:
    """Run the launcher in probe mode at `level` (in a check cgroup under `cgroup_root`, when given,
    and covering `hidden`, so a level that cannot hide them fails here, not in every check); its
    report, or IsolationUnavailable."""
    if level != "basic" and shutil.which("unshare") is None:
        raise IsolationUnavailable(f"{level}: the unshare command is not installed")
    workdir = NAMESPACE_WORKDIR if level != "basic" else tempfile.mkdtemp(prefix="evalrun-probe-")
    pipes = [os.pipe() for _ in range(3)]
    fds = (pipes[0][0], pipes[1][1], pipes[2][0])
    cgroup = None
    try:
        if level == "basic" and uid is not None:
            os.chown(workdir, uid, uid)
        try:
            cgroup = check_cgroup(cgroup_root, limits, uid is not None, level)
        except OSError as exc:                     # the probe reports it; checks then run without one
            cgroup = None
            cgroup_error = f"cannot make a check cgroup: {exc.strerror or exc}"
        else:
            cgroup_error = ""
        cfg = launcher_config("probe", level, uid, workdir, limits, fds, None, cgroup, hidden)
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
        if cgroup is not None:
            try:
                cgroup.remove()
            except OSError:
                pass                               # a leftover directory; nothing to stop the probe for
    report = _parse_probe(level, proc)
    if cgroup_error:
        report["cgroup_joined"], report["cgroup_error"] = False, cgroup_error
    return report


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


def detect(requested: str, python: str, limits: SandboxLimits, probe_uid: Optional[int],
           memory_cgroup: str = "auto", hidden: tuple[str, ...] = ()) -> Isolation:
    """Probe `requested` (or, for "auto", the strongest level that works); `probe_uid` is a
    sandbox uid to probe with (None when not root). `memory_cgroup` "auto": each check gets a
    memory/pids cgroup where one can be made and joined at that level; "off": never (the fallback)."""
    if requested != "auto" and requested not in LEVELS:
        raise ValueError(f"isolation must be 'auto' or one of {LEVELS}, got {requested!r}")
    if memory_cgroup not in ("auto", "off"):
        raise ValueError(f"memory_cgroup must be 'auto' or 'off', got {memory_cgroup!r}")
    root, why_not = find_root() if memory_cgroup == "auto" else (None, "turned off (memory_cgroup='off')")
    if requested == "auto":
        candidates = LEVELS if probe_uid is not None else LEVELS[1:]
    else:
        candidates = (requested,)
    failures = []
    for level in candidates:
        uid = None if level == "userns" else probe_uid
        try:
            report = probe(level, python, limits, uid, root, hidden)
        except IsolationUnavailable as exc:
            failures.append(str(exc))
            continue
        joined = root if report.get("cgroup_joined") else None
        if root is not None and joined is None:
            why_not = f"the launcher could not join a {root.describe()} cgroup: {report.get('cgroup_error')}"
        iso = Isolation(level, uid is not None, tuple(report.get("ro_failed", ())), cgroup=joined)
        info = describe(iso, report, limits, uid, failures, why_not)
        return Isolation(iso.level, iso.drops_uid, iso.ro_skip, info, joined)
    raise IsolationUnavailable("; ".join(failures))


def mqueue_mounts() -> list[str]:
    """Where an mqueue file system is mounted here (at the basic level the worker shares them)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return [line.split()[4] for line in f if line.split(" - ", 1)[-1].startswith("mqueue ")]
    except OSError:
        return []


def describe(iso: Isolation, report: dict, limits: SandboxLimits, uid: Optional[int],
             failures: list[str], cgroup_why_not: str = "") -> dict[str, Any]:
    """isolation_info(): what the probe showed the worker gets (JSON-able)."""
    namespaced = iso.level != "basic"
    notes = [f"not available: {f}" for f in failures]
    if not namespaced:
        notes.append("the file system is NOT isolated (no unshare)" + (
            "; nor is the network: no seccomp filter" if report.get("seccomp_error") else
            "; the network is out of reach only because the seccomp filter refuses socket() for every family"))
    memory = memory_bound(iso, limits, cgroup_why_not, report)
    if not namespaced:
        notes.append("files the worker writes in the host's /tmp and /dev/shm outlive the check"
                     + ("" if iso.cgroup else "; with no memory cgroup they are bounded only per file (RLIMIT_FSIZE)"))
        for point in mqueue_mounts():
            notes.append(f"POSIX message queues can still be made by open(2) in the host's mqueue mount {point} "
                         "(mq_open is refused): they outlive the check (RLIMIT_MSGQUEUE bounds them per user)")
    if not iso.drops_uid and os.geteuid() == 0:
        if memory["pids_max"] is None:
            notes.append("the worker runs as (k)uid 0, for which the kernel does not enforce RLIMIT_NPROC: "
                         "a fork bomb is bounded only by the timeout")
    elif not iso.drops_uid:
        notes.append("the worker keeps the caller's uid: RLIMIT_NPROC counts all of the caller's processes"
                     + ("" if namespaced else "; it can signal the caller's processes (its launcher excepted: the "
                        "seccomp filter refuses that) and ptrace the dumpable ones"))
    if report.get("kept_dac_read_search"):
        notes.append("the interpreter is unreachable for the sandbox uid: the worker keeps "
                     "CAP_DAC_READ_SEARCH (it can read any file)")
    if report.get("ro_failed"):
        notes.append(f"could not make read-only: {', '.join(report['ro_failed'])}")
    if report.get("seccomp_error"):
        notes.append(f"no seccomp filter ({report['seccomp_error']}): the worker can create Unix, netlink and "
                     "vsock sockets (a host's Unix sockets are reachable), use the kernel keyrings, make user "
                     "namespaces" + ("" if namespaced else ", kill its launcher (what it starts can outlive the "
                                                           "check) and make IPC objects that outlive the check"))
    no_sockets = not namespaced and not report.get("seccomp_error")      # socket() refused for every family
    return {"level": iso.level,
            "network_isolated": (namespaced and set(report["interfaces"]) <= {"lo"}) or no_sockets,
            "pid_namespace": bool(report.get("pid_namespace")), "readonly_fs": bool(report["root_readonly"]),
            "uid_dropped": uid is not None and report["uid"] == uid, "capabilities_dropped": report["cap_eff"] == 0,
            "exposed_paths": report.get("exposed", []), "rebound_paths": report.get("rebound", []),
            "host_dirs_hidden": report.get("host_hidden", []),
            "seccomp_denied": report.get("seccomp_denied", []), "memory_bound": memory,
            "rlimits": {"cpu_seconds": limits.cpu_seconds, "address_space_mb_above_interpreter": limits.memory_mb,
                        "file_size_mb": limits.file_size_mb, "max_processes": report["nproc"], "core": 0},
            "wall_timeout_s": limits.timeout, "output_bytes": limits.output_bytes, "notes": notes}
