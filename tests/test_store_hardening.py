"""The store against the attacks of issue 43 (class 6): a SIGKILL at the summary write (a run, a
`humaneval --score-samples`, a `merge`) never leaves a finalized run without its summary, and a
rerun writes it; a finalized run whose summary is missing or unreadable gets it back without a
model; `merge` refuses a shard holding a row outside its selection; the store follows no symbolic
link inside a run directory (samples/, prompts/, _checksums.jsonl, parts, manifest.json,
summary.json, ...), while a run directory that is itself a link is the user's choice and works.
Tiny random model, the MMLU fixture in tests/data/mmlu."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evalrun.commands.cli import main
from evalrun.commands.merge import PER_RUN_SUMMARY_KEYS
from evalrun.engine import Model
from evalrun.results import NotARunDirError, RunStore, inspect_run, read_samples, stored_keys

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
SELECTION = ("--subjects", "philosophy,nutrition", "--limit", "2")      # 4 questions
# Run in a child: evalrun's command line, SIGKILLed where the summary's first file is written.
KILL_AT_SUMMARY = """
import os, signal, sys
import evalrun.results.summary as summary
summary.atomic_write_parquet = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
from evalrun.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _mmlu_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(FIXTURE), "--dtype", "float32",
            "--num-fewshot", "0", "--output-dir", str(out), *SELECTION, *extra]


def _killed_at_summary(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", KILL_AT_SUMMARY, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _summary(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k not in PER_RUN_SUMMARY_KEYS}


def _assert_same_summary(got: Path, want: Path) -> None:
    assert _summary(got) == _summary(want)
    pd.testing.assert_frame_equal(pd.read_parquet(got / "summary.parquet"), pd.read_parquet(want / "summary.parquet"))


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_error(capsys: pytest.CaptureFixture, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"evalrun {command}: error: "), err
    return err


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> Path:
    """A clean run of SELECTION: what every repaired summary must equal."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(_mmlu_args(tiny_model_dir, out)) == 0
    return out


# -- a kill at the summary write --------------------------------------------------------------

def test_a_run_killed_at_its_summary_write_is_finished_by_the_rerun(tiny_model_dir, reference, tmp_path, capsys,
                                                                    no_model_load):
    out = tmp_path / "run"
    _killed_at_summary(_mmlu_args(tiny_model_dir, out))
    assert not (out / "summary.json").exists()
    assert _manifest(out)["status"] != "finalized", "the manifest says finalized, but the run has no summary"
    assert main(_mmlu_args(tiny_model_dir, out)) == 0           # no model: every row is stored
    assert "4 of 4 questions already done" in capsys.readouterr().err
    assert _manifest(out)["status"] == "finalized"
    _assert_same_summary(out, reference)


@pytest.mark.parametrize("damage", ["summary.json missing", "summary.json unreadable", "summary.parquet missing"])
def test_a_finalized_run_without_its_summary_gets_it_back_without_a_model(tiny_model_dir, reference, tmp_path,
                                                                          capsys, no_model_load, damage):
    """A run finalized by an evalrun from before the fix, killed before its summary: the rerun writes it."""
    out = shutil.copytree(reference, tmp_path / "run")
    name, how = damage.split()
    if how == "missing":
        (out / name).unlink()
    else:
        (out / name).write_text('{"accuracy": 0.')
    assert main(_mmlu_args(tiny_model_dir, out)) == 0
    assert "4 of 4 questions already done" in capsys.readouterr().err
    _assert_same_summary(out, reference)


def _score_args(samples: Path, out: Path) -> list[str]:
    return ["humaneval", "--no-progress", "--limit", "2", "--score-samples", str(samples), "--output-dir", str(out)]


def test_score_samples_killed_at_its_summary_write_is_finished_by_the_rerun(tmp_path, capsys):
    from evalrun.tasks.humaneval_data import load_humaneval
    problems = load_humaneval().problems[:2]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": p.task_id, "completion": p.canonical_solution}) + "\n"
                               for p in problems))
    want, out = tmp_path / "clean", tmp_path / "killed"
    assert main(_score_args(samples, want)) == 0
    _killed_at_summary(_score_args(samples, out))
    assert not (out / "summary.json").exists()
    assert _manifest(out)["status"] != "finalized", "the manifest says finalized, but the run has no summary"
    capsys.readouterr()
    assert main(_score_args(samples, out)) == 0
    assert "2 of 2 samples already scored" in capsys.readouterr().err
    _assert_same_summary(out, want)


@pytest.fixture(scope="module")
def shards(tiny_model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("shards")
    dirs = [root / f"s{k}" for k in range(2)]
    for k, shard in enumerate(dirs):
        assert main(_mmlu_args(tiny_model_dir, shard, "--shard", f"{k}/2")) == 0
    return dirs


def test_a_merge_killed_at_its_summary_write_is_finished_by_the_rerun(shards, reference, tmp_path, capsys):
    out = tmp_path / "merged"
    args = ["merge", *map(str, shards), "--output-dir", str(out)]
    _killed_at_summary(args)
    assert not (out / "summary.json").exists()
    assert _manifest(out)["status"] != "finalized", "the manifest says finalized, but the run has no summary"
    capsys.readouterr()
    assert main(args) == 0                                        # the same command finishes it
    assert "merged 2 shards (4 rows)" in capsys.readouterr().out
    _assert_same_summary(out, reference)


# -- merge: a shard's rows must be its selection's ---------------------------------------------

def _rekey_one_row(shard: Path, doc_id: int) -> dict:
    """Give the shard's first row another doc_id, as if it had stored that question instead."""
    table = pq.read_table(shard / "samples.parquet")
    ids = table.column("doc_id").to_pylist()
    old = {"subject": table.column("subject")[0].as_py(), "doc_id": ids[0]}
    ids[0] = doc_id
    table = table.set_column(table.column_names.index("doc_id"), table.schema.field("doc_id"),
                             pa.array(ids, type=table.schema.field("doc_id").type))
    pq.write_table(table, shard / "samples.parquet")
    manifest = _manifest(shard)
    manifest["samples_sha256"] = hashlib.sha256((shard / "samples.parquet").read_bytes()).hexdigest()
    (shard / "manifest.json").write_text(json.dumps(manifest))
    return old


def test_merge_refuses_a_shard_holding_a_row_outside_its_selection(shards, tmp_path, capsys):
    bad = shutil.copytree(shards[0], tmp_path / "bad")
    old = _rekey_one_row(bad, 7)                                  # question 7: beyond --limit 2
    out = tmp_path / "merged"
    assert main(["merge", str(bad), str(shards[1]), "--output-dir", str(out)]) == 2
    err = _one_line_error(capsys, "merge")
    assert f"{bad} (shard 0/2) holds the row {{'subject': '{old['subject']}', 'doc_id': 7}}" in err, err
    assert "outside its selection" in err
    assert not out.exists()


def test_a_shard_from_before_shard_keys_merges_with_a_warning(shards, reference, tmp_path, capsys):
    old = shutil.copytree(shards[0], tmp_path / "old")
    manifest = _manifest(old)
    del manifest["shard"]["keys"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "merged"
    assert main(["merge", str(old), str(shards[1]), "--output-dir", str(out)]) == 0
    assert f"warning: {old} (shard 0/2) was made before shards recorded their keys" in capsys.readouterr().err
    _assert_same_summary(out, reference)


# -- links inside a run directory ---------------------------------------------------------------

def _move_and_link(path: Path, target: Path) -> None:
    shutil.move(str(path), str(target))
    path.symlink_to(target, target_is_directory=target.is_dir())


@pytest.mark.parametrize("folder", ["samples", "prompts"])
def test_a_linked_folder_in_the_run_dir_is_refused_and_nothing_is_written_there(tiny_model_dir, tmp_path, capsys,
                                                                              folder):
    out = tmp_path / "run"
    assert main(_mmlu_args(tiny_model_dir, out, "--limit", "1")) == 0
    victim = tmp_path / "victim"
    _move_and_link(out / folder, victim)
    before = _tree(victim)
    capsys.readouterr()
    assert main(_mmlu_args(tiny_model_dir, out, "--limit", "2")) == 2      # new questions to store
    err = _one_line_error(capsys, "mmlu")
    assert f"{out / folder} is a symbolic link" in err
    assert _tree(victim) == before


def test_a_linked_checksum_index_is_refused_and_its_target_untouched(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_mmlu_args(tiny_model_dir, out, "--limit", "1")) == 0
    victim = tmp_path / "victim.jsonl"
    _move_and_link(out / "samples" / "_checksums.jsonl", victim)
    before = victim.read_bytes()
    capsys.readouterr()
    assert main(_mmlu_args(tiny_model_dir, out, "--limit", "2")) == 2
    err = _one_line_error(capsys, "mmlu")
    assert f"{out / 'samples' / '_checksums.jsonl'} is a symbolic link" in err
    assert victim.read_bytes() == before


@pytest.mark.parametrize("command", ["merge", "compare", "show"])
def test_reading_commands_refuse_a_run_dir_holding_a_link(shards, tmp_path, capsys, command):
    linked = shutil.copytree(shards[0], tmp_path / "linked")
    _move_and_link(linked / "prompts", tmp_path / "victim")
    args = {"merge": ["merge", str(linked), str(shards[1]), "--output-dir", str(tmp_path / "merged")],
            "compare": ["compare", str(shards[0]), str(linked)], "show": ["show", str(linked)]}[command]
    assert main(args) == 2
    assert f"error: {linked / 'prompts'} is a symbolic link" in _one_line_error(capsys, command)


def _store_run(run_dir: Path) -> None:
    with RunStore.open(run_dir, {"identity": {"task": "t"}}, ["k"]) as store:
        store.add({"k": 1, "v": "a"})
        store.flush()
        store.add({"k": 2, "v": "b"})
        store.finalize()
    (run_dir / "summary.json").write_text("{}\n")


@pytest.mark.parametrize("name", ["manifest.json", "samples.parquet", "summary.json", ".lock",
                                  "samples/_checksums.jsonl", "samples/part", "prompts"])
def test_the_store_refuses_every_link_inside_a_run_dir(tmp_path, name):
    run_dir = tmp_path / "run"
    _store_run(run_dir)
    (run_dir / "prompts").mkdir()
    if name == "samples/part":
        name = f"samples/{sorted(p.name for p in (run_dir / 'samples').glob('part-*'))[0]}"
    victim = tmp_path / "victim"
    _move_and_link(run_dir / name, victim)
    before = _tree(tmp_path / "victim") if victim.is_dir() else victim.read_bytes()
    for read in (inspect_run, read_samples, lambda d: stored_keys(d, ["k"]),
                 lambda d: RunStore.open(d, {"identity": {"task": "t"}}, ["k"]).close()):
        with pytest.raises(NotARunDirError, match="^" + re.escape(f"{run_dir / name} is a symbolic link")):
            read(run_dir)
    assert (_tree(tmp_path / "victim") if victim.is_dir() else victim.read_bytes()) == before


def test_a_run_dir_that_is_itself_a_link_is_the_users_choice(tmp_path):
    real = tmp_path / "scratch" / "run"
    real.parent.mkdir()
    (tmp_path / "runs").symlink_to(real.parent, target_is_directory=True)
    _store_run(tmp_path / "runs" / "run")
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    assert inspect_run(tmp_path / "link")["status"] == "finalized"
    assert len(read_samples(tmp_path / "link")) == 2
    with RunStore.open(tmp_path / "link", {"identity": {"task": "t"}}, ["k"]) as store:
        store.add({"k": 3, "v": "c"})
        assert len(store.finalize()) == 3
