"""Issue 43, class 3: nested user namespaces. An unprivileged worker could unshare(CLONE_NEWUSER) and
get a full capability set inside, and with it a network namespace (AF_PACKET raw sockets, network
ioctls) and mounts (tmpfs, sysfs, devpts): the usual container-escape kernel surface. The seccomp
filter now refuses unshare and clone with any namespace flag, setns, and clone3 (whose flags it cannot
read; it answers ENOSYS, on which glibc falls back to clone), at every level.

The completion returns the right answer for HumanEval/0 only if a namespace was made."""
from __future__ import annotations

import os

import pytest
from sandbox_helpers import he_spec, right_only_if, run_as_user

NEW_NAMESPACE = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x40000000, 0x20000, 17
made = []
pid = os.fork()
if pid == 0:                                      # a child, so the worker itself stays as it was
    code = 1
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) == 0:
        code = 0
        try:
            socket.socket(17, socket.SOCK_RAW).close()     # AF_PACKET: what the namespace would give
        except OSError:
            pass
    os._exit(code)
made.append(os.waitpid(pid, 0)[1] == 0)
child = libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)          # clone(2)
if child == 0:
    os._exit(0)
if child > 0:
    made.append(os.waitpid(child, 0)[1] == 0)
args = (ctypes.c_uint64 * 11)(CLONE_NEWUSER, 0, 0, 0, SIGCHLD, 0, 0, 0, 0, 0, 0)
child = libc.syscall(435, args, ctypes.sizeof(args))                  # clone3(2)
if child == 0:
    os._exit(0)
if child > 0:
    made.append(os.waitpid(child, 0)[1] == 0)
ok = any(made)
"""

# Control: threads and child processes (glibc makes both through clone3 first) still work.
THREADS_AND_CHILDREN = """
import subprocess, sys, threading
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start()
t.join()
ok = box == [1] and subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
"""


def _needs_x86_64() -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("raw x86_64 syscall numbers")


def test_no_namespace_can_be_made(level_box, problems):
    _needs_x86_64()
    result = level_box.run(he_spec(problems["HumanEval/0"], right_only_if(NEW_NAMESPACE)))
    assert result.status == "failed", result
    denied = level_box.isolation_info()["seccomp_denied"]
    assert {"unshare(namespaces)", "clone(namespaces)", "clone3", "setns"} <= set(denied), denied


@pytest.mark.parametrize("level", ("userns", "basic"))
def test_no_namespace_can_be_made_without_root(level, tmp_path):
    _needs_x86_64()
    report = run_as_user(level, [right_only_if(NEW_NAMESPACE)], tmp_path / "home")
    assert report["results"][0][0] == "failed", report["results"]


def test_threads_and_child_processes_still_work(level_box, problems):
    result = level_box.run(he_spec(problems["HumanEval/0"], right_only_if(THREADS_AND_CHILDREN)))
    assert result.passed, result
