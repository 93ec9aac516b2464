"""summary.parquet + summary.json of a finished run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from evalrun.results.atomic import atomic_write_json, atomic_write_parquet
from evalrun.results.links import read_bytes_nofollow
from evalrun.results.parts import read_part
from evalrun.results.schema import SCHEMA_VERSION, SUMMARY_JSON, SUMMARY_PARQUET


def write_summary(run_dir: str | Path, summary_rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Write summary.parquet (one row per dict, e.g. per subject) and summary.json, both atomically.

    summary.json gets "schema_version" unless the caller set it. NaN/inf are rejected (strict JSON).
    """
    run_dir = Path(run_dir)
    atomic_write_parquet(run_dir / SUMMARY_PARQUET, pa.Table.from_pylist(summary_rows))
    atomic_write_json(run_dir / SUMMARY_JSON, {"schema_version": SCHEMA_VERSION, **summary})


def summary_intact(run_dir: str | Path) -> bool:
    """Whether both summary files are there and readable (summary.json a JSON object)."""
    run_dir = Path(run_dir)
    try:
        summary = json.loads(read_bytes_nofollow(run_dir / SUMMARY_JSON))
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and read_part(run_dir / SUMMARY_PARQUET) is not None
