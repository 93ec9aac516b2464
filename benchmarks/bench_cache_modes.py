"""Acceptance item 4: what the quantized KV-cache modes cost in accuracy and buy in speed and memory.

Every figure compares a cache mode with the unquantized cache of the compute dtype (`fp32` here)
measured in the same run, same model, same token ids:

- memory: `cache.bytes_per_token()` per mode (scales included) and its ratio to fp16 storage.
- kl: next-token distributions at >= --kl-positions real positions, teacher-forced: MMLU 5-shot
  prompts (one question per subject, subjects in a fixed shuffled order, built by
  evalrun/tasks/mmlu.py) and HumanEval prompts + the model's greedy fp32 continuation (--kl-new-tokens,
  stop at EOS). Per sequence, the logits at every position with the fp32 cache and with each
  mode's cache, compared chunk by chunk (never all logits in memory): mean KL(ref || mode) in
  float64, top-1 agreement, per source and overall.
- mmlu: >= --mmlu-questions test questions (whole subjects in alphabetical order) run per mode
  through evalrun/tasks/mmlu.py's MMLUTask and evalrun/run/runner.py's run_task, as `evalrun mmlu` does:
  accuracy, stderr, predictions that differ from fp32's, flips each way.
- decode: --decode-jobs jobs with distinct real-text contexts (MMLU questions, k * page_size + 1
  tokens), greedy, --decode-tokens new tokens. Run 0 prefills; --repeats reruns hit the prompt
  cache for every full page; timed from the step where every job has its first token to the
  end (median over repeats), tokens/s and the ratio to fp32.

    python -m benchmarks.bench_cache_modes [--parts kl,mmlu,decode] [--modes q8,q6,q4,...] [--resume]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.cache_modes_accuracy import cache_format, run_kl, run_mmlu, split_names
from benchmarks.common import DEFAULT_MMLU_DIR, DEFAULT_OUT_DIR, TORCH_DTYPE, start_run, write_result
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer
from evalrun.engine.cache import auto_cache_mode

NAME = "bench_cache_modes"
PARTS = ("kl", "mmlu", "decode")
DEFAULT_MODES = "q8,q6,q4,q8-w0,q6-w0,q4-w0,q8-norot,q6-norot,q4-norot"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of kl,mmlu,decode")
    p.add_argument("--modes", default=DEFAULT_MODES, help="cache modes of kl and mmlu (fp32 is the "
                   "reference, always run); NAME-norot = NAME without the Hadamard rotation, NAME-wN = with a "
                   "recent-token window of N (-w0: none, the plain ExLlamaV2 scheme)")
    p.add_argument("--decode-modes", default="q8,q6,q4", help="cache modes timed beside fp32 in decode")
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPE), default="float32", help="model compute dtype")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--kl-positions", type=int, default=20000, help="at least this many positions, half "
                   "from MMLU prompts, half from HumanEval prompt + continuation")
    p.add_argument("--kl-new-tokens", type=int, default=128, help="greedy fp32 continuation of HumanEval")
    p.add_argument("--mmlu-questions", type=int, default=1000, help="whole subjects until at least this many")
    p.add_argument("--mmlu-cache-tokens", type=int, default=65536, help="PagedCache max_tokens (evalrun's default)")
    p.add_argument("--decode-jobs", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=2048, help="prompt = ceil(this / page size) pages + 1 token")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed decode reruns per mode (median reported)")
    p.add_argument("--seed", type=int, default=0, help="order of the MMLU subjects in kl")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_MMLU_DIR, help="MMLU dev/test.parquet")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{NAME}.json")
    p.add_argument("--resume", action="store_true", help="keep the parts (mmlu: modes) of --out whose "
                   "settings and git state equal this run's")
    args = p.parse_args(argv)
    args.parts = split_names(args.parts)
    if not set(args.parts) <= set(PARTS):
        p.error(f"--parts takes {','.join(PARTS)}")
    for name in split_names(args.modes) + split_names(args.decode_modes):
        cache_format(name)                                    # unknown names fail before loading
    return args


def memory_table(model: Model, names: list[str], page_size: int) -> dict[str, Any]:
    """bytes_per_token() of a one-page cache per mode, and its ratio to fp16 storage."""
    per_token = {n: PagedCache(model, max_tokens=page_size, page_size=page_size, mode=cache_format(n)).bytes_per_token()
                 for n in dict.fromkeys(names + ["fp16"])}
    return {n: {"bytes_per_token": b, "vs_fp16": b / per_token["fp16"], "format": cache_format(n).describe()}
            for n, b in per_token.items()}


# --- (c) decode throughput ------------------------------------------------------------
def decode_contexts(data: Any, tokenizer: Tokenizer, jobs: int, length: int) -> list[list[int]]:
    """`jobs` prompts of exactly `length` tokens, each from its own run of solved MMLU test questions."""
    from evalrun.tasks.mmlu import LETTERS, format_question
    blocks = [f"{format_question(d)} {LETTERS[d.answer]}\n\n" for s in sorted(data.test) for d in data.test[s]]
    out, cursor = [], 0
    for _ in range(jobs):
        text = ""
        while True:
            if cursor >= len(blocks):
                raise SystemExit(f"MMLU has too little text for {jobs} contexts of {length} tokens")
            text += blocks[cursor]
            cursor += 1
            ids = tokenizer.encode(text) if len(text) > 2 * length else []   # >= 2 chars per token here
            if len(ids) >= length:
                out.append(ids[:length])
                break
    return out


class TimedDefragCache(PagedCache):
    """A PagedCache that times its defragment(), which the generator runs when it goes idle:
    that time is not decode work and is taken out of the decode window."""
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.defragment_seconds = 0.0

    def defragment(self) -> None:
        start = time.perf_counter()
        super().defragment()
        self.defragment_seconds += time.perf_counter() - start


def timed_run(gen: DynamicGenerator, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy, no stop tokens. decode window = after the step giving the last job its first token."""
    cache, before = gen.cache, gen.stats()
    outs: list[list[int]] = [[] for _ in prompts]
    start, mark, at_mark, defrag_at_mark = time.perf_counter(), None, 0, 0.0
    gen.enqueue([DynamicJob(p, max_new_tokens=new_tokens, identifier=i) for i, p in enumerate(prompts)])
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            outs[r["identifier"]].extend(r["token_ids"])
        if mark is None and all(outs):
            mark, at_mark, defrag_at_mark = time.perf_counter(), sum(map(len, outs)), cache.defragment_seconds
    end = time.perf_counter()
    defrag = cache.defragment_seconds - defrag_at_mark
    seconds, tokens = end - mark - defrag, sum(map(len, outs)) - at_mark
    after = gen.stats()
    return {"first_tokens_s": mark - start, "decode_s": seconds, "decode_tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else math.nan, "defragment_s": defrag,
            "cached_tokens": after["cached_tokens"] - before["cached_tokens"],
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"], "completions": outs}


def run_decode_mode(args: argparse.Namespace, model: Model, tokenizer: Tokenizer, prompts: list[list[int]],
                    mode: str) -> dict[str, Any]:
    ps, n = args.page_size, len(prompts)
    pages_per_job = len(prompts[0]) // ps + 2 + (args.decode_tokens + 1) // ps   # + spare: no eviction of hits
    cache = TimedDefragCache(model, max_tokens=n * pages_per_job * ps, page_size=ps, mode=cache_format(mode))
    gen = DynamicGenerator(model, cache, tokenizer, max_batch_size=n)
    runs = [timed_run(gen, prompts, args.decode_tokens) for _ in range(1 + args.repeats)]
    timed = runs[1:]
    full_pages = n * (len(prompts[0]) // ps) * ps
    return {"bytes_per_token": cache.bytes_per_token(), "cache_memory_bytes": cache.memory_bytes(),
            "kernels": {"backend": cache.kernels.backend, **cache.kernels.describe()},
            "prefill_s": runs[0]["first_tokens_s"], "prefill_tokens": runs[0]["prefill_tokens"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "repeats": [{k: v for k, v in r.items() if k != "completions"} for r in runs],
            "prompt_cache_hit": min(r["cached_tokens"] for r in timed) / full_pages,
            "repeats_identical": all(r["completions"] == timed[0]["completions"] for r in timed),
            "completions": timed[0]["completions"]}


def run_decode(args: argparse.Namespace, model: Model, tokenizer: Tokenizer, data: Any, save: Any) -> dict[str, Any]:
    length = -(-args.decode_context // args.page_size) * args.page_size + 1
    prompts = decode_contexts(data, tokenizer, args.decode_jobs, length)
    ref = auto_cache_mode(model.dtype)
    part: dict[str, Any] = {"reference": ref, "jobs": len(prompts), "prompt_tokens": length, "modes": {}}
    for mode in [ref] + [m for m in split_names(args.decode_modes) if m != ref]:
        part["modes"][mode] = res = run_decode_mode(args, model, tokenizer, prompts, mode)
        base = part["modes"][ref]
        res["ratio_vs_reference"] = res["tokens_per_s"] / base["tokens_per_s"]
        res["completions_identical_to_reference"] = sum(a == b for a, b in zip(res["completions"], base["completions"]))
        print(f"  decode {mode}: {res['tokens_per_s']:.1f} tok/s (x{res['ratio_vs_reference']:.3f} of {ref}), "
              f"prefill {res['prefill_s']:.1f} s, prompt-cache hit {res['prompt_cache_hit']:.0%}", flush=True)
        save(part)
        gc.collect()
    for res in part["modes"].values():
        res.pop("completions")
    return part


# --- tables ---------------------------------------------------------------------------
def _table(head: list[str], rows: list[list[Any]]) -> str:
    fmt = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in fmt])


def print_tables(result: dict[str, Any]) -> None:
    mem = result["memory"]
    print("\n" + _table(["mode", "bytes/token", "vs fp16"],
                        [[m, int(v["bytes_per_token"]), v["vs_fp16"]] for m, v in mem.items()]))
    if "kl" in result and result["kl"].get("complete"):
        kl = result["kl"]
        g = kl["reference_reproduces_greedy"]
        print(f"\nkl: positions {kl['positions']}, sequences {kl['sequences']}, reference {kl['reference']} "
              f"(its argmax = the generator's greedy token at {g['equal']}/{g['positions']} continuation positions)")
        print(_table(["mode", "KL mmlu", "KL humaneval", "KL all", "p99 KL", "max KL", "top-1 mmlu",
                      "top-1 humaneval", "top-1 all", "positions"],
                     [[m, v["mmlu"]["mean_kl"], v["humaneval"]["mean_kl"], v["all"]["mean_kl"], v["all"]["p99_kl"],
                       v["all"]["max_kl"], v["mmlu"]["top1_agreement"], v["humaneval"]["top1_agreement"],
                       v["all"]["top1_agreement"], v["all"]["positions"]] for m, v in kl["modes"].items()]))
    if "mmlu" in result and result["mmlu"].get("complete"):
        mm = result["mmlu"]
        print(f"\nmmlu: {mm['questions']} questions, {len(mm['subjects'])} subjects, reference {mm['reference']}")
        print(_table(["mode", "n", "accuracy", "stderr", "Δ acc", "Δ stderr (paired)", "differ", "correct→wrong",
                      "wrong→correct", "seconds"],
                     [[m, v["n"], v["accuracy"], v["stderr"], v["delta_accuracy"], v["delta_stderr_paired"],
                       v["differ"], v["correct_to_wrong"], v["wrong_to_correct"], v["seconds"]]
                      for m, v in mm["modes"].items()]))
    if "decode" in result and result["decode"].get("complete"):
        dc = result["decode"]
        print(f"\ndecode: {dc['jobs']} jobs x {dc['prompt_tokens']} prompt tokens, reference {dc['reference']}")
        print(_table(["mode", "bytes/token", "decode tok/s (median)", "vs reference", "prefill s",
                      "prompt-cache hit", "same completions as reference"],
                     [[m, int(v["bytes_per_token"]), v["tokens_per_s"], v["ratio_vs_reference"], v["prefill_s"],
                       v["prompt_cache_hit"], f"{v['completions_identical_to_reference']}/{dc['jobs']}"]
                      for m, v in dc["modes"].items()]))


# --- main -----------------------------------------------------------------------------
PART_OPTIONS = {"kl": ("modes", "kl_positions", "kl_new_tokens", "seed", "page_size", "dtype", "data_dir"),
                "mmlu": ("mmlu_questions", "mmlu_cache_tokens", "page_size", "dtype", "data_dir"),
                "decode": ("decode_modes", "decode_jobs", "decode_context", "decode_tokens", "repeats",
                           "page_size", "dtype", "data_dir", "threads")}


def part_settings(args: argparse.Namespace, part: str, git: Any) -> dict[str, Any]:
    return {"git": git, **{k: str(getattr(args, k)) for k in PART_OPTIONS[part]}}


def load_stored(args: argparse.Namespace) -> dict[str, Any]:
    if not args.resume or not args.out.is_file():
        return {}
    return json.loads(args.out.read_text())


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info, model_dir, tokenizer = start_run()
    model = Model.load(model_dir, dtype=args.dtype)
    from evalrun.tasks.mmlu_data import load_mmlu
    data = load_mmlu(args.data_dir)
    stored = load_stored(args)
    names = [auto_cache_mode(model.dtype)] + split_names(args.modes) + split_names(args.decode_modes)
    result: dict[str, Any] = {"benchmark": NAME, "machine": info, "model": str(model_dir),
                              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "memory": memory_table(model, list(dict.fromkeys(names)), args.page_size)}
    for part in PARTS:
        settings = part_settings(args, part, info["git"])
        old = stored.get(part, {})
        if part not in args.parts and old:           # not asked for: kept as stored, with its own settings
            result[part] = old
            print(f"{part}: kept from {args.out}")
            continue
        if old.get("settings") != settings:
            old = {}
        if part not in args.parts or old.get("complete"):
            if old:
                result[part] = old
                print(f"{part}: kept from {args.out}")
            continue
        print(f"{part}: running", flush=True)

        def save(partial: dict[str, Any], part: str = part, settings: dict = settings) -> None:
            result[part] = {"settings": settings, "complete": False, **partial}
            write_result(args.out, result)
        if part == "kl":
            out = run_kl(args, model, tokenizer, data)
        elif part == "mmlu":
            out = run_mmlu(args, model, tokenizer, data, old, save)
        else:
            out = run_decode(args, model, tokenizer, data, save)
        result[part] = {"settings": settings, "complete": True, **out}
        write_result(args.out, result)
    write_result(args.out, result)              # parts kept after the last one run are in it too
    print_tables(result)
    return result


if __name__ == "__main__":
    main()
