"""What every `evalrun <task>` command shares: argument checks, model and generator set-up,
the run manifest, JSON-clean summaries."""
from __future__ import annotations

import argparse
import math
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from engine import DynamicGenerator, Model, PagedCache, Tokenizer, kernel_backends
from evalrun.errors import BadInput
from results import environment_info, throughput


def check_engine_args(args: argparse.Namespace) -> None:
    for name in ("cache_tokens", "page_size", "max_chunk_size"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise BadInput(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.flush_rows < 1 or args.flush_seconds <= 0:
        raise BadInput("--flush-rows must be >= 1 and --flush-seconds > 0")
    if args.cache_tokens < args.page_size:
        raise BadInput(f"--cache-tokens ({args.cache_tokens}) must be at least --page-size ({args.page_size})")


def resolve_model_dir(model: str | None) -> Path:
    """--model, or the embedded demo model when omitted."""
    if model is None:
        from evalrun.demo import ensure_demo_model
        return ensure_demo_model()
    path = Path(model)
    if not path.is_dir():
        raise BadInput(f"model directory not found: {model}")
    return path


def load_model(args: argparse.Namespace, model_dir: Path) -> tuple[Model, Tokenizer]:
    return Model.load(model_dir, dtype=args.dtype, device=args.device), Tokenizer.load(model_dir)


def make_generator(args: argparse.Namespace, model: Model, tokenizer: Tokenizer) -> DynamicGenerator:
    try:
        cache = PagedCache(model, max_tokens=args.cache_tokens, page_size=args.page_size, mode=args.cache_mode)
        return DynamicGenerator(model, cache, tokenizer, max_batch_size=args.max_batch_size,
                                max_chunk_size=args.max_chunk_size)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc


def engine_identity(args: argparse.Namespace, fp: dict) -> dict[str, Any]:
    """The part of a run's resume identity that the model and engine settings decide."""
    return {"model_fingerprint": fp["model_fingerprint"], "tokenizer_fingerprint": fp["tokenizer_fingerprint"],
            "dtype": args.dtype, "device": args.device, "cache_mode": args.cache_mode}


def base_manifest(args: argparse.Namespace, argv: Sequence[str], task: str, identity: dict[str, Any],
                  **extra: Any) -> dict[str, Any]:
    return {
        "run_id": uuid.uuid4().hex[:12], "task": task, "identity": identity, **extra,
        "seeds": {"base": args.seed}, "cli_args": list(argv), "environment": environment_info(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def model_manifest(args: argparse.Namespace, fp: dict, model_dir: Path) -> dict[str, Any]:
    return {"model": {"path": str(Path(model_dir).resolve()), **{k: v for k, v in fp.items() if k != "path"}},
            "dtype": args.dtype, "device": args.device, "cache_mode": args.cache_mode,
            "page_size": args.page_size, "cache_tokens": args.cache_tokens,
            "kernels": kernel_backends(args.device, args.dtype, args.cache_mode)}


def clean(obj: Any) -> Any:
    """NaN/inf → None, recursively (summary.json is strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v) for v in obj]
    return obj


def utc_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def generator_throughput(generator: DynamicGenerator, start: float) -> dict[str, Any]:
    """manifest["throughput"] of this session's generation (see results.Throughput)."""
    stats = generator.stats()
    tp = throughput(stats["prompt_tokens"], stats["prefill_tokens"], time.time() - start, stats["generated_tokens"])
    tp["dedup_ratio"] = stats["prompt_tokens"] / stats["prefill_tokens"] if stats["prefill_tokens"] else None
    return tp
