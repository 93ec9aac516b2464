"""The worker's seccomp filter: which system calls it refuses at which level, and loading it.

    every level   socket() for every family but AF_INET/AF_INET6 (all of them at `basic`, which has
                  no network namespace); the kernel keyrings; io_uring; memfd_secret; unshare/clone
                  with a namespace flag, setns, clone3 (ENOSYS: glibc then falls back to clone)
    no cgroup     memfd_create, socketpair and the IPC objects (shmget, msgget, semget, mq_open):
                  memory no address space holds, which only a memory cgroup would charge
    `basic`       the IPC objects (no IPC namespace: they would outlive the check)
    same uid      (`basic` without root) every way to signal the launcher, its group or all of the
                  uid's processes, or to lower its limits: it alone cleans up what the worker starts

A rule refuses with EPERM (clone3 with ENOSYS); syscalls of another ABI (int 0x80) kill the process
(libseccomp's default). Argument values are compared as the kernel reads them: an `int` argument
by its low 32 bits (MASKED_EQ), so high bits set by a raw syscall cannot dodge a rule.

NOTE: runs as text inside the sandbox child (see sources.py): standard library only, nothing at
import time.
"""
from __future__ import annotations

import ctypes
import errno
import os

_SCMP_ACT_ALLOW = 0x7FFF0000
_EQ, _GT, _MASKED_EQ = 4, 6, 7            # libseccomp's scmp_compare
_LOW32 = 0xFFFFFFFF
AF_INET, AF_INET6 = 2, 10
NAMESPACE_FLAGS = {"CLONE_NEWTIME": 0x80, "CLONE_NEWNS": 0x20000, "CLONE_NEWCGROUP": 0x02000000,
                   "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
                   "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
KEYRINGS_AND_IO_URING = ("add_key", "keyctl", "request_key",          # keys outlive a sample
                         "io_uring_setup", "io_uring_enter", "io_uring_register")   # sockets without socket()
IPC_OBJECTS = ("shmget", "msgget", "semget", "mq_open")
F_SETOWN, F_SETOWN_EX, FIOSETOWN, SIOCSPGRP = 8, 15, 0x8901, 0x8902

# (label, syscall, [(argument index, op, datum_a, datum_b)...], errno): one refusal; the comparisons
# of one rule must all hold, and a call is refused if any rule holds
Rule = tuple[str, str, list[tuple[int, int, int, int]], int]


def _int_is(arg: int, value: int) -> tuple[int, int, int, int]:
    """Argument `arg`, read as a C int, equals `value` (negative values included)."""
    return (arg, _MASKED_EQ, _LOW32, value & _LOW32)


def _refuse(syscall: str, label: str = "", *cmps: tuple[int, int, int, int], err: int = errno.EPERM) -> Rule:
    return (label or syscall, syscall, list(cmps), err)


def socket_rules(all_families: bool) -> list[Rule]:
    """socket() for every family (all_families), or for every one but AF_INET and AF_INET6: any value
    above AF_INET6 (high bits included) and each one below it."""
    if all_families:
        return [_refuse("socket", "socket(every family)")]
    label = "socket(every family but AF_INET, AF_INET6)"
    below = [f for f in range(AF_INET6) if f != AF_INET]
    return [_refuse("socket", label, (0, _GT, AF_INET6, 0))] + [_refuse("socket", label, (0, _EQ, f, 0)) for f in below]


def namespace_rules() -> list[Rule]:
    """No new namespace: unshare and clone with any namespace flag (one rule per flag), setns, and
    clone3, whose flags sit in memory a filter cannot read (ENOSYS makes glibc use clone)."""
    rules = []
    for syscall in ("unshare", "clone"):                     # clone's flags: argument 0 on x86_64/aarch64
        rules += [_refuse(syscall, f"{syscall}(namespaces)", (0, _MASKED_EQ, flag, flag))
                  for flag in NAMESPACE_FLAGS.values()]
    return rules + [_refuse("setns"), _refuse("clone3", err=errno.ENOSYS)]


def launcher_rules(launcher: int) -> list[Rule]:
    """Nothing may end or hobble the launcher (pid `launcher`, leader of its own process group; the
    worker is in a session of its own): kill() to it, to its group or to -1 (every process of the
    uid), tkill/tgkill/rt_(tg)sigqueueinfo to it, any pidfd signal (a pidfd to it can come from
    /proc), F_SETOWN to it (a SIGIO on a file it then owns), F_SETOWN_EX and FIOSETOWN/SIOCSPGRP
    (their target is in memory), and prlimit64 on it (RLIMIT_NOFILE 0 would break its cleanup).
    NOTE: ptrace and /proc/<pid>/mem are closed by the launcher being non-dumpable."""
    label = "signals to the launcher"
    rules = [_refuse("kill", label, _int_is(0, target)) for target in (launcher, -launcher, -1)]
    rules += [_refuse(s, label, _int_is(0, launcher)) for s in ("tkill", "tgkill", "rt_sigqueueinfo",
                                                                "rt_tgsigqueueinfo", "prlimit64")]
    rules += [_refuse("fcntl", label, _int_is(1, F_SETOWN), _int_is(2, target)) for target in (launcher, -launcher)]
    rules += [_refuse("fcntl", label, _int_is(1, F_SETOWN_EX)), _refuse("pidfd_send_signal", label)]
    return rules + [_refuse("ioctl", label, _int_is(1, cmd)) for cmd in (FIOSETOWN, SIOCSPGRP)]


def worker_rules(level: str, cgroup: bool, launcher: int | None) -> list[Rule]:
    """What the worker's filter refuses (module docstring): at `level`, with or without a memory
    `cgroup`, protecting pid `launcher` when the worker could otherwise signal it (same uid)."""
    basic = level == "basic"
    rules = socket_rules(all_families=basic) + [_refuse(s) for s in (*KEYRINGS_AND_IO_URING, "memfd_secret")]
    rules += namespace_rules()
    if not cgroup:
        rules += [_refuse("memfd_create"), _refuse("socketpair")]
    if basic or not cgroup:
        rules += [_refuse(s) for s in IPC_OBJECTS]
    return rules + (launcher_rules(launcher) if launcher is not None else [])


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise OSError(f"libseccomp is not installed ({exc})") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def load(rules: list[Rule]) -> list[str]:
    """Load a filter of `rules` (after PR_SET_NO_NEW_PRIVS); the distinct labels, in order.
    OSError when libseccomp is missing or the filter cannot be loaded."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        for label, syscall, cmps, err in rules:
            nr = lib.seccomp_syscall_resolve_name(syscall.encode())
            args = (_ArgCmp * len(cmps))(*(_ArgCmp(*c) for c in cmps)) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, 0x00050000 | (err & 0xFFFF), nr, len(cmps), args)   # ERRNO(err)
            if rc != 0:
                raise OSError(-rc, f"seccomp rule {label}: {os.strerror(-rc)}")
        rc = lib.seccomp_load(ctx)
        if rc != 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)
    return list(dict.fromkeys(label for label, _, _, _ in rules))
