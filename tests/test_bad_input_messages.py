"""Faults met while running give one line naming the file and the problem, exit 2, and leave the
run directory usable (issue 13, item 8): a busy run directory, a full disk, a read-only output
directory (new, or finished and extended), a manifest that is JSON but not an object, a part
without the key columns, truncated safetensors (large and tiny), a garbage tokenizer.json and a
zero-row MMLU test file. Root ignores file modes, so read-only and full file systems are real
tmpfs mounts (skipped where this process cannot mount)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evalrun.commands.cli import main
from evalrun.results import read_samples

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"


def _mmlu(model: Path, out: Path, *extra: str, data: Path = FIXTURE) -> int:
    return main(["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(data), "--output-dir", str(out),
                 "--subjects", "philosophy", *extra])


def _one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("evalrun mmlu: error: "), err
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs to mount a tmpfs (root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True, capture_output=True)


def test_busy_run_dir(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    fd = os.open(out / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert _mmlu(tiny_model_dir, out, "--limit", "2") == 2
        _one_error_line(capsys, str(out), "in use by another evalrun process")
    finally:
        os.close(fd)
    assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0                  # usable once free


def test_full_disk_then_resume(tiny_model_dir, tmp_path, capsys):
    with _tmpfs(tmp_path / "small", "28k") as mnt:
        out = mnt / "run"
        assert _mmlu(tiny_model_dir, out, "--limit", "8", "--flush-rows", "2") == 2
        _one_error_line(capsys, str(out), "No space left on device", "run the same command again")
        assert not list((out / "samples").glob(".*.tmp"))                   # no temp file left behind
        _remount(mnt, "size=16m")
        assert _mmlu(tiny_model_dir, out, "--limit", "8", "--flush-rows", "2") == 0
        assert sorted(read_samples(out)["doc_id"]) == list(range(8))


def test_read_only_output_dir_new_and_finished(tiny_model_dir, tmp_path, capsys):
    with _tmpfs(tmp_path / "ro", "16m") as mnt:
        assert _mmlu(tiny_model_dir, mnt / "done", "--limit", "1") == 0
        _remount(mnt, "ro")
        assert _mmlu(tiny_model_dir, mnt / "new", "--limit", "1") == 2
        _one_error_line(capsys, str(mnt / "new"), "Read-only file system")
        assert _mmlu(tiny_model_dir, mnt / "done", "--limit", "1") == 0     # nothing to run: reads only
        capsys.readouterr()
        assert _mmlu(tiny_model_dir, mnt / "done", "--limit", "2") == 2     # more to run: must write
        _one_error_line(capsys, str(mnt / "done"), "Read-only file system")
        _remount(mnt, "rw")
        assert _mmlu(tiny_model_dir, mnt / "done", "--limit", "2") == 0


def test_manifest_that_is_json_but_not_an_object(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_text("[1, 2]")
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 2
    _one_error_line(capsys, str(out / "manifest.json"))


def test_part_without_key_columns_does_not_block_the_run_dir(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_model_dir, out, "--limit", "1") == 0
    stray = out / "samples" / "part-000099-abcdef12.parquet"
    pq.write_table(pa.table({"x": [1]}), stray)
    with pytest.warns(UserWarning, match=f"torn or damaged sample part {stray.name}"):
        assert _mmlu(tiny_model_dir, out, "--limit", "2") == 0
    assert "Traceback" not in capsys.readouterr().err
    assert not stray.exists() and (out / "samples" / f"_quarantine-{stray.name}").exists()
    assert sorted(read_samples(out)["doc_id"]) == [0, 1]


@pytest.mark.parametrize("keep", ["half", "five bytes"])
def test_truncated_safetensors(tiny_model_dir, tmp_path, capsys, keep):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if keep == "half" else data[:5])
    assert _mmlu(model, tmp_path / "run", "--limit", "1") == 2
    _one_error_line(capsys, str(weights), "truncated or corrupt")


@pytest.mark.parametrize("content", ["garbage{", '{"a": 1}'])
def test_garbage_tokenizer_json(tiny_model_dir, tmp_path, capsys, content):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text(content)
    assert _mmlu(model, tmp_path / "run", "--limit", "1") == 2
    _one_error_line(capsys, str(model / "tokenizer.json"), "not a readable Hugging Face tokenizer file")


def test_zero_row_mmlu_test_file(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "mmlu"
    data.mkdir()
    shutil.copy(FIXTURE / "dev.parquet", data / "dev.parquet")
    pq.write_table(pq.read_table(FIXTURE / "test.parquet").slice(0, 0), data / "test.parquet")
    assert main(["mmlu", "--no-progress", "--model", str(tiny_model_dir), "--data-dir", str(data),
                 "--output-dir", str(tmp_path / "run")]) == 2
    _one_error_line(capsys, str(data / "test.parquet"), "no questions")


def test_cli_warnings_are_one_line_and_the_callers_format_comes_back():
    import warnings
    from evalrun.commands.cli import _one_line_warnings
    before = warnings.formatwarning
    with _one_line_warnings("mmlu"):
        assert warnings.formatwarning("part x moved aside", UserWarning, "/a/b.py", 7) == \
            "evalrun mmlu: warning: part x moved aside\n"
    assert warnings.formatwarning is before
