"""MMLU documents: the hub dataset, or local files in the cais/mmlu parquet layout or
the original Hendrycks CSV layout. Everything goes through `datasets`."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import TaskDataError

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
    if data_dir is None:
        import datasets
        ds = datasets.load_dataset("cais/mmlu", "all")
        return _build({"dev": (ds["dev"], "cais/mmlu:dev"), "test": (ds["test"], "cais/mmlu:test")})
    root = Path(data_dir)
    if not root.is_dir():
        raise TaskDataError(f"MMLU data directory not found: {root}")
    if (root / "dev.parquet").is_file() and (root / "test.parquet").is_file():
        return _build({s: (_parquet(root / f"{s}.parquet"), str(root / f"{s}.parquet")) for s in ("dev", "test")})
    if (root / "dev").is_dir() and (root / "test").is_dir():
        return _build({s: _csv_split(root / s, s) for s in ("dev", "test")})
    raise TaskDataError(
        f"{root} holds neither dev.parquet + test.parquet (cais/mmlu layout) nor dev/ + test/ CSV folders "
        f"(Hendrycks layout)"
    )


def _parquet(path: Path):
    import datasets
    return datasets.load_dataset("parquet", data_files=str(path), split="train")


def _csv_split(folder: Path, split: str):
    import datasets
    files = sorted(folder.glob(f"*_{split}.csv"))
    if not files:
        raise TaskDataError(f"no *_{split}.csv files in {folder}")
    rows = {"subject": [], "question": [], "choices": [], "answer": [], "_source": []}
    for f in files:
        subject = f.name[: -len(f"_{split}.csv")]
        table = datasets.load_dataset("csv", data_files=str(f), split="train", column_names=list("qabcde"))
        for i, r in enumerate(table):
            if r["e"] not in LETTERS:
                raise TaskDataError(f"{f} row {i + 1}: answer {r['e']!r} is not one of A, B, C, D")
            rows["subject"].append(subject)
            rows["question"].append(r["q"])
            rows["choices"].append([str(r[c]) for c in "abcd"])
            rows["answer"].append(LETTERS.index(r["e"]))
            rows["_source"].append(f"{f} row {i + 1}")
    return datasets.Dataset.from_dict(rows), str(folder)


def _build(splits) -> MMLUData:
    out, digest = {}, hashlib.sha256()
    for split, (table, source) in splits.items():
        missing = {"subject", "question", "choices", "answer"} - set(table.column_names)
        if missing:
            raise TaskDataError(f"{source}: missing column(s) {', '.join(sorted(missing))}")
        by_subject: dict[str, list[MMLUDoc]] = {}
        for i, r in enumerate(table):
            where = r.get("_source") or f"{source} row {i}"
            doc = _doc(r, len(by_subject.get(r["subject"], [])), where)
            by_subject.setdefault(doc.subject, []).append(doc)
            digest.update(repr((split, doc)).encode())
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
