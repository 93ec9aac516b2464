"""Run-directory result store: parts, merge, crash safety, resume rules, manifest, fingerprints."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from evalrun.results import (
    SCHEMA_VERSION,
    NotARunDirError,
    ResumeMismatchError,
    RunDirBusyError,
    RunStore,
    fingerprint_model_dir,
    read_manifest,
    read_samples,
    throughput,
    write_summary,
)

REPO = Path(__file__).resolve().parents[1]
KEYS = ["subject", "qid"]


def manifest(**identity_overrides: object) -> dict:
    identity = {"task": "mmlu", "model_fingerprint": "m-aaa", "tokenizer_fingerprint": "t-1",
                "data_fingerprint": "d-1", "config_hash": "c-1"}
    identity.update(identity_overrides)
    return {"task": "mmlu", "identity": identity, "dtype": "bfloat16", "cli_args": ["mmlu", "--shots", "5"]}


def row(subject: str, qid: int) -> dict:
    return {"subject": subject, "qid": qid, "choice_logprobs": [-1.0 * qid, -0.5, -2.0, -3.0],
            "pred": "ABCD"[qid % 4], "correct": qid % 3 == 0}


def part_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "samples").glob("part-*.parquet"))


def test_parts_merge_into_sorted_deduplicated_samples(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    expected = [(s, q) for s in ("b_subject", "a_subject") for q in (4, 0, 3, 1, 2)]
    with RunStore.open(run_dir, manifest(), KEYS, flush_rows=3) as store:
        for subject, qid in expected:
            r = row(subject, qid)
            store.add(dict(reversed(list(r.items()))) if qid % 2 else r)  # column order varies per row
        store.add({**row("a_subject", 0), "pred": "DUPLICATE"})  # later duplicate: first one wins
        frame = store.finalize()

    parts = part_files(run_dir)
    assert len(parts) == 4  # 11 rows / 3 per flush
    assert all(pq.read_schema(p).names == pq.read_schema(parts[0]).names for p in parts)
    assert pq.read_schema(parts[0]).names == ["subject", "qid", "choice_logprobs", "pred", "correct"]
    assert ds.dataset(run_dir / "samples", format="parquet").to_table().num_rows == 11

    assert list(zip(frame.subject, frame.qid)) == sorted(expected)
    assert frame.set_index(KEYS).loc[("a_subject", 0), "pred"] == "A"
    from_pandas = pd.read_parquet(run_dir / "samples.parquet")
    from_dataset = ds.dataset(run_dir / "samples.parquet", format="parquet").to_table().to_pandas()
    for other in (from_pandas, from_dataset, read_samples(run_dir)):
        assert list(zip(other.subject, other.qid)) == sorted(expected)
    assert list(from_pandas.loc[3, "choice_logprobs"]) == [-3.0, -0.5, -2.0, -3.0]  # ("a_subject", 3)
    assert read_manifest(run_dir)["num_samples"] == 10


CRASH_WRITER = textwrap.dedent("""
    import json, sys, time
    from evalrun.results import RunStore
    run_dir, manifest = sys.argv[1], json.loads(sys.argv[2])
    store = RunStore.open(run_dir, manifest, ["subject", "qid"], flush_rows=3)
    for qid in range(1000):
        store.add({"subject": "s", "qid": qid, "choice_logprobs": [0.1 * qid, -1.0], "pred": "A"})
        time.sleep(0.02)
""")


def test_sigkill_mid_run_then_resume_has_no_gaps_or_duplicates(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(run_dir), json.dumps(manifest())], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while len(part_files(run_dir)) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "writer exited early"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    parts = part_files(run_dir)
    assert len(parts) >= 4
    on_disk = {("s", q) for p in parts for q in pq.read_table(p).column("qid").to_pylist()}
    assert on_disk == {("s", q) for q in range(3 * len(parts))}  # whole flushes only, in order

    with RunStore.open(run_dir, manifest(), KEYS, flush_rows=7) as store:
        assert store.completed_keys() == on_disk
        assert store.quarantined == []
        for qid in range(40):
            if ("s", qid) not in store.completed_keys():
                store.add({"subject": "s", "qid": qid, "choice_logprobs": [0.1 * qid, -1.0], "pred": "B"})
        frame = store.finalize()
    assert list(frame.qid) == list(range(40))
    assert not [p for p in (run_dir / "samples").iterdir() if p.name.endswith(".tmp")]  # stale temp removed
    assert len(read_manifest(run_dir)["resumes"]) == 1


def test_torn_part_is_quarantined_and_its_rows_redone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore.open(run_dir, manifest(), KEYS, flush_rows=2) as store:
        for qid in range(6):
            store.add(row("s", qid))
    torn = part_files(run_dir)[1]  # rows qid 2, 3
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    stale_temp = torn.with_name(f".{torn.name}.0badf00d.tmp")  # a writer killed before os.replace
    stale_temp.write_bytes(b"PAR1 half a file")
    with pytest.raises(Exception):
        pq.read_table(torn)
    with pytest.warns(UserWarning, match="skipping torn"):
        assert sorted(read_samples(run_dir).qid) == [0, 1, 4, 5]  # read-only: nothing moved
    assert torn.exists()

    with pytest.warns(UserWarning, match="moved to _quarantine-"):
        store = RunStore.open(run_dir, manifest(), KEYS, flush_rows=2)
    with store:
        assert store.quarantined == [torn.with_name("_quarantine-" + torn.name)]
        assert not stale_temp.exists()
        assert store.completed_keys() == {("s", 0), ("s", 1), ("s", 4), ("s", 5)}
        for qid in (2, 3):
            store.add(row("s", qid))
        frame = store.finalize()
    assert list(frame.qid) == list(range(6))
    assert ds.dataset(run_dir / "samples", format="parquet").to_table().num_rows == 6  # "_" files ignored
    assert len(part_files(run_dir)) == 3
    assert part_files(run_dir)[-1].name.startswith("part-000003-")  # seq continues past the quarantined one


def test_resume_refused_when_identity_differs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore.open(run_dir, manifest(), KEYS) as store:
        store.add(row("s", 0))
    (run_dir / "notes.txt").write_text("mine")

    with pytest.raises(ResumeMismatchError) as err:
        RunStore.open(run_dir, manifest(model_fingerprint="m-bbb", data_fingerprint="d-2"), KEYS)
    message = str(err.value)
    for text in ("model_fingerprint", "'m-aaa'", "'m-bbb'", "data_fingerprint", "'d-1'", "'d-2'",
                 "the model (its config or weights) differs", "the data content differs", "--overwrite"):
        assert text in message
    assert "tokenizer_fingerprint" not in message
    with pytest.raises(ResumeMismatchError, match="key_columns"):
        RunStore.open(run_dir, manifest(), ["qid"])
    assert len(part_files(run_dir)) == 1  # refused opens changed nothing

    with RunStore.open(run_dir, manifest(model_fingerprint="m-bbb"), KEYS, overwrite=True) as store:
        assert store.completed_keys() == set()
        assert part_files(run_dir) == []
    assert read_manifest(run_dir)["identity"]["model_fingerprint"] == "m-bbb"
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_not_a_run_dir_is_never_touched(tmp_path: Path) -> None:
    user_dir = tmp_path / "data"
    user_dir.mkdir()
    (user_dir / "results.csv").write_text("a,b\n")
    for overwrite in (False, True):
        with pytest.raises(NotARunDirError, match="results.csv"):
            RunStore.open(user_dir, manifest(), KEYS, overwrite=overwrite)
    assert sorted(p.name for p in user_dir.iterdir()) == ["results.csv"]
    assert (user_dir / "results.csv").read_text() == "a,b\n"


def test_second_writer_is_refused(tmp_path: Path) -> None:
    with RunStore.open(tmp_path / "run", manifest(), KEYS):
        with pytest.raises(RunDirBusyError):
            RunStore.open(tmp_path / "run", manifest(), KEYS)


def test_flush_by_seconds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore.open(run_dir, manifest(), KEYS, flush_rows=1000, flush_seconds=0.05) as store:
        store.add(row("s", 0))
        assert part_files(run_dir) == [] and store.completed_keys() == set()
        time.sleep(0.1)
        store.add(row("s", 1))  # the oldest buffered row is now older than flush_seconds
        assert [pq.read_table(p).num_rows for p in part_files(run_dir)] == [2]
        assert store.completed_keys() == {("s", 0), ("s", 1)}


def test_manifest_update_is_atomic_and_keeps_prior_fields(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore.open(run_dir, manifest(), KEYS) as store:
        started = read_manifest(run_dir)
        assert started["schema_version"] == SCHEMA_VERSION == 2
        assert started["status"] == "running" and started["key_columns"] == KEYS
        assert started["environment"]["packages"]["pyarrow"] == importlib.metadata.version("pyarrow")
        stats = throughput(prompt_tokens=1000, prefill_tokens_computed=250, wall_seconds=2.0, generated_tokens=10)
        store.update_manifest(end_time="2025-01-01T00:00:00+00:00", throughput=stats)
        store.update_manifest(device="cpu")
    final = read_manifest(run_dir)
    for name in ("task", "identity", "dtype", "cli_args", "run_id", "start_time", "environment"):
        assert final[name] == started[name]
    assert final["device"] == "cpu" and final["end_time"].startswith("2025")
    assert final["throughput"]["dedup_ratio"] == 4.0
    assert final["throughput"]["tokens_per_s"] == 505.0
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_write_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore.open(run_dir, manifest(), KEYS):
        pass
    write_summary(run_dir, [{"subject": "a", "acc": 0.5, "n": 2}, {"subject": "b", "acc": 1.0, "n": 1}],
                  {"acc": 2 / 3, "n": 3})
    assert pd.read_parquet(run_dir / "summary.parquet").acc.tolist() == [0.5, 1.0]
    assert json.loads((run_dir / "summary.json").read_text()) == {"schema_version": 2, "acc": 2 / 3, "n": 3}


def test_fingerprint_model_dir(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "tokenizer.json").write_text('{"vocab": {}}')
    weights = model / "model.safetensors"
    weights.write_bytes(os.urandom(3 << 20))
    base = fingerprint_model_dir(model)
    assert base["weights"][0]["name"] == "model.safetensors" and base["weights"][0]["size"] == 3 << 20
    assert base["files"]["tokenizer_config.json"] is None

    os.utime(weights, (0, 0))
    assert fingerprint_model_dir(model) == base  # mtime plays no part

    original = weights.read_bytes()
    for flip in (0, len(original) - 1):  # the head and the tail are both sampled
        data = bytearray(original)
        data[flip] ^= 0xFF
        weights.write_bytes(bytes(data))
        changed = fingerprint_model_dir(model)
        assert changed["model_fingerprint"] != base["model_fingerprint"]
    assert changed["model_fingerprint"] != base["model_fingerprint"]
    assert changed["tokenizer_fingerprint"] == base["tokenizer_fingerprint"]

    (model / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    assert fingerprint_model_dir(model)["tokenizer_fingerprint"] != base["tokenizer_fingerprint"]
    single = fingerprint_model_dir(weights)  # a single weights file (e.g. a GGUF)
    assert single["weights"] == changed["weights"] and single["model_fingerprint"] != base["model_fingerprint"]
