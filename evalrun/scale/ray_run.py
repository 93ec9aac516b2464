"""`--ray`: a run's remaining documents computed by N Ray replicas while this process alone writes
the run directory: the same manifest, parts, resume and summary as a single-process run, so
either kind of run resumes the other.

    ray_options(RayRequest, cfg) ──► RayOptions (checked before anything loads; BadInput = exit 2)
    ray_generate(prepared)
      the documents not stored yet ──► replica_parcels (prefix groups kept whole, largest first)
      ray_instance ──► RunStore.open ──► RayBackend (N Replica actors) ──► Dispatcher.run()
          rows ──► StoreIntake: {row_base, **row} into the store (HumanEval --execute-on driver:
                   executed in this machine's sandbox first), prompts before the rows that use them
      ──► the single-process finish: samples.parquet, summary, this session's manifest entry with
          "ray" (actors, retries, failed parcels); parcels that failed everywhere: exit 1

Ctrl-C or SIGTERM: the `with` blocks end the actors, flush the rows received and stop a local
Ray instance. Rows still executing in the driver's sandbox then are computed again on resume.
"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from evalrun.errors import BadInput, RunFailed
from evalrun.results import RunStore, throughput, write_prompts
from evalrun.run.config import RayOptions, RayRequest
from evalrun.run.engine_config import EngineConfig
from evalrun.run.pipeline import PreparedRun, Session, all_skipped_status, finish_session, open_store, say_resuming
from evalrun.scale.dispatch import Dispatcher, Limits
from evalrun.scale.ray_actor import ReplicaHooks, ReplicaSpec
from evalrun.scale.ray_backend import RayBackend, ray_instance, require_ray
from evalrun.scale.units import replica_parcels
from evalrun.tasks.base import NONFINITE_COLUMN

__all__ = ["RayOptions", "StoreIntake", "ray_options", "ray_generate", "replica_hooks"]

PAUSE_ENV = "EVALRUN_TEST_PAUSE_REPLICA"      # tests: ROWS:PIDFILE (evalrun/scale/ray_actor.py ReplicaHooks)
DELAY_ENV = "EVALRUN_TEST_REPLICA_DELAY"      # tests: SECONDS after each message
FAIL_ENV = "EVALRUN_TEST_FAIL_DOC"            # tests: a document key (JSON) whose parcel raises everywhere
def ray_options(req: RayRequest, cfg: EngineConfig, execute_on: Optional[str] = None) -> Optional[RayOptions]:
    """The --ray settings (None without --ray); BadInput for a flag that needs --ray, a bad value, or
    Ray not installed. `execute_on`: where a task with a context (HumanEval) scores its rows."""
    if not req.enabled:
        given = req.given()
        if given:
            raise BadInput(f"{given[0]} needs --ray")
        if execute_on == "replica":
            raise BadInput("--execute-on replica needs --ray (without it everything runs in this process)")
        return None
    if req.replicas is None:
        raise BadInput("--ray needs --replicas N, the number of model replicas to run")
    cuda = cfg.device.startswith("cuda")
    if cfg.device not in ("cpu", "cuda"):
        raise BadInput(f"--ray gives each replica a device of its own: use --device cuda, not {cfg.device}")
    opts = RayOptions(req.replicas, req.address, _or(req.gpus_per_replica, 1.0 if cuda else 0.0),
                      _or(req.cpus_per_replica, 1.0), _or(req.timeout, 600.0), _or(req.batch_rows, 32), execute_on)
    _check(opts, cuda)
    require_ray()
    return opts


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check(opts: RayOptions, cuda: bool) -> None:
    if opts.replicas < 1:
        raise BadInput(f"--replicas must be >= 1, got {opts.replicas}")
    if opts.gpus_per_replica < 0 or opts.cpus_per_replica <= 0:
        raise BadInput("--gpus-per-replica must be >= 0 and --cpus-per-replica > 0, got "
                       f"{opts.gpus_per_replica:g} and {opts.cpus_per_replica:g}")
    if cuda and opts.gpus_per_replica == 0:
        raise BadInput("--device cuda with --gpus-per-replica 0: a replica would see no GPU; give it one or more")
    if not opts.timeout > 0 or opts.batch_rows < 1:
        raise BadInput(f"--ray-timeout must be > 0 and --ray-batch-rows >= 1, got {opts.timeout:g} and "
                       f"{opts.batch_rows}")


@dataclass
class StoreIntake:
    """Rows from the replicas into the store in arrival order, after the run's row_base; with `finish`
    (HumanEval --execute-on driver) a generated row is stored once its execution here is done."""
    run_dir: Path
    store: RunStore
    row_base: dict[str, Any]
    finish: Optional[Callable[[dict[str, Any]], Future]] = None
    rows: int = 0
    nonfinite: int = 0
    skipped: int = 0
    _prompts: set[str] = field(default_factory=set)
    _executing: set[Future] = field(default_factory=set)

    def add(self, rows: list[dict[str, Any]], prompts: Mapping[str, str]) -> None:
        new = {h: text for h, text in prompts.items() if h not in self._prompts}
        if new:
            write_prompts(self.run_dir, new)          # before the rows that reference them
            self._prompts.update(new)
        for row in rows:
            row = {**self.row_base, **row}
            if self.finish is not None and not row.get("skipped"):
                self._executing.add(self.finish(row))
            else:
                self._store(row)

    def tick(self) -> None:
        for fut in [f for f in self._executing if f.done()]:
            self._executing.discard(fut)
            self._store(fut.result())

    def drain(self, timeout: float) -> None:
        """Store the executions still running, waiting at most `timeout` seconds for them."""
        done, late = wait(set(self._executing), timeout=timeout)
        for fut in done:
            self._executing.discard(fut)
            self._store(fut.result())
        if late:
            print(f"warning: {len(late)} rows were still executing after {timeout:g} s; they are not stored and a "
                  "rerun computes them", file=sys.stderr)

    def _store(self, row: dict[str, Any]) -> None:
        self.store.add(row)
        self.rows += not row.get("skipped")
        self.skipped += bool(row.get("skipped"))
        self.nonfinite += bool(row.get(NONFINITE_COLUMN))


def replica_hooks() -> Optional[ReplicaHooks]:
    """The tests' ReplicaHooks from $EVALRUN_TEST_PAUSE_REPLICA, $EVALRUN_TEST_REPLICA_DELAY and
    $EVALRUN_TEST_FAIL_DOC (None: all unset)."""
    pause, delay, fail = os.environ.get(PAUSE_ENV), os.environ.get(DELAY_ENV), os.environ.get(FAIL_ENV)
    if not pause and not delay and not fail:
        return None
    rows, _, path = (pause or "").partition(":")
    return ReplicaHooks(int(rows) if rows else None, path, float(delay or 0),
                        tuple(json.loads(fail)) if fail else None)


def ray_generate(p: PreparedRun) -> int:
    """Compute what `p` has left on Ray replicas (see the module's diagram); returns 0, or raises
    RunFailed naming the parcels that failed on every replica once everything else is written."""
    opts, run = p.ray, p.run
    assert opts is not None and p.cfg is not None and p.model_dir is not None
    say_resuming(run, p.todo)
    parcels, cap = replica_parcels(run.task.restricted([k for k in p.todo.keys if k not in p.todo.done]),
                                   opts.replicas)
    spec = ReplicaSpec(p.cfg, str(p.model_dir), run.task, max(1, int(opts.cpus_per_replica)),
                       generate_only=p.finish_row is not None, setup=p.replica_setup, on_nonfinite=run.on_nonfinite,
                       batch_rows=opts.batch_rows, heartbeat_seconds=min(5.0, opts.timeout / 3))
    columns = run.task.key_columns
    with ray_instance(opts) as where, open_store(run) as store, RayBackend(spec, opts, replica_hooks()) as backend:
        intake = StoreIntake(run.out_dir, store, {"run_id": store.manifest["run_id"], "task": run.task.name,
                                                  "cache_mode": p.cfg.cache_mode}, p.finish_row)
        print(f"ray: {len(parcels)} parcels (at most {cap} estimated tokens each, largest first) for "
              f"{opts.replicas} replicas on {where['address']} {where['resources']}", file=sys.stderr, flush=True)
        t0 = time.time()
        report = Dispatcher(backend, parcels, opts.replicas, lambda row: tuple(row[c] for c in columns), intake,
                            seen=store.completed_keys(), limits=Limits(opts.timeout)).run()
        backend.close()
        intake.drain(opts.timeout)
        stats = report.generator_totals()
        record: dict[str, Any] = {"ray": {**opts.record(), **report.record(), "parcel_cap_tokens": cap,
                                          "wall_seconds": round(time.time() - t0, 3)}}
        setups = [a["setup"] for a in report.actors if a.get("setup")]
        if setups:                               # --execute-on replica: the first replica's sandbox
            record["sandbox"] = run.manifest["sandbox"] = {**setups[0], "execute_on": "replica"}
        session = Session(intake.rows, intake.nonfinite, stats,
                          throughput(stats.get("prompt_tokens", 0), stats.get("prefill_tokens", 0), time.time() - t0,
                                     stats.get("generated_tokens", 0)),
                          skipped=intake.skipped, cache_fits=_cache_fits(report.actors), record=record)
        rows, per, overall = finish_session(run, p.todo, store, session)
    p.report(rows, per, overall, session.throughput, run.out_dir)
    if report.failed:
        raise RunFailed(_failure_message(report.failed))
    return all_skipped_status(run, rows)


def _cache_fits(actors: list[dict[str, Any]]) -> Optional[int]:
    """The prompt length the replicas' caches cut at, where shorter than the model's context."""
    cut = [a["fits"] for a in actors if "fits" in a and a["fits"] < a.get("max_seq_len", a["fits"] + 1)]
    return min(cut) if cut else None


def _failure_message(failed: list[dict[str, Any]]) -> str:
    docs = sum(f["docs"] for f in failed)
    shown = "; ".join(f"{f['parcel']} ({f['docs']} documents): {f['error']}" for f in failed[:3])
    more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
    return (f"{len(failed)} parcel(s) failed on every replica tried, {docs} documents not stored: {shown}{more}. "
            "Everything else is stored (the manifest's ray.retries has each attempt); rerunning the same command "
            "computes only what is missing")
