"""`evalrun <task>` for every task of the registry: check everything, then load, plan, resume, run,
store, summarize (evalrun/run/pipeline.py draws the flow).

    RunConfig ──► prepare(cfg): run directory, engine settings, --ray, the task (TaskSpec.build),
                  its shard, the manifest and resume identity, its context (HumanEval's sandbox)
              ──► execute(prepared) (evalrun/scale/execute.py)

A task whose options ask for no model (TaskSpec.model_free: humaneval --score-samples) scores its
documents without one, through the same store, resume and summary.
"""
from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Optional

from evalrun.engine import Tokenizer
from evalrun.errors import BadInput
from evalrun.results import fingerprint_model_dir
from evalrun.results.text import terminal_safe
from evalrun.run.common import base_manifest, engine_identity, model_manifest, model_name, resolve_model_dir, stored_run
from evalrun.run.config import RunConfig
from evalrun.run.engine_config import engine_config
from evalrun.run.pipeline import PreparedRun, Report, TaskRun, pending
from evalrun.scale.ray_run import ray_options
from evalrun.scale.shard import TaskShard, parse_shard, take_shard
from evalrun.tasks.base import Task
from evalrun.tasks.chat import chat_identity
from evalrun.tasks.registry import task_spec
from evalrun.tasks.spec import RunReport, ScoredElsewhere, TaskContext, TaskSpec


def one_run(cfg: RunConfig, mode: str, run_dir: Path, tag: str) -> RunConfig:
    """One run's config out of a sweep's or suite's: its cache mode and directory, and the task's
    options for a run of its own (`tag`: HumanEval's --export-samples file)."""
    spec = task_spec(cfg.task)
    return replace(cfg.one_mode(mode, str(run_dir)), options=spec.per_run(cfg.options, tag))


def prepare(cfg: RunConfig) -> PreparedRun:
    """Everything decided and checked before a model is loaded (cfg: one cache mode)."""
    spec = task_spec(cfg.task)
    flag = spec.model_free(cfg.options)
    if flag is not None:
        return _prepare_model_free(spec, cfg, flag)
    shard_spec = parse_shard(cfg.shard)
    name = spec.run_name(cfg.options, model_name(cfg.model)) or f"{spec.name}-{model_name(cfg.model)}"
    out_dir = Path(cfg.output_dir or f"runs/{name}{shard_spec.dir_suffix if shard_spec else ''}")
    stored = stored_run(out_dir, cfg.overwrite)
    engine = engine_config(cfg.engine, stored, out_dir)
    context = spec.context(cfg.options) if spec.context is not None else None
    ray = ray_options(cfg.ray, engine, context.execute_on if context is not None else None)
    task = _build(spec, cfg)
    shard = take_shard(task, shard_spec) if shard_spec else None
    task = shard.task if shard else task
    model_dir = resolve_model_dir(cfg.model)
    fp = fingerprint_model_dir(model_dir)
    identity = {"task": spec.name, **engine_identity(engine, fp), **spec.identity(cfg.options, task),
                **_chat_identity(cfg.options, model_dir)}
    extra = {**model_manifest(engine, fp, model_dir), **spec.manifest_extra(cfg.options, task)}
    run = TaskRun(task, out_dir, _manifest(cfg, spec.name, identity, shard, extra), stored, spec.unit,
                  cfg.overwrite, cfg.flush_rows, cfg.flush_seconds, cfg.progress, on_nonfinite=cfg.on_nonfinite)
    prepared = PreparedRun(spec.name, run, pending(run), engine, model_dir, _reporter(spec, cfg, run), ray=ray)
    if context is not None:
        _attach(prepared, context, task)
    return prepared


def _prepare_model_free(spec: TaskSpec, cfg: RunConfig, flag: str) -> PreparedRun:
    if cfg.cache_modes != ("auto",):
        raise BadInput(f"{flag} scores existing completions without a model; it takes no --cache-mode")
    if cfg.shard is not None or cfg.ray.enabled:
        raise BadInput(f"{flag} scores its file whole, here; it takes no --shard or --ray")
    if cfg.model is not None:
        raise BadInput(f"{flag} scores existing completions without a model; it takes no --model")
    task = _build(spec, cfg)
    out_dir = Path(cfg.output_dir or f"runs/{spec.run_name(cfg.options, '') or task.name}")
    stored = stored_run(out_dir, cfg.overwrite)
    identity = {"task": task.name, **spec.identity(cfg.options, task)}
    manifest = _manifest(cfg, task.name, identity, None, spec.manifest_extra(cfg.options, task))
    run = TaskRun(task, out_dir, manifest, stored, spec.unit, cfg.overwrite, cfg.flush_rows, cfg.flush_seconds,
                  cfg.progress, verb="scored")
    prepared = PreparedRun(spec.name, run, pending(run), None, None, _reporter(spec, cfg, run))
    context = spec.context(cfg.options) if spec.context is not None else None
    if context is not None:
        _attach(prepared, context, task)
    return prepared


def _chat_identity(options: Any, model_dir: Path) -> dict[str, Any]:
    """{"chat": ...} for a task run with chat options in use (the template's hash included), else {}:
    runs from before chat options, and plain runs, keep their identity."""
    chat = getattr(options, "chat", None)
    if chat is None or not chat.identity():
        return {}
    return {"chat": chat_identity(chat, Tokenizer.load(model_dir))}


def _build(spec: TaskSpec, cfg: RunConfig) -> Task:
    assert spec.build is not None, f"{spec.name} does not run"
    return spec.build(cfg.options, cfg.seed)


def _manifest(cfg: RunConfig, task: str, identity: dict[str, Any], shard: Optional[TaskShard],
              extra: dict[str, Any]) -> dict[str, Any]:
    """A new run's manifest; a shard's identity also names the shard and its selection."""
    if shard is not None:
        identity, extra = {**identity, **shard.identity()}, {**extra, "shard": shard.record()}
    return base_manifest(cfg.seed, cfg.argv, task, identity, **extra)


def _reporter(spec: TaskSpec, cfg: RunConfig, run: TaskRun) -> Report:
    assert spec.report is not None

    def report(rows: list[dict], per: list[dict], overall: dict, tp: Optional[dict], out: Path) -> None:
        manifest = {**(run.stored or {}), **run.manifest}         # this session's entries, else the stored ones
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):                 # its subjects, task and metric names come from
            spec.report(cfg.options, RunReport(rows, per, overall, tp, out, manifest))     # data: escaped here
        sys.stdout.write(terminal_safe(printed.getvalue()))
    return report


def _attach(prepared: PreparedRun, context: TaskContext, task: Task) -> None:
    """The task's context: open around this process's scoring, or (--ray --execute-on replica) on each
    replica; with --ray on the driver, replicas only generate and rows are scored here (task.check_row)."""
    run, on_ray = prepared.run, prepared.ray is not None
    if on_ray and context.execute_on == "replica":
        prepared.replica_setup = context
        return
    where = {"execute_on": "driver"} if on_ray else {}

    @contextlib.contextmanager
    def opened() -> Iterator[None]:
        with context.open(task) as record:
            run.manifest[context.manifest_key] = {**record, **where}
            yield

    prepared.context = opened
    if on_ray:
        assert isinstance(task, ScoredElsewhere), f"{task.name} has a context but cannot score rows apart"
        prepared.finish_row = task.check_row
