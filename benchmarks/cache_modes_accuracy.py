"""Parts (a) and (b) of bench_cache_modes: what a cache mode costs in accuracy, against the
unquantized cache of the compute dtype, on the same token ids (see bench_cache_modes.py for
the whole benchmark and its options).

- kl: teacher-forced next-token distributions at every position of MMLU 5-shot prompts and
  HumanEval prompts + the model's greedy continuation: mean KL(ref || mode), top-1 agreement.
- mmlu: whole subjects through MMLUTask and run_task, as `evalrun mmlu` does: accuracy and the
  predictions that differ from the reference's.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import random
import statistics
import time
from typing import Any, Optional

import torch

from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer
from evalrun.engine.cache import auto_cache_mode
from evalrun.engine.model import ForwardBatch
from evalrun.kernels.attention import build_metadata
from evalrun.kernels.kv_format import KV_FORMATS, KVFormat

TF_CHUNK = 512          # teacher-forced forward: positions per forward (bounds logits memory)
KL_ROWS = 128           # rows per float64 log-softmax

def split_names(text: str) -> list[str]:
    return list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))


def cache_format(name: str) -> KVFormat:
    """A KV_FORMATS mode, or a quantized one with options: `-norot` (no Hadamard rotation),
    `-wN` (a recent-token window of N; -w0: none), e.g. q4-w0, q6-w0-norot."""
    base, *opts = name.split("-")
    fmt = KV_FORMATS.get(base)
    changes: dict = {}
    for opt in opts:
        if opt == "norot":
            changes["rotate"] = False
        elif opt[:1] == "w" and opt[1:].isdigit():
            changes["window"] = int(opt[1:])
        else:
            fmt = None
    if fmt is None or (opts and not fmt.quantized):
        raise SystemExit(f"unknown cache mode {name!r}: use {', '.join(KV_FORMATS)}, or q8/q6/q4 with "
                         "-norot and/or -wN (e.g. q4-w0, q4-norot)")
    return dataclasses.replace(fmt, name=name, **changes) if opts else fmt



# --- (a) next-token distributions ---------------------------------------------------
Seq = tuple[list[int], int]     # token ids, and where the reference's own greedy tokens start (len: none)


def mmlu_kl_sequences(data: Any, tokenizer: Tokenizer, budget: int, max_len: int, seed: int) -> list[Seq]:
    """One 5-shot prompt per subject (question r of each, r = 0, 1, ...) in a seeded subject order."""
    from evalrun.tasks.mmlu import MMLUTask
    subjects = sorted(data.test)
    random.Random(seed).shuffle(subjects)
    seqs, total, r = [], 0, 0
    while total < budget:
        have = [s for s in subjects if len(data.test[s]) > r]
        if not have:
            break
        task = MMLUTask(data=data, subjects=have, limit=r + 1)
        for plan in task.plan(tokenizer, max_len):
            if plan.doc_key[1] == r and plan.skip_reason is None and total < budget:
                seqs.append((list(plan.requests[0].input_ids), len(plan.requests[0].input_ids)))
                total += len(seqs[-1][0])
        r += 1
    return seqs


def humaneval_kl_sequences(model: Model, tokenizer: Tokenizer, budget: int, new_tokens: int,
                           page_size: int) -> list[Seq]:
    """HumanEval prompts in file order + their greedy continuation with the fp32 cache (EOS dropped)."""
    from evalrun.tasks.humaneval_data import load_humaneval
    prompts = [tokenizer.encode(p.prompt) for p in load_humaneval().problems]
    seqs: list[Seq] = []
    while sum(len(s) for s, _ in seqs) < budget and len(seqs) < len(prompts):
        want, batch = budget - sum(len(s) for s, _ in seqs), []
        for ids in prompts[len(seqs):]:
            if want <= 0:
                break
            batch.append(ids)
            want -= len(ids) + new_tokens
        pages = -(-(max(map(len, batch)) + new_tokens) // page_size)          # per job, enough for all at once
        cache = PagedCache(model, max_tokens=len(batch) * pages * page_size, page_size=page_size,
                           mode=auto_cache_mode(model.dtype))
        gen = DynamicGenerator(model, cache, tokenizer)
        eos = set(tokenizer.eos_token_ids)
        jobs = [DynamicJob(ids, max_new_tokens=new_tokens, stop_conditions=sorted(eos), identifier=i)
                for i, ids in enumerate(batch)]
        outs = _drain(gen, jobs)
        seqs += [(ids + [t for t in outs[i] if t not in eos], len(ids)) for i, ids in enumerate(batch)]
    return seqs


def _drain(gen: DynamicGenerator, jobs: list[DynamicJob]) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in jobs]
    gen.enqueue(jobs)
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            outs[r["identifier"]].extend(r["token_ids"])
    return outs


def forward_chunk(model: Model, cache: PagedCache, ids: list[int], pages: list[int], start: int,
                  end: int) -> torch.Tensor:
    """Teacher-forced forward of ids[start:end] (ids[:start] already in `pages`): [end - start, V] logits."""
    ps, dev = cache.page_size, model.device
    pos = torch.arange(start, end)                                                  # [T]
    slots = torch.tensor(pages)[pos // ps] * ps + pos % ps
    attn = build_metadata([end - start], [end], [pages[: -(-end // ps)]], ps, cache.null_page, dev,
                          window=cache.window, window_slots=[0])           # one sequence at a time
    batch = ForwardBatch(torch.tensor(ids[start:end], device=dev), pos.to(dev), slots.to(dev), attn,
                         torch.arange(end - start, device=dev))
    return model.forward(batch, cache)


def compare(ref_logp: torch.Tensor, ref_top: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position KL(ref || mode) in float64 and whether the argmax agrees. ref_logp [T, V] float64."""
    kl = torch.empty(logits.shape[0], dtype=torch.float64)
    for i in range(0, logits.shape[0], KL_ROWS):
        logq = logits[i: i + KL_ROWS].double().log_softmax(-1)                    # [R, V]
        logp = ref_logp[i: i + KL_ROWS]
        kl[i: i + KL_ROWS] = (logp.exp() * (logp - logq)).sum(-1)
    return kl, logits.argmax(-1) == ref_top


def sequence_kl(model: Model, ref: PagedCache, caches: dict[str, PagedCache],
                ids: list[int]) -> tuple[dict[str, Any], torch.Tensor]:
    """({mode: (kl [L], agree [L])}, reference argmax [L]) for one sequence; pages are released after."""
    pages = {name: c.pool.allocate(-(-len(ids) // c.page_size)) for name, c in {"": ref, **caches}.items()}
    kls: dict[str, list] = {m: [] for m in caches}
    agrees: dict[str, list] = {m: [] for m in caches}
    tops = []
    for start in range(0, len(ids), TF_CHUNK):
        end = min(start + TF_CHUNK, len(ids))
        ref_logits = forward_chunk(model, ref, ids, pages[""], start, end)         # [T, V]
        ref_logp = ref_logits.double().log_softmax(-1)
        ref_top = ref_logits.argmax(-1)
        tops.append(ref_top)
        del ref_logits
        for name, cache in caches.items():
            kl, agree = compare(ref_logp, ref_top, forward_chunk(model, cache, ids, pages[name], start, end))
            kls[name].append(kl)
            agrees[name].append(agree)
    for name, c in {"": ref, **caches}.items():
        for pid in pages[name]:
            c.pool.release(pid)
    return {m: (torch.cat(kls[m]), torch.cat(agrees[m])) for m in caches}, torch.cat(tops)


def kl_summary(kl: torch.Tensor, agree: torch.Tensor) -> dict[str, Any]:
    q = torch.quantile(kl.float(), torch.tensor([0.5, 0.99])).tolist() if len(kl) else [math.nan] * 2
    return {"positions": len(kl), "mean_kl": kl.mean().item() if len(kl) else math.nan,
            "median_kl": q[0], "p99_kl": q[1], "max_kl": kl.max().item() if len(kl) else math.nan,
            "top1_agreement": agree.double().mean().item() if len(agree) else math.nan}


def run_kl(args: argparse.Namespace, model: Model, tokenizer: Tokenizer, data: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    max_len = model.max_seq_len
    half = -(-args.kl_positions // 2)
    sources = {"mmlu": mmlu_kl_sequences(data, tokenizer, half, max_len, args.seed),
               "humaneval": humaneval_kl_sequences(model, tokenizer, half, args.kl_new_tokens, args.page_size)}
    gen_s = time.perf_counter() - t0
    longest = max(len(s) for seqs in sources.values() for s, _ in seqs)
    size = -(-longest // args.page_size) * args.page_size
    ref = PagedCache(model, max_tokens=size, page_size=args.page_size, mode=auto_cache_mode(model.dtype))
    modes = [m for m in split_names(args.modes) if m != ref.mode]
    caches = {m: PagedCache(model, max_tokens=size, page_size=args.page_size, mode=cache_format(m)) for m in modes}
    got: dict[str, dict[str, list]] = {m: {s: [] for s in sources} for m in modes}
    done, total, greedy = 0, sum(map(len, sources.values())), [0, 0]
    for source, seqs in sources.items():
        for ids, start in seqs:
            per_mode, ref_top = sequence_kl(model, ref, caches, ids)
            for m, pair in per_mode.items():
                got[m][source].append(pair)
            greedy[0] += int((ref_top[start - 1: -1] == torch.tensor(ids[start:])).sum())   # NOTE: a check
            greedy[1] += len(ids) - start            # of this teacher-forced path against the generator
            done += 1
            if done % 10 == 0 or done == total:
                print(f"  kl: {done}/{total} sequences, {time.perf_counter() - t0:.0f} s", flush=True)
    out = {m: {} for m in modes}
    for m in modes:
        for s in [*sources, "all"]:
            pairs = [p for src in sources for p in got[m][src]] if s == "all" else got[m][s]
            out[m][s] = kl_summary(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))
    print(f"  kl: the reference's argmax equals the generator's greedy token at {greedy[0]}/{greedy[1]} "
          "continuation positions")
    return {"reference": ref.mode, "sequences": {s: len(v) for s, v in sources.items()},
            "positions": {s: sum(len(i) for i, _ in v) for s, v in sources.items()}, "modes": out,
            "reference_reproduces_greedy": {"equal": greedy[0], "positions": greedy[1]},
            "continuation_seconds": gen_s, "seconds": time.perf_counter() - t0}


# --- (b) MMLU accuracy ----------------------------------------------------------------
def mmlu_subjects(data: Any, n: int) -> tuple[list[str], Optional[int]]:
    """Whole subjects in alphabetical order until >= n questions (limit n if the first alone has more)."""
    chosen, total = [], 0
    for s in sorted(data.test):
        if total >= n:
            break
        chosen.append(s)
        total += len(data.test[s])
    return chosen, (n if len(chosen) == 1 and total > n else None)


def run_mmlu_mode(args: argparse.Namespace, model: Model, tokenizer: Tokenizer, task: Any, mode: str) -> dict[str, Any]:
    """One `evalrun mmlu`-equivalent run (same task adapter, runner and engine defaults) in `mode`."""
    from evalrun.run.runner import run_task
    cache = PagedCache(model, max_tokens=args.mmlu_cache_tokens, page_size=args.page_size, mode=cache_format(mode))
    gen = DynamicGenerator(model, cache, tokenizer)                # evalrun: max_batch_size None, chunk 2048
    plans = list(task.plan(tokenizer, min(model.max_seq_len, cache.max_tokens)))
    totals = run_task(task, gen, plans, lambda row: None, {"cache_mode": mode}, progress=False)
    by_key = {(r["subject"], r["doc_id"]): r for r in totals.rows}
    rows = [by_key[k] for k in task.doc_keys()]
    _, overall = task.summarize(rows)
    return {"n": overall["n"], "skipped": overall["skipped"], "accuracy": overall["accuracy"],
            "stderr": overall["stderr"], "seconds": totals.wall_time, "stats": dict(gen.stats()),
            "predictions": "".join("-" if r.get("skipped") else r["prediction"] for r in rows)}


def compare_predictions(ref: str, preds: str, gold: str) -> dict[str, Any]:
    """Differences from the reference run and the paired accuracy difference with its stderr."""
    pairs = [(r == g, p == g, r != p) for r, p, g in zip(ref, preds, gold) if r != "-" and p != "-"]
    d = [int(b) - int(a) for a, b, _ in pairs]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return {"differ": sum(x for _, _, x in pairs), "correct_to_wrong": sum(a and not b for a, b, _ in pairs),
            "wrong_to_correct": sum(b and not a for a, b, _ in pairs),
            "delta_accuracy": sum(d) / len(d) if d else math.nan, "delta_stderr_paired": se}


def run_mmlu(args: argparse.Namespace, model: Model, tokenizer: Tokenizer, data: Any,
             stored: dict[str, Any], save: Any) -> dict[str, Any]:
    from evalrun.tasks.mmlu import LETTERS, MMLUTask
    subjects, limit = mmlu_subjects(data, args.mmlu_questions)
    task = MMLUTask(data=data, subjects=subjects, limit=limit)
    gold = "".join(LETTERS[d.answer] for d in task.docs())
    ref = auto_cache_mode(model.dtype)
    part = {"subjects": subjects, "limit": limit, "questions": len(gold), "gold": gold, "reference": ref,
            "modes": dict(stored.get("modes", {}))}
    for mode in [ref] + [m for m in split_names(args.modes) if m != ref]:
        if mode in part["modes"]:
            print(f"  mmlu {mode}: kept from {args.out}")
            continue
        part["modes"][mode] = res = run_mmlu_mode(args, model, tokenizer, task, mode)
        res.update(compare_predictions(part["modes"][ref]["predictions"], res["predictions"], gold))
        print(f"  mmlu {mode}: acc {res['accuracy']:.4f} +- {res['stderr']:.4f}, {res['differ']} differ "
              f"from {ref}, {res['seconds']:.0f} s", flush=True)
        save(part)
        gc.collect()
    return part


