"""What `pip wheel .` ships and what it does beside current transformers.

The wheel holds one top-level package, `evalrun` (engine, tasks, kernels and results live under it),
so it can share an environment with Hugging Face's `kernels` package, which current transformers
requires. Installed into a fresh venv (system site-packages visible, for torch and transformers),
transformers and evalrun import together in one process, from the checkout and from elsewhere, and
`evalrun` runs from a directory outside the checkout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_MMLU = ROOT.parent / "shared" / "data" / "mmlu"      # the full data set beside the checkout
MMLU_FIXTURE = ROOT / "tests" / "data" / "mmlu"
TOGETHER = """
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1))
import evalrun.commands.cli, evalrun.engine, kernels
print(evalrun.__file__)
print(kernels.__file__)
"""


def _tracked_tree(dst: Path) -> Path:
    """A copy of the files git tracks (what a clean clone holds), so the build sees no local leftovers."""
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        pytest.skip("git is needed to list the checkout's files")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = _tracked_tree(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    # no build isolation: no network in tests; .ci/run installs setuptools and wheel
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    (path,) = out.glob("evalrun-*.whl")
    return path


def test_the_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"evalrun"}
    for sub in ("engine", "tasks", "kernels", "results", "tasks/sandbox"):
        assert f"evalrun/{sub}/__init__.py" in names
    assert {"evalrun/kernels/cpu/csrc/gemm.c", "evalrun/kernels/cpu/csrc/pool.h"} <= set(names)   # compiled on first use
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
    if top_level is not None:
        assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["evalrun"]


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "USE_HUB_KERNELS")}
    return env


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_transformers_and_evalrun_in_one_process(venv, where, tmp_path):
    cwd = ROOT if where == "checkout" else tmp_path
    out = subprocess.run([str(venv / "bin" / "python"), "-c", TOGETHER], cwd=cwd, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    evalrun_file, kernels_file = (Path(line) for line in out.stdout.split())
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # `python -c` puts the working directory first on sys.path: the checkout's own evalrun there
    assert evalrun_file.is_relative_to(ROOT if where == "checkout" else site), evalrun_file
    assert not kernels_file.is_relative_to(ROOT)            # Hugging Face's package, never a project folder
    assert kernels_file.parent.name == "kernels"


def test_the_installed_command_runs_outside_the_checkout(venv, tmp_path, smollm2_dir):
    evalrun = venv / "bin" / "evalrun"
    version = subprocess.run([str(evalrun), "--version"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.strip().startswith("evalrun "), version.stderr
    assert "git" not in version.stdout                       # an installed wheel is no checkout
    data = SHARED_MMLU if (SHARED_MMLU / "test.parquet").is_file() else MMLU_FIXTURE
    # one question: the point is the installed command and its kernels, not a run's length (all 57
    # subjects at --limit 1 took 80 s in float32 on an AVX2-only CPU)
    run = subprocess.run([str(evalrun), "mmlu", "--data-dir", str(data.resolve()), "--subjects", "abstract_algebra",
                          "--limit", "1", "--no-progress", "--output-dir", str(tmp_path / "run")], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "run" / "summary.json").is_file()


def test_version_names_the_commit_in_a_checkout():
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    out = subprocess.run([sys.executable, "-m", "evalrun", "--version"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("evalrun 0.") and f"(git {head[:12]}" in out.stdout, out.stdout
