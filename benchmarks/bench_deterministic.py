"""What deterministic mode costs: MMLU-shaped scoring with batch-invariant linears on and off.

Both models are loaded in one process (`Model.load(..., deterministic=True/False)`, the same
weights and dtype); rounds alternate ABBA on fresh caches, each the MMLU-shaped questions of
bench_mmlu_shaped (5-shot prompts, next-token logits). Printed: each side's median time, the
cost (on / off - 1, the median of the paired rounds' ratios), and per side whether its
log-probs were bitwise equal across its rounds and in one extra run at --max-batch-size 1 (the
claim the mode makes; the off side is shown for comparison, not required to hold).

    python -m benchmarks.bench_deterministic [--dtype bfloat16] [--n 40] [--rounds 2]
"""
from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

import torch

from benchmarks.bench_mmlu_shaped import DEFAULT_SUBJECTS, build_questions, choice_token_ids, run_ours as run
from benchmarks.common import (CACHE_MODE, DEFAULT_MMLU_DIR, add_prefault_arg, base_parser, positive_int,
                               start_run, warm_up_ours, write_result)
from evalrun.engine import Model

NAME = "bench_deterministic"


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    parser = base_parser(NAME, __doc__.splitlines()[0])
    parser.set_defaults(dtype="bfloat16")
    parser.add_argument("--n", type=int, default=40, help="test questions in all (default 40)")
    parser.add_argument("--subjects", default=DEFAULT_SUBJECTS)
    parser.add_argument("--data-dir", default=DEFAULT_MMLU_DIR)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=positive_int, default=2, help="rounds per side, ABBA (default 2)")
    add_prefault_arg(parser)
    args = parser.parse_args(argv)
    args.sample = None
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info, model_dir, tokenizer = start_run()
    questions = build_questions(args, tokenizer)
    choice_ids = choice_token_ids(tokenizer)
    models = {}
    for side in ("on", "off"):
        models[side] = Model.load(model_dir, dtype=args.dtype, deterministic=side == "on")
        warm_up_ours(models[side], tokenizer, CACHE_MODE[args.dtype], args.page_size, "The answer is")
    print(f"{len(questions)} MMLU-shaped questions, dtype {args.dtype}, {args.rounds} round(s) per side, ABBA")
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for i in range(args.rounds):
        for side in (("on", "off") if i % 2 == 0 else ("off", "on")):             # ABBA
            runs[side].append(run(args, models[side], tokenizer, questions, choice_ids))
            print(f"  {side:3s} {runs[side][-1]['seconds']:.2f} s", flush=True)
    result: dict[str, Any] = {"machine": info, "dtype": args.dtype, "questions": len(questions)}
    for side in ("on", "off"):
        alone = run(args, models[side], tokenizer, questions, choice_ids, max_batch_size=1)
        same = all(torch.equal(r["logprobs"], runs[side][0]["logprobs"]) for r in runs[side][1:] + [alone])
        seconds = statistics.median(r["seconds"] for r in runs[side])
        result[side] = {"seconds": [r["seconds"] for r in runs[side]], "median_s": seconds,
                        "bitwise_equal_across_rounds_and_batch_1": same}
        print(f"deterministic {side:3s}: median {seconds:.2f} s; log-probs bitwise equal over the rounds and "
              f"at --max-batch-size 1: {same}")
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs["on"], runs["off"])]
    result["cost"] = statistics.median(ratios) - 1
    agree = (runs["on"][0]["logprobs"].argmax(-1) == runs["off"][0]["logprobs"].argmax(-1)).float().mean().item()
    result["same_answer_share"] = agree
    print(f"cost of deterministic mode: {100 * result['cost']:+.1f}% time (rounds: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}); same answer on {100 * agree:.1f}% of questions")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
