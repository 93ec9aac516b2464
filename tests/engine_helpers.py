"""Small helpers shared by the engine tests."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache

CACHE_MODES = ["fp32", "q8", "q6", "q4"]      # the engine tests run per mode (float storage + quantized)


def logit_atol(mode: str) -> float:
    """How far the logits of one job may move when its prompt is computed in other chunks
    (dedup, prompt cache, eviction): fp32 attention over a cached prefix differs from one
    whole-prompt pass by float noise (~5e-6 here). A quantized cache can turn that noise
    into one neighbouring code where a value sits on a rounding boundary, which moved the
    tiny model's logits (std ~3) by at most 3.4e-3 in these tests. A wrong page, slot or
    scale moves them by far more than 1e-2."""
    return 2e-5 if mode == "fp32" else 1e-2



def make_generator(model: Model, max_tokens: int = 4096, page_size: int = 16, mode: str = "fp32",
                   poison: bool = True, **kwargs) -> DynamicGenerator:
    cache = PagedCache(model, max_tokens=max_tokens, page_size=page_size, mode=mode)
    if poison:
        cache.fill_unused()          # NaN in every slot: outputs must never read unused slots
    return DynamicGenerator(model=model, cache=cache, **kwargs)


def run_jobs(gen: DynamicGenerator, jobs: Sequence[DynamicJob]) -> dict[int, dict]:
    """Enqueue and drain; returns the eos result of each job keyed by its identifier,
    with `all_token_ids` and stacked `all_logits` (when requested) added."""
    tokens: dict = {j.identifier: [] for j in jobs}
    logits: dict = {j.identifier: [] for j in jobs}
    final: dict = {}
    gen.enqueue(list(jobs))
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            tokens[r["identifier"]] += r["token_ids"]
            if "logits" in r:
                logits[r["identifier"]].append(r["logits"])
            if r["eos"]:
                final[r["identifier"]] = r
    for key, r in final.items():
        r["all_token_ids"] = tokens[key]
        r["all_logits"] = torch.cat(logits[key]) if logits[key] else None
    return final


def greedy_jobs(prompts: Sequence[Sequence[int]], max_new_tokens: int, return_logits: bool = False,
                stop: Optional[list] = None) -> list[DynamicJob]:
    return [DynamicJob(list(p), max_new_tokens=max_new_tokens, identifier=i, return_logits=return_logits,
                       stop_conditions=stop)
            for i, p in enumerate(prompts)]


def random_prompts(n: int, lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]
