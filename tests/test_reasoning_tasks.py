"""Reasoning models on a task (issue 42, item 2): `evalrun task` on a GSM8K-style generate_until task
with regex filters, on the tiny model scripted to think (a stop string inside the thinking), close
with `</think>`, then answer. The filters see only the answer, the row keeps the raw text, and
--max-thinking-tokens forces the marker after N tokens on a model that would think forever."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

from evalrun.commands.cli import main  # noqa: E402
from evalrun.engine import Tokenizer  # noqa: E402
from evalrun.results import read_samples  # noqa: E402
from evalrun.run import pipeline  # noqa: E402
from lm_eval_fixtures import write_fixture_tasks  # noqa: E402

MARKER = "</think>"


class Transitions:
    """The model, but a sampled row whose input token is in `table` makes table[token] the argmax."""

    def __init__(self, model: Any, table: dict[int, int]):
        self.model, self.table = model, table

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward(self, batch: Any, cache: Any) -> torch.Tensor:
        logits = self.model.forward(batch, cache).clone()               # [N, V]
        fed = batch.input_ids[batch.logits_indices].tolist()
        for row, token in enumerate(fed):
            if token in self.table:
                logits[row, self.table[token]] = logits[row].max() + 20.0
        return logits


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_fixture_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode_as_transformers(text, add_special_tokens=False)


def _chain(first: int, seq: list[int], loop_to: int | None = None) -> dict[int, int]:
    """first -> seq[0] -> seq[1] ...; the last token goes to seq[loop_to] when given."""
    table = {first: seq[0], **{a: b for a, b in zip(seq, seq[1:])}}
    if loop_to is not None:
        table[seq[-1]] = seq[loop_to]
    assert len(set(seq)) == len(seq), "a transition script needs distinct tokens"
    return table


def _run(monkeypatch, model_dir: Path, include: Path, out: Path, table: dict[int, int], *extra: str) -> list[dict]:
    real = pipeline.load_model

    def scripted(cfg: Any, path: Path) -> tuple[Any, Any]:
        model, tok = real(cfg, path)
        return Transitions(model, table), tok
    monkeypatch.setattr(pipeline, "load_model", scripted)
    rc = main(["task", "--tasks", "gsm8k_tiny", "--include-path", str(include), "--num-fewshot", "0", "--limit", "2",
               "--model", str(model_dir), "--dtype", "float32", "--output-dir", str(out), "--no-progress",
               "--apply-chat-template", "--think-end", MARKER, *extra])
    assert rc == 0
    return read_samples(out).to_dict("records")


def test_the_filters_see_only_the_answer_and_the_row_keeps_the_thinking(monkeypatch, tiny_model_dir, include_path,
                                                                          tmp_path):
    tok = Tokenizer.load(tiny_model_dir)
    newline = _ids(tok, "\n")[-1]                      # the generation prompt's last token
    thinking = _ids(tok, "Hmm, seven. Question: yes?")  # "Question:" is one of the task's stop strings
    answer = _ids(tok, " #### 42")
    table = _chain(newline, thinking + _ids(tok, MARKER) + answer + [tok.eos_token_id])
    rows = _run(monkeypatch, tiny_model_dir, include_path, tmp_path / "run", table)
    assert len(rows) == 2
    for row in rows:
        raw = json.loads(row["raw_resps"])[0]
        assert raw.startswith("Hmm, seven. Question: yes?" + MARKER) and "#### 42" in raw
        assert json.loads(row["resps"]) == [["#### 42"]]             # thinking removed, before the filters
        filtered = json.loads(row["filtered_resps"])
        assert filtered["strict-match"] == ["42"]
        assert json.loads(row["thinking_tokens"]) == [len(thinking) + len(_ids(tok, MARKER))]


@pytest.mark.parametrize("budget", [0, 5])
def test_the_thinking_budget_forces_the_marker(monkeypatch, tiny_model_dir, include_path, tmp_path, budget):
    tok = Tokenizer.load(tiny_model_dir)
    newline, marker = _ids(tok, "\n")[-1], _ids(tok, MARKER)
    forever = _ids(tok, "Hmm, seven.")                # a cycle: the model never closes its thinking
    answer = _ids(tok, " #### 42")
    table = {**_chain(newline, forever, loop_to=0), **_chain(marker[-1], answer + [tok.eos_token_id])}
    rows = _run(monkeypatch, tiny_model_dir, include_path, tmp_path / "run", table,
                "--max-thinking-tokens", str(budget))
    for row in rows:
        raw = json.loads(row["raw_resps"])[0]
        assert raw == tok.decode((forever * 4)[:budget] + marker + answer), raw
        assert json.loads(row["thinking_tokens"]) == [budget + len(marker)]
        assert json.loads(row["filtered_resps"])["strict-match"] == ["42"]


def test_humaneval_extracts_the_code_from_the_answer_after_the_thinking():
    from evalrun.tasks.base import Answer, DocPlan, Request
    from evalrun.tasks.chat import ChatOptions, ThinkEnd
    from evalrun.tasks.humaneval import HumanEvalSettings, HumanEvalTask
    from evalrun.tasks.humaneval_data import load_humaneval

    task = HumanEvalTask(load_humaneval(), HumanEvalSettings(chat=ChatOptions("default"), limit=1))
    task.think = ThinkEnd(MARKER, (7,))
    problem = task.problems[0]
    thinking = "Let me write ```python\ndef wrong(): pass\n``` no."
    answer = f"{thinking}{MARKER}\n```python\n{problem.prompt}{problem.canonical_solution}```"
    key = (problem.task_id, 0)
    plan = DocPlan(key, [Request(key, (1,))], {"seed": 0, "prompt_hash": "h"})
    row = task.generated(plan, [Answer(plan.requests[0], [1], answer, None, 1, 0, thinking_tokens=9)])
    assert row["response"] == answer and row["thinking_tokens"] == 9
    assert "wrong" not in row["program"] and problem.canonical_solution.strip() in row["program"]
