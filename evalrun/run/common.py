"""What every `evalrun <task>` command shares: the run directory, the model, the generator,
the manifest, JSON-clean summaries."""
from __future__ import annotations

import errno
import math
import os
import resource
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from evalrun.demo import DEMO_MODEL_NAME, ensure_demo_model
from evalrun.engine import DynamicGenerator, Model, PagedCache, Tokenizer
from evalrun.engine.cache import plan_cache, resolve_format
from evalrun.engine.config import ModelConfig
from evalrun.engine.gguf import is_gguf, open_gguf
from evalrun.errors import BadInput
from evalrun.results import environment_info, inspect_run, throughput
from evalrun.results.checksums import sha256_file
from evalrun.results.manifest import utc_now
from evalrun.engine.model import kernel_backends
from evalrun.run.engine_config import EngineConfig


def stored_run(out_dir: Path, overwrite: bool) -> Optional[dict[str, Any]]:
    """The manifest of the run in `out_dir` to resume (None: a new run, or --overwrite). Checks the
    directory either way: not a run dir, an unreadable manifest or a run in use are refused here."""
    stored = inspect_run(out_dir)
    return None if overwrite else stored


def model_name(model: Optional[str]) -> str:
    """The model's directory name (a GGUF file's name without .gguf), without converting the demo model."""
    if model is None:
        return DEMO_MODEL_NAME
    return Path(model).stem if is_gguf(model) else Path(model).name


def resolve_model_dir(model: Optional[str]) -> Path:
    """--model (a Hugging Face model directory or a .gguf file), or the embedded demo model when omitted."""
    if model is None:
        return ensure_demo_model()
    path = Path(model)
    if is_gguf(path):
        if not path.is_file():
            raise BadInput(f"GGUF file not found: {model}")
        return path
    if not path.is_dir():
        raise BadInput(f"model directory not found: {model}" + (" (a model file must end in .gguf)"
                                                                if path.is_file() else ""))
    if not (path / "config.json").is_file():
        raise BadInput(f"{path} has no config.json: not a Hugging Face model directory")
    return path


def load_model(cfg: EngineConfig, model_dir: Path) -> tuple[Any, Any]:
    """The model and its tokenizer; BadInput (one line) for a model evalrun cannot serve or one that
    does not fit in memory. The compute threads are started first: a thread that cannot be created
    later, when the memory is taken, ends the process inside the OpenMP runtime, not as an error."""
    start_compute_threads()
    try:
        model = Model.load(model_dir, **cfg.load_settings())
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    except (MemoryError, OSError, RuntimeError) as exc:
        if not is_memory_failure(exc):
            raise
        raise BadInput(f"not enough memory to load the model {model_dir}{_limit_note()}: "
                       f"{_short(exc)}") from None
    return model, Tokenizer.load(model_dir)


def start_compute_threads() -> None:
    """Start torch's intra-op (OpenMP) threads now: one small parallel op makes the whole team."""
    torch.ones(1 << 20).add_(1)


def is_memory_failure(exc: BaseException) -> bool:
    """An allocation that failed: MemoryError, ENOMEM, or torch's and safetensors' RuntimeError for it."""
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("can't allocate memory", "Cannot allocate memory", "out of memory", "unable to mmap"))


def address_space_left() -> Optional[int]:
    """Bytes this process may still map under its RLIMIT_AS (None: no limit, or not known)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None
    return max(0, limit - used)


def _limit_note() -> str:
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return "" if limit == resource.RLIM_INFINITY else f" (address-space limit RLIMIT_AS {limit / 2**30:.1f} GiB)"


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def make_generator(cfg: EngineConfig, model: Any, tokenizer: Any) -> Any:
    try:
        cache = PagedCache(model, max_tokens=cfg.cache_tokens, page_size=cfg.page_size, mode=cfg.cache_mode,
                           max_memory=cfg.cache_memory, max_jobs=cfg.max_batch_size, window=cfg.cache_window)
        draft = draft_cache = None
        if cfg.draft_model is not None:
            draft = Model.load(resolve_model_dir(cfg.draft_model), **cfg.load_settings())   # --eager too
            draft_cache = PagedCache(draft, max_tokens=cache.max_tokens, page_size=cfg.page_size, mode=cache.format,
                                     max_jobs=cache.window_slots or None)
        return DynamicGenerator(model, cache, tokenizer, max_batch_size=cfg.max_batch_size,
                                max_chunk_size=cfg.max_chunk_size, draft_model=draft, draft_cache=draft_cache,
                                num_draft_tokens=cfg.num_draft_tokens, use_ngram_draft=cfg.ngram_draft)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    except (MemoryError, OSError, RuntimeError) as exc:
        if not is_memory_failure(exc):
            raise
        raise BadInput(f"not enough memory for the KV cache{' or the draft model' if cfg.draft_model else ''}"
                       f"{_limit_note()}: {_short(exc)}; lower --cache-tokens "
                       "or --cache-memory") from None


def engine_identity(cfg: EngineConfig, fp: dict) -> dict[str, Any]:
    """The part of a run's resume identity that the model and engine settings decide (resolved
    values; a quantized mode's recent-token window too, which changes its answers)."""
    out = {"model_fingerprint": fp["model_fingerprint"], "tokenizer_fingerprint": fp["tokenizer_fingerprint"],
           "dtype": cfg.dtype, "device": cfg.device, "cache_mode": cfg.cache_mode}
    if cfg.deterministic:                    # absent when off: runs from before the setting resume as off
        out["deterministic"] = True
    try:
        window = resolve_format(cfg.cache_mode, cfg.page_size, cfg.cache_window).window
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    return {**out, "cache_window": window} if window else out


def base_manifest(seed: int, argv: Sequence[str], task: str, identity: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A new run's manifest (`identity` is compared on resume)."""
    return {
        "run_id": uuid.uuid4().hex[:12], "task": task, "identity": identity, **extra,
        "seeds": {"base": seed}, "cli_args": list(argv), "environment": environment_info(),
        "start_time": utc_now(),
    }


def cache_plan(cfg: EngineConfig, config: ModelConfig) -> dict[str, Any]:
    """The KV cache these settings build for this model, from its config alone (no weights):
    checks that the mode can store the model's heads and that the memory holds a page
    (BadInput otherwise), before anything is loaded."""
    try:
        plan = plan_cache(config, cfg.cache_mode, cfg.page_size, cfg.cache_tokens, cfg.cache_memory,
                          cfg.max_batch_size, cfg.cache_window)
    except ValueError as exc:
        raise BadInput(str(exc).replace("max_memory", "--cache-memory")) from exc
    memory, fmt = plan.memory_bytes, plan.format
    ram, left = _physical_memory(), address_space_left()
    if cfg.device == "cpu" and ram and memory > ram:
        raise BadInput(f"the KV cache would take {memory / 2**30:.1f} GiB ({plan.max_tokens} tokens in "
                       f"{fmt.name}), more than this machine's {ram / 2**30:.1f} GiB of memory: "
                       "lower --cache-tokens or --cache-memory")
    if cfg.device == "cpu" and left is not None and memory > left:
        raise BadInput(f"the KV cache would take {memory / 2**30:.1f} GiB ({plan.max_tokens} tokens in "
                       f"{fmt.name}), more than the {left / 2**30:.1f} GiB this process may still map under its "
                       "address-space limit (RLIMIT_AS): lower --cache-tokens or --cache-memory")
    return {"cache_tokens": plan.max_tokens, "cache_bytes_per_token": plan.bytes_per_token,
            "cache_memory_bytes": memory, "cache_format": fmt.describe(), "cache_window": fmt.window,
            "cache_window_jobs": plan.window_slots, "cache_window_bytes_per_job": plan.window_bytes_per_job}


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def model_manifest(cfg: EngineConfig, fp: dict, model_dir: Path) -> dict[str, Any]:
    """The manifest's model and engine entries (a GGUF file adds model["gguf"]: read_model)."""
    config, gguf = read_model(model_dir)
    model = {"path": str(Path(model_dir).resolve()), **{k: v for k, v in fp.items() if k != "path"}}
    return {"model": {**model, "gguf": gguf} if gguf else model,
            "dtype": cfg.dtype, "device": cfg.device, "cache_mode": cfg.cache_mode,
            "engine_choices": cfg.choices_record(), "page_size": cfg.page_size, **cache_plan(cfg, config),
            "speculative": cfg.speculative_record(),
            "deterministic": cfg.deterministic, "cuda_graphs": cfg.cuda_graphs,
            "kernels": kernel_backends(cfg.device, cfg.dtype, cfg.cache_mode, cfg.deterministic,
                                       config, cfg.page_size, cfg.cache_window)}


def read_model(model_dir: Path) -> tuple[ModelConfig, Optional[dict[str, Any]]]:
    """The model's config (checked: every refusal of engine/config.py, before weights are read) and,
    for a GGUF file, what the manifest records of it: its sha256 (the whole file, hashed once here),
    size, architecture, `general.file_type` and tensor count per quantization type."""
    if not is_gguf(model_dir):
        return ModelConfig.load(model_dir), None
    file = open_gguf(model_dir)
    config = file.model_config()
    return config, {**file.describe(), "sha256": sha256_file(model_dir), "bytes": model_dir.stat().st_size}


def clean(obj: Any) -> Any:
    """NaN/inf → None, recursively (summary.json is strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v) for v in obj]
    return obj


def generator_throughput(generator: Any, start: float) -> dict[str, Any]:
    """This session's generation figures (see results.Throughput)."""
    stats = generator.stats()
    return throughput(stats["prompt_tokens"], stats["prefill_tokens"], time.time() - start, stats["generated_tokens"])
