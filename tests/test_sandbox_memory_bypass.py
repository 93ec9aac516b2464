"""Issue 43, class 2: memory outside every address space, where no cgroup bounds it (the default for
a harness without root). RLIMIT_AS does not count socket buffers or memfd_secret pages: a sample
held 2,856 MB in Unix socketpair buffers under a 256 MB bound, another 375 MB of memfd_secret pages
under 64 MB. The seccomp filter now refuses memfd_secret at every level, and socketpair (with
socket(AF_UNIX), already refused) wherever no memory cgroup charges the buffers; with a cgroup both
are charged to it and the OOM killer ends the check.

Each attack holds 4x the bound; the completion returns the right answer only if it held it all,
so `passed` would reveal a hole. At every level this machine offers, with the cgroup and without it
(memory_cgroup="off", and a harness without root, which cannot make one)."""
from __future__ import annotations

import os

import pytest
from sandbox_helpers import MEMORY_BOXES, open_memory_box, he_spec, right_only_if, run_as_user

from evalrun.tasks.sandbox import SandboxLimits

LIMITS = SandboxLimits(timeout=20.0, memory_mb=64)
HOLD_MB = 4 * LIMITS.memory_mb

SOCKETPAIR_FLOOD = f"""
import socket
held, pairs, ok = 0, [], False
try:
    while held < ({HOLD_MB} << 20):
        a, b = socket.socketpair()
        pairs.append((a, b))
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            s.setblocking(False)
            while held < ({HOLD_MB} << 20):
                try:
                    held += s.send(b"x" * (1 << 16))
                except BlockingIOError:
                    break
    ok = True
except OSError:
    pass
"""

# 4 MB secret files (under RLIMIT_MEMLOCK's usual 8 MB, which a mapping of one counts against), each
# mapped, filled and unmapped in turn: the pages stay with the file, and only 4 MB is ever mapped
MEMFD_SECRET_FLOOD = f"""
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
held, fds, ok = 0, [], False
try:
    while held < ({HOLD_MB} << 20):
        fd = libc.syscall(447, 0)                               # memfd_secret (x86_64)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "memfd_secret")
        os.ftruncate(fd, 4 << 20)
        with mmap.mmap(fd, 4 << 20) as m:
            for offset in range(0, 4 << 20, 4096):
                m[offset] = 1
        fds.append(fd)
        held += 4 << 20
    ok = True
except (OSError, ValueError):
    pass
"""
ATTACKS = {"socketpair": SOCKETPAIR_FLOOD, "memfd_secret": MEMFD_SECRET_FLOOD}


@pytest.fixture(scope="module", params=MEMORY_BOXES, ids=lambda p: f"{p[0]}-cgroup-{p[1]}")
def mem_box(request):
    sandbox = open_memory_box(*request.param, LIMITS)
    yield sandbox
    sandbox.close()


def _needs_x86_64() -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the memfd_secret attack uses the x86_64 syscall number")


@pytest.mark.parametrize("attack", ATTACKS)
def test_memory_outside_the_address_space_is_bounded(mem_box, problems, attack):
    _needs_x86_64()
    result = mem_box.run(he_spec(problems["HumanEval/0"], right_only_if(ATTACKS[attack])))
    assert not result.passed, f"{attack} held {HOLD_MB} MB under a {LIMITS.memory_mb} MB bound: {result}"
    if mem_box.isolation_info()["memory_bound"]["kind"].startswith("cgroup") and attack == "socketpair":
        assert result.status == "killed" and "memory limit exceeded" in result.error, result


@pytest.mark.parametrize("level", ("userns", "basic"))
def test_memory_outside_the_address_space_is_bounded_without_root(level, tmp_path):
    _needs_x86_64()
    report = run_as_user(level, [right_only_if(a) for a in ATTACKS.values()], tmp_path / "home", limits=LIMITS)
    results = dict(zip(ATTACKS, report["results"]))
    assert report["info"]["memory_bound"]["kind"] == "seccomp"
    assert all(status != "passed" for status, _ in results.values()), \
        f"held {HOLD_MB} MB under a {LIMITS.memory_mb} MB bound: {results}"


def test_the_socket_buffer_bound_is_named(mem_box):
    bound = mem_box.isolation_info()["memory_bound"]
    denied = mem_box.isolation_info()["seccomp_denied"]
    assert "memfd_secret" in denied and "socket_buffers" in bound
    if bound["kind"] == "seccomp":
        assert "socketpair" in denied and "socketpair" in bound["socket_buffers"]
    else:
        assert "socketpair" not in denied and "cgroup" in bound["socket_buffers"]


def test_ordinary_sockets_still_work_where_a_cgroup_bounds_them(mem_box, problems):
    """Control: a socketpair carrying a few KB passes where the cgroup charges it."""
    if not mem_box.isolation_info()["memory_bound"]["kind"].startswith("cgroup"):
        pytest.skip("socketpair is refused without a cgroup")
    attack = "import socket\na, b = socket.socketpair()\na.sendall(b'x' * 4096)\nok = len(b.recv(8192)) > 0\n"
    assert mem_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack))).passed
