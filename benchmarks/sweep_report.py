"""Issue 11, acceptance 2: the table, markdown and HTML report of a real cache-mode sweep, and the
HTML opened in headless Chromium without network (tests/test_report_html.py's check).

    python -m evalrun mmlu --data-dir ../shared/data/mmlu --dtype float32 --limit 30 \\
        --subjects <10 subjects> --cache-mode fp32,bf16,fp16,q8,q6,q4 --output-dir bench_out/sweep_smollm2
    python -m benchmarks.sweep_report --sweep-dir bench_out/sweep_smollm2 --out bench_out/sweep_report
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from evalrun.commands.cli import main as evalrun


def run(sweep_dir: Path, out: Path, by: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    modes = sorted(p.name for p in sweep_dir.iterdir() if (p / "manifest.json").is_file())
    order = [m for m in ("fp32", "bf16", "fp16", "q8", "q6", "q4") if m in modes] + \
        [m for m in modes if m not in ("fp32", "bf16", "fp16", "q8", "q6", "q4")]
    dirs = [str(sweep_dir / m) for m in order]
    for fmt, name in (("table", "table.txt"), ("markdown", "report.md"), ("csv", "report.csv"),
                      ("json", "report.json"), ("html", "report.html")):
        status = evalrun(["compare", *dirs, "--by", by, "--format", fmt, "--output", str(out / name)])
        if status:
            return status
    print((out / "table.txt").read_text())
    check = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_report_html.py", "-k",
                            "given_report"], env={**os.environ, "EVALRUN_REPORT": str((out / "report.html").resolve())},
                           cwd=Path(__file__).parents[1])
    return check.returncode


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path("bench_out/sweep_report"))
    p.add_argument("--by", default="subject")
    a = p.parse_args()
    raise SystemExit(run(a.sweep_dir, a.out, a.by))
