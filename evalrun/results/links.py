"""No symbolic link inside a run directory is followed.

Everything the store keeps in a run directory (manifest.json, .lock, samples.parquet, summary.*,
samples/ and prompts/ and all they hold) is its own: a link among them would make it write parts
or append checksum lines somewhere else, or read another file as this run's. Such a directory is
refused with one line naming the link (RunDirLinkError, a NotARunDirError: exit 2 on the command
line); the user replaces the link with the file or folder itself.

    check_run_dir(run_dir)   lstat of every entry, when a run directory is opened or read
    open_nofollow(path, ...) every file the store opens in it: O_NOFOLLOW, so a link that appears
                             later is refused at the open instead of followed

NOTE: the run directory itself, and any folder above it, may be a link (`runs -> /scratch/runs`):
where a user keeps runs is the user's choice; only what is inside is checked. Folders are checked
by lstat before use, not opened relative to a directory descriptor: this refuses a directory
prepared with links, not a process racing the store with write access to it (which could rewrite
the rows anyway).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from evalrun.results.errors import NotARunDirError
from evalrun.results.schema import (LOCK_FILE, MANIFEST_FILE, PROMPTS_DIR, SAMPLES_DIR, SAMPLES_FILE, SUMMARY_JSON,
                                    SUMMARY_PARQUET)

RUN_DIR_ENTRIES = (MANIFEST_FILE, LOCK_FILE, SAMPLES_FILE, SUMMARY_PARQUET, SUMMARY_JSON, SAMPLES_DIR, PROMPTS_DIR)
FOLDERS = (SAMPLES_DIR, PROMPTS_DIR)          # every entry inside these is the store's too


class RunDirLinkError(NotARunDirError):
    """A file or folder inside a run directory is a symbolic link."""


def link_error(path: Path) -> RunDirLinkError:
    return RunDirLinkError(f"{path} is a symbolic link; evalrun follows no link inside a run directory: "
                           "replace it with the file or folder itself")


def check_not_link(path: Path) -> None:
    if os.path.islink(path):
        raise link_error(path)


def check_run_dir(run_dir: Path) -> None:
    """RunDirLinkError naming the first store entry of `run_dir` that is a link (nothing if absent)."""
    run_dir = Path(run_dir)
    for name in RUN_DIR_ENTRIES:
        check_not_link(run_dir / name)
    for name in FOLDERS:
        folder = run_dir / name
        if not folder.is_dir():
            continue
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_symlink():
                    raise link_error(folder / entry.name)


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open with O_NOFOLLOW; a link is a RunDirLinkError naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise link_error(Path(path)) from None
        raise


def read_bytes_nofollow(path: Path) -> bytes:
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:
        return f.read()
