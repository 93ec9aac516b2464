"""What benchmarks/vllm_runner.py and benchmarks/vllm_decode_runner.py share: both run as
scripts under a separate venv with vLLM (this folder is then sys.path[0]), import nothing else
from this repository, and start and describe the engine the same way."""

from __future__ import annotations

import os
import time

ENV_KEYS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "HF_HUB_OFFLINE",
    "OMP_NUM_THREADS",
)


def engine_kwargs(args, **extra):
    """LLM(...) arguments from the runners' shared flags (model, dtype, max_model_len,
    prefix caching, seed, enforce_eager), plus `extra`."""
    kwargs = dict(model=args.model, tokenizer=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  enable_prefix_caching=args.prefix_caching, seed=args.seed, trust_remote_code=False, **extra)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    return kwargs


def start_engine(kwargs):
    """(LLM, seconds its start took)."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - t0


def run_settings(kwargs):
    """The engine arguments, the vLLM environment variables in force and torch's version and threads."""
    settings = dict(kwargs)
    settings["env"] = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    try:
        import torch

        settings["torch_version"] = torch.__version__
        settings["torch_num_threads"] = torch.get_num_threads()
    except Exception:  # pragma: no cover
        pass
    return settings
