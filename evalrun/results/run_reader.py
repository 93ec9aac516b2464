"""Read a finished run directory for comparison: its manifest and every stored row, or a
RunReadError that names the directory and what is wrong with it (never a partial read).

    load_finished_run(dir) ── manifest.json readable, a run manifest, status "finalized",
                              nobody has it open ── samples.parquet intact and every part
                              on disk merged into it or readable ──► RunData
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import pyarrow as pa

from evalrun.results import checksums
from evalrun.results.errors import NotARunDirError, RunDirBusyError, RunReadError
from evalrun.results.links import RunDirLinkError
from evalrun.results.parts import list_parts, merge_tables, read_part
from evalrun.results.schema import MANIFEST_FILE, SAMPLES_DIR, SAMPLES_FILE
from evalrun.results.samples_read import read_samples_file
from evalrun.results.store import inspect_run


@dataclass(frozen=True)
class RunData:
    path: Path
    manifest: dict[str, Any]
    rows: pd.DataFrame                  # every stored row, skipped ones included, sorted by key

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(self.manifest["key_columns"])


def load_finished_run(run_dir: str | Path) -> RunData:
    path = Path(run_dir)
    manifest = finished_manifest(path)
    return RunData(path, manifest, read_finished_rows(path, manifest).to_pandas())


def finished_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the finished run in `path`, or RunReadError saying why it is not one."""
    if not path.exists():
        raise RunReadError(f"{path}: no such run directory")
    if not path.is_dir():
        raise RunReadError(f"{path}: not a directory")
    if not (path / MANIFEST_FILE).is_file():
        raise RunReadError(f"{path}: not a run directory (it has no {MANIFEST_FILE})")
    try:
        manifest = inspect_run(path)
    except RunDirBusyError:
        raise RunReadError(f"{path}: the run is still in progress (another evalrun process has it open); "
                           "compare it once it has finished") from None
    except RunDirLinkError as exc:
        raise RunReadError(str(exc)) from None             # names the link, inside `path`
    except NotARunDirError as exc:
        raise RunReadError(f"{path}: corrupt manifest: {exc}") from None
    assert manifest is not None
    if manifest.get("status") != "finalized":
        raise RunReadError(f"{path}: the run has not finished (status {manifest.get('status')!r}: it was "
                           "stopped or is being resumed); rerun its command to finish it, then compare")
    return manifest


def read_finished_rows(path: Path, manifest: dict[str, Any]) -> pa.Table:
    """Every row of a finished run (samples.parquet plus any part not merged into it), with its
    stored column types; a torn file is an error here, not a skip."""
    key_columns = manifest["key_columns"]
    samples = path / SAMPLES_FILE
    if not samples.is_file():
        raise RunReadError(f"{path}: {SAMPLES_FILE} is missing from a finished run")
    base, merged, problem = read_samples_file(path, manifest.get("samples_sha256"))
    if base is None:
        why = problem or "written before its merged parts were recorded"
        raise RunReadError(f"{path}: {SAMPLES_FILE} is torn or damaged ({why}): rerun the run's command to "
                           "rebuild it from its parts")
    tables = [base]
    index = checksums.load_index(path / SAMPLES_DIR)
    for part in list_parts(path / SAMPLES_DIR):
        if part.name in set(merged):
            continue
        table = read_part(part, sha256=checksums.recorded_hash(index, part.name))
        if table is None:
            raise RunReadError(f"{path}: sample part {SAMPLES_DIR}/{part.name} is torn, unreadable or damaged")
        tables.append(table)
    missing = [c for c in key_columns if c not in base.column_names]
    if missing:
        raise RunReadError(f"{path}: {SAMPLES_FILE} lacks the key column(s) {', '.join(missing)}")
    return merge_tables(tables, key_columns)


def manifest_value(manifest: dict[str, Any], *path: str) -> Optional[Any]:
    """manifest[a][b]..., or None where any step is missing."""
    value: Any = manifest
    for name in path:
        if not isinstance(value, dict) or name not in value:
            return None
        value = value[name]
    return value
