"""`--ray`: how many rows a second the driver alone can take in, and 1 vs 2 replicas (1 CPU each).

    python -m benchmarks.bench_ray_driver driver                      # no Ray: Dispatcher + store, fake replicas
    unshare -n sh -c 'ip link set lo up && exec python -m benchmarks.bench_ray_driver ray-driver scaling'

driver      the dispatcher and RunStore with in-process fake replicas (benchmarks/fake_replicas.py)
            sending MMLU-shaped rows in batches of --batch-rows: the driver's own ceiling, rows/s
ray-driver  the same through Ray: 2 fake actors (no model) streaming those rows, so Ray's per-message
            cost is in; rows/s from the first actor ready to the last row stored
scaling     `evalrun mmlu --ray --replicas 1`, then `--replicas 2` (--cpus-per-replica 1: one torch thread
            each), SmolLM2 on --subjects x --limit of MMLU, 5-shot, in ABBA order over --rounds pairs;
            wall of the dispatch and the median ratio, beside a single-process run with one torch
            thread; the rows of every run must be equal

Ray modes refuse to run outside a private network namespace (shared/FIELD_NOTES.md: Ray binds the
machine's address). Figures are wall clock on this machine; read them as ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_MMLU_DIR, DEFAULT_OUT_DIR, machine_info, positive_int, write_result
from benchmarks.fake_replicas import FakeBackend, FakeSpec, mmlu_like_row
from evalrun.scale.dispatch import Dispatcher, Limits
from evalrun.scale.units import Parcel

SUBJECTS = "philosophy,nutrition,high_school_biology,high_school_geography,prehistory,marketing"


def _parcels(docs: int, per_parcel: int) -> list[Parcel]:
    keys = [(f"subject_{i // per_parcel}", i % per_parcel) for i in range(docs)]
    return [Parcel(f"subject_{j}", (f"subject_{j}",), tuple(keys[j * per_parcel:(j + 1) * per_parcel]), per_parcel)
            for j in range(-(-docs // per_parcel))]


def _store_intake(out: Path) -> Any:
    from evalrun.scale.ray_run import StoreIntake
    from evalrun.results import RunStore
    store = RunStore.open(out, {"identity": {"bench": "ray-driver"}}, ("subject", "doc_id"))
    return store, StoreIntake(out, store, {"run_id": "bench", "task": "mmlu", "cache_mode": "fp32"})


def _key(row: dict[str, Any]) -> tuple:
    return row["subject"], row["doc_id"]


def bench_driver(docs: int, batch_rows: int, replicas: int) -> dict[str, Any]:
    """rows/s through Dispatcher + StoreIntake + RunStore (flushes and the final merge included)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, intake = _store_intake(Path(tmp) / "run")
        backend = FakeBackend(mmlu_like_row, batch_rows, step=0.0)
        t0 = time.perf_counter()
        with store:
            report = Dispatcher(backend, _parcels(docs, 100), replicas, _key, intake, clock=backend.clock,
                                log=lambda line: None).run()
            taken = time.perf_counter() - t0
            store.finalize()
        total = time.perf_counter() - t0
    assert report.rows == docs
    return {"mode": "driver", "docs": docs, "batch_rows": batch_rows, "replicas": replicas,
            "rows_per_s": round(docs / taken), "rows_per_s_with_finalize": round(docs / total)}


def bench_ray_driver(docs: int, batch_rows: int, replicas: int) -> dict[str, Any]:
    """rows/s of fake Ray actors streaming rows into the store (actor start excluded)."""
    from evalrun.scale.ray_backend import RayBackend, ray_instance
    from evalrun.scale.ray_run import RayOptions
    opts = RayOptions(replicas, batch_rows=batch_rows)
    spec = FakeSpec(batch_rows=batch_rows)
    with tempfile.TemporaryDirectory() as tmp, ray_instance(opts):
        store, intake = _store_intake(Path(tmp) / "run")
        with store, RayBackend(spec, opts) as backend:
            t0 = time.perf_counter()
            report = Dispatcher(backend, _parcels(docs, 100), replicas, _key, intake, log=lambda line: None).run()
            started = time.perf_counter() - t0 - max(a["start_seconds"] for a in report.actors)
    assert report.rows == docs, report.record()
    return {"mode": "ray-driver", "docs": docs, "batch_rows": batch_rows, "replicas": replicas,
            "seconds": round(started, 3), "rows_per_s": round(docs / started)}


def _ray_run(base: list[str], out: str, n: int) -> dict[str, Any]:
    from evalrun.commands.cli import main
    t0 = time.perf_counter()
    assert main([*base, "--output-dir", out, "--ray", "--replicas", str(n), "--cpus-per-replica", "1"]) == 0
    ray = json.loads(Path(out, "manifest.json").read_text())["ray"]
    first_ready = min(a["start_seconds"] for a in ray["actors"])
    return {"replicas": n, "command_wall_s": round(time.perf_counter() - t0, 2), "dispatch_wall_s": ray["wall_seconds"],
            "after_first_ready_s": round(ray["wall_seconds"] - first_ready, 2), "parcels": ray["parcels"],
            "cap_tokens": ray["parcel_cap_tokens"], "parcels_per_replica": [a["parcels"] for a in ray["actors"]],
            "retries": len(ray["retries"])}


def bench_scaling(model: Path, data_dir: Path, subjects: str, limit: int, rounds: int) -> dict[str, Any]:
    """1 vs 2 replicas of one CPU each on the same questions, in ABBA order over `rounds` pairs, beside
    one process with one thread; the rows of every run must be equal."""
    import statistics

    import pandas as pd
    import torch

    from evalrun.commands.cli import main
    result: dict[str, Any] = {"mode": "scaling", "subjects": subjects, "limit": limit, "rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = ["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(data_dir), "--subjects", subjects,
                "--limit", str(limit), "--dtype", "float32"]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        assert main([*base, "--output-dir", f"{tmp}/single"]) == 0
        result["single_1_thread_wall_s"] = round(time.perf_counter() - t0, 2)
        torch.set_num_threads(threads)
        dirs = [f"{tmp}/single"]
        for r in range(rounds):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            runs = {n: _ray_run(base, f"{tmp}/round{r}-r{n}", n) for n in order}
            dirs += [f"{tmp}/round{r}-r{n}" for n in order]
            result["rounds"].append({"order": list(order), "ray_1": runs[1], "ray_2": runs[2],
                                     "speedup": {k: round(runs[1][k] / runs[2][k], 3)
                                                 for k in ("dispatch_wall_s", "after_first_ready_s")}})
            print(json.dumps(result["rounds"][-1]), file=sys.stderr, flush=True)
        rows = [pd.read_parquet(f"{d}/samples.parquet").sort_values(["subject", "doc_id"]) for d in dirs]
        same = [[r[c].map(str).tolist() for c in ("prediction", "choice_logprobs")] for r in rows]
        result["rows_equal"] = all(s == same[0] for s in same[1:])
        result["questions"] = len(rows[0])
    result["speedup_2_over_1_median"] = {k: statistics.median(r["speedup"][k] for r in result["rounds"])
                                         for k in ("dispatch_wall_s", "after_first_ready_s")}
    return result


def _in_private_netns() -> bool:
    """Loopback is this process's only network interface (/proc/self/net/dev is per namespace;
    /sys/class/net shows the namespace sysfs was mounted in)."""
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_ray_driver", description=__doc__.split("\n")[0])
    p.add_argument("modes", nargs="*", choices=("driver", "ray-driver", "scaling"), default=["driver"])
    p.add_argument("--docs", type=positive_int, default=20000, help="rows of the driver benchmarks (default 20000)")
    p.add_argument("--batch-rows", type=positive_int, default=32, help="rows per message (default 32)")
    p.add_argument("--model", type=Path, help="scaling: the model (default: the SmolLM2 demo model)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_MMLU_DIR, help="scaling: MMLU (default: shared/data/mmlu)")
    p.add_argument("--subjects", default=SUBJECTS, help=f"scaling: MMLU subjects (default {SUBJECTS})")
    p.add_argument("--limit", type=positive_int, default=16, help="scaling: questions per subject (default 16)")
    p.add_argument("--rounds", type=positive_int, default=2, help="scaling: ABBA pairs of 1 and 2 replicas (default 2)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "bench_ray_driver.json")
    args = p.parse_args(argv)
    if {"ray-driver", "scaling"} & set(args.modes) and not _in_private_netns():
        print("the Ray modes run only in a private network namespace: unshare -n sh -c 'ip link set lo up && exec "
              "python -m benchmarks.bench_ray_driver ...'", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    for mode in args.modes:
        if mode == "driver":
            new = [bench_driver(args.docs, b, 4) for b in sorted({1, 8, args.batch_rows})]
        elif mode == "ray-driver":
            new = [bench_ray_driver(args.docs, b, 2) for b in sorted({1, args.batch_rows})]
        else:
            from evalrun.demo import ensure_demo_model
            new = [bench_scaling(args.model or ensure_demo_model(), args.data_dir, args.subjects, args.limit,
                                 args.rounds)]
        for r in new:
            print(json.dumps(r), flush=True)
        results += new
    write_result(args.out, {"machine": machine_info(), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
