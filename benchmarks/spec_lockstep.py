"""Where a speculative run gains or loses against plain decoding, step by step (issue 14): a plain and
an n-gram speculative generator stepped alternately on the same prompts in one process, so machine
drift hits both alike.

    python -m benchmarks.spec_lockstep [--batch 32] [--new-tokens 256] [--workload humaneval]

Reports both sides' total step time, and the steps of equal shape (same number of active jobs)
where the speculative side drafted nothing: their time ratio is the cost of the machinery alone.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Optional, Sequence

from benchmarks.bench_spec import PAGE
from benchmarks.common import positive_int
from benchmarks.spec_workloads import WORKLOADS, workload_texts
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer


def _generator(model: Model, tokenizer: Tokenizer, prompts: list[list[int]], new_tokens: int,
               options: dict[str, Any]) -> DynamicGenerator:
    pages = len(prompts) * (-(-(max(map(len, prompts)) + new_tokens) // PAGE)) + 1
    gen = DynamicGenerator(model, PagedCache(model, max_tokens=pages * PAGE, page_size=PAGE), tokenizer, **options)
    gen.enqueue([DynamicJob(p, new_tokens, stop_conditions=sorted(tokenizer.eos_token_ids), identifier=i)
                 for i, p in enumerate(prompts)])
    return gen


def _step(gen: DynamicGenerator) -> Optional[tuple[float, int, int]]:
    """(seconds, tokens drafted, active jobs before) of one step, None once the generator is done."""
    if not gen.num_remaining_jobs():
        return None
    drafted, active = gen.counters["drafted_tokens"], len(gen.scheduler.active)
    t0 = time.perf_counter()
    gen.iterate()
    return time.perf_counter() - t0, gen.counters["drafted_tokens"] - drafted, active


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_lockstep", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--new-tokens", type=positive_int, default=256)
    p.add_argument("--workload", choices=WORKLOADS, default="humaneval")
    args = p.parse_args(argv)
    from evalrun.demo import ensure_demo_model
    model_dir = ensure_demo_model()
    tokenizer, model = Tokenizer.load(model_dir), Model.load(model_dir, dtype="float32")
    prompts = [tokenizer.encode(t) for t in workload_texts(args.workload, args.batch)]
    gens = {"plain": _generator(model, tokenizer, prompts, args.new_tokens, {}),
            "spec": _generator(model, tokenizer, prompts, args.new_tokens, {"use_ngram_draft": True})}
    total = dict.fromkeys(gens, 0.0)
    same = dict.fromkeys(gens, 0.0)
    n_same = n = 0
    while any(g.num_remaining_jobs() for g in gens.values()):
        order = ["plain", "spec"] if n % 2 == 0 else ["spec", "plain"]
        steps = {name: _step(gens[name]) for name in order}
        for name, s in steps.items():
            total[name] += s[0] if s else 0.0
        plain, spec = steps["plain"], steps["spec"]
        if plain and spec and not spec[1] and plain[2] == spec[2]:
            n_same += 1
            for name, s in (("plain", plain), ("spec", spec)):
                same[name] += s[0]
        n += 1
    stats = gens["spec"].stats()
    print(f"all steps: plain {total['plain']:.2f} s, speculative {total['spec']:.2f} s "
          f"({total['plain'] / total['spec']:.3f}x); {n_same} equal-shape steps without drafts: plain "
          f"{same['plain']:.2f} s, speculative {same['spec']:.2f} s ({same['plain'] / max(same['spec'], 1e-9):.3f}x); "
          f"drafted {stats['drafted_tokens']}, kept {stats['accepted_draft_tokens']}, forwards "
          f"{stats['forward_passes']} vs {gens['plain'].stats()['forward_passes']}")
    return {"plain_s": total["plain"], "spec_s": total["spec"], "same_plain_s": same["plain"],
            "same_spec_s": same["spec"], "same_steps": n_same}


if __name__ == "__main__":
    main()
