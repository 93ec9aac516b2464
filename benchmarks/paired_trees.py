"""One benchmark, two source trees, paired: is a change faster or slower than the tree before it?

    python -m benchmarks.paired_trees --before ../tree-before --pairs 3 -- bench_decode --n 32 --skip-baseline --rounds 1

Each pair runs the benchmark once in each tree, in alternating order (AB, BA, AB, ...), every run a
fresh process whose `evalrun` and `benchmarks` are that tree's (it runs with the tree as its working
directory and first sys.path entry). The figure is ours' median seconds of each run's JSON record
(`result["ours"]["seconds"]`); a pair's ratio is after / before (below 1: the change is faster), and
the verdict is the median of the pairs' ratios with their range, since this kind of machine drifts
by tens of percent within minutes.
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

from benchmarks.common import DEFAULT_OUT_DIR

NAME = "paired_trees"


def run_once(tree: Path, bench: str, args: list[str], out: Path) -> float:
    """Seconds of ours in one run of `benchmarks.<bench>` in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", f"benchmarks.{bench}", *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree} ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(json.loads(out.read_text())["ours"]["seconds"])


def pairs(before: Path, after: Path, bench: str, args: list[str], n: int) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            order = [("before", before), ("after", after)] if i % 2 == 0 else [("after", after), ("before", before)]
            secs = {label: run_once(tree, bench, args, Path(tmp) / f"{label}{i}.json") for label, tree in order}
            out.append({**secs, "first": order[0][0], "ratio": secs["after"] / secs["before"]})
            print(f"pair {i}: before {secs['before']:.2f} s, after {secs['after']:.2f} s, "
                  f"after/before {out[-1]['ratio']:.3f} ({order[0][0]} first)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the tree before the change (a git worktree)")
    parser.add_argument("--after", type=Path, default=Path.cwd(), help="the changed tree (default: here)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON record (default: bench_out/paired_trees_<bench>.json)")
    parser.add_argument("bench", help="benchmark module under benchmarks/, e.g. bench_decode")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    args = parser.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    rows = pairs(args.before.resolve(), args.after.resolve(), args.bench, bench_args, args.pairs)
    ratios = [r["ratio"] for r in rows]
    result = {"bench": args.bench, "bench_args": bench_args, "before": str(args.before), "after": str(args.after),
              "pairs": rows, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
              "ratio_max": max(ratios), "loadavg_at_end": os.getloadavg()}
    print(f"{args.bench}: after/before median {result['ratio_median']:.3f} "
          f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    out = args.out or DEFAULT_OUT_DIR / f"{NAME}_{args.bench}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
