"""Crash-safe file writes: temp name in the same dir, fsync, os.replace, fsync the dir.

NOTE: a reader sees either the old file or the complete new one, never a torn file.
Temp names start with "." so pyarrow.dataset never lists them.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable, IO, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from evalrun.results.links import open_nofollow
from evalrun.results.schema import TMP_SUFFIX


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None],
                 before_publish: Optional[Callable[[Path], None]] = None) -> None:
    """Call `write(file)` on a temp file next to `path`, then publish it as `path`;
    `before_publish(temp path)` runs on the complete, fsynced file just before (e.g. to record
    its hash: a crash then leaves a record without a file, never a file without its record)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    try:
        f = os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")    # a new file, never a link
        try:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        finally:
            try:
                f.close()
            except OSError:        # flushing what a full disk refused: the error above is the one to report
                pass
        if before_publish is not None:
            before_publish(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        if exc.filename is None and exc.errno is not None:     # name the file the user can act on
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_dir(path.parent)


def _remove_quietly(path: Path) -> None:
    """Remove a temp file on the way out of a failed write; a second error (the file system went
    read-only) must not replace the first."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _json_default(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def to_jsonable(obj: Any) -> Any:
    """`obj` as it will read back from JSON (tuples become lists, paths strings, ...)."""
    return json.loads(json.dumps(obj, default=_json_default, allow_nan=False))


def atomic_write_json(path: Path, obj: Any) -> None:
    data = json.dumps(obj, indent=2, default=_json_default, allow_nan=False).encode() + b"\n"
    atomic_write(path, lambda f: f.write(data))


def atomic_write_parquet(path: Path, table: pa.Table,
                         before_publish: Optional[Callable[[Path], None]] = None) -> None:
    atomic_write(path, lambda f: pq.write_table(table, f), before_publish)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
