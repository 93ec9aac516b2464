"""`evalrun mmlu`: load, plan, resume, run, store, summarize."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

from evalrun.common import (base_manifest, check_engine_args, clean, engine_identity, generator_throughput,
                            load_model, make_generator, model_manifest, resolve_model_dir, utc_stamp)
from evalrun.errors import BadInput
from evalrun.runner import run_task
from results import RunStore, fingerprint_model_dir, write_summary
from tasks.mmlu import MMLUTask


def run_mmlu(args: argparse.Namespace, argv: Sequence[str]) -> int:
    check_engine_args(args)
    model_dir = resolve_model_dir(args.model)
    subjects = [s.strip() for s in args.subjects.split(",") if s.strip()] if args.subjects else None
    try:
        task = MMLUTask(args.data_dir, subjects, args.limit, args.num_fewshot)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    model, tokenizer = load_model(args, model_dir)
    fp = fingerprint_model_dir(model_dir)
    out_dir = Path(args.output_dir or f"runs/mmlu-{Path(model_dir).name}")
    manifest = _manifest(args, argv, task, fp, model_dir)
    store = RunStore.open(out_dir, manifest, key_columns=task.key_columns, overwrite=args.overwrite,
                          flush_rows=args.flush_rows, flush_seconds=args.flush_seconds)
    with store:
        done = store.completed_keys()
        generator = make_generator(args, model, tokenizer)
        fits = min(model.max_seq_len, generator.cache.max_tokens)     # longer prompts are skipped rows
        plans = [p for p in task.plan(tokenizer, fits) if p.doc_key not in done]
        row_base = {"run_id": store.manifest["run_id"], "task": "mmlu", "cache_mode": args.cache_mode}
        t0 = time.time()
        totals = run_task(task, generator, plans, store.add, row_base, progress=not args.no_progress)
        frame = store.finalize()
        rows = frame.to_dict("records")
        per_subject, overall = task.summarize(rows)
        tp = generator_throughput(generator, t0)
        write_summary(out_dir, clean(per_subject), clean({**overall, "this_session": {
            "questions": totals.docs, "generator": dict(generator.stats())}}))
        store.update_manifest(end_time=utc_stamp(), throughput=tp)
    _print_summary(per_subject, overall, out_dir, tp)
    return 0


def _manifest(args: argparse.Namespace, argv: Sequence[str], task: MMLUTask, fp: dict, model_dir: Path) -> dict:
    identity = {"task": "mmlu", **engine_identity(args, fp), "data_fingerprint": task.fingerprint(),
                "num_fewshot": args.num_fewshot}
    return base_manifest(args, argv, "mmlu", identity, **model_manifest(args, fp, model_dir))


def _print_summary(per_subject: list[dict], overall: dict, out_dir: Path, tp: dict) -> None:
    width = max([len(s["subject"]) for s in per_subject] + [7])
    print(f"\n{'subject':<{width}}  {'n':>5}  {'acc':>6}  {'stderr':>6}")
    for s in per_subject + [{"subject": "overall", **overall}]:
        acc = "-" if s["n"] == 0 else f"{s['accuracy']:.4f}"
        err = "-" if s["n"] < 2 else f"{s['stderr']:.4f}"
        print(f"{s['subject']:<{width}}  {s['n']:>5}  {acc:>6}  {err:>6}")
    ratio = tp.get("dedup_ratio")
    print(f"\nwall {tp['wall_seconds']:.1f}s, prompt tokens {tp['prompt_tokens']}, computed "
          f"{tp['prefill_tokens_computed']} (dedup x{ratio:.2f})" if ratio else "")
    print(f"results: {out_dir}")

