"""Sample parts on disk: list, read, quarantine torn ones, merge into one deduplicated table."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from evalrun.results.atomic import fsync_dir
from evalrun.results.links import open_nofollow, read_bytes_nofollow
from evalrun.results.schema import MERGED_PARTS_METADATA_KEY, PART_RE, QUARANTINE_PREFIX, TMP_SUFFIX

READ_ERRORS = (OSError, pa.ArrowException, ValueError)


def list_parts(samples_dir: Path) -> list[Path]:
    """Published parts in write order (sequence number, then name)."""
    if not samples_dir.is_dir():
        return []
    found = [(int(m.group(1)), p.name) for p in samples_dir.iterdir() if (m := PART_RE.match(p.name))]
    return [samples_dir / name for _, name in sorted(found)]


def next_seq(samples_dir: Path) -> int:
    """One past the highest sequence number ever used here, quarantined parts included."""
    if not samples_dir.is_dir():
        return 0
    seqs = [
        int(m.group(1))
        for p in samples_dir.iterdir()
        if (m := PART_RE.match(p.name.removeprefix(QUARANTINE_PREFIX)))
    ]
    return max(seqs, default=-1) + 1


def remove_stale_temps(samples_dir: Path) -> None:
    """Delete `.part-*.tmp` files left by a writer killed mid-flush."""
    for p in samples_dir.iterdir():
        if p.name.startswith(".part-") and p.name.endswith(TMP_SUFFIX):
            p.unlink(missing_ok=True)


def read_part(path: Path, columns: Optional[Sequence[str]] = None,
              sha256: Optional[str] = None) -> Optional[pa.Table]:
    """The part's table, or None when it is torn or unreadable, or (sha256 given) its bytes are
    not the ones recorded; the hash is taken over the same bytes that are parsed. A link is a
    RunDirLinkError, never followed."""
    cols = list(columns) if columns is not None else None
    try:
        data = read_bytes_nofollow(path)
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            return None
        return pq.read_table(pa.BufferReader(data), columns=cols)
    except READ_ERRORS:                              # NOTE: not RunDirLinkError: a link is no torn part
        return None


def quarantine(path: Path) -> Path:
    """Rename a torn or damaged part to `_quarantine-<name>` (pyarrow.dataset skips names starting with "_")."""
    target = path.with_name(QUARANTINE_PREFIX + path.name)
    os.replace(path, target)
    fsync_dir(path.parent)
    warnings.warn(f"torn or damaged sample part {path.name} (unreadable, its bytes not those recorded in "
                  f"_checksums.jsonl, or without this run's key columns) moved to {target.name}; its rows will be "
                  "redone")
    return target


def merge_tables(tables: Sequence[pa.Table], key_columns: Sequence[str]) -> pa.Table:
    """Concatenate in order, keep the first row of each key, sort by key (stable)."""
    if not tables:
        return pa.table({})
    table = pa.concat_tables(tables, promote_options="default")
    keys = table.select(list(key_columns)).to_pandas()
    first = keys[~keys.duplicated(keep="first")]
    order = first.sort_values(list(key_columns), kind="stable").index.to_numpy()
    return table.take(pa.array(order, type=pa.int64()))


def with_merged_parts(table: pa.Table, part_names: Sequence[str]) -> pa.Table:
    metadata = dict(table.schema.metadata or {})
    metadata[MERGED_PARTS_METADATA_KEY] = json.dumps(list(part_names)).encode()
    return table.replace_schema_metadata(metadata)


def merged_parts_of(path: Path) -> Optional[list[str]]:
    """Part names recorded in samples.parquet, or None when it is absent or unreadable."""
    try:
        with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:
            metadata = pq.read_schema(f).metadata or {}
    except READ_ERRORS:
        return None
    raw = metadata.get(MERGED_PARTS_METADATA_KEY)
    return json.loads(raw) if raw is not None else None
