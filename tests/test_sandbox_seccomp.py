"""Issue 13, items 3 and 4: host Unix sockets and kernel keyrings. A read-only mount and a network
namespace do not stop connect() to a 0666 AF_UNIX socket under a host path, and a key stored in the
user keyring by one sample was read back by the next (and by a later run on the same uid). The
worker's seccomp filter refuses socket() for every family but AF_INET and AF_INET6 (for every
family at the basic level, issue 43) and the keyring calls (add_key, keyctl, request_key), at every
level this machine provides.

A sample "passes" here only if its attack worked: the completion returns the right answer for
HumanEval/0 exactly when it reached the socket or found the key, so `passed` would reveal a hole."""
from __future__ import annotations

import ctypes
import os
import socket

import pytest
from sandbox_helpers import FAST, LEVELS, he_spec, open_sandbox, right_only_if

def _libseccomp_here() -> bool:
    try:
        ctypes.CDLL("libseccomp.so.2")
        return True
    except OSError:
        return False


# Where libseccomp is missing the sandbox runs without the filter and says so in isolation_info
# (notes); these attacks then succeed, so there is nothing to test.
pytestmark = pytest.mark.skipif(not _libseccomp_here(), reason="libseccomp.so.2 is not installed")


def test_host_unix_socket_is_unreachable(level_box, problems, tmp_path):
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o666)
    os.chmod(tmp_path, 0o755)
    server.listen(8)
    server.setblocking(False)
    try:
        attack = f"""
        import socket
        ok = False
        for family in (socket.AF_UNIX,):
            try:
                s = socket.socket(family, socket.SOCK_STREAM)
                s.connect({str(path)!r})
                s.sendall(b"hello")
                ok = True
            except OSError:
                pass
        """
        result = level_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack)))
        assert result.status == "failed", result
        with pytest.raises(BlockingIOError):
            server.accept()                                      # no connection ever arrived
    finally:
        server.close()
    assert any(label.startswith("socket(every family") for label in level_box.isolation_info()["seccomp_denied"])


def test_netlink_and_vsock_sockets_are_refused(level_box, problems):
    attack = """
    import socket
    ok = False
    for family in (16, 40):                                     # AF_NETLINK, AF_VSOCK
        try:
            socket.socket(family, socket.SOCK_RAW if family == 16 else socket.SOCK_STREAM).close()
            ok = True
        except OSError:
            pass
    """
    assert level_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack))).status == "failed"


KEYCTL = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, REQUEST_KEY, KEYCTL = 248, 249, 250                    # x86_64
KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING = -4, -3
"""


@pytest.mark.parametrize("level", LEVELS)
def test_keyrings_do_not_carry_between_samples(level, problems):
    """One worker slot, so both samples run under the same uid (as with --workers 1)."""
    if os.uname().machine != "x86_64":
        pytest.skip("the attack uses x86_64 syscall numbers")
    store = KEYCTL + """
payload = b"evalrun-secret"
kid = libc.syscall(ADD_KEY, b"user", b"evalrun-probe", payload, len(payload), KEY_SPEC_USER_KEYRING)
ok = kid > 0
"""
    find = KEYCTL + """
kid = libc.syscall(REQUEST_KEY, b"user", b"evalrun-probe", None, 0)
ok = kid > 0
"""
    problem = problems["HumanEval/0"]
    box = open_sandbox(level, limits=FAST, workers=1)
    try:
        first = box.run(he_spec(problem, right_only_if(store)))
        second = box.run(he_spec(problem, right_only_if(find)))
    finally:
        box.close()
    assert first.status == "failed" and second.status == "failed", (first, second)


def test_the_filter_is_what_refuses(level_box, problems):
    """Control: the same probe for an allowed family (AF_INET socket creation, not connecting)
    does pass, so `failed` above comes from the filter, not from a broken attack. At the basic
    level, which has no network namespace, every family is refused (issue 43)."""
    attack = """
    import socket
    ok = False
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        ok = True
    except OSError:
        pass
    """
    expected = "failed" if level_box.isolation_info()["level"] == "basic" else "passed"
    assert level_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack))).status == expected


def test_high_bits_in_the_family_do_not_dodge_the_filter(level_box, problems):
    """The kernel reads socket()'s family as a 32-bit int: 0x1_0000_0001 is AF_UNIX to it, so the
    rule must compare the low 32 bits only (a plain 64-bit compare let this through)."""
    if os.uname().machine != "x86_64":
        pytest.skip("raw x86_64 syscall numbers")
    attack = """
    import ctypes, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ok = False
    for family in (0x100000001, 0x100000010, 0xFFFFFFFF00000001):
        fd = libc.syscall(41, ctypes.c_long(family), socket.SOCK_STREAM, 0)     # socket(2)
        ok = ok or fd >= 0
    fd = libc.syscall(425, 8, ctypes.create_string_buffer(120))                 # io_uring_setup(2)
    ok = ok or fd >= 0
    """
    assert level_box.run(he_spec(problems["HumanEval/0"], right_only_if(attack))).status == "failed"
