"""Confinement steps the launcher applies before untrusted code runs (Linux, via ctypes).

Mount steps need a private mount namespace (`unshare --mount`) and root in it; the
privilege steps work in any process. Every function raises OSError on failure and leaves
the choice of what is fatal to the launcher.

NOTE: runs as text inside the sandbox children (see sources.py): standard library only,
nothing at import time.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import resource
import stat
from collections.abc import Iterable

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE = 32, 1024, 2048, 4096, 8192
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_KEEPCAPS = 1, 4, 8
PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 24, 36, 38
CAP_DAC_READ_SEARCH = 2
_CAPABILITY_VERSION_3 = 0x20080522
# Per-mount flags a bind remount must repeat (the kernel refuses to clear locked ones).
_KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) for every line of /proc/self/mountinfo, in order."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])
            flags = 0
            for option in parts[5].split(","):
                flags |= _KEPT_FLAGS.get(option, 0)
            points.append((path, flags))
    return points


def is_below(path: str, roots: Iterable[str]) -> bool:
    """`path` is one of `roots` or inside one (by name; no symlinks resolved)."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def remount_readonly(skip: Iterable[str], within: str = "/") -> list[str]:
    """Bind-remount every mount at or below `within` read-only, except those at or below a
    `skip` path (covered by a fresh tmpfs); returns the mount points that failed. A mount whose
    path no longer resolves (it lies under a directory a tmpfs now covers) is unreachable and
    needs nothing."""
    skip, failed, done = tuple(skip), [], set()
    for path, flags in mount_points():
        if path in done or not is_below(path, (within,)) or is_below(path, skip):
            continue
        done.add(path)
        try:
            mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
        except OSError:
            if os.path.lexists(path):
                failed.append(path)
    return failed


def mount_tmpfs(path: str, size_mb: int, mode: int = 0o1777, uid: int = 0) -> None:
    options = f"size={size_mb}m,nr_inodes=4096,mode={mode:o},uid={uid},gid={uid}"
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)


def hide_paths(paths: Iterable[str]) -> list[str]:
    """Cover each path in this mount namespace: a file with /dev/null (reads as empty), a directory
    with an empty tmpfs (read-only once everything is remounted so). Paths already gone (under a
    fresh tmpfs) need nothing. Returns those covered; a mount that fails raises (never a silent leak)."""
    covered = []
    for path in paths:
        if os.path.isdir(path):
            mount_tmpfs(path, 1, 0o555)
        elif os.path.lexists(path):
            mount("/dev/null", path, None, MS_BIND)
        else:
            continue
        covered.append(path)
    return covered


def outermost(paths: Iterable[str]) -> list[str]:
    """`paths` without those inside another of them."""
    ps = sorted(set(paths))
    return [p for p in ps if not any(q != p and is_below(p, (q,)) for q in ps)]


def cover_except(directory: str, keep: Iterable[str], mode: int = 0o755) -> list[str]:
    """Cover `directory` with an empty tmpfs, then bind back (recursively, read-only once all is
    remounted so) only the paths `keep` below it: directories and files; a symlink brings back
    what it leads to, a dangling one nothing. Returns what came back."""
    keep = [k for k in outermost(keep) if k != directory and is_below(k, (directory,)) and os.path.exists(k)]
    fds: list[tuple[str, int]] = []
    try:
        for path in keep:
            fds.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        mount_tmpfs(directory, 1, mode)
        for path, fd in fds:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                make_dirs(path)
            else:
                make_dirs(os.path.dirname(path))
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    finally:
        for _, fd in fds:
            os.close(fd)
    return keep


def minimal_view(keep: Iterable[str], system: Iterable[str], etc_files: Iterable[str],
                 dev_nodes: Iterable[str]) -> list[str]:
    """Hide the host's file system except what a Python program needs: every top-level directory
    that is neither in `system` (e.g. /usr, /lib, /proc) nor inside a `keep` path (the interpreter's
    own) is covered by an empty tmpfs with only the `keep` paths below it bound back (a home
    directory then shows just the interpreter under it); /etc keeps only `etc_files` and /dev only
    `dev_nodes`; every other top-level file reads as /dev/null. `keep` counts by name and by real
    path (/home -> var/home keeps /var/home/...). Symlinks at the top level (e.g. /bin -> usr/bin)
    are left: they lead into kept paths or nowhere. Returns what was covered."""
    keep = [k for k in keep if os.path.exists(k)]
    # NOTE: never "/" (a file mapped from the root, a link resolving there): it would keep everything
    keep = [k for k in outermost([*keep, *(os.path.realpath(k) for k in keep)]) if k != "/"]
    system, covered = tuple(system), []
    names = sorted(os.listdir("/"))
    for top in ("/" + name for name in names):         # files first: /dev/null is still the host's
        if not os.path.islink(top) and not os.path.isdir(top) and top not in system and not is_below(top, keep):
            mount("/dev/null", top, None, MS_BIND)
            covered.append(top)
    for top in ("/" + name for name in names):
        if os.path.islink(top) or not os.path.isdir(top) or top in system or is_below(top, keep):
            continue
        wanted = {"/etc": etc_files, "/dev": dev_nodes}.get(top, ())
        cover_except(top, [*keep, *wanted])
        covered.append(top)
    return sorted(covered)


def make_dirs(path: str, mode: int = 0o755) -> None:
    """mkdir -p, giving the directories it creates exactly `mode` (no umask)."""
    if os.path.isdir(path):
        return
    make_dirs(os.path.dirname(path), mode)
    os.mkdir(path)
    os.chmod(path, mode)


def bind_back_readonly(fd: int, target: str) -> None:
    """Bind-mount the directory behind `fd` (an O_PATH fd opened before a tmpfs covered it)
    at `target`, creating the path, and make it and every mount below it read-only."""
    make_dirs(target)
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    failed = remount_readonly(skip=(), within=target)
    if failed:
        raise OSError(f"read-only remount failed for {', '.join(failed)}")


def can_traverse(st: os.stat_result, uid: int) -> bool:
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == uid:        # NOTE: the sandbox gid equals its uid, with no other groups
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def first_blocked(path: str, uid: int) -> tuple[str, str] | None:
    """(ancestor `uid` cannot enter, its child on the way to `path`), or None if reachable."""
    parts = os.path.realpath(path).strip("/").split("/")
    current = "/"
    for part in parts:
        if not can_traverse(os.stat(current), uid):
            return current, os.path.join(current, part)
        current = os.path.join(current, part)
    return None


def expose_paths(paths: Iterable[str], uid: int, stage_dir: str) -> list[str]:
    """Make `paths` reachable for `uid` in this mount namespace by covering each blocking
    directory (e.g. /root, 0700) with a tmpfs (mode o+x, otherwise empty) and bind-mounting
    only the needed child (e.g. /root/.pyenv) back. Returns the children exposed."""
    blocked: dict[str, set[str]] = {}
    for path in paths:
        hit = first_blocked(path, uid) if os.path.exists(path) else None
        if hit:
            blocked.setdefault(hit[0], set()).add(hit[1])
    exposed = []
    for i, (parent, children) in enumerate(sorted(blocked.items())):
        staged = []
        for j, child in enumerate(sorted(children)):
            stage = os.path.join(stage_dir, f"expose-{i}-{j}")
            os.mkdir(stage, 0o700)
            mount(child, stage, None, MS_BIND | MS_REC)
            staged.append((stage, child))
        st = os.stat(parent)
        mount_tmpfs(parent, 1, mode=(st.st_mode & 0o7777) | 0o111, uid=st.st_uid)
        for stage, child in staged:
            os.mkdir(child, 0o711)
            mount(stage, child, None, MS_MOVE)
            os.rmdir(stage)
            exposed.append(child)
    return exposed


def lower_rlimit(which: int, value: int) -> None:
    """Set soft and hard limit to `value`, or to the current hard limit if that is lower."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def set_rlimits(cpu_s: int, memory_mb: int, file_size_mb: int, max_processes: int) -> None:
    """The worker's limits. NOTE: RLIMIT_AS is relative to this (fresh) interpreter's size."""
    lower_rlimit(resource.RLIMIT_CORE, 0)
    lower_rlimit(resource.RLIMIT_FSIZE, file_size_mb << 20)
    lower_rlimit(resource.RLIMIT_NPROC, max_processes)
    soft_cpu, hard_cpu = resource.getrlimit(resource.RLIMIT_CPU)
    want = cpu_s if hard_cpu == resource.RLIM_INFINITY else min(cpu_s, hard_cpu)
    resource.setrlimit(resource.RLIMIT_CPU, (want, want + 1 if hard_cpu == resource.RLIM_INFINITY else hard_cpu))
    lower_rlimit(resource.RLIMIT_AS, vm_size_bytes() + (memory_mb << 20))


def drop_bounding_set() -> None:
    """Remove every capability from the bounding set (needs CAP_SETPCAP)."""
    for cap in range(64):
        if _libc().prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:     # EINVAL: past the last capability
                return
            _check(-1, f"PR_CAPBSET_DROP {cap}")


def set_capabilities(mask: int) -> None:
    """Effective = permitted = `mask` (capabilities 0-31), inheritable = 0."""
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(mask, mask, 0, 0, 0, 0)
    _check(_libc().capset(header, data), "capset")


def switch_user(uid: int, keep_dac_read: bool) -> None:
    """Become `uid`/gid `uid` with no supplementary groups (and no capabilities, except
    CAP_DAC_READ_SEARCH when `keep_dac_read`)."""
    if keep_dac_read:
        prctl(PR_SET_KEEPCAPS, 1)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if keep_dac_read:
        set_capabilities(1 << CAP_DAC_READ_SEARCH)
