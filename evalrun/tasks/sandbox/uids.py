"""Distinct sandbox uids for concurrent slots, also across Sandboxes and processes.

RLIMIT_NPROC counts processes per uid and the parent kills leftovers by uid, so two
slots running at once must never share one, whichever process runs them. Each slot holds
an flock on LOCK_DIR/<uid> for the life of its Sandbox; the kernel drops the lock when the
process dies. Only root leases uids (see Sandbox).

NOTE: LOCK_DIR is one fixed path for the whole machine, not under $TMPDIR (two runs with
different TMPDIRs would not exclude each other), and in /run, where only root can create
it. If it cannot be used safely, leasing fails with a message naming it: there is no
fallback that would silently lose the exclusion.
"""
from __future__ import annotations

import fcntl
import os
import stat

UID_SPAN = 4096
LOCK_DIR = "/run/evalrun-sandbox-uids"


class UidLockDirError(RuntimeError):
    """The machine-wide uid lock directory cannot be used safely."""


def check_lock_dir(path: str) -> None:
    """Create `path` if missing; UidLockDirError unless it is a directory of ours that
    nobody else can write."""
    try:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass                        # a directory or not: checked below
        st = os.lstat(path)
    except OSError as exc:
        raise UidLockDirError(f"sandbox uid lock directory {path} cannot be created: {exc}") from exc
    problem = ("it is not a directory" if not stat.S_ISDIR(st.st_mode) else
               f"it is owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid() else
               f"its mode {stat.S_IMODE(st.st_mode):o} lets others write" if st.st_mode & 0o022 else None)
    if problem:
        raise UidLockDirError(f"sandbox uid lock directory {path} is not safe to use: {problem}; "
                              "remove it or fix it (it must be a directory of this user, mode 700)")


class UidLease:
    """`count` uids from [base_uid, base_uid + UID_SPAN) that no other lease on this machine holds."""

    def __init__(self, base_uid: int, count: int, lock_dir: str = LOCK_DIR) -> None:
        self.uids: list[int] = []
        self._files: list[int] = []
        check_lock_dir(lock_dir)
        for uid in range(base_uid, base_uid + UID_SPAN):
            if self._try_lock(lock_dir, uid) and len(self.uids) == count:
                return
        self.release()
        raise RuntimeError(f"no {count} free sandbox uids in [{base_uid}, {base_uid + UID_SPAN})")

    def _try_lock(self, lock_dir: str, uid: int) -> bool:
        path = os.path.join(lock_dir, str(uid))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            self.release()
            raise UidLockDirError(f"sandbox uid lock {path} cannot be opened: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.uids.append(uid)
        self._files.append(fd)
        return True

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)
        self._files, self.uids = [], []
