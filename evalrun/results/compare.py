"""Compare finished runs of one task question by question: per group and overall, each run's
metric with its standard error, and against the baseline the paired delta with its interval,
the p-value and how many questions flipped each way.

    RunData ×N ──► align on the rows all runs share (the rest counted per run, never dropped
    silently) ──► units (a question, or a HumanEval problem with its samples) ──► per group:
    exact McNemar + exact paired interval when every unit is one pass/fail row, else a paired
    bootstrap of the mean unit score ──► Comparison (one record; evalrun/results/compare_format.py
    prints it)

What a task's rows mean comes from a `MetricSpec` (evalrun/tasks/registry.py's TaskSpec is one).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

import numpy as np
import pandas as pd

from evalrun.results.errors import CompareError
from evalrun.results.paired_stats import PairedComparison, compare_binary, compare_units, holm
from evalrun.results.run_reader import RunData, manifest_value

OVERALL = "overall"


class MetricSpec(Protocol):
    name: str
    key_columns: tuple[str, ...]
    metric: str
    aggregate: str
    unit_columns: tuple[str, ...]
    unit_score: Callable[[int, int], float]
    groupings: Mapping[str, Callable[[tuple], str]]
    group_order: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class RunHeader:
    """One run's column head, from its manifest (None: the manifest does not say)."""
    label: str
    run_dir: str
    task: str
    model: Optional[str]
    dtype: Optional[str]
    cache_mode: Optional[str]
    cache_window: Optional[int]
    bytes_per_token: Optional[int]
    wall_seconds: Optional[float]               # all sessions of the run
    tokens_per_s: Optional[float]               # (prompt + generated) tokens / wall, all sessions
    dedup_ratio: Optional[float]                # prompt tokens / prompt tokens computed
    evalrun_version: Optional[str]
    git_sha: Optional[str]
    rows: int                                   # stored rows, skipped included
    skipped: int                                # rows stored as skipped (prompt did not fit)
    left_out: int                               # scored rows (of the selection) not shared by every run


@dataclass(frozen=True)
class GroupResult:
    """One run in one group. Delta fields are None for the baseline itself."""
    group: str
    run: str
    n: int                                      # units compared (questions, or problems)
    metric: float
    stderr: float
    delta: Optional[float] = None
    ci_low: Optional[float] = None
    ci_high: Optional[float] = None
    p_value: Optional[float] = None
    p_holm: Optional[float] = None              # Holm-adjusted over the groups (not overall)
    to_correct: Optional[int] = None
    to_wrong: Optional[int] = None
    method: Optional[str] = None


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str                                 # "accuracy", "pass@1"
    unit: str                                   # "question", "problem"
    by: str
    baseline: str                               # the baseline run's label
    level: float
    method: str                                 # "mcnemar-exact" or "bootstrap"
    shared_rows: int
    runs: list[RunHeader]
    results: list[GroupResult]                  # groups in order, then overall; runs in order within

    def group_names(self) -> list[str]:
        return list(dict.fromkeys(r.group for r in self.results))

    def result(self, group: str, run: str) -> GroupResult:
        return next(r for r in self.results if r.group == group and r.run == run)

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))


def compare_runs(runs: Sequence[RunData], spec: MetricSpec, baseline: int = 0, by: str = "none",
                 labels: Optional[Sequence[str]] = None, level: float = 0.95, n_boot: int = 10000,
                 seed: int = 0, selection: Optional[Iterable[tuple]] = None) -> Comparison:
    """Every run against runs[baseline] on the rows they all share; with `selection` (row keys),
    only on those rows (a sweep's current --subjects/--limit): other stored rows are out of scope."""
    if not runs:
        raise CompareError("no runs to compare")
    if by != "none" and by not in spec.groupings:
        choices = ", ".join([*spec.groupings, "none"])
        raise CompareError(f"{spec.name} runs cannot be grouped by {by!r}; choose one of: {choices}")
    labels = list(labels) if labels is not None else run_labels([str(r.path) for r in runs])
    scored = [_scored(r, spec) for r in runs]
    if selection is not None:
        wanted = set(selection)
        scored = [f[[k in wanted for k in f.index]] for f in scored]
    shared = _shared_keys(scored, labels, [len(r.rows) for r in runs])
    matrix = np.stack([frame.loc[shared, spec.metric].to_numpy(dtype=bool) for frame in scored])   # [runs, rows]
    units, counts = _units(shared, spec)
    per_run = np.stack([np.add.reduceat(m.astype(np.int64), counts.starts) for m in matrix])        # passes per unit
    binary = bool(np.all(counts.sizes == 1))
    scores = per_run.astype(bool) if binary else np.vectorize(spec.unit_score)(counts.sizes, per_run)
    groups = _groups(units, spec, by)
    results: list[GroupResult] = []
    for name, idx in [*groups, (OVERALL, np.arange(len(units)))]:
        results += _group_results(name, idx, scores, labels, baseline, binary, level, n_boot, seed)
    results = _with_holm(results, [g for g, _ in groups], labels, baseline)
    headers = [_header(r, label, frame, len(shared)) for r, label, frame in zip(runs, labels, scored)]
    unit = "question" if spec.unit_columns == spec.key_columns else "problem"
    return Comparison(spec.name, spec.aggregate, unit, by, labels[baseline], level,
                      "mcnemar-exact" if binary else "bootstrap", len(shared), headers, results)


def run_labels(paths: Sequence[str]) -> list[str]:
    """Short distinct names: the directory's last component, more of the path where those clash."""
    parts = [[p for p in path.rstrip("/").split("/") if p] or [path] for path in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{label} #{i + 1}" for i, label in enumerate("/".join(p) for p in parts)]


# ------------------------------------------------------------------------------ alignment

def _scored(run: RunData, spec: MetricSpec) -> pd.DataFrame:
    frame = run.rows
    if "skipped" in frame.columns:
        frame = frame[~frame["skipped"].fillna(False).astype(bool)]
    if spec.metric not in frame.columns and len(frame):
        raise CompareError(f"{run.path}: rows lack the {spec.name} metric column {spec.metric!r}")
    if len(frame) and frame[spec.metric].isna().any():
        raise CompareError(f"{run.path}: {int(frame[spec.metric].isna().sum())} scored rows have no "
                           f"{spec.metric!r} value")
    return frame.set_index(list(spec.key_columns)).sort_index()


def _shared_keys(frames: list[pd.DataFrame], labels: list[str], stored: list[int]) -> pd.Index:
    empty = [f"{label} ({n} rows stored, all skipped)" if n else f"{label} (no rows)"
             for label, f, n in zip(labels, frames, stored) if len(f) == 0]
    if empty:
        raise CompareError(f"nothing to compare: no scored rows in {', '.join(empty)}")
    shared = frames[0].index
    for frame in frames[1:]:
        shared = shared.intersection(frame.index)
    if len(shared) == 0:
        sizes = ", ".join(f"{label} has {len(f)}" for label, f in zip(labels, frames))
        raise CompareError(f"the runs share no scored rows ({sizes}): they evaluated different questions")
    return shared.sort_values()


@dataclass(frozen=True)
class _Counts:
    starts: np.ndarray          # first row of each unit in the sorted shared rows
    sizes: np.ndarray           # rows per unit


def _units(shared: pd.Index, spec: MetricSpec) -> tuple[list[tuple], _Counts]:
    positions = [spec.key_columns.index(c) for c in spec.unit_columns]
    keys = [tuple(k[i] for i in positions) if isinstance(k, tuple) else (k,) for k in shared]
    starts = [i for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
    sizes = np.diff([*starts, len(keys)])
    return [keys[i] for i in starts], _Counts(np.asarray(starts), np.asarray(sizes))


def _groups(units: list[tuple], spec: MetricSpec, by: str) -> list[tuple[str, np.ndarray]]:
    if by == "none":
        return []
    names = [str(spec.groupings[by](u)) for u in units]
    listed = spec.group_order.get(by, ())
    order = sorted(set(names), key=lambda g: (listed.index(g) if g in listed else len(listed), g))
    arr = np.asarray(names, dtype=object)
    return [(g, np.flatnonzero(arr == g)) for g in order]


# ------------------------------------------------------------------------------ statistics

def _group_results(group: str, idx: np.ndarray, scores: np.ndarray, labels: list[str], baseline: int,
                   binary: bool, level: float, n_boot: int, seed: int) -> list[GroupResult]:
    base = scores[baseline, idx]
    out = []
    for i, label in enumerate(labels):
        cand = scores[i, idx]
        c: PairedComparison = (compare_binary(base, cand, level) if binary
                               else compare_units(base, cand, level, n_boot, seed))
        if i == baseline:
            out.append(GroupResult(group, label, c.n, c.base_metric, c.base_stderr))
        else:
            out.append(GroupResult(group, label, c.n, c.cand_metric, c.cand_stderr, c.delta, c.ci_low, c.ci_high,
                                   c.p_value, None, c.to_correct, c.to_wrong, c.method))
    return out


def _with_holm(results: list[GroupResult], groups: list[str], labels: list[str], baseline: int) -> list[GroupResult]:
    """Each candidate's group p-values adjusted together (Holm); overall keeps its own p."""
    if len(groups) < 2:
        return results
    adjusted: dict[tuple[str, str], float] = {}
    for i, label in enumerate(labels):
        if i == baseline:
            continue
        rows = [r for r in results if r.run == label and r.group != OVERALL]
        for r, p in zip(rows, holm([r.p_value for r in rows])):
            adjusted[(r.group, label)] = p
    return [GroupResult(**{**asdict(r), "p_holm": adjusted[(r.group, r.run)]}) if (r.group, r.run) in adjusted
            else r for r in results]


# ------------------------------------------------------------------------------ headers

def _header(run: RunData, label: str, scored: pd.DataFrame, shared: int) -> RunHeader:
    m = run.manifest
    sessions = [m.get("throughput")] + [s.get("throughput") for s in m.get("resumes", []) if isinstance(s, dict)]
    sessions = [s for s in sessions if isinstance(s, dict)]
    wall = sum(_number(s.get("wall_seconds")) or 0.0 for s in sessions) or None
    prompt = sum(_number(s.get("prompt_tokens")) or 0 for s in sessions)
    tokens = prompt + sum(_number(s.get("generated_tokens")) or 0 for s in sessions)
    computed = sum(_number(s.get("prefill_tokens_computed")) or 0 for s in sessions)
    model, git = manifest_value(m, "model", "path"), manifest_value(m, "environment", "git", "sha")
    version = manifest_value(m, "environment", "packages", "evalrun")
    bytes_per_token, window = _number(m.get("cache_bytes_per_token")), _number(m.get("cache_window"))
    return RunHeader(
        label=label, run_dir=str(run.path), task=str(m.get("task")),
        model=model.rstrip("/").rsplit("/", 1)[-1] if isinstance(model, str) else None,
        dtype=_text(m.get("dtype")), cache_mode=_text(m.get("cache_mode")),
        cache_window=int(window) if window is not None else None,
        bytes_per_token=int(bytes_per_token) if bytes_per_token is not None else None, wall_seconds=wall,
        tokens_per_s=tokens / wall if wall and tokens else None,
        dedup_ratio=prompt / computed if computed else None,
        evalrun_version=_text(version), git_sha=git[:10] if isinstance(git, str) else None,
        rows=len(run.rows), skipped=_skipped(run.rows), left_out=len(scored) - shared)


def _skipped(rows: pd.DataFrame) -> int:
    return int(rows["skipped"].fillna(False).astype(bool).sum()) if "skipped" in rows.columns else 0


def _number(value: Any) -> Optional[float]:
    """A manifest number, or None where the field is missing or not a number (a hand-edited manifest)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _text(value: Any) -> Optional[str]:
    return value if isinstance(value, str) else None


def _finite(obj: Any) -> Any:
    """NaN/inf -> None, recursively (JSON output is strict)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj
