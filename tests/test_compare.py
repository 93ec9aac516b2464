"""`evalrun compare` / `regress` on real run directories written through RunStore, checked against
independent computations (scipy, statsmodels), plus every bad-input case of issue 11."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint

from evalrun.commands.cli import main
from evalrun.commands.compare import compare_dirs
from evalrun.results import RunStore
from evalrun.results.schema import SAMPLES_DIR, SAMPLES_FILE

SUBJECTS = ["abstract_algebra", "anatomy", "high_school_geography", "philosophy", "nutrition"]


def write_run(run_dir: Path, rows: list[dict[str, Any]], task: str = "mmlu", finalize: bool = True,
              cache_mode: str = "fp32", **manifest: Any) -> Path:
    keys = ("subject", "doc_id") if task == "mmlu" else ("task_id", "sample_idx")
    m = {"task": task, "identity": {"task": task, "cache_mode": cache_mode}, "cache_mode": cache_mode,
         "model": {"path": "/models/tiny"}, "cache_bytes_per_token": 1024,
         "throughput": {"prompt_tokens": 1000, "prefill_tokens_computed": 250, "generated_tokens": 0,
                        "wall_seconds": 2.0}, **manifest}
    store = RunStore.open(run_dir, m, keys, flush_rows=50)
    for row in rows:
        store.add(row)
    if finalize:
        store.finalize()
    store.close()
    return run_dir


def mmlu_rows(correct: list[bool], subjects: list[str] = SUBJECTS) -> list[dict[str, Any]]:
    return [{"subject": subjects[i % len(subjects)], "doc_id": i // len(subjects), "correct": bool(c),
             "prediction": "A"} for i, c in enumerate(correct)]


def flipped(correct: list[bool], to_wrong: int, to_right: int, seed: int = 1) -> list[bool]:
    rng = np.random.default_rng(seed)
    right = [i for i, c in enumerate(correct) if c]
    wrong = [i for i, c in enumerate(correct) if not c]
    out = list(correct)
    for i in rng.choice(right, to_wrong, replace=False):
        out[i] = False
    for i in rng.choice(wrong, to_right, replace=False):
        out[i] = True
    return out


def base_answers(n: int, p: float = 0.6, seed: int = 0) -> list[bool]:
    return list(np.random.default_rng(seed).random(n) < p)


def exact_reference(base: list[bool], cand: list[bool], level: float = 0.95) -> dict[str, float]:
    """Independent: McNemar from statsmodels and scipy's binomial test; interval from the
    Clopper-Pearson interval of c / (b + c) (statsmodels), mapped to delta = (b + c)/n (2 theta - 1)."""
    x, y = np.asarray(base), np.asarray(cand)
    b, c, n = int(np.sum(x & ~y)), int(np.sum(~x & y)), len(x)
    table = [[int(np.sum(x & y)), b], [c, int(np.sum(~x & ~y))]]
    p = mcnemar(table, exact=True).pvalue
    if b + c:
        assert math.isclose(p, stats.binomtest(c, b + c, 0.5).pvalue, rel_tol=1e-9)
        lo, hi = proportion_confint(c, b + c, alpha=1 - level, method="beta")
        scale = (b + c) / n
        low, high = scale * (2 * lo - 1), scale * (2 * hi - 1)
    else:
        low = high = 0.0
    return {"b": b, "c": c, "p": min(1.0, p), "low": low, "high": high, "delta": (c - b) / n}


# ------------------------------------------------------------------------------ acceptance 1

def test_a_run_compared_with_itself_has_zero_deltas_and_p_one(tmp_path, capsys):
    run = write_run(tmp_path / "a", mmlu_rows(base_answers(200)))
    c = compare_dirs([str(run), str(run)], by="subject")
    cand = [r for r in c.results if r.delta is not None]
    assert cand and all(r.delta == 0 and r.p_value == 1 and r.to_correct == r.to_wrong == 0 for r in cand)
    assert all(r.ci_low == 0 and r.ci_high == 0 for r in cand)
    assert main(["regress", "--baseline", str(run), "--candidate", str(run)]) == 0
    assert "ok: change +0.00 points" in capsys.readouterr().out


def test_flips_p_values_and_exact_intervals_match_scipy_and_statsmodels(tmp_path):
    base = base_answers(500)
    cand = flipped(base, to_wrong=23, to_right=9)
    a = write_run(tmp_path / "base", mmlu_rows(base))
    b = write_run(tmp_path / "cand", mmlu_rows(cand), cache_mode="q4")
    c = compare_dirs([str(a), str(b)], by="subject")
    overall = c.result("overall", "cand")
    ref = exact_reference(base, cand)
    assert (overall.to_wrong, overall.to_correct) == (ref["b"], ref["c"]) == (23, 9)
    assert overall.p_value == pytest.approx(ref["p"], rel=1e-9)
    assert overall.delta == pytest.approx(ref["delta"])
    assert overall.ci_low == pytest.approx(ref["low"], abs=1e-9)
    assert overall.ci_high == pytest.approx(ref["high"], abs=1e-9)
    assert overall.metric == pytest.approx(np.mean(cand)) and c.result("overall", "base").metric == np.mean(base)
    assert overall.stderr == pytest.approx(np.std(np.asarray(cand, float), ddof=1) / math.sqrt(len(cand)))
    per_p = []
    for i, subject in enumerate(SUBJECTS):
        sel = slice(i, None, len(SUBJECTS))
        ref = exact_reference(base[sel], cand[sel])
        r = c.result(subject, "cand")
        assert (r.n, r.to_wrong, r.to_correct) == (len(base[sel]), ref["b"], ref["c"])
        assert r.p_value == pytest.approx(ref["p"], rel=1e-9)
        assert (r.ci_low, r.ci_high) == (pytest.approx(ref["low"], abs=1e-9), pytest.approx(ref["high"], abs=1e-9))
        per_p.append(r.p_value)
    holm = multipletests(per_p, method="holm")[1]
    assert [c.result(s, "cand").p_holm for s in SUBJECTS] == pytest.approx(list(holm), rel=1e-9)


def test_category_grouping_follows_lm_eval_groups(tmp_path):
    base = base_answers(200, seed=3)
    a = write_run(tmp_path / "a", mmlu_rows(base))
    b = write_run(tmp_path / "b", mmlu_rows(flipped(base, 5, 2)))
    c = compare_dirs([str(a), str(b)])                                   # MMLU default: category
    assert c.by == "category"
    assert c.group_names() == ["stem", "humanities", "social_sciences", "other", "overall"]
    stem = c.result("stem", "b")
    assert stem.n == 80                                                  # abstract_algebra + anatomy


def humaneval_rows(scores: np.ndarray) -> list[dict[str, Any]]:
    """scores: [problems, samples] of pass/fail."""
    return [{"task_id": f"HumanEval/{p}", "sample_idx": s, "passed": bool(scores[p, s]), "completion": ""}
            for p in range(scores.shape[0]) for s in range(scores.shape[1])]


def test_bootstrap_interval_agrees_with_scipys_paired_bootstrap(tmp_path):
    rng = np.random.default_rng(7)
    skill = rng.random(60)
    base = rng.random((60, 10)) < skill[:, None]
    cand = rng.random((60, 10)) < np.clip(skill - 0.08, 0, 1)[:, None]
    a = write_run(tmp_path / "a", humaneval_rows(base), task="humaneval")
    b = write_run(tmp_path / "b", humaneval_rows(cand), task="humaneval")
    c = compare_dirs([str(a), str(b)], n_boot=20000)
    assert c.method == "bootstrap" and c.unit == "problem" and c.metric == "pass@1"
    r = c.result("overall", "b")
    x, y = base.mean(axis=1), cand.mean(axis=1)          # pass@1 per problem = c / n
    assert r.n == 60 and r.delta == pytest.approx(y.mean() - x.mean())
    ref = stats.bootstrap((x, y), lambda u, v, axis=-1: v.mean(axis=axis) - u.mean(axis=axis), paired=True,
                          n_resamples=20000, method="percentile", random_state=np.random.default_rng(123))
    # two independent Monte Carlo runs of the same bootstrap: bounds agree within 0.005 (pass@1 units)
    assert r.ci_low == pytest.approx(ref.confidence_interval.low, abs=0.005)
    assert r.ci_high == pytest.approx(ref.confidence_interval.high, abs=0.005)
    assert (r.to_correct, r.to_wrong) == (int(np.sum(y > x)), int(np.sum(y < x)))


def test_humaneval_with_one_sample_uses_the_exact_test(tmp_path):
    base = np.asarray(base_answers(164, 0.3))[:, None]
    cand = np.asarray(flipped(list(base[:, 0]), 6, 1))[:, None]
    a = write_run(tmp_path / "a", humaneval_rows(base), task="humaneval")
    b = write_run(tmp_path / "b", humaneval_rows(cand), task="humaneval-score")   # same metric, comparable
    c = compare_dirs([str(a), str(b)])
    ref = exact_reference(list(base[:, 0]), list(cand[:, 0]))
    r = c.result("overall", "b")
    assert c.method == "mcnemar-exact" and r.p_value == pytest.approx(ref["p"]) and (r.to_wrong, r.to_correct) == (6, 1)


# ------------------------------------------------------------------------------ acceptance 3

@pytest.mark.parametrize("to_wrong, expected", [(50, 1), (1, 0)])
def test_regress_flags_a_planted_5_point_drop_and_passes_one_question(tmp_path, capsys, to_wrong, expected):
    base = base_answers(1000)
    a = write_run(tmp_path / "base", mmlu_rows(base))
    b = write_run(tmp_path / "cand", mmlu_rows(flipped(base, to_wrong, 0)))
    assert main(["regress", "--baseline", str(a), "--candidate", str(b)]) == expected
    out = capsys.readouterr().out
    assert ("REGRESSION" in out) == (expected == 1)
    assert f"-{to_wrong / 10:.2f} points" in out
    for subject in SUBJECTS:                                 # every group printed, with Holm p
        assert subject in out


def test_a_large_drop_on_few_questions_is_not_significant(tmp_path, capsys):
    base = [True] * 12 + [False] * 8
    a = write_run(tmp_path / "base", mmlu_rows(base))
    b = write_run(tmp_path / "cand", mmlu_rows(flipped(base, 2, 0)))      # -10 points on 20 questions
    assert main(["regress", "--baseline", str(a), "--candidate", str(b), "--max-drop", "1"]) == 0
    assert "not significantly" in capsys.readouterr().out


def test_regress_bad_options_exit_2(tmp_path, capsys):
    a = write_run(tmp_path / "a", mmlu_rows(base_answers(20)))
    assert main(["regress", "--baseline", str(a), "--candidate", str(a), "--alpha", "1.5"]) == 2
    assert "--alpha" in capsys.readouterr().err
    assert main(["regress", "--baseline", str(a), "--candidate", str(a), "--max-drop", "-1"]) == 2
    assert main(["regress", "--baseline", str(a), "--candidate", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------ acceptance 4

def _fails(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_runs_of_different_tasks_are_refused(tmp_path, capsys):
    a = write_run(tmp_path / "mm", mmlu_rows(base_answers(10)))
    b = write_run(tmp_path / "he", humaneval_rows(np.ones((3, 1), bool)), task="humaneval")
    _fails(capsys, ["compare", str(a), str(b)], "different tasks", f"{a} is mmlu", f"{b} is humaneval")


def test_runs_without_shared_questions_are_refused(tmp_path, capsys):
    a = write_run(tmp_path / "a", mmlu_rows(base_answers(10), ["anatomy"]))
    b = write_run(tmp_path / "b", mmlu_rows(base_answers(10), ["nutrition"]))
    _fails(capsys, ["compare", str(a), str(b)], "share no scored rows", "a has 10", "b has 10")


def test_a_run_in_progress_is_refused(tmp_path, capsys):
    a = write_run(tmp_path / "a", mmlu_rows(base_answers(10)))
    m = {"task": "mmlu", "identity": {"task": "mmlu", "cache_mode": "fp32"}}
    with RunStore.open(tmp_path / "busy", m, ("subject", "doc_id")) as store:
        store.add(mmlu_rows([True])[0])
        _fails(capsys, ["compare", str(a), str(tmp_path / "busy")], str(tmp_path / "busy"), "still in progress")
    _fails(capsys, ["compare", str(a), str(tmp_path / "busy")], "has not finished", "rerun its command")


@pytest.mark.parametrize("damage, needle", [
    ("no_manifest", "no manifest.json"),
    ("corrupt_manifest", "corrupt manifest"),
    ("torn_samples", "samples.parquet is torn"),
    ("torn_part", "is torn, unreadable or damaged"),
    ("missing_samples", "samples.parquet is missing"),
])
def test_damaged_runs_are_named_with_the_problem(tmp_path, capsys, damage, needle):
    a = write_run(tmp_path / "a", mmlu_rows(base_answers(10)))
    b = write_run(tmp_path / "b", mmlu_rows(base_answers(10)))
    if damage == "no_manifest":
        (b / "manifest.json").unlink()
    elif damage == "corrupt_manifest":
        (b / "manifest.json").write_text('{"task": "mmlu", ')
    elif damage == "torn_samples":
        data = (b / SAMPLES_FILE).read_bytes()
        (b / SAMPLES_FILE).write_bytes(data[: len(data) // 2])
    elif damage == "torn_part":
        (b / SAMPLES_DIR / "part-000099-deadbeef.parquet").write_bytes(b"PAR1 torn")
    else:
        (b / SAMPLES_FILE).unlink()
    _fails(capsys, ["compare", str(a), str(b)], str(b), needle)


def test_partly_shared_runs_compare_on_the_shared_questions_and_say_so(tmp_path, capsys):
    base = base_answers(100)
    a = write_run(tmp_path / "a", mmlu_rows(base))
    b = write_run(tmp_path / "b", mmlu_rows(base[:80]))
    c = compare_dirs([str(a), str(b)])
    assert c.shared_rows == 80 and [h.left_out for h in c.runs] == [20, 0]
    assert c.result("overall", "b").delta == 0
    assert main(["compare", str(a), str(b)]) == 0
    assert "a: 20 scored rows not in every run, left out" in capsys.readouterr().out


def test_skipped_rows_are_counted_not_compared(tmp_path):
    rows = mmlu_rows(base_answers(20))
    rows[3] = {**rows[3], "skipped": True, "correct": None}
    for r in rows:
        r.setdefault("skipped", False)
    a = write_run(tmp_path / "a", rows)
    b = write_run(tmp_path / "b", mmlu_rows(base_answers(20)))
    c = compare_dirs([str(a), str(b)])
    assert c.shared_rows == 19 and c.runs[0].skipped == 1 and c.runs[1].left_out == 1


# ------------------------------------------------------------------------------ output formats

def test_formats_carry_the_same_numbers(tmp_path, capsys):
    base = base_answers(300)
    a = write_run(tmp_path / "fp32", mmlu_rows(base))
    b = write_run(tmp_path / "q4", mmlu_rows(flipped(base, 12, 4)), cache_mode="q4", cache_bytes_per_token=288)
    out = tmp_path / "c.json"
    assert main(["compare", str(a), str(b), "--by", "subject", "--format", "json", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["baseline"] == "fp32" and [h["cache_mode"] for h in data["runs"]] == ["fp32", "q4"]
    assert data["runs"][1]["bytes_per_token"] == 288 and data["runs"][0]["dedup_ratio"] == 4.0
    overall = [r for r in data["results"] if r["group"] == "overall" and r["run"] == "q4"][0]
    assert (overall["to_wrong"], overall["to_correct"]) == (12, 4)
    assert main(["compare", str(a), str(b), "--by", "subject", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 2 * (len(SUBJECTS) + 1)
    assert main(["compare", str(a), str(b), "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert f"{overall['delta']:+.4f}" in md and "| q4 |" in md.replace("  ", " ")
    assert main(["compare", str(b), "--baseline", str(a), "--by", "none"]) == 0     # baseline added first
    assert "baseline fp32" in capsys.readouterr().out


def test_compare_refuses_a_grouping_the_task_lacks(tmp_path, capsys):
    a = write_run(tmp_path / "a", humaneval_rows(np.ones((3, 1), bool)), task="humaneval")
    _fails(capsys, ["compare", str(a), str(a), "--by", "subject"], "cannot be grouped by 'subject'", "none")


def test_labels_stay_distinct_when_directory_names_clash():
    from evalrun.results.compare import run_labels
    assert run_labels(["x/n1/fp32", "x/n2/fp32"]) == ["n1/fp32", "n2/fp32"]
    assert run_labels(["a", "b/"]) == ["a", "b"]


def _unused(x: Optional[int]) -> None:      # keep Optional imported for the type hints above
    return None


def test_review_cases(tmp_path, capsys):
    # a subject MMLU does not have gets the "unlisted" category instead of crashing the table
    own = mmlu_rows(base_answers(20), ["anatomy", "my_own_subject"])
    a = write_run(tmp_path / "own_a", own)
    b = write_run(tmp_path / "own_b", mmlu_rows(flipped(base_answers(20), 2, 1), ["anatomy", "my_own_subject"]))
    assert main(["compare", str(a), str(b)]) == 0
    assert "unlisted" in capsys.readouterr().out
    # a drop of exactly --max-drop points (11 of 1000, 1.0999999999999999 in floating point) fails the gate
    base = base_answers(1000)
    x = write_run(tmp_path / "x", mmlu_rows(base))
    y = write_run(tmp_path / "y", mmlu_rows(flipped(base, 11, 0)))
    assert main(["regress", "--baseline", str(x), "--candidate", str(y), "--max-drop", "1.1"]) == 1
    capsys.readouterr()
    # runs made from other data are refused unless the user says so
    fa = write_run(tmp_path / "fa", mmlu_rows(base[:50]), identity={"task": "mmlu", "data_fingerprint": "sha-AAAA"})
    fb = write_run(tmp_path / "fb", mmlu_rows(base[:50]), identity={"task": "mmlu", "data_fingerprint": "sha-BBBB"})
    _fails(capsys, ["compare", str(fa), str(fb)], "different data", "sha-AAAA", "--allow-different-data")
    assert main(["compare", str(fa), str(fb), "--allow-different-data"]) == 0
    # a run whose rows were all skipped is named as such
    skipped = [{**r, "skipped": True, "correct": None} for r in mmlu_rows(base_answers(5))]
    s = write_run(tmp_path / "skipped", skipped)
    _fails(capsys, ["compare", str(x), str(s)], "no scored rows in skipped (5 rows stored, all skipped)")
    # hand-edited manifests with fields of the wrong type do not crash the header
    w = write_run(tmp_path / "w", mmlu_rows(base), cache_bytes_per_token="big",
                  throughput={"wall_seconds": "slow", "prompt_tokens": None})
    assert main(["compare", str(x), str(w)]) == 0
