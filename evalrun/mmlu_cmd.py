"""`evalrun mmlu`: load, plan, resume, run, store, summarize."""
from __future__ import annotations

import argparse
import math
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from engine import DynamicGenerator, Model, PagedCache, Tokenizer
from evalrun.errors import BadInput
from evalrun.runner import run_task
from results import RunStore, environment_info, fingerprint_model_dir, throughput, write_summary
from tasks.mmlu import MMLUTask


def run_mmlu(args: argparse.Namespace, argv: Sequence[str]) -> int:
    _check_numbers(args)
    model_dir = _model_dir(args.model)
    subjects = [s.strip() for s in args.subjects.split(",") if s.strip()] if args.subjects else None
    try:
        task = MMLUTask(args.data_dir, subjects, args.limit, args.num_fewshot)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    model = Model.load(model_dir, dtype=args.dtype, device=args.device)
    tokenizer = Tokenizer.load(model_dir)
    fp = fingerprint_model_dir(model_dir)
    out_dir = Path(args.output_dir or f"runs/mmlu-{Path(model_dir).name}")
    manifest = _manifest(args, argv, task, fp, model_dir)
    store = RunStore.open(out_dir, manifest, key_columns=task.key_columns, overwrite=args.overwrite,
                          flush_rows=args.flush_rows, flush_seconds=args.flush_seconds)
    with store:
        done = store.completed_keys()
        generator = _generator(args, model, tokenizer)
        fits = min(model.max_seq_len, generator.cache.max_tokens)     # longer prompts are skipped rows
        plans = [p for p in task.plan(tokenizer, fits) if p.doc_key not in done]
        row_base = {"run_id": store.manifest["run_id"], "task": "mmlu", "cache_mode": args.cache_mode}
        t0 = time.time()
        totals = run_task(task, generator, plans, store.add, row_base, progress=not args.no_progress)
        frame = store.finalize()
        rows = frame.to_dict("records")
        per_subject, overall = task.summarize(rows)
        stats = generator.stats()
        tp = throughput(stats["prompt_tokens"], stats["prefill_tokens"], time.time() - t0,
                        stats["generated_tokens"])
        tp["dedup_ratio"] = stats["prompt_tokens"] / stats["prefill_tokens"] if stats["prefill_tokens"] else None
        write_summary(out_dir, _clean(per_subject), _clean({**overall, "this_session": {
            "questions": totals.docs, "generator": dict(stats)}}))
        store.update_manifest(end_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), throughput=tp)
    _print_summary(per_subject, overall, out_dir, tp)
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("cache_tokens", "page_size", "max_chunk_size"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise BadInput(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.flush_rows < 1 or args.flush_seconds <= 0:
        raise BadInput("--flush-rows must be >= 1 and --flush-seconds > 0")
    if args.cache_tokens < args.page_size:
        raise BadInput(f"--cache-tokens ({args.cache_tokens}) must be at least --page-size ({args.page_size})")


def _model_dir(model: str | None) -> Path:
    if model is None:
        from evalrun.demo import ensure_demo_model
        return ensure_demo_model()
    path = Path(model)
    if not path.is_dir():
        raise BadInput(f"model directory not found: {model}")
    return path


def _generator(args: argparse.Namespace, model: Model, tokenizer: Tokenizer) -> DynamicGenerator:
    try:
        cache = PagedCache(model, max_tokens=args.cache_tokens, page_size=args.page_size, mode=args.cache_mode)
        return DynamicGenerator(model, cache, tokenizer, max_batch_size=args.max_batch_size,
                                max_chunk_size=args.max_chunk_size)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc


def _manifest(args: argparse.Namespace, argv: Sequence[str], task: MMLUTask, fp: dict, model_dir: Path) -> dict:
    identity = {
        "task": "mmlu",
        "model_fingerprint": fp["model_fingerprint"],
        "tokenizer_fingerprint": fp["tokenizer_fingerprint"],
        "data_fingerprint": task.fingerprint(),
        "dtype": args.dtype,
        "device": args.device,
        "cache_mode": args.cache_mode,
        "num_fewshot": args.num_fewshot,
    }
    return {
        "run_id": uuid.uuid4().hex[:12], "task": "mmlu", "identity": identity,
        "model": {"path": str(Path(model_dir).resolve()), **{k: v for k, v in fp.items() if k != "path"}},
        "dtype": args.dtype, "device": args.device, "cache_mode": args.cache_mode,
        "page_size": args.page_size, "cache_tokens": args.cache_tokens, "seeds": {"base": args.seed},
        "cli_args": list(argv), "environment": environment_info(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


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

