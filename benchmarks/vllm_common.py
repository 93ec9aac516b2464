"""What benchmarks/vllm_runner.py and benchmarks/vllm_decode_runner.py share: both run as
scripts under a separate venv with vLLM (this folder is then sys.path[0]), import nothing else
from this repository, and start and describe the engine the same way."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ENV_KEYS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "HF_HUB_OFFLINE",
    "OMP_NUM_THREADS",
)


def base_parser(description):
    """The flags both runners take: --model, --in, --out, --dtype, --prefix-caching, --max-model-len,
    --enforce-eager, --seed."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--in", dest="inp", required=True, help="input prompts JSON")
    p.add_argument("--out", required=True, help="output result JSON")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="float32",
                   help="vLLM's dtype; the caller resolves an `auto` first (vLLM's own auto would take the "
                        "checkpoint's dtype, not the one our engine runs)")
    p.add_argument("--prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                   default=True, help="enable vLLM automatic prefix caching (default: on)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true",
                   help="disable torch.compile in vLLM (faster start, maybe slower run)")
    p.add_argument("--seed", type=int, default=0)
    return p


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



def write_result(path, kwargs, prompts, load_seconds, warmup_seconds, seconds, what, **fields):
    """The output JSON: vLLM's version, the three timings, prompt counts, `fields` and the run
    settings; then one summary line on stderr ("... for `what`")."""
    import vllm

    result = {"vllm_version": getattr(vllm, "__version__", "unknown"), "load_seconds": load_seconds,
              "warmup_seconds": warmup_seconds, "seconds": seconds,
              "prompt_tokens": sum(len(p) for p in prompts), "num_prompts": len(prompts),
              **fields, "settings": run_settings(kwargs)}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"vllm {result['vllm_version']}: load {load_seconds:.1f}s, warmup {warmup_seconds:.2f}s, "
          f"generate {seconds:.2f}s for {what} ({result['prompt_tokens']} prompt tokens) -> {path}", file=sys.stderr)
    return result


def say(text):
    """One protocol line on stdout (--paired, benchmarks/paired.py)."""
    print(f"@@evalrun {text}", flush=True)


def serve_rounds(timed_round, key=lambda result: result):
    """--paired: `@@evalrun ready`, then one round per `go` line on stdin until `quit` (or the end of
    input): `timed_round()` -> (result, seconds) (it resets the prefix cache), the seconds answered.
    Returns (the first round's result, every round's seconds, whether every result's `key` equalled
    the first's)."""
    first, round_seconds, identical = None, [], True
    say("ready")
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        if line.strip() != "go":
            continue
        result, secs = timed_round()
        round_seconds.append(secs)
        if first is None:
            first = result
        else:
            identical &= key(result) == key(first)
        say(json.dumps({"round": len(round_seconds) - 1, "seconds": secs}))
    if first is None:
        raise SystemExit("--paired: no round was asked for")
    return first, round_seconds, identical
