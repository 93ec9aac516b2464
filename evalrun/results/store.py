"""RunStore: crash-safe, resumable sample rows of one eval run (see evalrun/results/schema.py for the layout).

    open ──► completed_keys() ──► add(row) … (auto flush: one parquet part per flush)
         ──► merge_samples() ──► (the caller writes the summary) ──► mark_finalized()
             (finalize() = both, for a run without a summary)

NOTE: a part is published with os.replace after fsync, so on disk it is complete or absent;
rows still buffered when the process dies are simply redone on resume.
NOTE: a run whose manifest says "finalized" has its summary: the summary is written before the
manifest says so, and a run killed in between is finalized again by its rerun, without a model.
NOTE: no link inside a run directory is followed (evalrun/results/links.py).
"""

from __future__ import annotations

import fcntl
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
import pyarrow as pa

from evalrun.results import checksums
from evalrun.results.atomic import atomic_write_parquet, fsync_dir, to_jsonable
from evalrun.results.errors import NotARunDirError, ResumeMismatchError, RunDirBusyError
from evalrun.results.links import check_not_link, check_run_dir, open_nofollow
from evalrun.results.manifest import environment_info, identity_mismatches, read_manifest, utc_now, write_manifest
from evalrun.results.parts import (
    merge_tables,
    next_seq,
    quarantine,
    remove_stale_temps,
    with_merged_parts,
)
from evalrun.results.samples_read import Key, _collect, _keys_of
from evalrun.results.schema import (
    CHECKSUMS_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    PART_RE,
    PROMPTS_DIR,
    QUARANTINE_PREFIX,
    SAMPLES_DIR,
    SAMPLES_FILE,
    SCHEMA_VERSION,
    SUMMARY_JSON,
    SUMMARY_PARQUET,
    TMP_SUFFIX,
    part_name,
)



class RunStore:
    """Use `RunStore.open(...)`; the constructor is internal."""

    def __init__(self, run_dir: Path, manifest: dict[str, Any], key_columns: Sequence[str],
                 flush_rows: int, flush_seconds: float, lock_fd: int) -> None:
        self.run_dir = run_dir
        self.samples_dir = run_dir / SAMPLES_DIR
        self.manifest = manifest
        self.key_columns = tuple(key_columns)
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.quarantined: list[Path] = []  # torn parts moved aside by this store
        self._lock_fd: Optional[int] = lock_fd
        self._buffer: list[dict[str, Any]] = []
        self._first_buffered_at = 0.0
        self._columns: dict[str, Optional[pa.DataType]] = {}  # insertion order = column order
        self._keys: set[Key] = set()
        self._seq = 0
        self.resumed = False            # True when open() resumed a stored run
        self._checksummed = (self.samples_dir / CHECKSUMS_FILE).exists()   # False: a run from before checksums

    @classmethod
    def open(cls, run_dir: str | Path, manifest: dict[str, Any], key_columns: Sequence[str],
             overwrite: bool = False, flush_rows: int = 256, flush_seconds: float = 30.0) -> "RunStore":
        """Start a new run in `run_dir`, or resume the one there if its manifest["identity"] matches.

        Raises ResumeMismatchError (identity or key columns differ; overwrite=True starts over),
        NotARunDirError (non-empty dir without manifest.json; never touched), RunDirBusyError.
        """
        run_dir = Path(run_dir)
        if not key_columns:
            raise ValueError("key_columns must name at least one column")
        if not isinstance(manifest.get("identity"), dict):
            raise ValueError('manifest needs an "identity" dict (task, fingerprints, config hash)')
        if flush_rows < 1 or flush_seconds <= 0:
            raise ValueError(f"need flush_rows >= 1 and flush_seconds > 0, got {flush_rows}, {flush_seconds}")
        check_run_dir(run_dir)
        _check_is_run_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = _lock(run_dir)
        try:
            resuming = (run_dir / MANIFEST_FILE).exists()
            if resuming and overwrite:
                _clear_run_dir(run_dir)
                resuming = False
            given = to_jsonable(manifest)
            if resuming:
                final = _resume_manifest(run_dir, read_manifest(run_dir), given, key_columns)
            else:
                final = _new_manifest(given, key_columns)
            write_manifest(run_dir, final)
            (run_dir / SAMPLES_DIR).mkdir(exist_ok=True)
            if not resuming:
                checksums.start_index(run_dir / SAMPLES_DIR)      # a new run: every part verified
            fsync_dir(run_dir)
            store = cls(run_dir, final, key_columns, flush_rows, flush_seconds, lock_fd)
            store.resumed = resuming
            store._scan()
        except BaseException:
            os.close(lock_fd)
            raise
        return store

    def completed_keys(self) -> set[Key]:
        """Keys of rows durably stored (flushed parts and samples.parquet); buffered rows excluded."""
        return set(self._keys)

    def add(self, row: dict[str, Any]) -> None:
        """Buffer one row; flushes when flush_rows are buffered or the oldest is flush_seconds old."""
        self._check_open()
        missing = [c for c in self.key_columns if c not in row]
        if missing:
            raise KeyError(f"row lacks key column(s) {missing}")
        if not self._buffer:
            self._first_buffered_at = time.monotonic()
        self._buffer.append(dict(row))
        too_old = time.monotonic() - self._first_buffered_at >= self.flush_seconds
        if len(self._buffer) >= self.flush_rows or too_old:
            self.flush()

    def flush(self) -> None:
        """Write buffered rows as one new part (temp file, fsync, os.replace, fsync dir)."""
        self._check_open()
        if not self._buffer:
            return
        check_not_link(self.samples_dir)
        table = self._to_table(self._buffer)
        name = part_name(self._seq, uuid.uuid4().hex[:8])
        record = None
        if self._checksummed:
            def record(tmp: Path) -> None:
                checksums.record(self.samples_dir, name, checksums.sha256_file(tmp))
        atomic_write_parquet(self.samples_dir / name, table, record)
        self._seq += 1
        self._keys.update(_keys_of(table, self.key_columns))
        self._buffer.clear()

    def finalize(self) -> pd.DataFrame:
        """merge_samples(), then mark_finalized(): for a run without a summary."""
        merged = self.merge_samples()
        self.mark_finalized()
        return merged

    def merge_samples(self) -> pd.DataFrame:
        """Flush, merge everything into samples.parquet (first row per key wins, sorted by key) and
        record its hash in the manifest. The run is not finalized yet: write its summary, then
        mark_finalized(), so that a run killed in between is finalized again by its rerun."""
        self.flush()
        tables, covered = _collect(self.run_dir, self._quarantine, self.manifest.get("samples_sha256"),
                                   self.key_columns)
        merged = merge_tables(tables, self.key_columns)
        digest: dict[str, str] = {}
        atomic_write_parquet(self.run_dir / SAMPLES_FILE, with_merged_parts(merged, covered),
                             lambda tmp: digest.update(sha256=checksums.sha256_file(tmp)))
        self._keys = set(_keys_of(merged, self.key_columns)) if merged.num_columns else set()
        self.update_manifest(num_samples=merged.num_rows, samples_sha256=digest["sha256"])
        return merged.to_pandas()

    def mark_finalized(self) -> None:
        """The manifest says "finalized": every row is in samples.parquet and the summary is written."""
        self.update_manifest(status="finalized", finalized_at=utc_now())

    def update_manifest(self, **fields: Any) -> None:
        """Shallow-update manifest.json atomically; fields not named are kept."""
        self._check_open()
        self.manifest.update(to_jsonable(fields))
        write_manifest(self.run_dir, self.manifest)

    def record_session(self, **fields: Any) -> None:
        """This session's figures (end_time, throughput, ...): at the top level of the manifest for
        the session that started the run, in its own `resumes` entry for a resume, so the first
        run's figures are never overwritten."""
        self._check_open()
        if not self.resumed:
            self.update_manifest(**fields)
            return
        self.manifest["resumes"][-1].update(to_jsonable(fields))
        write_manifest(self.run_dir, self.manifest)

    def close(self, raise_errors: bool = True) -> None:
        """Flush and release the run dir's lock. Idempotent. With raise_errors=False (the run is
        already failing, e.g. the disk is full) a failed last flush is dropped, so the first error
        is the one reported; the rows it held are not stored and a resume computes them again."""
        if self._lock_fd is None:
            return
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - another error is already on its way
            if raise_errors:
                raise
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "RunStore":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(raise_errors=exc_type is None)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError(f"RunStore for {self.run_dir} is closed")

    def _quarantine(self, path: Path) -> None:
        self.quarantined.append(quarantine(path))

    def _scan(self) -> None:
        """Load what is on disk: keys, column order and types; quarantine torn parts."""
        remove_stale_temps(self.samples_dir)
        tables, _ = _collect(self.run_dir, self._quarantine, self.manifest.get("samples_sha256"), self.key_columns)
        for table in tables:
            self._keys.update(_keys_of(table, self.key_columns))
            for field in table.schema:
                if self._columns.get(field.name) is None or pa.types.is_null(self._columns[field.name]):
                    self._columns[field.name] = field.type
        self._seq = next_seq(self.samples_dir)

    def _to_table(self, rows: list[dict[str, Any]]) -> pa.Table:
        """Rows → table with the store's column order; a column keeps the type it first got."""
        for row in rows:
            for name in row:
                self._columns.setdefault(name, None)
        arrays = {}
        for name, known in self._columns.items():
            values = [row.get(name) for row in rows]
            if known is None or pa.types.is_null(known):
                arrays[name] = pa.array(values)
                self._columns[name] = arrays[name].type
                continue
            try:
                arrays[name] = pa.array(values, type=known)
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise TypeError(f"column {name!r}: values do not fit its type {known} from earlier rows: {e}") from e
        return pa.table(arrays)


def _check_is_run_dir(run_dir: Path) -> None:
    if not run_dir.exists() or (run_dir / MANIFEST_FILE).is_file():
        return
    if not run_dir.is_dir():
        raise NotARunDirError(f"{run_dir} exists and is not a directory")
    others = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise NotARunDirError(
            f"{run_dir} is not empty and has no {MANIFEST_FILE} ({shown}); refusing to use it as a run dir"
        )


def _lock(run_dir: Path) -> int:
    fd = open_nofollow(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusyError(f"{run_dir} is in use by another RunStore") from None
    return fd


def _clear_run_dir(run_dir: Path) -> None:
    """Remove only what the store writes; manifest.json last, so a crash here leaves a run dir."""
    for folder in (run_dir / SAMPLES_DIR, run_dir / PROMPTS_DIR):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            name = p.name.removeprefix(QUARANTINE_PREFIX)
            ours = PART_RE.match(name) or (name.startswith(".part-") and name.endswith(TMP_SUFFIX))
            if ours and p.is_file():
                p.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()
    for name in (SAMPLES_FILE, SUMMARY_PARQUET, SUMMARY_JSON):
        (run_dir / name).unlink(missing_ok=True)
        for tmp in run_dir.glob(f".{name}.*{TMP_SUFFIX}"):
            tmp.unlink()
    fsync_dir(run_dir)
    (run_dir / MANIFEST_FILE).unlink()
    fsync_dir(run_dir)


def _new_manifest(given: dict[str, Any], key_columns: Sequence[str]) -> dict[str, Any]:
    manifest = dict(given)
    manifest["schema_version"] = SCHEMA_VERSION
    manifest["key_columns"] = list(key_columns)
    manifest.setdefault("run_id", f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    manifest.setdefault("start_time", utc_now())
    manifest.setdefault("environment", environment_info())
    manifest["status"] = "running"
    return manifest


def _resume_manifest(run_dir: Path, stored: dict[str, Any], given: dict[str, Any],
                     key_columns: Sequence[str]) -> dict[str, Any]:
    check_resumable(run_dir, stored, given["identity"], key_columns)
    manifest = dict(stored)
    for name, value in given.items():
        manifest.setdefault(name, value)
    manifest["resumes"] = list(stored.get("resumes", [])) + [{"at": utc_now(), "cli_args": given.get("cli_args")}]
    manifest["status"] = "running"
    return manifest


def inspect_run(run_dir: str | Path) -> Optional[dict[str, Any]]:
    """The manifest of the run in `run_dir`, or None when there is none yet (absent or empty dir).

    Read-only. Raises NotARunDirError for a non-empty dir without manifest.json, or a manifest
    that is not readable JSON or lacks its store fields (the message names the file), and
    RunDirBusyError while another process has the run open."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    _check_is_run_dir(run_dir)
    _check_not_busy(run_dir)
    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = read_manifest(run_dir)
    except (OSError, ValueError) as exc:
        raise NotARunDirError(f"{path} is not a readable run manifest: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("identity"), dict):
        raise NotARunDirError(f"{path} is not a run manifest (no \"identity\" object)")
    keys = manifest.get("key_columns")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise NotARunDirError(f"{path} is not a run manifest (no \"key_columns\" list)")
    return manifest


def _check_not_busy(run_dir: Path) -> None:
    """RunDirBusyError if a RunStore (any process) holds the run dir's lock; takes nothing."""
    try:
        fd = open_nofollow(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return                                  # no lock file: nobody has opened it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirBusyError(f"{run_dir} is in use by another evalrun process") from None
    finally:
        os.close(fd)


def check_resumable(run_dir: Path, stored: dict[str, Any], identity: dict[str, Any],
                    key_columns: Sequence[str]) -> None:
    """Raise ResumeMismatchError, one line naming each difference in words, unless the run
    stored in `run_dir` has this identity and key columns."""
    if stored.get("schema_version") != SCHEMA_VERSION:
        raise ResumeMismatchError(
            f"{run_dir} holds a run written by another evalrun version (run schema "
            f"{stored.get('schema_version')}, this evalrun writes {SCHEMA_VERSION}), which cannot be resumed; "
            "choose another --output-dir, or pass --overwrite to discard it")
    lines = identity_mismatches(stored.get("identity", {}), to_jsonable(identity))
    lines += identity_mismatches({"key_columns": stored.get("key_columns")}, {"key_columns": list(key_columns)})
    if lines:
        raise ResumeMismatchError(
            f"{run_dir} holds another run: " + "; ".join(lines)
            + ". Rerun with its settings, choose another --output-dir, or pass --overwrite to discard it"
        )
