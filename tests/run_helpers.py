"""Comparing run directories: two runs of the same selection (merged shards, a --ray run) against a
single-process one, row by row, but for the columns that belong to one process (evalrun merge's
PER_RUN_COLUMNS: run_id, cached_tokens, exec_time); and the private network namespace Ray's tests run in."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd

from evalrun.commands.merge import PER_RUN_COLUMNS


def sorted_rows(run_dir: Path, keys: list[str]) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "samples.parquet").sort_values(keys).reset_index(drop=True)


def assert_same_rows(got: Path, single: Path, keys: list[str]) -> pd.DataFrame:
    """`got`'s rows equal `single`'s exactly in every column but the per-run ones; returns got's rows."""
    a, b = sorted_rows(got, keys), sorted_rows(single, keys)
    assert set(a.columns) == set(b.columns)
    compared = sorted(set(b.columns) - set(PER_RUN_COLUMNS))
    pd.testing.assert_frame_equal(a[compared], b[compared], check_exact=True)
    return a


def sigkill_after_parts(cmd: list[str], out: Path, parts: int = 3, timeout: float = 120.0) -> None:
    """Start the run `cmd` (writing into `out`), SIGKILL it once `parts` result parts are on disk,
    and check that it had not finished by then."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline and len(list((out / "samples").glob("part-*.parquet"))) < parts:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "samples.parquet").exists(), "run finished before it could be killed"


# Ray binds the machine's address unless loopback is all there is (shared/FIELD_NOTES.md): its tests run the CLI in
# a network namespace of its own, loopback up.
IN_NETNS = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']


def private_netns_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True).returncode == 0
