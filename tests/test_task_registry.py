"""The task registry is the one place a task is declared: a task defined here, in the test, and
registered at run time runs through `evalrun <task>`, `show`, `compare`, `merge` (of `--shard` runs)
and a suite, with no other file touched."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Optional

import pandas as pd
import pytest
import torch

from evalrun.commands.cli import build_parser, main
from evalrun.tasks import registry
from evalrun.tasks.base import NONFINITE_COLUMN, Answer, DocPlan, PrefixGroup, Request, TaskSettingError, prompt_hash
from evalrun.tasks.spec import CliArg, RunReport, TaskSpec
from run_helpers import assert_same_rows

# three groups of two yes/no questions: each group is a work unit, so --shard 0/2 and 1/2 both get one
QUESTIONS = {"colours": [("Is grass green?", "yes"), ("Is snow black?", "no")],
             "numbers": [("Is two more than one?", "yes"), ("Is zero odd?", "no")],
             "places": [("Is Paris in France?", "yes"), ("Is Rome in Peru?", "no")]}
KEYS = ("group", "idx")


@dataclass(frozen=True)
class YesNoOptions:
    limit: Optional[int] = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise TaskSettingError(f"--limit must be >= 1, got {self.limit}")


class YesNoTask:
    """Each question scored by the next-token log-probabilities of " yes" and " no"."""
    name = "yesno"
    key_columns = KEYS

    def __init__(self, limit: Optional[int] = None, only: Optional[Collection[tuple]] = None):
        self.limit, self.only = limit, (frozenset(only) if only is not None else None)

    def _docs(self) -> Iterator[tuple[tuple, str, str]]:
        for group, questions in QUESTIONS.items():
            for idx, (question, answer) in enumerate(questions[: self.limit]):
                if self.only is None or (group, idx) in self.only:
                    yield (group, idx), question, answer

    def doc_keys(self) -> list[tuple]:
        return [key for key, _, _ in self._docs()]

    def prefix_groups(self) -> list[PrefixGroup]:
        keys = self.doc_keys()
        return [PrefixGroup(g, tuple(k for k in keys if k[0] == g), 4, tuple(8 for k in keys if k[0] == g))
                for g in dict.fromkeys(k[0] for k in keys)]

    def restricted(self, keys: Collection[tuple]) -> "YesNoTask":
        return YesNoTask(self.limit, keys if self.only is None else self.only & frozenset(keys))

    def plan(self, tokenizer: Any, max_seq_len: int) -> Iterator[DocPlan]:
        self.choices = [tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]]
        for key, question, answer in self._docs():
            text = f"Question: {question}\nAnswer:"
            ids = tokenizer.encode(text)
            yield DocPlan(key, [Request(key, tuple(ids), 1, True)], {"target": answer, "prompt_hash": prompt_hash(ids)},
                          prompt=text)

    def score(self, plan: DocPlan, answers: list[Answer]) -> dict[str, Any]:
        logprobs = torch.log_softmax(answers[0].logits[0].float(), dim=-1)[self.choices].tolist()
        prediction = "yes" if logprobs[0] >= logprobs[1] else "no"
        return {**plan.info, "prediction": prediction, "correct": prediction == plan.info["target"],
                "prompt_tokens": answers[0].prompt_tokens, "cached_tokens": answers[0].cached_tokens,
                NONFINITE_COLUMN: False}

    def summarize(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return summarize(rows, list(dict.fromkeys(k[0] for k in self.doc_keys())))

    def fingerprint(self) -> str:
        return "yesno-v1"


def summarize(rows: list[dict[str, Any]], groups: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    per = [{"group": g, "n": sum(r["group"] == g for r in rows),
            "accuracy": _mean([r["correct"] for r in rows if r["group"] == g])} for g in groups]
    return per, {"n": len(rows), "accuracy": _mean([r["correct"] for r in rows])}


def _mean(values: list[bool]) -> float:
    return sum(values) / len(values) if values else math.nan


def report(options: YesNoOptions, r: RunReport) -> None:
    print(f"yesno accuracy {r.overall['accuracy']:.4f} over {r.overall['n']} questions\nresults: {r.out_dir}")


SPEC = TaskSpec(
    name="yesno", key_columns=KEYS, metric="correct", aggregate="accuracy", unit_columns=KEYS,
    unit_score=lambda n, c: c / n, groupings={"group": lambda key: str(key[0])}, default_by="group",
    help="six yes/no questions (a test's task)", description="A task registered by a test.",
    cli_args=(CliArg(("--limit",), "at most N questions per group (default: all)", type=int),),
    options=YesNoOptions, build=lambda options, seed: YesNoTask(options.limit), summarize=summarize, report=report,
    show_row=lambda row: f"{row['group']} #{row['idx']}: predicted {row['prediction']}, target {row['target']}")


@pytest.fixture
def yesno():
    registry.register(SPEC)
    try:
        yield SPEC
    finally:
        registry.unregister(SPEC.name)


def _run(model: Path, out: Path, *extra: str) -> int:
    return main(["yesno", "--model", str(model), "--dtype", "float32", "--output-dir", str(out), "--no-progress",
                 *extra])


def test_a_registered_task_runs_through_every_command(yesno, tiny_model_dir, tmp_path, capsys):
    assert _run(tiny_model_dir, tmp_path / "a") == 0
    assert "yesno accuracy" in capsys.readouterr().out
    rows = pd.read_parquet(tmp_path / "a" / "samples.parquet")
    assert sorted(zip(rows.group, rows.idx)) == sorted((g, i) for g in QUESTIONS for i in range(2))
    assert _run(tiny_model_dir, tmp_path / "a") == 0                          # a rerun resumes: nothing to do
    assert "6 of 6 questions already done" in capsys.readouterr().err

    assert main(["show", str(tmp_path / "a"), "--limit", "2"]) == 0
    shown = capsys.readouterr().out
    assert "yesno, 6 matching row(s)" in shown and "colours #0: predicted" in shown and "Question: Is grass" in shown

    assert _run(tiny_model_dir, tmp_path / "b", "--limit", "1") == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--format", "csv"]) == 0
    table = capsys.readouterr().out
    assert "colours" in table and "places" in table

    for k in (0, 1):
        assert _run(tiny_model_dir, tmp_path / f"s{k}", "--shard", f"{k}/2") == 0
    assert main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--output-dir", str(tmp_path / "m")]) == 0
    assert "merged 2 shards (6 rows)" in capsys.readouterr().out
    assert_same_rows(tmp_path / "m", tmp_path / "a", list(KEYS))

    suite = tmp_path / "suite.toml"
    suite.write_text(f'output_dir = "{tmp_path / "nightly"}"\n[[tasks]]\nname = "yesno"\nlimit = 1\n'
                     f'[[models]]\nname = "tiny"\npath = "{tiny_model_dir}"\ncache_modes = ["fp32"]\ndtype = "float32"\n')
    assert main(["suite", str(suite), "--no-progress"]) == 0
    assert (tmp_path / "nightly" / "comparison.md").read_text().startswith("## yesno")
    assert len(pd.read_parquet(tmp_path / "nightly" / "yesno" / "tiny" / "fp32" / "samples.parquet")) == 3


def test_a_registered_tasks_options_are_checked(yesno, tiny_model_dir, tmp_path, capsys):
    assert _run(tiny_model_dir, tmp_path / "a", "--limit", "0") == 2
    assert "evalrun yesno: error: --limit must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_registration_is_undone_and_names_are_unique(yesno):
    assert "yesno" in build_parser().parse_args(["yesno"]).command
    with pytest.raises(ValueError, match="registered already"):
        registry.register(SPEC)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(TaskSpec(name="humaneval-score", key_columns=KEYS, metric="correct", aggregate="accuracy",
                                   unit_columns=KEYS, unit_score=lambda n, c: c / n))
    with pytest.raises(ValueError, match="built-in"):
        registry.unregister("mmlu")


def test_the_registry_resolves_aliases_and_names_the_known_tasks():
    assert registry.task_spec("humaneval-score") is registry.HUMANEVAL
    assert [s.name for s in registry.runnable_specs()] == ["mmlu", "humaneval", "task"]
    with pytest.raises(ValueError, match="unknown task 'gsm8k'; evalrun knows humaneval, humaneval-score, mmlu, task"):
        registry.task_spec("gsm8k")
