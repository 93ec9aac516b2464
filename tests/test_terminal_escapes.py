"""Issue 43, classes 4 and 6 (reports): what a model, a dataset or a run directory holds reaches the
terminal only with its control characters escaped (`evalrun show`, `compare`, `regress`, error
lines); CSV cells cannot start a spreadsheet formula; `show` refuses a malformed manifest in one
line, as `compare` does."""
from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from evalrun.commands.cli import main
from evalrun.results import write_prompts
from evalrun.results.text import csv_safe, terminal_safe

from test_compare import write_run

# clear screen, a fake green "passed", an OSC window title (BEL-terminated), a C1 CSI, DEL
HOSTILE = "\x1b[2J\x1b[32mpassed\x1b[0m\x1b]0;pwned\x07\x9b31m\x7f"
RAW_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def assert_no_raw_control(text: str) -> None:
    found = sorted(set(RAW_CONTROL.findall(text)))
    assert not found, f"raw control characters {found!r} in:\n{text!r}"


def _mmlu_run(run_dir: Path, subject: str = "anatomy", **manifest: Any) -> Path:
    rows = [{"subject": subject, "doc_id": i, "correct": i % 2 == 0, "prediction": "A" + HOSTILE, "target": "A",
             "choice_logprobs": [-1.0, -2.0, -3.0, -4.0], "question": f"question {i} {HOSTILE}",
             "prompt_hash": f"h{i}"} for i in range(2)]
    write_run(run_dir, rows, model={"path": f"/models/tiny{HOSTILE}"}, cache_mode=f"fp32{HOSTILE}", **manifest)
    chat = {"messages": [{"role": f"system{HOSTILE}", "content": f"be brief {HOSTILE}"},
                         {"role": "user", "content": f"what? {HOSTILE}"}], "generation_prompt": True}
    write_prompts(run_dir, {"h0": f"plain prompt {HOSTILE}", "h1": f"chat prompt {HOSTILE}"}, {"h1": chat})
    return run_dir


def _humaneval_run(run_dir: Path) -> Path:
    rows = [{"task_id": f"HumanEval/0{HOSTILE}", "sample_idx": 0, "exec_status": f"failed{HOSTILE}",
             "stop_reason": "eos", "new_tokens": 3, "error": f"AssertionError: {HOSTILE}",
             "completion": f"    return 1  # {HOSTILE}\n", "response": f"```python\n{HOSTILE}\n```", "passed": False}]
    return write_run(run_dir, rows, task="humaneval")


# ------------------------------------------------------------------------------ the function

def test_terminal_safe_shows_every_control_character_and_keeps_the_rest():
    assert terminal_safe(HOSTILE) == "\\x1b[2J\\x1b[32mpassed\\x1b[0m\\x1b]0;pwned\\x07\\x9b31m\\x7f"
    assert terminal_safe("a\nb\tc\rd\x00") == "a\nb\tc\\x0dd\\x00"
    assert terminal_safe("a\nb", one_line=True) == "a\\x0ab"
    text = "caf\u00e9 \u65e5\u672c \U0001f600 \u00a0"
    assert terminal_safe(text) == text                              # letters, emoji, no-break space stay
    assert terminal_safe("\ud800") == "\\ud800"                  # a lone surrogate from JSON would not print
    assert terminal_safe(5) == "5"
    every = "".join(map(chr, range(0x2000)))
    once = terminal_safe(every)
    assert terminal_safe(once) == once and not RAW_CONTROL.search(once)
    assert once.count("\n") == 1 and once.count("\t") == 1


def test_csv_safe_quotes_formulas_and_leaves_numbers():
    for text in ["=1+1", "+1", "-2+3", "@SUM(A1)", "\tx", "-5"]:
        assert csv_safe(text) == "'" + text
    assert csv_safe("\rx") == "\\x0dx"                           # escaped first: no CR left to start a cell
    for number in [-2.5, 0, -3, np.float64(-0.25), np.int64(-7), True, None]:
        assert csv_safe(number) is number
    assert csv_safe("a=b") == "a=b" and csv_safe("x\x1b") == "x\\x1b"


# ------------------------------------------------------------------------------ class 4: escapes

def test_show_escapes_rows_prompts_chat_turns_and_errors(tmp_path, capsys):
    mmlu = _mmlu_run(tmp_path / f"run{HOSTILE}")
    he = _humaneval_run(tmp_path / "he")
    assert main(["show", str(mmlu)]) == 0
    out = capsys.readouterr().out
    assert "question 0" in out and "plain prompt" in out and "be brief" in out and "[user]" in out
    assert_no_raw_control(out)
    assert main(["show", str(he)]) == 0
    out = capsys.readouterr().out
    assert "AssertionError" in out and "return 1" in out and "```python" in out
    assert_no_raw_control(out)


def test_compare_and_regress_escape_names_subjects_and_manifest_fields(tmp_path, capsys):
    versions = {"environment": {"packages": {"evalrun": f"0.1{HOSTILE}"}, "git": {"sha": f"abc{HOSTILE}"}}}
    a = _mmlu_run(tmp_path / f"a{HOSTILE}", subject=f"anatomy{HOSTILE}", **versions)
    b = _mmlu_run(tmp_path / f"b{HOSTILE}", subject=f"anatomy{HOSTILE}", **versions)
    for fmt in ("table", "markdown", "csv", "json", "html"):
        assert main(["compare", str(a), str(b), "--by", "subject", "--format", fmt]) == 0
        captured = capsys.readouterr()
        assert "anatomy" in captured.out, fmt
        assert_no_raw_control(captured.out + captured.err)
    assert main(["regress", "--baseline", str(a), "--candidate", str(b), "--by", "subject", "--n-boot", "100"]) == 0
    captured = capsys.readouterr()
    assert "anatomy" in captured.out
    assert_no_raw_control(captured.out + captured.err)


def test_error_lines_are_escaped(tmp_path, capsys):
    missing = tmp_path / f"gone{HOSTILE}"
    for argv in (["show", str(missing)], ["compare", str(missing), str(missing)],
                 ["regress", "--baseline", str(missing), "--candidate", str(missing)],
                 ["suite", str(missing) + ".toml"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "gone" in err and err.count("\n") == 1, err
        assert_no_raw_control(err)


# ------------------------------------------------------------------------------ class 6: csv cells

FORMULAS = ['=HYPERLINK("evil.example","click")', "+1+1", "@SUM(A1)", "-2+3"]


def test_csv_cells_never_start_a_formula_and_numbers_stay_numbers(tmp_path, capsys):
    runs = []
    for i, name in enumerate(FORMULAS):
        rows = [{"subject": FORMULAS[j % 4], "doc_id": j, "correct": (j + i) % 3 == 0, "prediction": "A"}
                for j in range(40)]
        runs.append(str(write_run(tmp_path / name, rows, model={"path": f"/m/{name}"})))
    assert main(["compare", *runs, "--by", "subject", "--format", "csv"]) == 0
    cells = [c for row in csv.reader(io.StringIO(capsys.readouterr().out)) for c in row]
    for cell in cells:
        if cell[:1] in ("=", "+", "-", "@", "\t", "\r"):
            float(cell)          # only a number may start so (a negative delta); a formula raises here
    for name in FORMULAS:
        assert "'" + name in cells
    assert any(c.startswith("-0.") for c in cells)           # a negative delta stays a number


# ------------------------------------------------------------------------------ class 6: show's manifest

def _broken(tmp_path: Path, name: str, change: dict[str, Any], drop: tuple[str, ...] = (),
            rows: list[dict[str, Any]] | None = None) -> Path:
    rows = rows or [{"subject": "anatomy", "doc_id": 0, "correct": True, "prediction": "A", "target": "A",
                     "choice_logprobs": [-1.0, -2.0, -3.0, -4.0], "question": "q"}]
    run = write_run(tmp_path / name, rows)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest = {k: v for k, v in {**manifest, **change}.items() if k not in drop}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


@pytest.mark.parametrize("change, drop, needle", [
    ({"task": 5}, (), "task"),
    ({"task": ["x"]}, (), "task"),
    ({"task": {"name": "mmlu"}}, (), "task"),
    ({}, ("task",), "task"),
    ({}, ("identity",), "identity"),
    ({}, ("key_columns",), "key_columns"),
    ({"task": "humaneval"}, (), "keyed by"),              # mmlu rows under another task's name
    ({"task": "task"}, (), "keyed by"),
    ({"task": "humaneval-score"}, (), "keyed by"),
    ({"key_columns": ["doc_id"]}, (), "keyed by"),
])
def test_show_refuses_a_malformed_manifest_in_one_line(tmp_path, capsys, change, drop, needle):
    run = _broken(tmp_path, "run", change, drop)
    assert main(["show", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and str(run) in err, err


def test_show_refuses_rows_it_cannot_print_in_one_line(tmp_path, capsys):
    run = _broken(tmp_path, "run", {}, rows=[{"subject": "anatomy", "doc_id": 0}])      # no metric, no prediction
    assert main(["show", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "correct" in err, err
    run = _broken(tmp_path, "run2", {}, rows=[{"subject": "anatomy", "doc_id": 0, "correct": True}])
    assert main(["show", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be shown" in err, err


def test_html_report_draws_a_dollar_run_name_as_text(tmp_path, capsys):
    rows = [{"subject": "anatomy", "doc_id": j, "correct": j % 2 == 0, "prediction": "A"} for j in range(20)]
    a = write_run(tmp_path / "base", rows)
    b = write_run(tmp_path / "$\\foo{$", rows)        # matplotlib would parse "$...$" as maths and raise
    out = tmp_path / "r.html"
    assert main(["compare", str(a), str(b), "--format", "html", "--output", str(out)]) == 0
    assert "$\\foo{$" in out.read_text()


def test_a_task_report_prints_dataset_text_escaped(tiny_model_dir, tmp_path, capsys):
    """A subject name from a user's data with terminal escapes: the printed summary shows them escaped."""
    import pandas as pd
    data = tmp_path / "data"
    data.mkdir()
    subject = "evil\x1b[2J\x1b]0;pwned\x07"
    row = {"question": "2 + 2?", "subject": subject, "choices": ["3", "4", "5", "6"], "answer": 1}
    pd.DataFrame([row] * 2).to_parquet(data / "test.parquet")
    pd.DataFrame([row] * 5).to_parquet(data / "dev.parquet")
    capsys.readouterr()
    assert main(["mmlu", "--data-dir", str(data), "--num-fewshot", "1", "--model", str(tiny_model_dir), "--output-dir",
                 str(tmp_path / "m"), "--dtype", "float32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "evil\\x1b[2J" in out
