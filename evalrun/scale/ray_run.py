"""`--ray`: a run's remaining documents computed by N Ray replicas while this process alone writes
the run directory: the same manifest, parts, resume and summary as a single-process run, so
either kind of run resumes the other.

    ray_options(args, cfg) ──► RayOptions (checked before anything loads; BadInput = exit 2)
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

import argparse
import os
import sys
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from evalrun.errors import BadInput, RunFailed

if TYPE_CHECKING:
    from evalrun.run.engine_config import EngineConfig
    from evalrun.run.pipeline import PreparedRun
    from evalrun.results import RunStore

PAUSE_ENV = "EVALRUN_TEST_PAUSE_REPLICA"      # tests: ROWS:PIDFILE (evalrun/scale/ray_actor.py ReplicaHooks)
DELAY_ENV = "EVALRUN_TEST_REPLICA_DELAY"      # tests: SECONDS after each message
FAIL_ENV = "EVALRUN_TEST_FAIL_DOC"            # tests: a document key (JSON) whose parcel raises everywhere
_RAY_FLAGS = {"ray_address": "--ray-address", "replicas": "--replicas", "gpus_per_replica": "--gpus-per-replica",
              "cpus_per_replica": "--cpus-per-replica", "ray_timeout": "--ray-timeout",
              "ray_batch_rows": "--ray-batch-rows"}


def add_ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true",
                   help="compute the run on Ray replicas, each loading the model once and pulling work units "
                        "(prefix groups kept together) as it finishes; this process alone writes the run "
                        "directory, which resumes like any other. Needs `pip install evalrun[ray]` (default: off)")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="join this running Ray cluster (host:port, ray://host:port or auto) instead of starting "
                        "a local Ray instance for the run (default: a local instance, stopped at the end)")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="model replicas (Ray actors) to run; required with --ray (no default)")
    p.add_argument("--gpus-per-replica", type=float, metavar="G",
                   help="GPUs each replica asks Ray for (default: 1 with --device cuda, else 0)")
    p.add_argument("--cpus-per-replica", type=float, metavar="C",
                   help="CPUs each replica asks Ray for; also its torch threads (default: 1)")
    p.add_argument("--ray-timeout", type=float, metavar="SECONDS",
                   help="the longest a replica may take to start, or stay silent while running a parcel, "
                        "before it is killed and its work re-queued (default: 600)")
    p.add_argument("--ray-batch-rows", type=int, metavar="N",
                   help="rows a replica sends back at once, or what it has after a second (default: 32)")


@dataclass(frozen=True)
class RayOptions:
    replicas: int
    address: Optional[str] = None           # None: a local instance for this run
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    timeout: float = 600.0
    batch_rows: int = 32
    execute_on: Optional[str] = None        # HumanEval: "driver" | "replica"

    def record(self) -> dict[str, Any]:
        out = {"address": self.address or "local", "replicas": self.replicas,
               "gpus_per_replica": self.gpus_per_replica, "cpus_per_replica": self.cpus_per_replica,
               "timeout": self.timeout, "batch_rows": self.batch_rows}
        return {**out, "execute_on": self.execute_on} if self.execute_on else out


def ray_options(args: argparse.Namespace, cfg: "EngineConfig") -> Optional[RayOptions]:
    """The --ray settings (None without --ray); BadInput for a flag that needs --ray, a bad value, or
    Ray not installed."""
    given = [flag for name, flag in _RAY_FLAGS.items() if getattr(args, name, None) is not None]
    execute_on = getattr(args, "execute_on", None)
    if not getattr(args, "ray", False):
        if given:
            raise BadInput(f"{given[0]} needs --ray")
        if execute_on == "replica":
            raise BadInput("--execute-on replica needs --ray (without it everything runs in this process)")
        return None
    if args.replicas is None:
        raise BadInput("--ray needs --replicas N, the number of model replicas to run")
    cuda = cfg.device.startswith("cuda")
    if cfg.device not in ("cpu", "cuda"):
        raise BadInput(f"--ray gives each replica a device of its own: use --device cuda, not {cfg.device}")
    opts = RayOptions(args.replicas, args.ray_address, _or(args.gpus_per_replica, 1.0 if cuda else 0.0),
                      _or(args.cpus_per_replica, 1.0), _or(args.ray_timeout, 600.0), _or(args.ray_batch_rows, 32),
                      execute_on)
    _check(opts, cuda)
    from evalrun.scale.ray_backend import require_ray
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


def ray_argv(args: argparse.Namespace) -> list[str]:
    """The --ray flags of `args` as command-line words (a suite hands them to each of its runs)."""
    if not getattr(args, "ray", False):
        return []
    out = ["--ray"]
    for name, flag in _RAY_FLAGS.items():
        if getattr(args, name, None) is not None:
            out += [flag, str(getattr(args, name))]
    return out


@dataclass
class StoreIntake:
    """Rows from the replicas into the store in arrival order, after the run's row_base; with `finish`
    (HumanEval --execute-on driver) a generated row is stored once its execution here is done."""
    run_dir: Path
    store: "RunStore"
    row_base: dict[str, Any]
    finish: Optional[Callable[[dict[str, Any]], Future]] = None
    rows: int = 0
    nonfinite: int = 0
    skipped: int = 0
    _prompts: set[str] = field(default_factory=set)
    _executing: set[Future] = field(default_factory=set)

    def add(self, rows: list[dict[str, Any]], prompts: Mapping[str, str]) -> None:
        from evalrun.results import write_prompts
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
        from evalrun.tasks.base import NONFINITE_COLUMN
        self.store.add(row)
        self.rows += not row.get("skipped")
        self.skipped += bool(row.get("skipped"))
        self.nonfinite += bool(row.get(NONFINITE_COLUMN))


def replica_hooks() -> Any:
    """The tests' ReplicaHooks from $EVALRUN_TEST_PAUSE_REPLICA, $EVALRUN_TEST_REPLICA_DELAY and
    $EVALRUN_TEST_FAIL_DOC (None: all unset)."""
    import json

    from evalrun.scale.ray_actor import ReplicaHooks
    pause, delay, fail = os.environ.get(PAUSE_ENV), os.environ.get(DELAY_ENV), os.environ.get(FAIL_ENV)
    if not pause and not delay and not fail:
        return None
    rows, _, path = (pause or "").partition(":")
    return ReplicaHooks(int(rows) if rows else None, path, float(delay or 0),
                        tuple(json.loads(fail)) if fail else None)


def ray_generate(p: "PreparedRun") -> int:
    """Compute what `p` has left on Ray replicas (see the module's diagram); returns 0, or raises
    RunFailed naming the parcels that failed on every replica once everything else is written."""
    from evalrun.scale.dispatch import Dispatcher, Limits
    from evalrun.run.pipeline import Session, finish_session, open_store, say_resuming
    from evalrun.scale.ray_actor import ReplicaSpec
    from evalrun.scale.ray_backend import RayBackend, ray_instance
    from evalrun.scale.units import replica_parcels
    from evalrun.results import throughput
    opts, run = p.ray, p.run
    assert opts is not None
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
    return 0


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
