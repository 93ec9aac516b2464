"""`evalrun mmlu` as a user meets it: auto settings, checks before loading, resume and
extension of a run, the manifest's schema, readable samples (`evalrun show`), category
groups and lm-eval's flag spellings. Runs on the MMLU fixture in tests/data/mmlu."""
from __future__ import annotations

import hashlib
import json
import re
import typing
from pathlib import Path

import pandas as pd
import pytest

from evalrun.engine import Model
from evalrun.commands.cli import build_parser, main
from evalrun.results.schema import Manifest, Resume, Throughput
from evalrun.tasks.mmlu import build_prompt
from evalrun.tasks.mmlu_data import load_mmlu

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
SUBJECTS = 5                                  # in the fixture
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def _mmlu(model: Path, out: Path, *extra: str) -> int:
    return main(["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(FIXTURE),
                 "--output-dir", str(out), *extra])


def _tree(run_dir: Path) -> dict[str, str]:
    """Every file of a run directory and its content hash."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _cpu_has_native_bf16() -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return " avx512_bf16" in text or " amx_bf16" in text


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if any model is loaded."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: refuse()))


def test_default_settings_follow_the_cpu_and_are_recorded(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    # bf16 only on a CPU with native bf16 whose measured bf16 linears beat float32's (the probe's figures)
    probe = manifest["engine_choices"]["dtype"].get("probe")
    assert (probe is not None) == _cpu_has_native_bf16()
    expected = "bfloat16" if probe is not None and probe["ratio"] < probe["margin"] else "float32"
    assert manifest["identity"]["dtype"] == manifest["dtype"] == expected
    assert manifest["identity"]["cache_mode"] == {"bfloat16": "bf16", "float32": "fp32"}[expected]
    assert manifest["identity"]["device"] == "cpu"
    assert "auto" not in json.dumps(manifest["identity"])
    assert manifest["engine_choices"]["dtype"]["requested"] == "auto"
    err = capsys.readouterr().err
    assert f"dtype {expected} (auto: " in err and "device cpu (auto: " in err


@pytest.mark.parametrize("argv,needle", [
    (["--device", "cuda"], "no CUDA device"),
    (["--device", "tpu"], "--device must be"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--num-fewshot", "9"], "--num-fewshot must be between 0 and 5"),
    (["--subjects", "astrology"], "unknown subject(s) astrology"),
    (["--cache-tokens", "8"], "must be at least --page-size"),
    (["--flush-rows", "0"], "--flush-rows must be >= 1"),
])
def test_bad_arguments_give_one_line_before_any_model_loads(tiny_model_dir, tmp_path, capsys, no_model_load,
                                                            argv, needle):
    if argv[:2] == ["--device", "cuda"]:
        import torch
        if torch.cuda.is_available():
            pytest.skip("tests the no-CUDA message")
    assert _mmlu(tiny_model_dir, tmp_path / "o", *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("evalrun mmlu: error: ") and needle in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content,needle", [(b"", "not a readable parquet file"),
                                            (b"PAR1 this is not parquet", "not a readable parquet file")])
def test_unreadable_data_file_is_named(tiny_model_dir, tmp_path, capsys, no_model_load, content, needle):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dev.parquet").write_bytes((FIXTURE / "dev.parquet").read_bytes())
    (data / "test.parquet").write_bytes(content)
    rc = main(["mmlu", "--model", str(tiny_model_dir), "--data-dir", str(data), "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{data / 'test.parquet'}: {needle}" in err


def test_run_dir_problems_are_found_before_loading(tiny_model_dir, tmp_path, capsys, no_model_load):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    assert _mmlu(tiny_model_dir, junk, "--limit", "1") == 2
    assert "not empty and has no manifest.json" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{ not json")
    assert _mmlu(tiny_model_dir, broken, "--limit", "1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{broken / 'manifest.json'} is not a readable run manifest" in err


def test_noop_resume_changes_nothing(tiny_model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0
    before = _tree(out)
    capsys.readouterr()
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: pytest.fail("loaded a model for nothing")))
    assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0
    captured = capsys.readouterr()
    assert f"{2 * SUBJECTS} of {2 * SUBJECTS} questions already done" in captured.err
    assert "overall" in captured.out                       # the stored results are still shown
    assert _tree(out) == before                            # manifest.json byte-identical, nothing else touched
    assert _mmlu(tiny_model_dir, out, "--limit", "1", "--subjects", "philosophy") == 0   # narrower: nothing to do
    assert "1 of 1 questions already done" in capsys.readouterr().err
    assert _tree(out) == before


def test_extending_the_selection_computes_only_the_new_questions(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0
    first = json.loads((out / "manifest.json").read_text())
    old = pd.read_parquet(out / "samples.parquet")
    assert _mmlu(tiny_model_dir, out, "--limit", "3") == 0
    assert f"{2 * SUBJECTS} of {3 * SUBJECTS} questions already done, {SUBJECTS} to run" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["this_session"]["rows"] == SUBJECTS and summary["n"] == 3 * SUBJECTS
    new = pd.read_parquet(out / "samples.parquet")
    kept = new.merge(old[["subject", "doc_id"]], on=["subject", "doc_id"])
    pd.testing.assert_frame_equal(kept.reset_index(drop=True), old.reset_index(drop=True))   # old rows untouched
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["throughput"] == first["throughput"] and manifest["end_time"] == first["end_time"]
    (resume,) = manifest["resumes"]
    assert resume["throughput"]["prompt_tokens"] > 0 and TIME.match(resume["end_time"])
    # a narrower selection with one new question: only it runs, and the summary covers the selection
    assert _mmlu(tiny_model_dir, out, "--subjects", "philosophy", "--limit", "4") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["this_session"]["rows"] == 1 and summary["n"] == 4
    assert len(pd.read_parquet(out / "samples.parquet")) == 3 * SUBJECTS + 1           # the rest stay stored


def test_a_real_difference_is_named_in_words(tiny_model_dir, tiny_model_factory, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    before = _tree(out)
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: pytest.fail("loaded a model")))
    capsys.readouterr()
    assert _mmlu(tiny_model_dir, out, "--limit", "1", "--num-fewshot", "3", "--dtype", "bfloat16",
                 "--cache-mode", "bf16") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_fewshot differs (stored 5, now 3)" in err
    if not _cpu_has_native_bf16():
        assert "dtype differs (stored 'float32', now 'bfloat16')" in err
    other = tiny_model_factory("llama", seed=123, tokenizer_from=tiny_model_dir)
    assert _mmlu(other, out, "--limit", "1") == 2
    assert "the model (its config or weights) differs" in capsys.readouterr().err
    assert _tree(out) == before


def test_resume_with_auto_keeps_the_stored_settings(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1", "--dtype", "bfloat16", "--cache-mode", "bf16") == 0
    assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0                  # auto: as stored, not the host's pick
    err = capsys.readouterr().err
    assert "dtype bfloat16 (auto: as stored by the run in" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["dtype"] == "bfloat16" and len(manifest["resumes"]) == 1


def _keys(typed_dict: type) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def test_manifest_matches_its_schema(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest) <= _keys(Manifest), set(manifest) - _keys(Manifest)
    assert set(manifest["throughput"]) == _keys(Throughput)
    for resume in manifest["resumes"]:
        assert set(resume) <= _keys(Resume)
    stamps = [manifest[k] for k in ("start_time", "end_time", "finalized_at")]
    stamps += [r[k] for r in manifest["resumes"] for k in ("at", "end_time")]
    assert all(TIME.match(s) for s in stamps), stamps
    assert set(manifest["kernels"]) == {"backend", "linear", "lm_head", "kv_write", "decode_attention",   # the plan
                                        "prefill_attention", "rope_write", "norm_act", "norm_in", "head_norm",
                                        "gate_up_silu",
                                        "decode_step", "cuda_graphs", "stream"}


def test_rows_are_readable_and_show_prints_their_prompts(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0
    rows = pd.read_parquet(out / "samples.parquet")
    data = load_mmlu(FIXTURE)
    for row in rows.itertuples():
        assert row.question == data.test[row.subject][row.doc_id].question
    prompts = pd.read_parquet(out / "prompts")
    assert prompts.prompt_hash.is_unique and set(prompts.prompt_hash) == set(rows.prompt_hash)
    capsys.readouterr()
    assert main(["show", str(out), "--subject", "philosophy", "-n", "5"]) == 0
    text = capsys.readouterr().out
    doc = data.test["philosophy"][1]
    prompt = build_prompt("philosophy", data.dev["philosophy"], doc)
    assert "\n".join("  | " + line for line in prompt.split("\n")) in text
    assert "philosophy #0" in text and "philosophy #1" in text and "abstract_algebra" not in text
    assert main(["show", str(out), "--wrong", "-n", "100", "--no-prompt"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("(wrong)") == int((~rows.correct).sum()) and "(correct)" not in shown
    assert "| The following" not in shown


def test_show_refuses_what_is_not_a_run(tmp_path, capsys):
    assert main(["show", str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    assert main(["show", str(tmp_path)]) == 2
    assert "holds no run" in capsys.readouterr().err


def test_summary_has_lm_eval_category_groups(tiny_model_dir, tmp_path, capsys):
    from evalrun.tasks.mmlu_groups import SUBJECT_GROUP
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "3") == 0
    rows = pd.read_parquet(out / "samples.parquet")
    groups = json.loads((out / "summary.json").read_text())["groups"]
    for group, got in groups.items():
        mine = rows[rows.subject.map(SUBJECT_GROUP) == group]
        assert got["n"] == len(mine) and got["accuracy"] == pytest.approx(mine.correct.mean())
    assert groups["stem"]["n"] == 6 and groups["humanities"]["n"] == 3      # two STEM subjects in the fixture
    per_subject = pd.read_parquet(out / "summary.parquet")
    assert dict(zip(per_subject.subject, per_subject.group)) == {s: SUBJECT_GROUP[s] for s in per_subject.subject}
    printed = capsys.readouterr().out
    assert re.search(r"^social sciences\s+3\s", printed, re.M)


def test_lm_eval_flag_spellings_mean_the_same():
    parser = build_parser()
    ours = parser.parse_args(["mmlu", "--num-fewshot", "0", "--output-dir", "x", "--max-batch-size", "4",
                              "--device", "cpu"])
    theirs = parser.parse_args(["mmlu", "--num_fewshot", "0", "--output_path", "x", "--batch_size", "4",
                                "--device", "cpu"])
    assert vars(ours) == vars(theirs)
    assert parser.parse_args(["mmlu", "--batch_size", "auto"]).max_batch_size is None
    assert parser.parse_args(["humaneval", "--output_path", "y"]).output_dir == "y"


def test_help_states_every_default():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert "default" in (action.help or ""), f"evalrun {name} {action.option_strings[0]}"


def test_humaneval_run_shows_prompts_and_matches_the_schema(tiny_model_dir, tmp_path, capsys):
    from evalrun.tasks.humaneval_data import load_humaneval
    out = tmp_path / "he"
    assert main(["humaneval", "--no-progress", "--model", str(tiny_model_dir), "--limit", "2",
                 "--max-new-tokens", "4", "--workers", "1", "--output-dir", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest) <= _keys(Manifest), set(manifest) - _keys(Manifest)
    assert "sandbox" in manifest and manifest["identity"]["dtype"] != "auto"
    before = _tree(out)
    capsys.readouterr()
    assert main(["humaneval", "--no-progress", "--model", str(tiny_model_dir), "--limit", "2",
                 "--max-new-tokens", "4", "--output-dir", str(out)]) == 0
    assert "2 of 2 samples already done" in capsys.readouterr().err and _tree(out) == before
    assert main(["show", str(out), "--task-id", "HumanEval/1"]) == 0
    text = capsys.readouterr().out
    problem = load_humaneval().problems[1]
    assert "HumanEval/1 sample 0" in text and "HumanEval/0" not in text
    assert "\n".join("  | " + line for line in problem.prompt.rstrip("\n").split("\n")) in text


# --- edges found in review --------------------------------------------------------------------------
def test_a_run_killed_after_its_last_flush_is_finalized_without_a_model(tiny_model_dir, tmp_path, capsys,
                                                                       monkeypatch):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    for name in ("samples.parquet", "summary.json", "summary.parquet"):
        (out / name).unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: pytest.fail("loaded a model")))
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    assert f"{SUBJECTS} of {SUBJECTS} questions already done" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["status"] == "finalized"
    assert len(pd.read_parquet(out / "samples.parquet")) == SUBJECTS and (out / "summary.json").is_file()


def test_overwrite_still_refuses_a_folder_that_is_not_a_run(tiny_model_dir, tmp_path, capsys, no_model_load):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "important.txt").write_text("keep")
    assert _mmlu(tiny_model_dir, mine, "--limit", "1", "--overwrite") == 2
    assert "not empty and has no manifest.json" in capsys.readouterr().err
    assert (mine / "important.txt").read_text() == "keep"


def test_a_run_in_use_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    import fcntl
    import os
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    fd = os.open(out / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        capsys.readouterr()
        assert _mmlu(tiny_model_dir, out, "--limit", "2") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "in use by another evalrun process" in err
    finally:
        os.close(fd)


def test_a_subject_named_twice_counts_once(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "2", "--subjects", "nutrition,nutrition") == 0
    assert json.loads((out / "summary.json").read_text())["n"] == 2


def test_a_run_of_an_older_schema_is_refused_with_the_reason(tiny_model_dir, tmp_path, capsys, no_model_load):
    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"identity": {"task": "mmlu"}, "schema_version": 1,
                                                   "key_columns": ["subject", "doc_id"]}))
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 2
    assert "written by another evalrun version (run schema 1" in capsys.readouterr().err


def test_show_on_a_damaged_run_gives_one_line(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "key_columns": ["task_id"]}))
    capsys.readouterr()
    assert main(["show", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rows keyed by ['task_id'], but mmlu runs are keyed by" in err   # as compare says
    (out / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "key_columns"}))
    assert main(["show", str(out)]) == 2
    assert 'no "key_columns" list' in capsys.readouterr().err


def test_hub_failures_are_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch, no_model_load):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'cais/mmlu' on the Hub (OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert main(["mmlu", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not load cais/mmlu from the Hugging Face hub" in err and "--data-dir" in err
    assert main(["humaneval", "--hub", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "h")]) == 2
    assert "could not load openai_humaneval" in capsys.readouterr().err


def test_csv_layout_with_a_bom_and_blank_lines_reads_like_parquet(tmp_path):
    import csv
    data = load_mmlu(FIXTURE)
    for split, docs in (("dev", data.dev), ("test", data.test)):
        (tmp_path / split).mkdir()
        for subject, items in docs.items():
            with open(tmp_path / split / f"{subject}_{split}.csv", "w", newline="", encoding="utf-8-sig") as f:
                writer = csv.writer(f)
                for d in items:
                    writer.writerow([d.question, *d.choices, "ABCD"[d.answer]])
                f.write("\r\n")                                   # a trailing blank line
    csv_data = load_mmlu(tmp_path)
    assert csv_data.test == data.test and csv_data.dev == data.dev


def test_score_samples_rerun_changes_nothing(tmp_path, capsys):
    from evalrun.tasks.humaneval_data import load_humaneval
    problems = load_humaneval().problems[:2]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": p.task_id, "completion": p.canonical_solution}) + "\n"
                               for p in problems))
    out = tmp_path / "scored"
    args = ["humaneval", "--no-progress", "--limit", "2", "--score-samples", str(samples), "--output-dir", str(out)]
    assert main(args) == 0
    before = _tree(out)
    capsys.readouterr()
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "2 of 2 samples already scored" in captured.err and "pass@1" in captured.out
    assert _tree(out) == before
