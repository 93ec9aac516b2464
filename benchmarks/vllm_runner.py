#!/usr/bin/env python3
"""Standalone vLLM scoring runner used to compare evalrun against vLLM (CPU build).

Runs under a separate virtual environment that has vLLM installed (e.g.
/tmp/vllm-venv/bin/python); it imports nothing from this repository, only the
standard library and vllm.

Usage:
    python benchmarks/vllm_runner.py --model DIR --in prompts.json --out result.json \
        [--dtype float32] [--prefix-caching/--no-prefix-caching] [--max-model-len 4096] \
        [--method token_ids|full_vocab] [--enforce-eager] [--paired]

Input JSON:  {"prompts": [[token ids], ...], "choice_ids": [id_A, id_B, id_C, id_D]}
             Token ids are passed verbatim (no BOS added).
Output JSON: {"vllm_version", "load_seconds", "warmup_seconds", "seconds",
              "choice_logprobs": [[4 floats] per prompt], "prompt_tokens",
              "method", "settings"}

For each prompt the natural-log, full-vocabulary log-softmax of the choice ids
at the position right after the prompt is obtained by a greedy generation of a
single token (temperature 0, max_tokens=1):

* method "token_ids" (default): SamplingParams(logprob_token_ids=choice_ids).
  vLLM's sampler computes log_softmax over the full vocabulary of the raw
  logits (logprobs_mode="raw_logprobs", fp32) and gathers the requested ids,
  so the values are exact full-vocab log-probs (no renormalisation, no top-k).
* method "full_vocab": SamplingParams(logprobs=-1) with the engine's
  max_logprobs=-1, returning all vocab_size log-probs per prompt (slow, mainly
  for cross-checking); the choice ids are picked out of that.

--paired: rounds on demand, the protocol of vllm_decode_runner.py (benchmarks/paired.py): after
the warm-up `@@evalrun ready` on stdout; each `go` line on stdin resets the prefix cache, times
one generate over all prompts and answers `@@evalrun {"round": i, "seconds": s}`; `quit` writes
the output JSON with `round_seconds`, `rounds_identical` (every round's log-probs equal to the
first's) and the first round's `seconds` and `choice_logprobs`.

Recommended environment on a CPU host:
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1
"""

from __future__ import annotations

import json
import math
import sys
import time

import vllm_common  # noqa: E402  (this folder is sys.path[0] when run as a script)


def parse_args(argv=None):
    p = vllm_common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("token_ids", "full_vocab"), default="token_ids",
                   help="how log-probs are obtained (see module docstring)")
    p.add_argument("--paired", action="store_true",
                   help="rounds on demand through stdin/stdout (see the docstring)")
    return p.parse_args(argv)



def load_input(path):
    with open(path) as f:
        data = json.load(f)
    prompts = data["prompts"]
    choice_ids = [int(t) for t in data["choice_ids"]]
    if not prompts:
        raise SystemExit("no prompts in input")
    for i, p in enumerate(prompts):
        if not p:
            raise SystemExit(f"prompt {i} is empty")
    prompts = [[int(t) for t in p] for p in prompts]
    return prompts, choice_ids


def warmup_prompts(prompts, choice_ids):
    """Two short, distinct prompts (built from the input's own ids)."""
    first = prompts[0]
    a = first[: min(8, len(first))]
    b = list(reversed(first[: min(12, len(first))])) + [choice_ids[0]]
    if a == b:
        b = a + [choice_ids[1]]
    return [a, b]


def main(argv=None):
    args = parse_args(argv)
    prompts, choice_ids = load_input(args.inp)

    from vllm import SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # very old versions: plain dicts work as well
        TokensPrompt = dict  # type: ignore

    engine_kwargs = vllm_common.engine_kwargs(args)
    if args.method == "full_vocab":
        engine_kwargs["max_logprobs"] = -1  # no cap: allow logprobs=-1

    llm, load_seconds = vllm_common.start_engine(engine_kwargs)

    if args.method == "token_ids":
        sp = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprob_token_ids=list(choice_ids),
        )
        method = (
            "SamplingParams(max_tokens=1, temperature=0, logprob_token_ids=choice_ids): "
            "vLLM gathers the requested ids from log_softmax over the full vocab of the "
            "raw fp32 logits (logprobs_mode=raw_logprobs); exact full-vocab log-probs"
        )
    else:
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1)
        method = (
            "SamplingParams(max_tokens=1, temperature=0, logprobs=-1) with engine "
            "max_logprobs=-1: all vocab_size raw log-probs returned, choice ids picked out"
        )

    def to_inputs(ps):
        return [TokensPrompt(prompt_token_ids=p) for p in ps]

    def extract(outputs):
        res = []
        for i, out in enumerate(outputs):
            lp = out.outputs[0].logprobs
            if not lp:
                raise RuntimeError(f"prompt {i}: vLLM returned no logprobs")
            first = lp[0]
            row = []
            for cid in choice_ids:
                entry = first.get(cid) if hasattr(first, "get") else first[cid]
                if entry is None:
                    raise RuntimeError(
                        f"prompt {i}: choice id {cid} missing from returned logprobs"
                    )
                row.append(float(entry.logprob))
            res.append(row)
        return res

    t0 = time.perf_counter()
    wout = llm.generate(to_inputs(warmup_prompts(prompts, choice_ids)), sp, use_tqdm=False)
    extract(wout)
    warmup_seconds = time.perf_counter() - t0

    inputs = to_inputs(prompts)

    def timed_round():
        llm.reset_prefix_cache()              # a round never reuses the previous round's prompt pages
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, sp, use_tqdm=False)
        return extract(outputs), time.perf_counter() - t0

    rounds = {}
    if args.paired:
        choice_logprobs, round_seconds, identical = vllm_common.serve_rounds(timed_round)
        seconds = round_seconds[0]
        rounds = {"round_seconds": round_seconds, "rounds_identical": identical}
    else:
        choice_logprobs, seconds = timed_round()

    for i, row in enumerate(choice_logprobs):
        if not all(math.isfinite(x) for x in row):
            print(f"warning: non-finite log-prob in prompt {i}: {row}", file=sys.stderr)

    vllm_common.write_result(args.out, engine_kwargs, prompts, load_seconds, warmup_seconds, seconds,
                             f"{len(prompts)} prompts", choice_logprobs=choice_logprobs, choice_ids=choice_ids,
                             method=method, **rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
