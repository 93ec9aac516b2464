"""MMLU adapter and `evalrun mmlu` end to end: format, reference agreement, resume, bad input.

Most tests run on the 5-subject fixture in tests/data/mmlu (8 test questions per subject), so a
fresh clone runs them; only those that need all 57 subjects / 14,042 questions read the full data
from ../shared/data/mmlu (or $EVALRUN_MMLU_DIR) and are skipped without it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from evalrun.commands.cli import main
from run_helpers import sigkill_after_parts
from evalrun.tasks.mmlu import MMLUTask, build_prompt
from evalrun.tasks.mmlu_data import MMLUDoc, load_mmlu

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
FIXTURE_SUBJECTS = ["abstract_algebra", "high_school_biology", "high_school_geography", "nutrition", "philosophy"]
FULL = Path(os.environ.get("EVALRUN_MMLU_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data" / "mmlu")
needs_full = pytest.mark.skipif(not FULL.is_dir(),
                                reason="needs the full MMLU in ../shared/data/mmlu (not in a fresh clone)")


@pytest.fixture(scope="module")
def data():
    return load_mmlu(FIXTURE)


def _longer_fixture(root: Path, copies: int) -> Path:
    """The fixture with its test rows repeated `copies` times: a run long enough to interrupt."""
    root.mkdir()
    shutil.copy(FIXTURE / "dev.parquet", root / "dev.parquet")
    test = pd.read_parquet(FIXTURE / "test.parquet")
    pd.concat([test] * copies, ignore_index=True).to_parquet(root / "test.parquet")
    return root


def test_prompt_is_lm_eval_default_format():
    shot = MMLUDoc("high_school_biology", 0, "  What is DNA? ", ("a", "b", "c", "d"), 2)
    doc = MMLUDoc("high_school_biology", 1, "Why?", ("w", "x", "y", "z"), 0)
    assert build_prompt(doc.subject, [shot], doc) == (
        "The following are multiple choice questions (with answers) about high school biology.\n\n"
        "What is DNA?\nA. a\nB. b\nC. c\nD. d\nAnswer: C\n\n"
        "Why?\nA. w\nB. x\nC. y\nD. z\nAnswer:"
    )


def test_fixture_shapes(data):
    assert sorted(data.test) == sorted(data.dev) == FIXTURE_SUBJECTS
    assert all(len(v) == 8 for v in data.test.values()) and all(len(v) == 5 for v in data.dev.values())


@needs_full
def test_data_shapes():
    data = load_mmlu(FULL)
    assert len(data.test) == 57 and sum(len(v) for v in data.test.values()) == 14042
    assert all(len(v) == 5 for v in data.dev.values())


def _cli(*args: str) -> int:
    return main(["mmlu", "--no-progress", "--dtype", "float32", "--cache-mode", "fp32", *args])


def _samples(out: Path) -> pd.DataFrame:
    return pd.read_parquet(out / "samples.parquet")


def _two_per_subject(model: Path, data_dir: Path, out: Path, subjects: int) -> pd.DataFrame:
    """`evalrun mmlu --limit 2` on every subject of data_dir: one row per question, none twice."""
    assert _cli("--model", str(model), "--data-dir", str(data_dir), "--limit", "2", "--output-dir", str(out)) == 0
    df = _samples(out)
    assert len(df) == subjects * 2 and df[["subject", "doc_id"]].duplicated().sum() == 0
    return df


def test_all_subjects_from_cli(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    df = _two_per_subject(tiny_model_dir, FIXTURE, out, 5)
    assert {"run_id", "task", "subject", "doc_id", "prompt_hash", "prompt_tokens", "cached_tokens",
            "num_fewshot_used", "target", "prediction", "correct", "choice_logprobs", "cache_mode"} <= set(df.columns)
    assert (df.cached_tokens > 0).mean() >= 0.45                     # the second question of a subject hits
    assert "overall" in capsys.readouterr().out
    assert (out / "summary.json").is_file() and (out / "manifest.json").is_file()
    kernels = json.loads((out / "manifest.json").read_text())["kernels"]
    assert kernels["linear"] in {"native-gemm", "onednn-prepacked", "torch"}
    assert kernels["decode_attention"] in {"native-c", "torch"}


@needs_full
def test_full_57_subjects_from_cli(tiny_model_dir, tmp_path, capsys):
    df = _two_per_subject(tiny_model_dir, FULL, tmp_path / "run", 57)
    assert sorted(df.subject.unique()) == sorted(load_mmlu(FULL).test)
    assert "overall" in capsys.readouterr().out


def test_csv_layout_gives_same_rows(tiny_model_dir, tmp_path, data):
    csv_root = tmp_path / "csv"
    for split, table in (("dev", data.dev), ("test", data.test)):
        (csv_root / split).mkdir(parents=True)
        for subject in ("philosophy", "nutrition"):
            rows = [[d.question, *d.choices, "ABCD"[d.answer]] for d in table[subject]]
            pd.DataFrame(rows).to_csv(csv_root / split / f"{subject}_{split}.csv", header=False, index=False)
    outs = []
    for i, root in enumerate((csv_root, FIXTURE)):
        out = tmp_path / f"run{i}"
        assert _cli("--model", str(tiny_model_dir), "--data-dir", str(root), "--subjects", "philosophy,nutrition",
                    "--limit", "3", "--output-dir", str(out)) == 0
        outs.append(_samples(out))
    cols = ["subject", "doc_id", "prompt_hash", "prediction"]
    pd.testing.assert_frame_equal(outs[0][cols], outs[1][cols])


def test_long_prompts_drop_shots_then_skip(tiny_model_dir, tmp_path, capsys):
    # SmolLM2's tokenizer: nutrition's first 3 questions are 561-601 tokens 5-shot, 505-545 4-shot
    # and 61-101 0-shot
    common = ["--model", str(tiny_model_dir), "--data-dir", str(FIXTURE), "--subjects", "nutrition",
              "--limit", "3", "--page-size", "16"]
    assert _cli(*common, "--cache-tokens", "512", "--output-dir", str(tmp_path / "a")) == 0
    df = _samples(tmp_path / "a")
    assert (df.num_fewshot_used < 5).all() and not df.skipped.any()
    assert _cli(*common, "--cache-tokens", "48", "--output-dir", str(tmp_path / "b")) == 2   # all skipped
    df = _samples(tmp_path / "b")
    assert df.skipped.all() and df.skip_reason.str.contains("does not fit in 48 tokens").all()
    err = capsys.readouterr().err
    assert "warning: 3 questions skipped because their prompt does not fit in the KV cache's 48 tokens" in err
    assert "error: all 3 questions were skipped, so there is no score: prompt does not fit in 48 tokens" in err
    overall = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert overall["accuracy"] is None and overall["macro_accuracy"] is None and overall["n"] == 0


def test_batch_invariance_fp32(tiny_model_dir, tmp_path):
    frames = []
    for bs in ("1", "8", None):
        out = tmp_path / f"bs{bs}"
        extra = ["--max-batch-size", bs] if bs else []
        assert _cli("--model", str(tiny_model_dir), "--data-dir", str(FIXTURE), "--subjects",
                    "abstract_algebra,nutrition", "--limit", "6", "--output-dir", str(out), *extra) == 0
        frames.append(_samples(out))
    for other in frames[1:]:
        assert list(other.prediction) == list(frames[0].prediction)
        a = torch.tensor(np.stack(frames[0].choice_logprobs.tolist()))
        b = torch.tensor(np.stack(other.choice_logprobs.tolist()))
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_ties_break_to_lowest_letter():
    from evalrun.tasks.base import Answer, DocPlan, Request

    task = MMLUTask.__new__(MMLUTask)
    task.choice_ids = [[1], [2], [3], [4]]
    req = Request(("x", 0), (7, 8), 1, True, 0)
    plan = DocPlan(("x", 0), [req], {"target": "C"})
    logits = torch.zeros(1, 10)
    logits[0, 3] = logits[0, 4] = 5.0                                 # C and D tie
    row = task.score(plan, [Answer(req, [3], "", logits, 2, 0)])
    assert row["prediction"] == "C" and row["correct"]
    expected = torch.log_softmax(logits[0], -1)[[1, 2, 3, 4]].tolist()
    assert row["choice_logprobs"] == pytest.approx(expected, abs=1e-7)


def test_bad_inputs_exit_2(tiny_model_dir, smollm2_dir, tmp_path, capsys):
    base = ["--data-dir", str(FIXTURE), "--limit", "1", "--subjects", "philosophy"]
    assert _cli("--model", str(tmp_path / "nope"), *base, "--output-dir", str(tmp_path / "o1")) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert _cli("--model", str(tiny_model_dir), "--data-dir", str(FIXTURE), "--subjects", "astrology",
                "--output-dir", str(tmp_path / "o2")) == 2
    err = capsys.readouterr().err
    assert "unknown subject(s) astrology" in err and "philosophy" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    dev = pd.read_parquet(FIXTURE / "dev.parquet")
    dev.to_parquet(bad / "dev.parquet")
    test = pd.read_parquet(FIXTURE / "test.parquet").head(20)
    test.loc[3, "answer"] = 7
    test.to_parquet(bad / "test.parquet")
    assert _cli("--model", str(tiny_model_dir), "--data-dir", str(bad), "--output-dir", str(tmp_path / "o3")) == 2
    err = capsys.readouterr().err
    assert "test.parquet row 3" in err and "out of range" in err
    out = tmp_path / "o4"
    assert _cli("--model", str(tiny_model_dir), *base, "--output-dir", str(out)) == 0
    before = _samples(out)
    assert _cli("--model", str(smollm2_dir), *base, "--output-dir", str(out)) == 2
    assert "model_fingerprint" in capsys.readouterr().err
    pd.testing.assert_frame_equal(_samples(out), before)              # nothing lost
    assert main(["mmlu", "--limit", "0", "--model", str(tiny_model_dir)]) == 2


def test_kill_9_then_resume_matches_uninterrupted(tiny_model_dir, tmp_path):
    args = ["--model", str(tiny_model_dir), "--data-dir", str(FIXTURE), "--subjects",
            "abstract_algebra,high_school_biology,philosophy,nutrition", "--limit", "8"]
    full = tmp_path / "full"
    assert _cli(*args, "--output-dir", str(full)) == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "evalrun", "mmlu", "--no-progress", "--dtype", "float32", "--cache-mode",
           "fp32", *args, "--output-dir", str(out), "--flush-rows", "3", "--max-batch-size", "2"]
    sigkill_after_parts(cmd, out)
    assert _cli(*args, "--output-dir", str(out)) == 0
    cols = ["subject", "doc_id", "prompt_hash", "prediction", "target", "correct"]
    a, b = _samples(full), _samples(out)
    assert not b[["subject", "doc_id"]].duplicated().any()
    pd.testing.assert_frame_equal(a[cols].reset_index(drop=True), b[cols].reset_index(drop=True))
    torch.testing.assert_close(torch.tensor(np.stack(list(a.choice_logprobs))), torch.tensor(np.stack(list(b.choice_logprobs))),
                               atol=1e-5, rtol=0)


def test_sigterm_flushes_buffered_rows(tiny_model_dir, tmp_path):
    """With parts flushed only every 1000 rows, a SIGTERM still leaves every finished row on disk."""
    out = tmp_path / "term"
    data_dir = _longer_fixture(tmp_path / "data", copies=25)         # 5 subjects x 200 questions
    cmd = [sys.executable, "-m", "evalrun", "mmlu", "--dtype", "float32", "--cache-mode", "fp32",
           "--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--max-batch-size", "1",
           "--output-dir", str(out), "--flush-rows", "1000", "--flush-seconds", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    for line in proc.stderr:        # text mode reads universal newlines: tqdm's "\r" updates end a line too
        if "acc=" in line or time.time() > deadline:
            break
    time.sleep(1.0)
    proc.terminate()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    parts = list((out / "samples").glob("part-*.parquet"))
    assert len(parts) == 1 and not (out / "samples.parquet").exists()
    rows = pd.read_parquet(parts[0])
    assert 0 < len(rows) < 5 * 200 and not rows[["subject", "doc_id"]].duplicated().any()


def test_main_in_a_callers_process_gives_back_its_sigterm_handler(tiny_model_dir, tmp_path):
    """main() installs its SIGTERM handler for the run only: a caller's process (and what it forks later,
    multiprocessing's workers among them) has its own handler again afterwards, after a run and after bad
    input alike."""
    def callers(signum, frame):  # noqa: ANN001 - signal's signature
        pass
    before = signal.signal(signal.SIGTERM, callers)
    try:
        data_dir = _longer_fixture(tmp_path / "data", copies=1)
        assert _cli("--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--limit", "1",
                    "--output-dir", str(tmp_path / "run")) == 0
        assert signal.getsignal(signal.SIGTERM) is callers
        assert _cli("--model", str(tmp_path / "missing"), "--data-dir", str(data_dir),
                    "--output-dir", str(tmp_path / "bad")) == 2
        assert signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.slow
def test_smollm2_predictions_match_transformers(smollm2_dir, data):
    from transformers import AutoModelForCausalLM

    from evalrun.engine import DynamicGenerator, Model, PagedCache, Tokenizer
    from evalrun.run.runner import run_task

    task = MMLUTask(subjects=["abstract_algebra", "high_school_biology", "nutrition"], limit=4, data=data)
    model = Model.load(smollm2_dir, dtype="float32")
    tok = Tokenizer.load(smollm2_dir)
    gen = DynamicGenerator(model, PagedCache(model, max_tokens=8192, page_size=256, mode="fp32"), tok)
    plans = list(task.plan(tok, model.max_seq_len))
    rows = run_task(task, gen, plans, lambda r: None, {}, progress=False).rows
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    letters = [tok.encode(" " + L)[0] for L in "ABCD"]
    by_key = {(r["subject"], r["doc_id"]): r for r in rows}
    correct = 0
    for doc in task.docs():
        prompt = build_prompt(doc.subject, data.dev[doc.subject][:5], doc)
        ids = tok.encode(prompt)
        with torch.inference_mode():
            logits = ref(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)[letters]
        row = by_key[(doc.subject, doc.doc_id)]
        assert row["prediction"] == "ABCD"[int(lp.argmax())]
        torch.testing.assert_close(torch.tensor(row["choice_logprobs"]), lp, atol=1e-3, rtol=0)
        correct += row["prediction"] == "ABCD"[doc.answer]
    assert correct == sum(r["correct"] for r in rows)
