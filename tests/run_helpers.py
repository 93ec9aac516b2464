"""Comparing run directories: two runs of the same selection (merged shards, a --ray run) against a
single-process one, row by row, but for the columns that belong to one process (evalrun merge's
PER_RUN_COLUMNS: run_id, cached_tokens, exec_time)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from evalrun.merge_cmd import PER_RUN_COLUMNS


def sorted_rows(run_dir: Path, keys: list[str]) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "samples.parquet").sort_values(keys).reset_index(drop=True)


def assert_same_rows(got: Path, single: Path, keys: list[str]) -> pd.DataFrame:
    """`got`'s rows equal `single`'s exactly in every column but the per-run ones; returns got's rows."""
    a, b = sorted_rows(got, keys), sorted_rows(single, keys)
    assert set(a.columns) == set(b.columns)
    compared = sorted(set(b.columns) - set(PER_RUN_COLUMNS))
    pd.testing.assert_frame_equal(a[compared], b[compared], check_exact=True)
    return a
