"""The worker's launcher: confine, fork the worker, supervise it until it or the parent ends.

    parent --(unshare ...)--> launcher  (PID 1 of the new PID namespace at the namespace levels)
        launcher: private read-only mounts, tmpfs /tmp and /dev/shm (the interpreter's own
                  directories bound back read-only if they hid it), work dir
        launcher --fork--> worker: own session, rlimits, drop uid/capabilities, no_new_privs,
                  seccomp filter (seccomp.py), chdir, run program
        launcher waits for: the worker's exit | EOF on the lifeline pipe (parent done or dead) | deadline
        then kills what is left and exits with the worker's status (128 + signal if signalled).

The launcher never runs untrusted code, so its own state (PID 1, subreaper, lifeline) holds; it is
non-dumpable, and where the worker has its uid and no PID namespace protects it (the basic level
without root) the worker's filter refuses every way to signal it (seccomp.launcher_rules).
Config arrives as JSON in argv[1]; at mode "run" the job ({"program", "entry_point", "names"}) on stdin.
In mode "probe" the worker prints what the confinement achieved instead of running a job.
NOTE: runs as text inside the sandbox child (see sources.py): standard library and
tasks.sandbox modules only, nothing at import time.
"""
from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys

from evalrun.tasks.sandbox import confine, seccomp
from evalrun.tasks.sandbox.codec import error_line, write_frame
from evalrun.tasks.sandbox.worker import worker_main

NAMESPACE_LEVELS = ("namespaces", "userns")
COVERED = ("/tmp", "/dev/shm")           # each gets a fresh tmpfs at the namespace levels
# What stays of the host's file system at the namespace levels (besides the interpreter's own
# directories): the system's programs and libraries, /proc (the PID namespace's own) and /sys, a
# few files of /etc the loader and libc read, and the harmless device nodes.
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/proc", "/sys", "/tmp")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd",
             "/etc/group", "/etc/nsswitch.conf", "/etc/alternatives", "/etc/hosts")
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEV_LINKS = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0", "/dev/stdout": "/proc/self/fd/1",
             "/dev/stderr": "/proc/self/fd/2"}
# Extension modules the probe's `python` must still import in the view (those this interpreter has).
PROBE_MODULES = ("_csv", "_ctypes", "_decimal", "_hashlib", "_sqlite3", "_ssl", "zlib")


def executable_dirs() -> list[str]:
    """The directory of sys.executable and of every symlink on the way to the real file."""
    path, dirs = sys.executable, []
    for _ in range(40):
        dirs.append(os.path.dirname(path))
        if not os.path.islink(path):
            break
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return dirs


def venv_dir() -> str | None:
    """The venv that sys.executable belongs to (where its pyvenv.cfg is), found as site.py
    does. NOTE: under -S, sys.prefix stays the base interpreter's even in a venv."""
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    for folder in (bin_dir, os.path.dirname(bin_dir)):
        if os.path.isfile(os.path.join(folder, "pyvenv.cfg")):
            return folder
    return None


def interpreter_paths() -> list[str]:
    """Directories this interpreter (and a `python` started from sys.executable) reads from."""
    paths = [os.path.dirname(os.path.realpath(sys.executable)), *executable_dirs(), venv_dir(),
             sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    return sorted({os.path.normpath(p) for p in paths + sys.path if p and os.path.isdir(p)})


def mapped_dirs(system: tuple[str, ...]) -> list[str]:
    """Directories of the files this process has mapped (its libraries and the loader) outside
    `system`: where a Nix- or Guix-style interpreter finds its shared objects."""
    dirs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) == 6 else ""
            if name.startswith("/") and os.path.isfile(name):
                folder = os.path.dirname(os.path.realpath(name))
                if not confine.is_below(folder, system + COVERED):
                    dirs.add(folder)
    return sorted(dirs)


def covered_interpreter_paths(paths: list[str]) -> list[str]:
    """The outermost of `paths` that a COVERED tmpfs would hide (e.g. a venv under /tmp)."""
    inside = [p for p in paths if confine.is_below(p, COVERED)]
    if set(inside) & set(COVERED):
        raise OSError(f"the interpreter reads from {sorted(set(inside) & set(COVERED))}: it cannot run "
                      "in the sandbox (that directory gets a private tmpfs)")
    return [p for p in inside if not any(q != p and confine.is_below(p, (q,)) for q in inside)]


def prepare_mounts(cfg: dict, report: dict) -> None:
    """Namespace levels: private mounts; the host's file system hidden except the system's
    directories and the interpreter's own (confine.minimal_view: homes, /etc, /dev, /var, /run,
    ... become empty tmpfs with only what Python needs bound back); fresh size-capped tmpfs on
    /tmp and /dev/shm, the interpreter's own directories bound back read-only at their paths when
    those hid them (a venv under /tmp), the interpreter exposed to the uid, the problems' data
    covered, everything else read-only, and the work dir in the new /tmp."""
    confine.mount(None, "/", None, confine.MS_REC | confine.MS_PRIVATE)
    paths = sorted({*interpreter_paths(), *mapped_dirs(SYSTEM_DIRS)})
    hidden = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in covered_interpreter_paths(paths)]
    report["host_hidden"] = confine.minimal_view(paths, SYSTEM_DIRS, ETC_FILES, DEV_NODES)
    if "/dev" in report["host_hidden"]:
        for link, target in DEV_LINKS.items():
            os.symlink(target, link)
    for path in COVERED:
        confine.make_dirs(path)
        confine.mount_tmpfs(path, cfg["tmpfs_mb"])
    for path, fd in hidden:
        confine.bind_back_readonly(fd, path)
        os.close(fd)
    report["rebound"] = [path for path, _ in hidden]
    if cfg["uid"] is not None:
        report["exposed"] = confine.expose_paths(paths, cfg["uid"], "/tmp")
    report["hidden"] = confine.hide_paths(cfg["hidden"])      # after the binds above, which could bring them back
    failed = confine.remount_readonly(skip=COVERED)
    report["ro_failed"] = failed
    unexpected = sorted(set(failed) - set(cfg["ro_skip"] or ()))
    if cfg["ro_skip"] is not None and unexpected:
        raise OSError(f"read-only remount failed for {', '.join(unexpected)}")
    os.mkdir(cfg["workdir"], 0o700)
    if cfg["uid"] is not None:
        os.chown(cfg["workdir"], cfg["uid"], cfg["uid"])


def confine_worker(cfg: dict, report: dict, launcher: int) -> None:
    """In the forked worker, before untrusted code: its own session (so that kill(0) and killpg
    reach only what it starts), limits, identity, capabilities, the seccomp filter (seccomp.py),
    protecting `launcher` where the worker keeps the harness's uid."""
    confine.prctl(confine.PR_SET_DUMPABLE, 1)    # NOTE: inherited non-dumpable from the launcher
    os.setsid()
    set_oom_score_adj(1000)             # the first a memory cgroup's (or the host's) OOM killer ends
    lim = cfg["limits"]
    confine.set_rlimits(lim["cpu_s"], lim["memory_mb"], lim["file_size_mb"], lim["max_processes"])
    privileged = cfg["level"] in NAMESPACE_LEVELS or os.geteuid() == 0
    if privileged:
        confine.drop_bounding_set()
    if cfg["uid"] is not None:
        keep = cfg["level"] == "basic" and any(confine.first_blocked(p, cfg["uid"]) for p in interpreter_paths())
        report["kept_dac_read_search"] = keep
        confine.switch_user(cfg["uid"], keep)
    elif privileged:
        confine.set_capabilities(0)
    confine.prctl(confine.PR_SET_NO_NEW_PRIVS, 1)
    same_uid = cfg["level"] == "basic" and cfg["uid"] is None     # no PID namespace and no uid of its own
    rules = seccomp.worker_rules(cfg["level"], bool(report.get("cgroup_joined")), launcher if same_uid else None)
    try:
        report["seccomp_denied"] = seccomp.load(rules)
    except OSError as exc:
        report["seccomp_denied"], report["seccomp_error"] = [], str(exc)
    confine.prctl(confine.PR_SET_DUMPABLE, 1)    # NOTE: setuid cleared it; /proc/self needs it
    os.chdir(cfg["workdir"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def set_oom_score_adj(value: int) -> bool:
    """The OOM killer's preference for this process (-1000: never, 1000: first); False if refused."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
        return True
    except OSError:
        return False


def in_cgroup(procs_file: str) -> bool:
    """Whether this process is a member of the cgroup of `procs_file` (which lists its members'
    pids as seen from this PID namespace)."""
    with open(procs_file) as f:
        return str(os.getpid()) in f.read().split()


def join_cgroups(cfg: dict, report: dict) -> None:
    """Move this process (so the worker it forks, and all below) into the check's cgroups (memcg.py),
    where the OOM killer is to spare it (the worker it forks asks to be chosen first: pages of a
    memfd count in no process's size, so the killer could otherwise pick the supervisor).
    In probe mode a failure is reported instead of raised."""
    try:
        for path in cfg["cgroup_procs"]:
            if not in_cgroup(path):                  # the harness may have moved us already
                with open(path, "w") as f:
                    f.write("0")
        if cfg["cgroup_procs"]:
            report["launcher_oom_protected"] = set_oom_score_adj(-1000)
        report["cgroup_joined"] = bool(cfg["cgroup_procs"])
    except OSError as exc:
        if cfg["mode"] != "probe":
            raise OSError(f"cannot join the check's cgroup ({exc.strerror or exc})") from None
        report["cgroup_joined"], report["cgroup_error"] = False, exc.strerror or str(exc)


def interpreter_error(modules: list[str]) -> str:
    """Why sys.executable cannot start and import `modules` in this view ("" when it can, or when
    the limits leave no process to try it with: a tight max_processes is not a broken view)."""
    import subprocess
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", f"import {', '.join(modules) or 'sys'}"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=20)   # < the probe's 30 s
    except BlockingIOError:
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{sys.executable} does not start: {error_line(exc)}"
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return f"{sys.executable} -c 'import {', '.join(modules)}' fails: {tail[0]}"
    return ""


def probe_report(cfg: dict, report: dict) -> dict:
    """What the worker ended up with (printed in probe mode); not ok when the interpreter cannot
    start and import its extension modules in the worker's view of the host."""
    broken = interpreter_error(report.pop("probe_modules", []))
    if broken:
        return {"ok": False, "error": f"the sandbox's view of the host breaks the interpreter: {broken}"}
    try:               # /proc, not if_nameindex(): that needs a netlink socket, which the filter refuses
        with open("/proc/self/net/dev") as f:
            interfaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:] if ":" in line)
    except OSError:
        interfaces = ["(unknown)"]
    with open("/proc/self/status") as f:
        cap_eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return {**report, "ok": True, "uid": os.getuid(), "euid": os.geteuid(), "cap_eff": cap_eff,
            "loopback_reachable": loopback_reachable(),
            "root_readonly": bool(os.statvfs("/").f_flag & os.ST_RDONLY),
            "workdir_writable": os.access(cfg["workdir"], os.W_OK),
            "interfaces": interfaces, "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0]}


def loopback_reachable() -> bool:
    """Whether a UDP socket of this process can send to 127.0.0.1 (no: the network namespace's
    loopback is down, or the filter refuses the socket), so socket buffers can fill over it."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("127.0.0.1", 9))
            return True
    except OSError:
        return False


def run_worker(cfg: dict, job: dict, report: dict, launcher: int) -> None:
    """The forked child: confine, then probe or serve. Never returns."""
    try:
        os.close(cfg["fd_lifeline"])
        confine_worker(cfg, report, launcher)
    except Exception as exc:
        fail(cfg, f"sandbox setup failed: {error_line(exc)}")
    if cfg["mode"] == "probe":
        print(json.dumps(probe_report(cfg, report)), flush=True)
        os._exit(0)
    worker_main(job["program"], job["entry_point"], cfg["fd_requests"], cfg["fd_replies"], job.get("names") or [])


def fail(cfg: dict, message: str) -> None:
    """Report a setup failure to the checker (run) or on stdout (probe), then exit."""
    try:
        if cfg["mode"] == "probe":
            print(json.dumps({"ok": False, "error": message}), flush=True)
        else:
            write_frame(cfg["fd_replies"], {"load_error": message})
    finally:
        os._exit(1)


def exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def supervise(pid: int, cfg: dict) -> None:
    """Wait for the worker, the lifeline's EOF or the deadline; kill the rest; exit."""
    os.close(cfg["fd_requests"])
    os.close(cfg["fd_replies"])
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd, cfg["fd_lifeline"]], [], [], cfg["deadline_s"])
    code = 137
    if pidfd in ready:
        code = exit_code(os.waitpid(pid, 0)[1])
    if os.getpid() != 1:                 # PID 1's exit kills the whole namespace by itself
        if cfg["uid"] is not None:
            kill_as(cfg["uid"])
        kill_descendants()
    os._exit(code)


def kill_as(uid: int) -> None:
    """kill(-1, SIGKILL) as `uid`: every process of the sandbox uid in one pass that the
    kernel makes atomic against fork (a fork bomb cannot outrun it)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)      # NOTE: kill(-1) spares the caller itself
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def children() -> list[int]:
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == me:
                found.append(int(name))
    return found


def kill_descendants(rounds: int = 200) -> None:
    """SIGKILL children until none is left; orphans reparent to us (we are a subreaper)."""
    for _ in range(rounds):
        pids = children()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def main() -> None:
    """Entry point of the launcher child (see the module docstring)."""
    cfg: dict[str, object] = json.loads(sys.argv[1])
    job = json.loads(sys.stdin.buffer.read() or b"{}") if cfg["mode"] == "run" else {}
    report: dict[str, object] = {"pid_namespace": os.getpid() == 1}
    if cfg["mode"] == "probe":
        import importlib.util
        report["probe_modules"] = [m for m in PROBE_MODULES if importlib.util.find_spec(m) is not None]
    try:
        join_cgroups(cfg, report)           # NOTE: 10-20 ms (an RCU grace period) unless the harness moved us
        confine.prctl(confine.PR_SET_CHILD_SUBREAPER, 1)
        if cfg["level"] in NAMESPACE_LEVELS:
            prepare_mounts(cfg, report)
    except Exception as exc:
        fail(cfg, f"sandbox setup failed: {error_line(exc)}")
    # Non-dumpable: no process of its uid (the worker's, at the basic level without root) may
    # ptrace it or open its /proc files; the seccomp filter closes the other ways to end it.
    confine.prctl(confine.PR_SET_DUMPABLE, 0)
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:
        run_worker(cfg, job, report, launcher)
    else:
        supervise(pid, cfg)
