"""`evalrun compare` and `evalrun regress`: read finished run directories, align them by question
through the task registry, and report paired statistics (evalrun/results/compare.py).

regress gates a nightly job: exit 1 only when the overall metric dropped by at least --max-drop
points AND the paired test says the drop is significant at --alpha; every group's change is
printed with Holm-adjusted p-values, which are reported but never gate.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from evalrun.errors import BadInput
from evalrun.results.compare import OVERALL, Comparison, GroupResult, compare_runs, run_labels
from evalrun.results.compare_format import render
from evalrun.results.errors import CompareError, RunReadError
from evalrun.results.run_reader import RunData, load_finished_run
from evalrun.results.text import terminal_safe
from evalrun.tasks.registry import task_spec
from evalrun.tasks.spec import TaskSpec

EXIT_REGRESSION = 1


def load_runs(paths: Sequence[str], allow_different_data: bool = False) -> tuple[list[RunData], TaskSpec]:
    """Finished runs of one task, or BadInput naming the run and the problem."""
    try:
        runs = [load_finished_run(p) for p in paths]
    except RunReadError as exc:
        raise BadInput(str(exc)) from None
    specs = [run_spec(run.path, run.manifest) for run in runs]
    if len({s.name for s in specs}) > 1:
        tasks = ", ".join(f"{r.path} is {r.manifest.get('task')}" for r in runs)
        raise BadInput(f"the runs are of different tasks and cannot be compared: {tasks}")
    if not allow_different_data:
        _check_same_data(runs)
    return runs, specs[0]


def run_spec(path: Path, manifest: dict[str, Any]) -> TaskSpec:
    """The spec of the task a run's manifest names, or BadInput: `task` must be a task's name and the
    rows keyed as that task keys them (what compare and show both check before reading a row)."""
    task = manifest.get("task")
    if not isinstance(task, str):
        raise BadInput(f"{path}: the manifest's task is {task!r}, not a task name")
    try:
        spec = task_spec(task)
    except ValueError as exc:
        raise BadInput(f"{path}: {exc}") from None
    keys = manifest.get("key_columns")
    if not isinstance(keys, list) or tuple(keys) != spec.key_columns:
        raise BadInput(f"{path}: rows keyed by {keys!r}, but {spec.name} runs are keyed by {list(spec.key_columns)}")
    return spec


def _check_same_data(runs: list[RunData]) -> None:
    """Rows are matched by key (MMLU: subject and position), so runs of other data would pair
    different questions: refuse unless the user says the data differ on purpose."""
    prints = {str(r.path): r.manifest.get("identity", {}).get("data_fingerprint") for r in runs}
    known = {fp for fp in prints.values() if fp is not None}
    if len(known) > 1:
        shown = ", ".join(f"{path} has {str(fp)[:12]}" for path, fp in prints.items())
        raise BadInput(f"the runs were made from different data (data_fingerprint: {shown}), so the same key may "
                       "be another question; pass --allow-different-data to compare them anyway")


def compare_dirs(paths: Sequence[str], baseline: int = 0, by: Optional[str] = None,
                 labels: Optional[Sequence[str]] = None, level: float = 0.95, n_boot: int = 10000,
                 seed: int = 0, selection: Optional[Sequence[tuple]] = None,
                 allow_different_data: bool = False) -> Comparison:
    runs, spec = load_runs(paths, allow_different_data)
    try:
        return compare_runs(runs, spec, baseline, by or spec.default_by, labels, level, n_boot, seed, selection)
    except CompareError as exc:
        raise BadInput(str(exc)) from None


def _check_stats_args(args: argparse.Namespace, default_level: float = 0.95) -> None:
    if args.level is None:
        args.level = default_level
    if not 0 < args.level < 1:
        raise BadInput(f"--level must be between 0 and 1, got {args.level}")
    if args.n_boot < 100:
        raise BadInput(f"--n-boot must be >= 100, got {args.n_boot}")


def run_compare(args: argparse.Namespace) -> int:
    _check_stats_args(args)
    paths = list(args.run_dirs)
    baseline = 0
    if args.baseline is not None:
        resolved = [Path(p).resolve() for p in paths]
        if Path(args.baseline).resolve() in resolved:
            baseline = resolved.index(Path(args.baseline).resolve())
        else:
            paths.insert(0, args.baseline)
    comparison = compare_dirs(paths, baseline, args.by, run_labels(paths), args.level, args.n_boot, args.seed,
                              allow_different_data=args.allow_different_data)
    text = render(comparison, args.format)
    if args.output:
        out = Path(args.output)
        try:
            out.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise BadInput(f"cannot write --output {out}: {exc.strerror or exc}") from None
        print(terminal_safe(f"wrote {out}"), file=sys.stderr)
    else:
        sys.stdout.write(terminal_safe(text))           # the cells are escaped; captions and plot labels too
    return 0


@dataclass(frozen=True)
class GateResult:
    """The regress verdict on one baseline/candidate pair."""
    overall: GroupResult
    drop_points: float                      # baseline minus candidate, in points (positive: worse)
    failed: bool
    comparison: Comparison


def gate(comparison: Comparison, max_drop: float, alpha: float) -> GateResult:
    cand = [h.label for h in comparison.runs if h.label != comparison.baseline][0]
    overall = comparison.result(OVERALL, cand)
    assert overall.delta is not None and overall.p_value is not None
    drop = -overall.delta * 100.0
    # NOTE: 11 of 1000 flipped is -0.011 * 100 = 1.0999999999999999 in floating point: "at least"
    # --max-drop needs a tolerance far below one question's share
    failed = drop >= max_drop - 1e-9 and overall.p_value <= alpha
    return GateResult(overall, drop, failed, comparison)


def check_gate_args(max_drop: float, alpha: float) -> None:
    if not max_drop >= 0:
        raise BadInput(f"--max-drop must be >= 0 points, got {max_drop}")
    if not 0 < alpha < 1:
        raise BadInput(f"--alpha must be between 0 and 1, got {alpha}")


def regress_comparison(base_dir: str, cand_dir: str, by: Optional[str] = None, level: float = 0.95,
                       n_boot: int = 10000, seed: int = 0, allow_different_data: bool = False) -> Comparison:
    """Candidate against baseline, grouped by the task's finest grouping unless `by` says otherwise."""
    runs, spec = load_runs([base_dir, cand_dir], allow_different_data)
    try:
        return compare_runs(runs, spec, 0, by or next(iter(spec.groupings), "none"), ["baseline", "candidate"],
                            level, n_boot, seed)
    except CompareError as exc:
        raise BadInput(str(exc)) from None


def run_regress(args: argparse.Namespace) -> int:
    check_gate_args(args.max_drop, args.alpha)
    _check_stats_args(args, 1 - args.alpha)
    comparison = regress_comparison(args.baseline, args.candidate, args.by, args.level, args.n_boot, args.seed,
                                    args.allow_different_data)
    result = gate(comparison, args.max_drop, args.alpha)
    print(terminal_safe(format_gate(result, args.max_drop, args.alpha, args.baseline, args.candidate)))
    return EXIT_REGRESSION if result.failed else 0


def format_gate(result: GateResult, max_drop: float, alpha: float, base_dir: str, cand_dir: str) -> str:
    c, o = result.comparison, result.overall
    cand = o.run
    lines = [f"{c.task} {c.metric}: baseline {base_dir}", f"{' ' * len(c.task + c.metric)}   candidate {cand_dir}"]
    groups = [g for g in c.group_names() if g != OVERALL]
    if groups:
        width = max(len(g) for g in groups + [OVERALL])
        lines += ["", f"{'group':<{width}}  {'n':>5}  {'baseline':>8}  {'candidate':>9}  {'delta pts':>9}  "
                      f"{'p':>8}  {'p Holm':>8}  to right/wrong"]
        for g in groups:
            b, r = c.result(g, c.baseline), c.result(g, cand)
            lines.append(f"{g:<{width}}  {r.n:>5}  {b.metric:>8.4f}  {r.metric:>9.4f}  {100 * r.delta:>+9.2f}  "
                         f"{r.p_value:>8.3g}  {r.p_holm if r.p_holm is not None else r.p_value:>8.3g}  "
                         f"{r.to_correct}/{r.to_wrong}")
    b = c.result(OVERALL, c.baseline)
    lines += ["", f"overall: {o.n} {c.unit}s shared, baseline {b.metric:.4f}, candidate {o.metric:.4f}, "
                  f"delta {100 * o.delta:+.2f} points ({c.level:.0%} CI {100 * o.ci_low:+.2f} to "
                  f"{100 * o.ci_high:+.2f}), p = {o.p_value:.3g} ({o.method}), "
                  f"{o.to_correct} to right / {o.to_wrong} to wrong"]
    left = [f"{h.run_dir}: {h.left_out} left out" for h in c.runs if h.left_out]
    if left:
        lines.append("not in both runs: " + "; ".join(left))
    significant = o.p_value <= alpha
    if result.failed:
        verdict = (f"REGRESSION: dropped {result.drop_points:.2f} points (>= {max_drop:g}) and p = "
                   f"{o.p_value:.3g} <= alpha {alpha:g}")
    elif result.drop_points >= max_drop - 1e-9:
        verdict = (f"ok: dropped {result.drop_points:.2f} points, but not significantly "
                   f"(p = {o.p_value:.3g} > {alpha:g})")
    else:
        verdict = (f"ok: change {-result.drop_points:+.2f} points, within --max-drop {max_drop:g}"
                   + (" (significant)" if significant else ""))
    return "\n".join(lines + [verdict])
