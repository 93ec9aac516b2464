"""`--shard K/N` and `evalrun merge` (issue 15 without Ray): three shards merged equal the
single-process run row by row (but for PER_RUN_COLUMNS) and in their summaries; shards of
different settings, a missing or repeated shard, a bad --shard and a resume as another shard
are refused in one line (exit 2). Tiny random model, the MMLU fixture in tests/data/mmlu."""
from __future__ import annotations

import hashlib
import json
import shutil
import typing
from pathlib import Path

import pandas as pd
import pytest

from evalrun.engine import Model
from evalrun.commands.cli import main
from evalrun.commands.merge import PER_RUN_COLUMNS, PER_RUN_SUMMARY_KEYS
from evalrun.results.schema import Manifest
from tests.run_helpers import assert_same_rows

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
SUBJECTS = 5
QUESTIONS = 40                                   # 8 per subject in the fixture
# The columns a merged row may differ in from the single-process row, spelled out here too.
EXPECTED_PER_RUN_COLUMNS = ("run_id", "cached_tokens", "exec_time")
EXPECTED_PER_RUN_SUMMARY_KEYS = ("this_session", "mean_exec_time")
MMLU_KEYS = ["subject", "doc_id"]
HE_KEYS = ["task_id", "sample_idx"]


def _mmlu(model: Path, out: Path, *extra: str) -> int:
    return main(["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(FIXTURE), "--dtype", "float32",
                 "--num-fewshot", "0", "--output-dir", str(out), *extra])


def _merge(out: Path, *dirs: Path, extra: tuple[str, ...] = ()) -> int:
    return main(["merge", *map(str, dirs), "--output-dir", str(out), *extra])


def _tree(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _one_line_error(capsys: pytest.CaptureFixture, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"evalrun {command}: error: "), err
    return err


def _assert_same_rows(merged: Path, single: Path, keys: list[str]) -> None:
    a = assert_same_rows(merged, single, keys)
    assert set(a.run_id) == {m["run_id"] for m in _manifest(merged)["merged_from"]}


def _assert_same_summary(merged: Path, single: Path) -> None:
    got = json.loads((merged / "summary.json").read_text())
    want = json.loads((single / "summary.json").read_text())
    assert "this_session" in want and "this_session" not in got
    for key in PER_RUN_SUMMARY_KEYS:
        got.pop(key, None)
        want.pop(key, None)
    assert got == want
    pd.testing.assert_frame_equal(pd.read_parquet(merged / "summary.parquet"),
                                  pd.read_parquet(single / "summary.parquet"))


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))


@pytest.fixture(scope="module")
def mmlu_runs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """One single-process run and its three shards (0-shot: the fixture's subjects are cut into
    chunks, so subjects are spread over shards)."""
    root = tmp_path_factory.mktemp("mmlu-shards")
    runs = {"single": root / "single", **{f"s{k}": root / f"s{k}" for k in range(3)}}
    assert _mmlu(tiny_model_dir, runs["single"]) == 0
    for k in range(3):
        assert _mmlu(tiny_model_dir, runs[f"s{k}"], "--shard", f"{k}/3") == 0
    return runs


def test_per_run_columns_are_the_documented_ones():
    assert PER_RUN_COLUMNS == EXPECTED_PER_RUN_COLUMNS
    assert PER_RUN_SUMMARY_KEYS == EXPECTED_PER_RUN_SUMMARY_KEYS


def test_three_mmlu_shards_merge_into_the_single_process_run(mmlu_runs, tmp_path, tiny_model_dir, capsys,
                                                           monkeypatch):
    shards = [mmlu_runs[f"s{k}"] for k in range(3)]
    records = [_manifest(s)["shard"] for s in shards]
    assert [r["index"] for r in records] == [0, 1, 2] and {r["count"] for r in records} == {3}
    units = [u for r in records for u in r["units"]]
    assert len(units) == len(set(units)) == records[0]["selection"]["units"]
    assert any("#" in u for u in units)                     # subjects were cut into chunks
    assert sum(r["docs"] for r in records) == QUESTIONS == records[0]["selection"]["docs"]
    for shard, record in zip(shards, records):
        assert len(pd.read_parquet(shard / "samples.parquet")) == record["docs"]
        assert json.loads((shard / "summary.json").read_text())["n"] == record["docs"]   # the summary covers the shard
    out = tmp_path / "merged"
    assert _merge(out, shards[2], shards[0], shards[1]) == 0
    assert "merged 3 shards (40 rows)" in capsys.readouterr().out
    single = mmlu_runs["single"]
    _assert_same_rows(out, single, MMLU_KEYS)
    _assert_same_summary(out, single)
    assert pd.read_parquet(out / "prompts").set_index("prompt_hash").prompt.sort_index().equals(
        pd.read_parquet(single / "prompts").set_index("prompt_hash").prompt.sort_index())
    manifest = _manifest(out)
    assert manifest["identity"] == _manifest(single)["identity"] and "shard" not in manifest
    assert [m["shard"]["index"] for m in manifest["merged_from"]] == [0, 1, 2]
    assert set(manifest) <= set(typing.get_type_hints(Manifest)), set(manifest) - set(typing.get_type_hints(Manifest))
    assert main(["compare", str(single), str(out)]) == 0
    assert main(["show", str(out), "-n", "1"]) == 0
    capsys.readouterr()
    assert _merge(out, *shards) == 2                              # a second merge into it: only with --overwrite
    assert "is not empty; choose another directory, or pass --overwrite" in _one_line_error(capsys, "merge")
    assert _merge(out, *shards, extra=("--overwrite",)) == 0
    _assert_same_rows(out, single, MMLU_KEYS)
    # the same command without --shard sees the merged run as its own, finished: nothing to run
    before = _tree(out)
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: pytest.fail("loaded a model")))
    capsys.readouterr()
    assert _mmlu(tiny_model_dir, out) == 0
    assert f"{QUESTIONS} of {QUESTIONS} questions already done" in capsys.readouterr().err
    assert _tree(out) == before


def test_five_shot_shards_keep_whole_subjects_and_merge_the_same(tiny_model_dir, tmp_path):
    single, shards = tmp_path / "single", [tmp_path / f"s{k}" for k in range(3)]
    assert _mmlu(tiny_model_dir, single, "--num-fewshot", "5") == 0
    for k, shard in enumerate(shards):
        assert _mmlu(tiny_model_dir, shard, "--num-fewshot", "5", "--shard", f"{k}/3") == 0
        units = _manifest(shard)["shard"]["units"]
        assert set(pd.read_parquet(shard / "samples.parquet").subject) == set(units)     # whole subjects
    assert _merge(tmp_path / "merged", *shards) == 0
    _assert_same_rows(tmp_path / "merged", single, MMLU_KEYS)
    _assert_same_summary(tmp_path / "merged", single)


def test_merge_refuses_what_is_not_one_whole_run(mmlu_runs, tiny_model_dir, tmp_path, capsys):
    s0, s1, s2 = (mmlu_runs[f"s{k}"] for k in range(3))
    other = tmp_path / "bf16"                               # shard 1 of the same run with another cache mode
    assert _mmlu(tiny_model_dir, other, "--shard", "1/3", "--cache-mode", "bf16") == 0
    capsys.readouterr()
    assert _merge(tmp_path / "m1", s0, other, s2) == 2
    err = _one_line_error(capsys, "merge")
    assert f"shards differ in cache_mode: fp32 ({s0}) vs bf16 ({other})" in err
    assert _merge(tmp_path / "m2", s0, s1) == 2
    assert "shard(s) 2/3 missing (given 0/3, 1/3)" in _one_line_error(capsys, "merge")
    assert _merge(tmp_path / "m3", s0, s1, s1, s2) == 2
    assert f"shard 1/3 is given twice: {s1} and {s1}" in _one_line_error(capsys, "merge")
    assert _merge(tmp_path / "m4", mmlu_runs["single"], s1) == 2
    assert "not a shard run (made without --shard)" in _one_line_error(capsys, "merge")
    assert _merge(s0, s0, s1, s2) == 2
    assert "is one of the shards being merged" in _one_line_error(capsys, "merge")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert _merge(busy, s0, s1, s2) == 2
    assert "is not empty; choose another directory, or pass --overwrite" in _one_line_error(capsys, "merge")
    assert _merge(busy, s0, s1, s2, extra=("--overwrite",)) == 2     # --overwrite replaces runs, not other files
    assert "not empty and has no manifest.json" in _one_line_error(capsys, "merge")
    assert (busy / "notes.txt").read_text() == "mine"
    for name in ("m1", "m2", "m3", "m4"):
        assert not (tmp_path / name).exists()


def test_merge_refuses_unfinished_shards_and_rows_stored_twice(mmlu_runs, tmp_path, capsys):
    s0, s1, s2 = (mmlu_runs[f"s{k}"] for k in range(3))
    unfinished = shutil.copytree(s2, tmp_path / "unfinished")
    manifest = _manifest(unfinished)
    (unfinished / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    assert _merge(tmp_path / "m", s0, s1, unfinished) == 2
    assert f"{unfinished}: the run has not finished" in _one_line_error(capsys, "merge")
    short = shutil.copytree(s2, tmp_path / "short")               # a shard that stored fewer rows than its units
    manifest = _manifest(short)
    docs = manifest["shard"]["docs"]
    (short / "manifest.json").write_text(json.dumps({**manifest, "shard": {**manifest["shard"], "docs": docs + 1}}))
    assert _merge(tmp_path / "m", s0, s1, short) == 2
    assert f"{short} (shard 2/3) holds {docs} rows, but its units have {docs + 1} documents" in \
        _one_line_error(capsys, "merge")
    twin = shutil.copytree(s1, tmp_path / "twin")                 # shard 1's rows posing as shard 2
    manifest = _manifest(twin)
    (twin / "manifest.json").write_text(json.dumps({**manifest, "shard": {**manifest["shard"], "index": 2}}))
    assert _merge(tmp_path / "m", s0, s1, twin) == 2
    assert f"is stored in two shards: {s1} and {twin}" in _one_line_error(capsys, "merge")
    assert not (tmp_path / "m").exists()


def test_merge_refuses_other_shard_counts_and_selections(mmlu_runs, tiny_model_dir, tmp_path, capsys):
    s0, s1 = mmlu_runs["s0"], mmlu_runs["s1"]
    half = tmp_path / "half"
    assert _mmlu(tiny_model_dir, half, "--shard", "1/2", "--subjects", "philosophy,nutrition") == 0
    capsys.readouterr()
    assert _merge(tmp_path / "m", s0, half) == 2
    assert f"shards differ in shard count: 3 ({s0}) vs 2 ({half})" in _one_line_error(capsys, "merge")
    fewer = tmp_path / "fewer"
    assert _mmlu(tiny_model_dir, fewer, "--shard", "1/3", "--limit", "4") == 0
    capsys.readouterr()
    assert _merge(tmp_path / "m", s0, fewer, s1) == 2
    assert "shards differ in shard_selection (another --subjects, --limit or --n-samples)" in \
        _one_line_error(capsys, "merge")


@pytest.mark.parametrize("value", ["3/3", "a/b", "-1/2", "1/0", "1/", "1 /3", "0/3/1", ""])
def test_bad_shard_values_exit_2_naming_the_flag(tiny_model_dir, tmp_path, capsys, no_model_load, value):
    assert _mmlu(tiny_model_dir, tmp_path / "o", f"--shard={value}") == 2
    assert "--shard" in _one_line_error(capsys, "mmlu")
    assert not (tmp_path / "o").exists()
    assert main(["humaneval", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "h"),
                 f"--shard={value}"]) == 2
    assert "--shard" in _one_line_error(capsys, "humaneval")


def test_a_negative_shard_as_its_own_word_is_an_argparse_error(tiny_model_dir, tmp_path, capsys, no_model_load):
    with pytest.raises(SystemExit) as exc:                  # argparse takes "-1/2" for an option
        _mmlu(tiny_model_dir, tmp_path / "o", "--shard", "-1/2")
    assert exc.value.code == 2 and "argument --shard: expected one argument" in capsys.readouterr().err


def test_an_empty_shard_is_refused(tiny_model_dir, tmp_path, capsys, no_model_load):
    assert _mmlu(tiny_model_dir, tmp_path / "o", "--subjects", "philosophy", "--limit", "1", "--shard", "1/2") == 2
    assert "makes only 1 work unit(s), so shard 1 would be empty; use at most 1 shards" in \
        _one_line_error(capsys, "mmlu")


def test_a_shard_resumes_only_as_itself(mmlu_runs, tiny_model_dir, capsys, no_model_load):
    s1 = mmlu_runs["s1"]
    before = _tree(s1)
    assert _mmlu(tiny_model_dir, s1, "--shard", "1/3") == 0             # the same shard: nothing to run
    assert "already done" in capsys.readouterr().err
    assert _mmlu(tiny_model_dir, s1, "--shard", "2/3") == 2
    assert "the shard (--shard) differs (shard '1/3' stored, '2/3' now)" in _one_line_error(capsys, "mmlu")
    assert _mmlu(tiny_model_dir, s1) == 2
    assert "the shard (--shard) differs (shard '1/3' stored, '<missing>' now)" in _one_line_error(capsys, "mmlu")
    assert _mmlu(tiny_model_dir, s1, "--shard", "1/3", "--limit", "4") == 2
    assert "the sharded selection (--subjects, --limit, --n-samples) differs" in _one_line_error(capsys, "mmlu")
    assert _mmlu(tiny_model_dir, mmlu_runs["single"], "--shard", "1/3") == 2   # a whole run resumed as a shard
    assert "the shard (--shard) differs" in _one_line_error(capsys, "mmlu")
    assert _tree(s1) == before


def test_default_run_dir_names_the_shard(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["mmlu", "--no-progress", "--model", str(tiny_model_dir), "--data-dir", str(FIXTURE),
                 "--subjects", "philosophy,nutrition", "--limit", "1", "--shard", "0/2"]) == 0
    run = tmp_path / "runs" / f"mmlu-{tiny_model_dir.name}-shard-0-of-2"
    assert _manifest(run)["shard"]["units"] in (["philosophy"], ["nutrition"])


def test_a_suite_refuses_shard(tmp_path, capsys):
    suite = tmp_path / "s.toml"
    suite.write_text('output_dir = "runs"\n[[tasks]]\nname = "mmlu"\nshard = "0/3"\n[[models]]\nname = "m"\n')
    assert main(["suite", str(suite)]) == 2
    assert "shard cannot be set in a suite" in _one_line_error(capsys, "suite")


def test_humaneval_shards_with_several_samples_merge_into_the_single_run(tiny_model_dir, tmp_path, capsys):
    common = ["humaneval", "--no-progress", "--model", str(tiny_model_dir), "--dtype", "float32", "--cache-mode",
              "fp32", "--limit", "4", "--n-samples", "2", "--temperature", "0.9", "--max-new-tokens", "8",
              "--workers", "2"]
    single = tmp_path / "single"
    assert main([*common, "--output-dir", str(single)]) == 0
    shards = [tmp_path / f"s{k}" for k in range(3)]
    for k, shard in enumerate(shards):
        assert main([*common, "--shard", f"{k}/3", "--output-dir", str(shard)]) == 0
    for shard in shards:                                   # all samples of a problem in one shard
        rows = pd.read_parquet(shard / "samples.parquet")
        assert (rows.groupby("task_id").size() == 2).all()
        assert sorted(rows.task_id.unique()) == sorted(_manifest(shard)["shard"]["units"])
    out = tmp_path / "merged"
    assert _merge(out, *shards) == 0
    _assert_same_rows(out, single, HE_KEYS)
    _assert_same_summary(out, single)
    assert _manifest(out)["identity"] == _manifest(single)["identity"]
    capsys.readouterr()
    assert main([*common, "--output-dir", str(out)]) == 0
    assert "8 of 8 samples already done" in capsys.readouterr().err
