"""The read side of a run's sample rows (no lock, nothing written): samples.parquet and the parts not
merged into it, checked against their recorded hashes (evalrun/results/store.py writes them)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd
import pyarrow as pa

from evalrun.results import checksums
from evalrun.results.errors import NotARunDirError
from evalrun.results.links import check_run_dir
from evalrun.results.manifest import read_manifest
from evalrun.results.parts import list_parts, merge_tables, merged_parts_of, read_part
from evalrun.results.schema import MANIFEST_FILE, SAMPLES_DIR, SAMPLES_FILE

Key = tuple


def read_samples(run_dir: str | Path) -> pd.DataFrame:
    """All rows of a run (finalized or not): first row per key, sorted by key; torn parts skipped."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    if not (run_dir / MANIFEST_FILE).is_file():
        raise NotARunDirError(f"{run_dir} has no {MANIFEST_FILE}")
    manifest = read_manifest(run_dir)
    key_columns = manifest["key_columns"]
    tables, _ = _collect(run_dir, lambda p: warnings.warn(f"skipping torn or damaged sample part {p}"),
                         manifest.get("samples_sha256"), key_columns)
    return merge_tables(tables, key_columns).to_pandas()


def _collect(run_dir: Path, on_torn: Callable[[Path], None], samples_sha256: Optional[str] = None,
             key_columns: Sequence[str] = ()) -> tuple[list[pa.Table], list[str]]:
    """Tables in write order — samples.parquet, then parts not merged into it — and the part names
    they cover. samples.parquet is used only if it records which parts it merged and its bytes
    hash to `samples_sha256` (when given); otherwise it is rebuilt from the parts, with a warning.
    A part that is torn, or whose bytes do not hash to its line in _checksums.jsonl, goes to
    `on_torn` and is not read, as does one without the `key_columns` (not a part of this run)."""
    base, covered, problem = read_samples_file(run_dir, samples_sha256)
    if problem is not None:
        warnings.warn(f"{run_dir / SAMPLES_FILE} is damaged ({problem}): its rows are read from the sample "
                      "parts, and it is rebuilt from them when the run is finalized")
    tables: list[pa.Table] = [] if base is None else [base]
    merged_names = set(covered)
    index = checksums.load_index(run_dir / SAMPLES_DIR)
    for path in list_parts(run_dir / SAMPLES_DIR):
        if path.name in merged_names:
            continue
        table = read_part(path, sha256=checksums.recorded_hash(index, path.name))
        if table is None or not _has_columns(table, key_columns):
            on_torn(path)
            continue
        tables.append(table)
        covered.append(path.name)
    return tables, covered


def read_samples_file(run_dir: Path, sha256: Optional[str]) -> tuple[Optional[pa.Table], list[str], Optional[str]]:
    """samples.parquet as (table, the part names merged into it, None), or (None, [], why it cannot
    be used): torn or unreadable, or not the bytes `sha256` records. Absent, or from before
    merged-part names were recorded: (None, [], None), the parts hold the rows."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.exists():
        return None, [], None
    table = read_part(path, sha256=sha256)
    if table is None:
        readable = sha256 is not None and read_part(path) is not None
        return None, [], "its bytes do not match the hash in its manifest" if readable else "unreadable or truncated"
    merged = merged_parts_of(path)
    return (None, [], None) if merged is None else (table, list(merged), None)


def samples_file_intact(run_dir: str | Path) -> bool:
    """Whether the run's samples.parquet is there, readable, and (when the manifest records its
    hash) byte for byte what was written."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    recorded = read_manifest(run_dir).get("samples_sha256") if (run_dir / MANIFEST_FILE).is_file() else None
    return read_samples_file(run_dir, recorded)[0] is not None


def _has_columns(table: pa.Table, columns: Sequence[str]) -> bool:
    try:
        return set(columns) <= set(table.column_names)
    except (UnicodeDecodeError, ValueError):         # a garbled schema (a run from before checksums)
        return False


def _keys_of(table: pa.Table, key_columns: Sequence[str]) -> list[Key]:
    return list(zip(*(table.column(c).to_pylist() for c in key_columns)))


def stored_keys(run_dir: str | Path, key_columns: Sequence[str]) -> set[Key]:
    """Keys of the rows durably stored in `run_dir` (read-only: torn parts are skipped, not moved)."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    stored = read_manifest(run_dir) if (run_dir / MANIFEST_FILE).is_file() else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the store that opens the run says it, once
        tables, _ = _collect(run_dir, lambda p: None, stored.get("samples_sha256"), key_columns)
    return {k for t in tables for k in _keys_of(t, key_columns)}
