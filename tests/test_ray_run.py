"""`--ray` on a real local Ray instance with 2 CPU replicas, each run inside a private network
namespace (`unshare -n`, loopback up: shared/FIELD_NOTES.md), the CLI as a subprocess:
the rows equal a single-process run's question by question (tiny model; SmolLM2, slow); a
replica SIGKILLed mid-parcel is restarted, its rows kept, the rest recomputed once and the retry
recorded; a parcel failing on every replica ends the run with exit 1, the rest stored; a
SIGKILLed or SIGTERMed driver leaves no process of its namespace behind, and the rerun computes
only what was not stored."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from evalrun.commands.cli import main
from evalrun.commands.merge import PER_RUN_SUMMARY_KEYS
from evalrun.scale.ray_run import DELAY_ENV, FAIL_ENV, PAUSE_ENV
from evalrun.results import stored_keys
from tests.run_helpers import IN_NETNS, assert_same_rows, private_netns_works

pytest.importorskip("ray", reason="Ray is not installed (pip install 'evalrun[ray]')")


pytestmark = pytest.mark.skipif(not private_netns_works(), reason="needs `unshare -n` and `ip` (root): every Ray "
                                "test runs in a private network namespace (shared/FIELD_NOTES.md)")

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
QUESTIONS = 40
MMLU_KEYS = ["subject", "doc_id"]
HE_KEYS = ["task_id", "sample_idx"]
WAIT = 120                                     # seconds: no wait in these tests is unbounded


def _mmlu_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(FIXTURE), "--dtype", "float32",
            "--num-fewshot", "0", "--output-dir", str(out), *extra]


def _start(argv: list[str], log: Path, **env: str) -> subprocess.Popen:
    """`python -m evalrun argv` in a network namespace of its own; output into `log`."""
    full = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "RAY_USAGE_STATS_ENABLED": "0", **env}
    with open(log, "w") as out:
        return subprocess.Popen([*IN_NETNS, sys.executable, "-m", "evalrun", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=full, cwd=REPO)


def _finish(proc: subprocess.Popen, log: Path, want: int = 0) -> str:
    try:
        rc = proc.wait(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == want, text[-4000:]
    return text


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _assert_same_summary(got: Path, single: Path) -> None:
    a, b = (json.loads((d / "summary.json").read_text()) for d in (got, single))
    for key in PER_RUN_SUMMARY_KEYS:
        a.pop(key, None)
        b.pop(key, None)
    assert a == b


def _no_key_stored_twice(run_dir: Path, keys: list[str]) -> None:
    parts = [pd.read_parquet(p) for p in sorted((run_dir / "samples").glob("part-*.parquet"))]
    stored = pd.concat(parts)[keys].apply(tuple, axis=1).tolist()
    assert len(stored) == len(set(stored))


def _wait_for_pid(pidfile: Path, proc: subprocess.Popen, log: Path) -> int:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        text = pidfile.read_text() if pidfile.exists() else ""
        if text:
            return int(text)
        assert proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.1)
    raise AssertionError(f"no replica paused within {WAIT} s: {log.read_text()[-4000:]}")


def _wait_until_parts_settle(samples: Path, quiet: float = 2.0) -> None:
    """Until no new part appeared for `quiet` seconds (the other replica has finished its parcels)."""
    last, since = -1, time.monotonic()
    deadline = since + WAIT
    while time.monotonic() < deadline:
        count = len(list(samples.glob("part-*.parquet"))) if samples.is_dir() else 0
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.2)


def _in_netns(ns: str) -> list[str]:
    """Command lines of the processes in network namespace `ns`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns" / "net") == ns:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            continue
    return found


def _assert_namespace_empties(ns: str) -> None:
    deadline = time.monotonic() + 30
    while _in_netns(ns) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _in_netns(ns) == [], "left running after the driver died"


@pytest.fixture(scope="module")
def single_mmlu(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single") / "mmlu"
    assert main(_mmlu_args(tiny_model_dir, out)) == 0
    return out


def test_two_replicas_store_the_single_process_rows(tiny_model_dir, single_mmlu, tmp_path, capsys):
    out, log = tmp_path / "ray", tmp_path / "log.txt"
    proc = _start([*_mmlu_args(tiny_model_dir, out), "--ray", "--replicas", "2", "--ray-batch-rows", "2"], log,
                  **{DELAY_ENV: "0.4"})                      # both replicas take parcels
    text = _finish(proc, log)
    assert "ray: replica 0 ready" in text and "ray: replica 1 ready" in text
    assert_same_rows(out, single_mmlu, MMLU_KEYS)
    _assert_same_summary(out, single_mmlu)
    record = _manifest(out)["ray"]
    assert (record["address"], record["replicas"], record["cpus_per_replica"]) == ("local", 2, 1.0)
    assert [a["slot"] for a in record["actors"]] == [0, 1] and all(a["pid"] > 0 for a in record["actors"])
    assert sum(a["parcels"] for a in record["actors"]) == record["parcels"] > 2
    assert all(a["parcels"] and a["rows"] for a in record["actors"])
    assert record["retries"] == record["failed"] == [] and record["rows"] == QUESTIONS
    assert _manifest(out)["identity"] == _manifest(single_mmlu)["identity"]     # either resumes the other
    capsys.readouterr()
    assert main([*_mmlu_args(tiny_model_dir, out), "--ray", "--replicas", "2"]) == 0    # nothing left: no Ray
    assert f"{QUESTIONS} of {QUESTIONS} questions already done" in capsys.readouterr().err


def test_humaneval_on_replicas_executes_on_either_side_with_the_single_process_rows(tiny_model_dir, tmp_path):
    common = ["humaneval", "--no-progress", "--model", str(tiny_model_dir), "--dtype", "float32", "--cache-mode",
              "fp32", "--limit", "4", "--n-samples", "2", "--temperature", "0.9", "--max-new-tokens", "8",
              "--workers", "2"]
    single = tmp_path / "single"
    assert main([*common, "--output-dir", str(single)]) == 0
    for side in ("driver", "replica"):
        out, log = tmp_path / side, tmp_path / f"{side}.txt"
        _finish(_start([*common, "--output-dir", str(out), "--ray", "--replicas", "2", "--execute-on", side], log), log)
        assert_same_rows(out, single, HE_KEYS)
        _assert_same_summary(out, single)
        manifest = _manifest(out)
        assert manifest["sandbox"]["execute_on"] == side and manifest["ray"]["execute_on"] == side
        assert manifest["sandbox"]["level"] == _manifest(single)["sandbox"]["level"]
        setups = [a["setup"] for a in manifest["ray"]["actors"] if "pid" in a]      # those that became ready
        assert setups and (all(setups) if side == "replica" else not any(setups))


def test_a_replica_killed_mid_parcel_is_replaced_and_no_row_is_lost_or_stored_twice(tiny_model_dir, single_mmlu,
                                                                                    tmp_path):
    out, log, pidfile = tmp_path / "ray", tmp_path / "log.txt", tmp_path / "paused.pid"
    proc = _start([*_mmlu_args(tiny_model_dir, out), "--ray", "--replicas", "2", "--ray-batch-rows", "1",
                   "--flush-rows", "1"], log, **{PAUSE_ENV: f"2:{pidfile}"})
    pid = _wait_for_pid(pidfile, proc, log)
    os.kill(pid, signal.SIGKILL)
    _finish(proc, log)
    assert_same_rows(out, single_mmlu, MMLU_KEYS)
    _no_key_stored_twice(out, MMLU_KEYS)
    record = _manifest(out)["ray"]
    killed = next(a for a in record["actors"] if a.get("pid") == pid)
    [retry] = record["retries"]
    assert (retry["slot"], retry["instance"]) == (killed["slot"], killed["instance"])
    assert retry["rows_kept"] == 2 and retry["docs_left"] > 0 and retry["outcome"] == "re-queued"
    assert "ActorDiedError" in retry["error"] and killed["end"].startswith("lost: ActorDiedError")
    assert any(a["slot"] == killed["slot"] and a["instance"] == 1 for a in record["actors"])     # restarted
    assert record["duplicates_dropped"] == 0 and record["rows"] == QUESTIONS


def test_a_parcel_failing_on_every_replica_ends_the_run_with_1_after_storing_the_rest(tiny_model_dir, single_mmlu,
                                                                                      tmp_path):
    out, log = tmp_path / "ray", tmp_path / "log.txt"
    bad = tuple(pd.read_parquet(single_mmlu / "samples.parquet")[MMLU_KEYS].iloc[7])
    args = [*_mmlu_args(tiny_model_dir, out), "--ray", "--replicas", "2"]
    text = _finish(_start(args, log, **{FAIL_ENV: json.dumps([str(bad[0]), int(bad[1])])}), log, want=1)
    assert "1 parcel(s) failed on every replica tried" in text and "rerunning the same command" in text
    record = _manifest(out)["ray"]
    [failed] = record["failed"]
    assert failed["attempts"] == 2 and "test hook" in failed["error"]
    tries = [r for r in record["retries"] if r["parcel"] == failed["parcel"]]
    assert sorted(r["slot"] for r in tries) == [0, 1] and tries[-1]["outcome"] == "given up"
    stored = stored_keys(out, MMLU_KEYS)
    assert bad not in stored and len(stored) == QUESTIONS - failed["docs"] and record["rows"] == len(stored)
    rerun = tmp_path / "rerun.txt"
    assert f"{len(stored)} of {QUESTIONS} questions already done" in _finish(_start(args, rerun), rerun)
    assert_same_rows(out, single_mmlu, MMLU_KEYS)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_driver_leaves_no_process_and_the_rerun_computes_only_the_rest(tiny_model_dir, single_mmlu,
                                                                               tmp_path, sig):
    out, log, pidfile = tmp_path / "ray", tmp_path / "log.txt", tmp_path / "paused.pid"
    flush = ["--flush-rows", "1"] if sig == signal.SIGKILL else []          # SIGTERM: the exit flushes them
    args = [*_mmlu_args(tiny_model_dir, out), "--ray", "--replicas", "2", "--ray-batch-rows", "1", *flush]
    proc = _start(args, log, **{PAUSE_ENV: f"2:{pidfile}"})
    _wait_for_pid(pidfile, proc, log)
    ns = os.readlink(f"/proc/{proc.pid}/ns/net")
    _wait_until_parts_settle(out / "samples")
    proc.send_signal(sig)
    _finish(proc, log, want=-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM)
    _assert_namespace_empties(ns)
    stored = stored_keys(out, MMLU_KEYS)
    assert 2 <= len(stored) < QUESTIONS
    rerun = tmp_path / "rerun.txt"
    text = _finish(_start(args, rerun), rerun)
    assert f"resuming {out}: {len(stored)} of {QUESTIONS} questions already done" in text
    assert_same_rows(out, single_mmlu, MMLU_KEYS)
    _no_key_stored_twice(out, MMLU_KEYS)
    assert _manifest(out)["resumes"][-1]["ray"]["rows"] == QUESTIONS - len(stored)


@pytest.mark.slow
def test_smollm2_on_two_replicas_equals_one_process(smollm2_dir, tmp_path):
    mmlu = ["mmlu", "--no-progress", "--model", str(smollm2_dir), "--data-dir", str(FIXTURE), "--dtype", "float32",
            "--subjects", "philosophy,nutrition,high_school_biology", "--limit", "3"]
    he = ["humaneval", "--no-progress", "--model", str(smollm2_dir), "--dtype", "float32", "--limit", "3",
          "--max-new-tokens", "48", "--workers", "2"]
    for name, argv, keys in (("mmlu", mmlu, MMLU_KEYS), ("humaneval", he, HE_KEYS)):
        single, out, log = tmp_path / f"{name}-single", tmp_path / f"{name}-ray", tmp_path / f"{name}.txt"
        assert main([*argv, "--output-dir", str(single)]) == 0
        _finish(_start([*argv, "--output-dir", str(out), "--ray", "--replicas", "2"], log), log)
        assert_same_rows(out, single, keys)
        _assert_same_summary(out, single)
