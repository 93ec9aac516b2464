"""Cache-mode sweeps: one model load, OUTPUT_DIR/<mode>/ run directories that equal standalone
runs of each mode, a comparison table at the end, resumable, and bad lists refused up front."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import evalrun.run.pipeline as pipeline
from evalrun.commands.cli import main
from evalrun.results import read_manifest, read_samples

DATA = Path(__file__).parent / "data" / "mmlu"


def _mmlu(model: Path, out: Path, modes: str, *extra: str) -> int:
    return main(["mmlu", "--model", str(model), "--data-dir", str(DATA), "--dtype", "float32",
                 "--cache-mode", modes, "--output-dir", str(out), "--no-progress", *extra])


def test_sweep_loads_once_and_each_mode_equals_its_standalone_run(tiny_kv32_dir, tmp_path, capsys, monkeypatch):
    loads = []
    real = pipeline.load_model
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    assert _mmlu(tiny_kv32_dir, tmp_path / "sweep", "fp32,q8,q4") == 0
    assert len(loads) == 1
    out = capsys.readouterr().out
    assert "cache-mode sweep: fp32, q8, q4 against fp32" in out
    assert "exact McNemar" in out and re.search(r"\noverall\s+q4\s+40\s", out)
    for mode in ("fp32", "q8", "q4"):
        run = tmp_path / "sweep" / mode
        assert read_manifest(run)["cache_mode"] == mode and read_manifest(run)["status"] == "finalized"
    # one pipeline: the q4 run of the sweep is the run `--cache-mode q4` alone makes
    assert _mmlu(tiny_kv32_dir, tmp_path / "alone", "q4") == 0
    swept, alone = read_samples(tmp_path / "sweep" / "q4"), read_samples(tmp_path / "alone")
    assert swept["prediction"].tolist() == alone["prediction"].tolist()
    assert [list(x) for x in swept["choice_logprobs"]] == [list(x) for x in alone["choice_logprobs"]]
    # a rerun resumes every mode with nothing to do, loads nothing, and prints the table again
    loads.clear()
    capsys.readouterr()
    assert _mmlu(tiny_kv32_dir, tmp_path / "sweep", "fp32,q8,q4") == 0
    captured = capsys.readouterr()
    assert loads == [] and captured.err.count("already done") == 3 and "cache-mode sweep" in captured.out


def test_sweep_refuses_a_mismatched_mode_directory_before_computing(tiny_kv32_dir, tmp_path, capsys, monkeypatch):
    assert _mmlu(tiny_kv32_dir, tmp_path / "s" / "q8", "q8", "--subjects", "nutrition") == 0
    assert _mmlu(tiny_kv32_dir, tmp_path / "other", "fp32", "--num-fewshot", "1") == 0
    (tmp_path / "s" / "fp32").symlink_to(tmp_path / "other")               # holds a 1-shot run
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    assert _mmlu(tiny_kv32_dir, tmp_path / "s", "fp32,q8") == 2
    err = capsys.readouterr().err
    assert "num_fewshot differs" in err and err.count("\n") == 1


@pytest.mark.parametrize("modes, needle", [
    ("fp32,q9", "unknown cache mode 'q9'"),
    ("auto,q8", "'auto' cannot be one of them"),
    ("q8,q8", "named twice"),
])
def test_bad_mode_lists_exit_2(tmp_path, capsys, modes, needle):
    with pytest.raises(SystemExit) as exc:
        main(["mmlu", "--cache-mode", modes, "--output-dir", str(tmp_path)])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_humaneval_sweep_shares_the_pipeline(tiny_kv32_dir, tmp_path, capsys):
    argv = ["humaneval", "--model", str(tiny_kv32_dir), "--dtype", "float32", "--limit", "3", "--max-new-tokens", "8",
            "--n-samples", "2", "--temperature", "0.8", "--cache-mode", "fp32,q8", "--output-dir", str(tmp_path),
            "--no-progress", "--export-samples", str(tmp_path / "samples.jsonl")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "humaneval: pass@1 per problem" in out and "paired bootstrap over problems" in out
    for mode in ("fp32", "q8"):
        rows = read_samples(tmp_path / mode)
        assert len(rows) == 6 and read_manifest(tmp_path / mode)["cache_mode"] == mode
        assert len((tmp_path / f"samples.{mode}.jsonl").read_text().splitlines()) == 6    # one export per mode


def test_sweep_table_covers_the_current_selection_and_windows_apply_to_quantized_modes(tiny_kv32_dir, tmp_path,
                                                                                        capsys):
    window = ["--cache-window", "32", "--page-size", "32"]
    assert _mmlu(tiny_kv32_dir, tmp_path, "fp32,q8", "--subjects", "nutrition,philosophy", "--limit", "4",
                 *window) == 0
    assert read_manifest(tmp_path / "q8")["cache_window"] == 32
    assert "cache_window" not in read_manifest(tmp_path / "fp32")["identity"]
    capsys.readouterr()
    assert _mmlu(tiny_kv32_dir, tmp_path, "fp32,q8", "--subjects", "nutrition", "--limit", "2", *window) == 0
    out = capsys.readouterr().out
    assert "2 shared rows" in out and "left out" not in out
