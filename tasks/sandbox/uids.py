"""Distinct sandbox uids for concurrent slots, also across Sandboxes and processes.

RLIMIT_NPROC counts processes per uid and the parent kills leftovers by uid, so two
slots running at once must never share one. Each slot holds an flock on
<tmp>/evalrun-sandbox-uids/<uid> for the life of its Sandbox; the kernel drops the lock
when the process dies.
"""
from __future__ import annotations

import fcntl
import os
import stat
import tempfile

UID_SPAN = 4096


def _lock_dir() -> str:
    """The shared lock directory, or a private one if the shared one is not safely ours."""
    path = os.path.join(tempfile.gettempdir(), "evalrun-sandbox-uids")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return tempfile.mkdtemp(prefix="evalrun-sandbox-uids-")
    return path


class UidLease:
    """`count` uids from [base_uid, base_uid + UID_SPAN) that no other lease holds."""

    def __init__(self, base_uid: int, count: int) -> None:
        self.uids: list[int] = []
        self._files: list[int] = []
        lock_dir = _lock_dir()
        for uid in range(base_uid, base_uid + UID_SPAN):
            if len(self.uids) == count:
                return
            fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uids.append(uid)
            self._files.append(fd)
        self.release()
        raise RuntimeError(f"no {count} free sandbox uids in [{base_uid}, {base_uid + UID_SPAN})")

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)
        self._files, self.uids = [], []
