"""Content hashes of the sample files, so a flipped bit is found instead of read back as data.

Parquet's page checksums (when a writer sets them) do not cover the footer, where a flip can
change a column's name, type or statistics; so every whole file is hashed:

- each sample part: its sha256 is appended to `samples/_checksums.jsonl` (one JSON object per
  line: {"part": name, "sha256": hex}) and fsynced BEFORE the part is published, so every
  published part has its line (a torn last line belongs to a part that never appeared);
- samples.parquet: its sha256 goes into the manifest ("samples_sha256") when it is written.

A run directory from before checksums (no `_checksums.jsonl`) is read as before, unverified.
The index is opened with O_NOFOLLOW: a link there is refused, never appended to (results/links.py).
The leading "_" keeps pyarrow.dataset from listing the index as data.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from evalrun.results.links import open_nofollow, read_bytes_nofollow
from evalrun.results.schema import CHECKSUMS_FILE

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def load_index(samples_dir: Path) -> Optional[dict[str, str]]:
    """{part name: sha256} recorded in samples_dir, or None when the run predates checksums.
    Lines that do not parse (a torn last line) are skipped: their parts were never published."""
    path = Path(samples_dir) / CHECKSUMS_FILE
    try:
        text = read_bytes_nofollow(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    index: dict[str, str] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            index[str(entry["part"])] = str(entry["sha256"])
        except (ValueError, TypeError, KeyError):
            continue
    return index


def record(samples_dir: Path, part: str, sha256: str) -> None:
    """Append one part's line and fsync it (called before the part is published)."""
    line = json.dumps({"part": part, "sha256": sha256}) + "\n"
    path = Path(samples_dir) / CHECKSUMS_FILE
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":   # a line torn by a crash or a full disk: end it
            line = "\n" + line
        data = line.encode()
        while data:                                   # a short write (full disk) must not pass as done
            written = os.write(fd, data)
            if written <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            data = data[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def start_index(samples_dir: Path) -> None:
    """Create an empty index in a new run's samples dir: from then on every part is verified."""
    fd = open_nofollow(Path(samples_dir) / CHECKSUMS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recorded_hash(index: Optional[dict[str, str]], part: str) -> Optional[str]:
    """What a part must hash to (for parts.read_part): None for a run without an index (read
    unverified); "" (which no file hashes to) for a part the index does not list."""
    return None if index is None else index.get(part, "")
