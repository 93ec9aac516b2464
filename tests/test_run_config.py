"""argv becomes a frozen, checked RunConfig once, in the CLI; sweeps and suites derive each run's config
with dataclasses.replace; below evalrun/commands nothing takes an argparse Namespace."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from evalrun.commands.parser import build_parser, run_config
from evalrun.commands.task import one_run
from evalrun.errors import BadInput
from evalrun.run.config import RayRequest, RunConfig
from evalrun.run.engine_config import EngineRequest
from evalrun.tasks.humaneval_spec import HumanEvalOptions
from evalrun.tasks.mmlu import MMLUOptions

ROOT = Path(__file__).resolve().parents[1]


def _config(*argv: str) -> RunConfig:
    return run_config(build_parser().parse_args(argv), argv)


def test_argv_becomes_records():
    cfg = _config("mmlu", "--subjects", "anatomy,nutrition", "--limit", "3", "--cache-mode", "q4", "--cache-window",
                  "64", "--no-progress", "--seed", "7", "--output-dir", "out")
    assert cfg.options == MMLUOptions(subjects="anatomy,nutrition", limit=3)
    assert cfg.options.subject_list == ["anatomy", "nutrition"]
    assert cfg.engine == EngineRequest(cache_mode="q4", cache_window=64)
    assert (cfg.cache_modes, cfg.seed, cfg.output_dir, cfg.progress, cfg.ray) == (("q4",), 7, "out", False,
                                                                                RayRequest())
    assert cfg.argv[:3] == ("mmlu", "--subjects", "anatomy,nutrition")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1                                      # type: ignore[misc]


def test_task_options_and_run_settings_are_checked_when_made():
    with pytest.raises(BadInput, match="--flush-rows must be >= 1"):
        _config("mmlu", "--flush-rows", "0")
    with pytest.raises(ValueError, match="--num-fewshot must be between 0 and 5, got 6"):
        _config("mmlu", "--num-fewshot", "6")
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        _config("humaneval", "--workers", "0")
    with pytest.raises(ValueError, match="--n-samples must be >= 1"):
        _config("humaneval", "--n-samples", "0")


def test_a_sweep_derives_each_mode_by_replace():
    cfg = _config("humaneval", "--cache-mode", "fp32,q4", "--cache-window", "32", "--export-samples", "s.jsonl")
    assert cfg.sweep and cfg.engine.cache_mode == "fp32"
    fp32, q4 = (one_run(cfg, mode, Path("root") / mode, mode) for mode in cfg.cache_modes)
    assert (fp32.engine.cache_mode, fp32.engine.cache_window, fp32.output_dir) == ("fp32", None, "root/fp32")
    assert (q4.engine.cache_mode, q4.engine.cache_window, q4.cache_modes) == ("q4", 32, ("q4",))
    assert (fp32.options.export_samples, q4.options.export_samples) == ("s.fp32.jsonl", "s.q4.jsonl")
    assert dataclasses.replace(q4.options, export_samples=None) == dataclasses.replace(cfg.options,
                                                                                       export_samples=None)
    assert isinstance(q4.options, HumanEvalOptions) and not q4.sweep


def test_ray_flags_are_a_record():
    cfg = _config("mmlu", "--ray", "--replicas", "2", "--ray-timeout", "5")
    assert cfg.ray == RayRequest(True, 2, timeout=5.0)
    assert _config("mmlu", "--replicas", "2").ray.given() == ["--replicas"]


def test_no_namespace_below_the_cli():
    """Outside evalrun/commands no function takes or reads an argparse Namespace."""
    found = []
    for path in sorted((ROOT / "evalrun").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "commands":
            continue
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None and "Namespace" in ast.unparse(node.annotation):
                found.append(f"{rel}:{node.lineno} {node.arg}: {ast.unparse(node.annotation)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
                found.append(f"{rel}:{node.lineno} getattr(args, ...)")
    assert found == []
