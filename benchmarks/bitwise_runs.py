"""Are a real model's MMLU log-probs bitwise the same at any batch size and after a kill? (issue 39, item 4)

Runs `evalrun mmlu` on the demo model (or --model) several times into fresh directories: at
--max-batch-size 1, 8 and the default, then once more at batch 2 killed (SIGKILL) after a few
result parts are on disk and resumed at the default batch. Every run's choice log-probs are
compared to the default run's, bit for bit. Prints one line per run and writes a JSON record.

    python -m benchmarks.bitwise_runs [--dtype bfloat16] [--subjects a,b,c,d] [--limit 10]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from benchmarks.common import DEFAULT_MMLU_DIR, write_result


def _cmd(args: argparse.Namespace, out: Path, *extra: str) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return [sys.executable, "-m", "evalrun", "mmlu", "--no-progress", "--dtype", args.dtype, *model,
            "--data-dir", args.data_dir, "--subjects", args.subjects, "--limit", str(args.limit),
            "--output-dir", str(out), *extra]


def _logprobs(out: Path) -> tuple[list[str], np.ndarray, dict[str, Any]]:
    df = pd.read_parquet(out / "samples.parquet").sort_values(["subject", "doc_id"]).reset_index(drop=True)
    manifest = json.loads((out / "manifest.json").read_text())
    return list(df.prediction), np.stack(list(df.choice_logprobs)), manifest


def _killed_then_resumed(args: argparse.Namespace, out: Path) -> float:
    """Seconds until the kill; the run resumed to the end."""
    proc = subprocess.Popen(_cmd(args, out, "--flush-rows", "3", "--max-batch-size", "2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start, deadline = time.time(), time.time() + 600
    while time.time() < deadline and len(list((out / "samples").glob("part-*.parquet"))) < 3:
        if proc.poll() is not None:
            raise RuntimeError("the run ended before it could be killed: use more questions")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.time() - start
    if (out / "samples.parquet").exists():
        raise RuntimeError("the run finished before it was killed")
    subprocess.run(_cmd(args, out), check=True, stdout=subprocess.DEVNULL)
    return killed_at


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bitwise_runs", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--data-dir", default=DEFAULT_MMLU_DIR)
    p.add_argument("--subjects", default="abstract_algebra,anatomy,astronomy,business_ethics")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("bench_out/bitwise_runs.json"))
    args = p.parse_args(argv)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("default", ()), ("batch-1", ("--max-batch-size", "1")),
                            ("batch-8", ("--max-batch-size", "8"))):
            out = Path(tmp) / name
            subprocess.run(_cmd(args, out, *extra), check=True, stdout=subprocess.DEVNULL)
            runs[name] = _logprobs(out)
        out = Path(tmp) / "killed"
        killed_at = _killed_then_resumed(args, out)
        runs["killed-resumed"] = _logprobs(out)
    base_pred, base, manifest = runs["default"]
    result: dict[str, Any] = {"dtype": manifest["dtype"], "deterministic": manifest["deterministic"],
                              "kernels": manifest["kernels"], "questions": len(base_pred),
                              "killed_after_s": round(killed_at, 2), "runs": {}}
    for name, (pred, lp, _) in runs.items():
        same = lp.shape == base.shape and np.array_equal(lp.view(np.uint32), base.view(np.uint32))
        result["runs"][name] = {"bitwise_equal_to_default": bool(same), "same_predictions": pred == base_pred}
        print(f"{name:16s} log-probs bitwise equal to the default run: {same}; predictions equal: {pred == base_pred}")
    result["all_bitwise_equal"] = all(r["bitwise_equal_to_default"] for r in result["runs"].values())
    print(f"{result['questions']} questions, dtype {result['dtype']}, deterministic {result['deterministic']}, "
          f"linear {result['kernels'].get('linear')}: all bitwise equal: {result['all_bitwise_equal']}")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
