"""`--ray` flags refused in one line (exit 2) before any model loads or run directory is made: Ray
not installed (with the install command), a Ray flag without --ray, --ray without --replicas, bad
values, --execute-on replica without --ray, --score-samples with --ray. None of these needs Ray."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evalrun.engine import Model
from evalrun.commands.cli import main

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(Model, "load", classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))


def _error(capsys: pytest.CaptureFixture, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"evalrun {command}: error: "), err
    return err


def _mmlu(model: Path, out: Path, *extra: str) -> int:
    return main(["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(FIXTURE), "--output-dir", str(out),
                 *extra])


def test_ray_without_ray_installed_says_how_to_install_it(tiny_model_dir, tmp_path, capsys, no_model_load,
                                                          monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)                 # `import ray` raises ImportError
    assert _mmlu(tiny_model_dir, tmp_path / "o", "--ray", "--replicas", "2") == 2
    assert "--ray needs Ray, an optional extra: pip install 'evalrun[ray]'" in _error(capsys, "mmlu")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --ray"),
    (["--cpus-per-replica", "2"], "--cpus-per-replica needs --ray"),
    (["--ray"], "--ray needs --replicas N"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--ray", "--replicas", "2", "--cpus-per-replica", "0"], "--cpus-per-replica > 0"),
    (["--ray", "--replicas", "2", "--gpus-per-replica", "-1"], "--gpus-per-replica must be >= 0"),
    (["--ray", "--replicas", "2", "--ray-timeout", "0"], "--ray-timeout must be > 0"),
    (["--ray", "--replicas", "2", "--ray-batch-rows", "0"], "--ray-batch-rows >= 1"),
])
def test_bad_ray_flags_exit_2_before_anything_loads(tiny_model_dir, tmp_path, capsys, no_model_load, monkeypatch,
                                                    argv, needle):
    monkeypatch.setitem(sys.modules, "ray", None)                 # the checks come before Ray is needed
    assert _mmlu(tiny_model_dir, tmp_path / "o", *argv) == 2
    assert needle in _error(capsys, "mmlu")
    assert not (tmp_path / "o").exists()


def test_humaneval_execute_on_replica_needs_ray_and_score_samples_takes_none(tiny_model_dir, tmp_path, capsys,
                                                                            no_model_load):
    base = ["humaneval", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "h")]
    assert main([*base, "--execute-on", "replica"]) == 2
    assert "--execute-on replica needs --ray" in _error(capsys, "humaneval")
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"task_id": "HumanEval/0", "completion": "    return 1\\n"}\n')
    assert main(["humaneval", "--score-samples", str(samples), "--output-dir", str(tmp_path / "h"), "--ray",
                 "--replicas", "2"]) == 2
    assert "takes no --shard or --ray" in _error(capsys, "humaneval")
    assert not (tmp_path / "h").exists()


def test_a_suite_passes_its_ray_flags_to_every_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    suite = tmp_path / "s.toml"
    suite.write_text(f'output_dir = "{tmp_path / "runs"}"\n[[tasks]]\nname = "mmlu"\ndata_dir = "{FIXTURE}"\n'
                     '[[models]]\nname = "m"\n')
    assert main(["suite", str(suite), "--ray", "--replicas", "2"]) == 2
    assert "--ray needs Ray, an optional extra" in _error(capsys, "suite")
