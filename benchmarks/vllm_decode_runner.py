#!/usr/bin/env python3
"""Standalone vLLM greedy-generation runner used to compare evalrun's decoding against vLLM (CPU build).

Runs under a separate virtual environment that has vLLM installed (e.g.
/tmp/vllm-venv/bin/python); it imports nothing from this repository, only the
standard library and vllm.

Usage:
    python benchmarks/vllm_decode_runner.py --model DIR --in prompts.json --out result.json \
        [--dtype float32] [--prefix-caching/--no-prefix-caching] [--max-model-len 4096] \
        [--min-tokens/--no-min-tokens] [--enforce-eager] [--paired]

Input JSON:  {"prompts": [[token ids], ...], "new_tokens": T}
             Token ids are passed verbatim (TokensPrompt(prompt_token_ids=...), no BOS added).
Output JSON: {"vllm_version", "load_seconds", "warmup_seconds", "seconds",
              "token_ids": [[T ids] per prompt, input order], "finish_reasons",
              "prompt_tokens", "num_prompts", "new_tokens", "sampling", "settings"}

`seconds` times the one `LLM.generate` call over all prompts only (engine start-up and
the warm-up are reported separately).

--paired: rounds on demand, so the caller can alternate them with its own timed runs (this
machine's speed drifts by tens of percent over minutes; only adjacent runs compare). After the
warm-up the runner prints the line `@@evalrun ready` on stdout, then reads commands from stdin:
`go` resets the prefix cache (each round prefills from scratch), times one generate and prints
`@@evalrun {"round": i, "seconds": s}`; `quit` (or end of input) writes the output JSON, where
`seconds` is the first round's, `round_seconds` every round's and `rounds_identical` whether
every round produced the first round's token ids. Other lines on stdout are vLLM's own logs.

Sampling is greedy (temperature 0) with exactly T new tokens per prompt: max_tokens=T,
ignore_eos=True (EOS does not stop a request) and, by default, min_tokens=T.

NOTE (vLLM 0.32): SamplingParams.update_from_generation_config adds the EOS id to
all_stop_token_ids even with ignore_eos=True, and the min-tokens logits processor bans
every id there until min_tokens are generated: with min_tokens=T vLLM never emits EOS
(like transformers' min_new_tokens); with --no-min-tokens it may emit EOS and go on.
The model's generation_config.json is not applied (generation_config="vllm"), so no
sampling defaults (repetition penalty, ...) sneak in.

The environment defaults to all of this process's cores for vLLM's OpenMP threads
(VLLM_CPU_OMP_THREADS_BIND=0-N), VLLM_CPU_KVCACHE_SPACE=4 (GiB) and HF_HUB_OFFLINE=1;
values already set are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import vllm_common  # noqa: E402  (this folder is sys.path[0] when run as a script)


def parse_args(argv=None):
    p = vllm_common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--min-tokens", dest="min_tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="min_tokens=T (default: on; in vLLM 0.32 this also bans EOS, see the docstring)")
    p.add_argument("--paired", action="store_true",
                   help="rounds on demand through stdin/stdout (see the docstring)")
    return p.parse_args(argv)


def default_env():
    """All cores this process may run on, unless the caller bound vLLM already."""
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_input(path):
    with open(path) as f:
        data = json.load(f)
    prompts = [[int(t) for t in p] for p in data["prompts"]]
    new_tokens = int(data["new_tokens"])
    if not prompts:
        raise SystemExit("no prompts in input")
    if any(not p for p in prompts):
        raise SystemExit("an input prompt is empty")
    if new_tokens < 1:
        raise SystemExit(f"new_tokens must be >= 1, got {new_tokens}")
    return prompts, new_tokens


def warmup_prompts(prompts):
    """Two short prompts that are not prefixes of the timed ones (reversed slices), so the
    warm-up does not pre-fill the prefix cache for the timed call."""
    first = prompts[0]
    a = list(reversed(first[: min(8, len(first))]))
    b = list(reversed(first[: min(12, len(first))])) + [first[0]]
    return [a, b]


def sampling(new_tokens, min_tokens):
    from vllm import SamplingParams

    kwargs = dict(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    if min_tokens:
        kwargs["min_tokens"] = new_tokens
    return SamplingParams(**kwargs), kwargs


def main(argv=None):
    args = parse_args(argv)
    prompts, new_tokens = load_input(args.inp)
    default_env()

    from vllm.inputs import TokensPrompt

    engine_kwargs = vllm_common.engine_kwargs(args, generation_config="vllm")

    llm, load_seconds = vllm_common.start_engine(engine_kwargs)

    def to_inputs(ps):
        return [TokensPrompt(prompt_token_ids=p) for p in ps]

    warm_sp, _ = sampling(4, args.min_tokens)
    t0 = time.perf_counter()
    llm.generate(to_inputs(warmup_prompts(prompts)), warm_sp, use_tqdm=False)
    warmup_seconds = time.perf_counter() - t0

    sp, sp_kwargs = sampling(new_tokens, args.min_tokens)
    inputs = to_inputs(prompts)

    def timed_round():
        llm.reset_prefix_cache()              # a round never reuses the previous round's prompt pages
        t0 = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        return outs, time.perf_counter() - t0

    if args.paired:
        outputs, round_seconds, identical = vllm_common.serve_rounds(
            timed_round, key=lambda outs: [o.outputs[0].token_ids for o in outs])
        seconds = round_seconds[0]
        rounds = {"round_seconds": round_seconds, "rounds_identical": identical}
    else:
        outputs, seconds = timed_round()
        rounds = {}

    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    finish = [out.outputs[0].finish_reason for out in outputs]
    counts = sorted({len(t) for t in token_ids})
    if counts != [new_tokens]:
        print(f"warning: vLLM generated {counts} tokens per prompt, not all {new_tokens}", file=sys.stderr)

    vllm_common.write_result(args.out, engine_kwargs, prompts, load_seconds, warmup_seconds, seconds,
                             f"{len(prompts)} prompts x {new_tokens} new tokens", token_ids=token_ids,
                             finish_reasons=finish, new_tokens=new_tokens, sampling=dict(sp_kwargs), **rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
