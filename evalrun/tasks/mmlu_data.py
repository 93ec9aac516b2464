"""MMLU documents: the hub dataset, or local files in the cais/mmlu parquet layout or
the original Hendrycks CSV layout."""
from __future__ import annotations

import csv
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from .base import TaskDataError, load_hub_dataset

LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class MMLUDoc:
    subject: str
    doc_id: int                 # index within the subject's split
    question: str
    choices: tuple[str, str, str, str]
    answer: int                 # 0..3


@dataclass
class MMLUData:
    dev: dict[str, list[MMLUDoc]]
    test: dict[str, list[MMLUDoc]]
    fingerprint: str


def load_mmlu(data_dir: Optional[str | Path] = None) -> MMLUData:
    """The hub's cais/mmlu (via `datasets`) when `data_dir` is None, else local files, read
    directly with pyarrow / csv (fast, and every error names the file)."""
    if data_dir is None:
        ds = load_hub_dataset("cais/mmlu", "all", hint="give local files with --data-dir DIR")
        return _build({s: (ds[s].column_names, list(ds[s]), f"cais/mmlu:{s}") for s in ("dev", "test")})
    root = Path(data_dir)
    if not root.is_dir():
        raise TaskDataError(f"MMLU data directory not found: {root}")
    if (root / "dev.parquet").is_file() and (root / "test.parquet").is_file():
        return _build({s: _parquet(root / f"{s}.parquet") for s in ("dev", "test")})
    if (root / "dev").is_dir() and (root / "test").is_dir():
        return _build({s: _csv_split(root / s, s) for s in ("dev", "test")})
    raise TaskDataError(
        f"{root} holds neither dev.parquet + test.parquet (cais/mmlu layout) nor dev/ + test/ CSV folders "
        f"(Hendrycks layout)"
    )


Split = tuple[list[str], list[dict], str]        # column names, rows, where they came from


def _parquet(path: Path) -> Split:
    try:
        table = pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise TaskDataError(f"{path}: not a readable parquet file ({exc})") from None
    return table.column_names, table.to_pylist(), str(path)


def _csv_split(folder: Path, split: str) -> Split:
    files = sorted(folder.glob(f"*_{split}.csv"))
    if not files:
        raise TaskDataError(f"no *_{split}.csv files in {folder}")
    rows = []
    for f in files:
        subject = f.name[: -len(f"_{split}.csv")]
        for i, r in enumerate(_csv_rows(f)):
            where = f"{f} row {i + 1}"
            if not r:
                continue                                   # blank line
            if len(r) != 6:
                raise TaskDataError(f"{where}: expected 6 fields (question, 4 choices, answer), got {len(r)}")
            if r[5] not in LETTERS:
                raise TaskDataError(f"{where}: answer {r[5]!r} is not one of A, B, C, D")
            rows.append({"subject": subject, "question": r[0], "choices": r[1:5],
                         "answer": LETTERS.index(r[5]), "_source": where})
    return ["subject", "question", "choices", "answer"], rows, str(folder)


def _csv_rows(path: Path) -> list[list[str]]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:      # -sig: a leading BOM is not data
            return list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TaskDataError(f"{path}: not a readable CSV file ({exc})") from None


def _build(splits: dict[str, Split]) -> MMLUData:
    out, digest = {}, hashlib.sha256()
    for split, (columns, rows, source) in splits.items():
        missing = {"subject", "question", "choices", "answer"} - set(columns)
        if missing:
            raise TaskDataError(f"{source}: missing column(s) {', '.join(sorted(missing))}")
        by_subject: dict[str, list[MMLUDoc]] = {}
        for i, r in enumerate(rows):
            where = r.get("_source") or f"{source} row {i}"
            doc = _doc(r, len(by_subject.get(r["subject"], [])), where)
            by_subject.setdefault(doc.subject, []).append(doc)
            digest.update(repr((split, doc)).encode())
        if split == "test" and not by_subject:
            raise TaskDataError(f"{source}: the test split has no questions (0 rows)")
        out[split] = by_subject
    for subject, docs in out["test"].items():
        if len(out["dev"].get(subject, [])) < 5:
            raise TaskDataError(
                f"subject {subject!r} has {len(out['dev'].get(subject, []))} dev rows; 5 are needed for few-shot"
            )
    return MMLUData(dev=out["dev"], test=out["test"], fingerprint=digest.hexdigest()[:16])


def _doc(r: dict, doc_id: int, where: str) -> MMLUDoc:
    choices, answer = r["choices"], r["answer"]
    if not isinstance(r["subject"], str) or not r["subject"]:
        raise TaskDataError(f"{where}: empty subject")
    if not isinstance(r["question"], str):
        raise TaskDataError(f"{where}: question is not text")
    if choices is None or len(choices) != 4:
        raise TaskDataError(f"{where}: expected 4 choices, got {choices!r}")
    if not isinstance(answer, int) or not 0 <= answer < 4:
        raise TaskDataError(f"{where}: answer {answer!r} out of range 0..3")
    return MMLUDoc(r["subject"], doc_id, r["question"], tuple(str(c) for c in choices), answer)
