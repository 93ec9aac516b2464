"""`evalrun mmlu`: check everything, then load, plan, resume, run, store, summarize."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional, Sequence

from evalrun.run.common import (base_manifest, check_flush_args, engine_identity, model_manifest, model_name,
                            resolve_model_dir, stored_run)
from evalrun.run.engine_config import EngineConfig, engine_config
from evalrun.errors import BadInput
from evalrun.run.pipeline import PreparedRun, TaskRun, execute, pending
from evalrun.scale.ray_run import ray_options
from evalrun.scale.shard import TaskShard, parse_shard, take_shard
from evalrun.results import fingerprint_model_dir
from evalrun.tasks.mmlu import PROMPT_FORMAT, MMLUTask
from evalrun.tasks.mmlu_groups import GROUP_DISPLAY_NAME


def run_mmlu(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if len(args.cache_modes) > 1:
        from evalrun.commands.sweep import run_sweep
        return run_sweep(args, argv, "mmlu", prepare_mmlu)
    return execute(prepare_mmlu(args, argv))


def prepare_mmlu(args: argparse.Namespace, argv: Sequence[str]) -> PreparedRun:
    """Everything decided and checked before a model is loaded (args.cache_mode: one mode)."""
    check_flush_args(args)
    spec = parse_shard(args.shard)
    out_dir = Path(args.output_dir or f"runs/mmlu-{model_name(args.model)}{spec.dir_suffix if spec else ''}")
    stored = stored_run(out_dir, args.overwrite)
    cfg = engine_config(args, stored, out_dir)
    ray = ray_options(args, cfg)
    subjects = [s.strip() for s in args.subjects.split(",") if s.strip()] if args.subjects else None
    try:
        task = MMLUTask(args.data_dir, subjects, args.limit, args.num_fewshot)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    shard = take_shard(task, spec) if spec else None
    task = shard.task if shard else task
    model_dir = resolve_model_dir(args.model)
    fp = fingerprint_model_dir(model_dir)
    run = TaskRun(task, out_dir, _manifest(args, argv, cfg, task, fp, model_dir, shard), stored, "questions",
                  args.overwrite, args.flush_rows, args.flush_seconds, not args.no_progress,
                  on_nonfinite=args.on_nonfinite)
    return PreparedRun("mmlu", run, pending(run), cfg, model_dir, _print_summary, ray=ray)


def _manifest(args: argparse.Namespace, argv: Sequence[str], cfg: EngineConfig, task: MMLUTask, fp: dict,
              model_dir: Path, shard: Optional[TaskShard]) -> dict:
    identity = {"task": "mmlu", **engine_identity(cfg, fp), "data_fingerprint": task.fingerprint(),
                "num_fewshot": task.num_fewshot, "prompt_format": PROMPT_FORMAT}
    return base_manifest(args, argv, "mmlu", identity, shard, **model_manifest(cfg, fp, model_dir))


def _print_summary(rows: list[dict], per_subject: list[dict], overall: dict, tp: Optional[dict],
                   out_dir: Path) -> None:
    width = max([len(s["subject"]) for s in per_subject] + [15])
    print(f"\n{'subject':<{width}}  {'n':>5}  {'acc':>6}  {'stderr':>6}")
    for s in per_subject:
        print(_line(s["subject"], s, width))
    print()
    for group, stats in overall.get("groups", {}).items():
        if stats["n"]:
            print(_line(GROUP_DISPLAY_NAME[group], stats, width))
    print(_line("overall", overall, width))
    if tp and tp.get("dedup_ratio"):
        print(f"\nwall {tp['wall_seconds']:.1f}s, prompt tokens {tp['prompt_tokens']}, computed "
              f"{tp['prefill_tokens_computed']} (dedup x{tp['dedup_ratio']:.2f})")
    print(f"results: {out_dir}")


def _line(name: str, s: dict[str, Any], width: int) -> str:
    acc = "-" if s["n"] == 0 else f"{s['accuracy']:.4f}"
    err = "-" if s["n"] < 2 or s["stderr"] != s["stderr"] else f"{s['stderr']:.4f}"     # NaN: undefined
    return f"{name:<{width}}  {s['n']:>5}  {acc:>6}  {err:>6}"
