"""Speculative decoding against plain decoding in the same run (issue 14): SmolLM2 float32, greedy,
up to --new-tokens tokens per prompt (EOS ends a job early, as in an evaluation), B prompts at
once for each batch size B (no queue: the run lasts as long as its longest job).

    python -m benchmarks.bench_spec [--batches 1,4,32] [--workloads humaneval,repetitive]
        [--drafts ngram] [--num-draft-tokens 4] [--new-tokens 256] [--rounds 3] [--out FILE]

Per workload, batch size and drafting: --rounds paired rounds, plain and speculative alternated
(ABBA), each on a fresh cache; the speed ratio is the median of the rounds' plain / speculative
times. Reported beside it: the acceptance rate (draft tokens kept / verified), tokens per target
forward for both sides, and whether every job's tokens are identical to plain decoding's (they
must be: greedy verification is exact). The machine's sgemm and bandwidth roofs are printed first.

--drafts: `ngram` (prompt lookup), `self:N` (SmolLM2's first N layers with its own head as the
draft model), `model:DIR` (a draft model directory).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.common import DEFAULT_OUT_DIR, machine_info, positive_int, print_machine, timed, write_result
from benchmarks.machine_roofs import format_roofs, measure_roofs
from benchmarks.spec_workloads import WORKLOADS, workload_texts
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer

NAME = "bench_spec"
PAGE = 256


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,32", help="prompts decoded at once (default 1,4,32)")
    p.add_argument("--workloads", default="humaneval,repetitive", help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--drafts", default="ngram", help="comma-separated: ngram, self:N, model:DIR")
    p.add_argument("--num-draft-tokens", type=positive_int, default=4)
    p.add_argument("--new-tokens", type=positive_int, default=256)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--verify-all", action="store_true",
                   help="verify every proposed draft token (adaptive_draft=False): for identity checks, not speed")
    p.add_argument("--cache-mode", default="fp32", help="KV cache mode of both sides and of a draft model (default fp32)")
    p.add_argument("--mmlu-dir", type=Path, default=None, help="cais/mmlu parquet folder for the mmlu workload")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{NAME}.json")
    args = p.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    args.workloads = args.workloads.split(",")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: unknown workload {w!r}, one of {', '.join(WORKLOADS)}")
    args.drafts = args.drafts.split(",")
    for d in args.drafts:
        if d != "ngram" and not d.startswith(("self:", "model:")):
            p.error(f"--drafts: {d!r} is not ngram, self:N or model:DIR")
    return args


def draft_options(kind: str, model_dir: Path) -> dict[str, Any]:
    """DynamicGenerator keyword arguments for one --drafts entry (the draft cache is made per run)."""
    if kind == "ngram":
        return {"use_ngram_draft": True}
    if kind.startswith("self:"):
        from evalrun.engine.draft_model import truncated_model
        return {"draft_model": truncated_model(Model.load(model_dir, dtype="float32"), int(kind[5:]))}
    return {"draft_model": Model.load(Path(kind[6:]), dtype="float32")}


def run_once(model: Model, tokenizer: Tokenizer, prompts: list[list[int]], new_tokens: int,
             options: dict[str, Any], mode: str = "fp32") -> dict[str, Any]:
    pages = len(prompts) * (-(-(max(map(len, prompts)) + new_tokens) // PAGE)) + 1
    cache = PagedCache(model, max_tokens=pages * PAGE, page_size=PAGE, mode=mode)
    opts = dict(options)
    if "draft_model" in opts:
        opts["draft_cache"] = PagedCache(opts["draft_model"], max_tokens=pages * PAGE, page_size=PAGE, mode=mode)
    gen = DynamicGenerator(model, cache, tokenizer, **opts)
    tokens: list[list[int]] = [[] for _ in prompts]
    with timed() as t:
        gen.enqueue([DynamicJob(p, new_tokens, stop_conditions=sorted(tokenizer.eos_token_ids), identifier=i)
                     for i, p in enumerate(prompts)])
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                tokens[r["identifier"]].extend(r["token_ids"])
    return {"seconds": t.seconds, "tokens": tokens, "stats": gen.stats()}


def compare(model: Model, tokenizer: Tokenizer, prompts: list[list[int]], args: Any,
            options: dict[str, Any]) -> dict[str, Any]:
    plain_runs, spec_runs = [], []
    for r in range(args.rounds):
        order = [("plain", {}), ("spec", options)]
        for side, opts in (order if r % 2 == 0 else order[::-1]):
            (plain_runs if side == "plain" else spec_runs).append(
                run_once(model, tokenizer, prompts, args.new_tokens, opts, args.cache_mode))
    ratios = [p["seconds"] / s["seconds"] for p, s in zip(plain_runs, spec_runs)]
    identical = all(s["tokens"] == plain_runs[0]["tokens"] for s in spec_runs + plain_runs)
    gaps = [] if identical else divergences(model, prompts, plain_runs[0]["tokens"], spec_runs[0]["tokens"],
                                            args.cache_mode)
    st, pst = spec_runs[0]["stats"], plain_runs[0]["stats"]
    return {
        "ratio": statistics.median(ratios), "ratios": ratios,
        "plain_s": [p["seconds"] for p in plain_runs], "spec_s": [s["seconds"] for s in spec_runs],
        "drafted_per_round": [s["stats"]["drafted_tokens"] for s in spec_runs],
        "identical_tokens": identical, "divergences": gaps, "generated_tokens": st["generated_tokens"],
        "drafted_tokens": st["drafted_tokens"], "accepted_draft_tokens": st["accepted_draft_tokens"],
        "acceptance": st["accepted_draft_tokens"] / st["drafted_tokens"] if st["drafted_tokens"] else None,
        "tokens_per_forward": st["generated_tokens"] / st["forward_passes"],
        "plain_tokens_per_forward": pst["generated_tokens"] / pst["forward_passes"],
    }


def divergences(model: Model, prompts: list[list[int]], plain: list[list[int]], spec: list[list[int]],
                mode: str) -> list[dict[str, Any]]:
    """Per job whose tokens differ: the first differing position and the logit gap there (plain's
    token minus speculative's, in logits recomputed over plain's prefix): a near tie, or a real bug."""
    out = []
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a == b:
            continue
        n = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        entry: dict[str, Any] = {"job": i, "position": n, "plain_len": len(a), "spec_len": len(b)}
        if n < min(len(a), len(b)):
            cache = PagedCache(model, max_tokens=-(-(len(prompts[i]) + n + 1) // PAGE) * PAGE, page_size=PAGE, mode=mode)
            gen = DynamicGenerator(model, cache)
            gen.enqueue(DynamicJob(prompts[i] + a[:n], 1, return_logits=True))
            logits = _one_logits(gen)
            entry["logit_gap"] = float(logits[a[n]] - logits[b[n]])
        out.append(entry)
    return out


def _one_logits(gen: DynamicGenerator) -> Any:
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if "logits" in r:
                return r["logits"][0]
    raise RuntimeError("the job produced no logits")


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info = machine_info()
    print_machine(info)
    from evalrun.demo import ensure_demo_model
    model_dir = ensure_demo_model()
    tokenizer = Tokenizer.load(model_dir)
    model = Model.load(model_dir, dtype="float32")
    roofs = measure_roofs()
    print(f"roofs: {format_roofs(roofs)}")
    result: dict[str, Any] = {"benchmark": NAME, "machine": info, "roofs_start": roofs, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "cells": []}
    for kind in args.drafts:
        options = draft_options(kind, model_dir)
        options["num_draft_tokens"] = args.num_draft_tokens
        options["adaptive_draft"] = not args.verify_all
        for workload in args.workloads:
            for b in args.batches:
                prompts = [tokenizer.encode(t) for t in workload_texts(workload, b, args.mmlu_dir)]
                cell = {"drafts": kind, "workload": workload, "batch": b, **compare(model, tokenizer, prompts, args, options)}
                result["cells"].append(cell)
                acc = "-" if cell["acceptance"] is None else f"{cell['acceptance']:.0%}"
                print(f"{kind:8s} {workload:10s} batch {b:3d}: {cell['ratio']:.2f}x plain "
                      f"(drafted per round {cell['drafted_per_round']}) "
                      f"(rounds {', '.join(f'{x:.2f}' for x in cell['ratios'])}), acceptance {acc}, "
                      f"tokens/forward {cell['tokens_per_forward']:.2f} vs {cell['plain_tokens_per_forward']:.2f}, "
                      f"identical {cell['identical_tokens']}")
                for d in cell["divergences"]:
                    print(f"    job {d['job']} differs at token {d['position']}: logit gap {d.get('logit_gap', 'n/a')}")
    result["roofs_end"] = measure_roofs()
    print(f"roofs at the end: {format_roofs(result['roofs_end'])}")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
