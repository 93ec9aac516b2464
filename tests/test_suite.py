"""`evalrun suite FILE.toml`: end to end on tiny models and the MMLU fixture, SIGKILL and resume,
the gate against a baseline model or an earlier suite, and bad files refused before any work."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalrun.commands.cli import main
from evalrun.results import RunStore, read_manifest, read_samples

DATA = Path(__file__).parent / "data" / "mmlu"
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}


def _toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _suite_cmd(path: Path) -> list[str]:
    return [sys.executable, "-m", "evalrun", "suite", str(path), "--no-progress"]


def test_two_entry_suite_with_a_baseline_survives_sigkill(tmp_path, tiny_model_dir, tiny_model_factory):
    other = tiny_model_factory("llama", seed=5, tokenizer_from=tiny_model_dir)
    root = tmp_path / "nightly"
    suite = _toml(tmp_path / "suite.toml", f"""
output_dir = "{root}"
[defaults]
dtype = "float32"
flush_rows = 1

[[tasks]]
name = "mmlu"
data_dir = "{DATA}"

[[models]]
name = "base"
path = "{tiny_model_dir}"
cache_modes = ["fp32"]

[[models]]
name = "cand"
path = "{other}"
cache_modes = ["fp32"]
max_batch_size = 1            # one question at a time: a wide window to kill it mid-run

[baseline]
model = "base"
max_drop = 1.0
""")
    base_dir, cand_dir = root / "mmlu" / "base" / "fp32", root / "mmlu" / "cand" / "fp32"
    proc = subprocess.Popen(_suite_cmd(suite), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        parts = list((cand_dir / "samples").glob("part-*.parquet")) if cand_dir.is_dir() else []
        if parts:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode()
    assert read_manifest(base_dir)["status"] == "finalized", out
    base_before = read_manifest(base_dir)
    stored_before = len(read_samples(cand_dir))
    killed_mid_run = read_manifest(cand_dir)["status"] == "running"

    rerun = subprocess.run(_suite_cmd(suite), env=ENV, capture_output=True, text=True, timeout=600)
    assert rerun.returncode in (0, 1), rerun.stderr
    assert read_manifest(base_dir) == base_before                      # finished run: not touched, not redone
    assert "40 of 40 questions already done" in rerun.stderr
    cand = read_manifest(cand_dir)
    assert cand["status"] == "finalized" and len(read_samples(cand_dir)) == 40
    if killed_mid_run:
        assert len(cand["resumes"]) == 1 and 0 < stored_before < 40
        assert f"resuming {cand_dir}: {stored_before} of 40" in rerun.stderr
    for name in ("comparison.md", "comparison.csv", "comparison.json"):
        assert (root / name).is_file()
    table = json.loads((root / "comparison.json").read_text())[0]
    assert [h["label"] for h in table["runs"]] == ["base/fp32", "cand/fp32"] and table["baseline"] == "base/fp32"
    # the gate's verdict is regress's verdict on the same pair
    assert main(["regress", "--baseline", str(base_dir), "--candidate", str(cand_dir)]) == rerun.returncode
    assert "suite gate:" in rerun.stdout


def test_gate_against_an_earlier_suite_fails_on_a_significant_drop(tmp_path, tiny_model_dir, capsys):
    root, earlier = tmp_path / "tonight", tmp_path / "last-night"
    suite = _toml(tmp_path / "s.toml", f"""
output_dir = "{root}"
[[tasks]]
name = "mmlu"
data_dir = "{DATA}"
[[models]]
name = "m"
path = "{tiny_model_dir}"
cache_modes = ["fp32"]
dtype = "float32"
[baseline]
output_dir = "{earlier}"
""")
    assert main(["suite", str(suite), "--no-progress"]) == 0           # a first night: nothing to gate against
    out = capsys.readouterr().out
    assert "NOT GATED" in out and "in 0 gated runs; 1 of 1 NOT GATED" in out
    run = root / "mmlu" / "m" / "fp32"
    rows = read_samples(run).to_dict("records")
    assert sum(r["correct"] for r in rows) < 30
    m = read_manifest(run)
    with RunStore.open(earlier / "mmlu" / "m" / "fp32", {"task": "mmlu", "identity": m["identity"]},
                       m["key_columns"]) as store:                      # last night answered everything right
        for r in rows:
            store.add({**r, "correct": True})
        store.finalize()
    assert main(["suite", str(suite), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "suite gate: 1 of 1 gated runs regressed" in out


@pytest.mark.parametrize("body, needle", [
    ('output_dir = "x"\n[[models]]\nname = "m"\n', "needs at least one [[tasks]]"),
    ('output_dir = "x"\nfoo = 1\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\n', "unknown key(s) foo"),
    ('output_dir = "x"\n[[tasks]]\nname = "gsm8k"\n[[models]]\nname = "m"\n', "name must be one of mmlu, humaneval"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\noutput_dir = "y"\n[[models]]\nname = "m"\n',
     "output_dir cannot be set in a suite"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\nbogus_flag = 3\n[[models]]\nname = "m"\n',
     "(mmlu, m, auto): unrecognized arguments: --bogus-flag 3"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\ncache_modes = ["q9"]\n',
     "unknown cache mode 'q9'"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "a/b"\n', "must be letters, digits"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\n"cache-mode" = "q8"\n',
     "cache-mode cannot be set in a suite"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\noutput_d = "/tmp/elsewhere"\n',
     "unrecognized arguments: --output-d"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\nover = true\n',
     "unrecognized arguments: --over"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\ncache_modes = ["fp32,q4"]\n',
     "one mode per item"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\n[baseline]\nmodel = "zz"\n',
     "model 'zz' is not one of the [[models]]"),
    ('output_dir = "x"\n[[tasks]]\nname = "mmlu"\n[[models]]\nname = "m"\n[baseline]\nalpha = 2\nmodel = "m"\n',
     "needs a second [[models]]"),
    ('output_dir = [1\n', "is not valid TOML"),
])
def test_bad_suite_files_are_refused_before_any_work(tmp_path, capsys, monkeypatch, body, needle):
    import evalrun.run.pipeline as pipeline
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.chdir(tmp_path)
    suite = _toml(tmp_path / "bad.toml", body)
    assert main(["suite", str(suite)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


def test_a_missing_suite_file_is_named(tmp_path, capsys):
    assert main(["suite", str(tmp_path / "none.toml")]) == 2
    assert "suite file not found" in capsys.readouterr().err


def test_the_readme_example_is_a_valid_suite(tmp_path):
    from evalrun.commands.cli import build_parser
    from evalrun.commands.suite import _RaisingParser, load_suite
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    suite = load_suite(_toml(tmp_path / "example.toml", example))
    assert [(e.task, e.model, e.cache_mode) for e in suite.entries] == [
        ("mmlu", "ckpt-1201", "fp32"), ("mmlu", "ckpt-1201", "q4"),
        ("humaneval", "ckpt-1201", "fp32"), ("humaneval", "ckpt-1201", "q4")]
    assert suite.entries[1].run_dir == Path("runs/nightly/2026-12-01/mmlu/ckpt-1201/q4")
    assert suite.baseline is not None and suite.baseline.output_dir == Path("runs/nightly/2026-11-30")
    parser = build_parser(_RaisingParser)
    for entry in suite.entries:                             # every entry is a valid command line
        args = parser.parse_args(entry.argv)
        assert args.output_dir == str(entry.run_dir) and args.cache_modes == [entry.cache_mode]
    mmlu = parser.parse_args(suite.entries[0].argv)
    assert (mmlu.subjects, mmlu.limit, mmlu.cache_tokens) == ("abstract_algebra,anatomy,astronomy", 50, 65536)


def test_require_baseline_turns_a_missing_baseline_run_into_exit_2(tmp_path, tiny_model_dir, capsys):
    suite = _toml(tmp_path / "s.toml", f"""
output_dir = "{tmp_path / 'tonight'}"
[[tasks]]
name = "mmlu"
data_dir = "{DATA}"
subjects = ["nutrition"]
[[models]]
name = "m"
path = "{tiny_model_dir}"
cache_modes = ["fp32"]
dtype = "float32"
[baseline]
output_dir = "{tmp_path / 'last-nihgt'}"
require_baseline = true
""")
    assert main(["suite", str(suite), "--no-progress"]) == 2
    assert "no baseline run for" in capsys.readouterr().err
