"""Prefix dedup, prompt caching, eviction and defragmentation (tiny fp32 model), per cache mode:
shared pages are shared codes, so every mode must reproduce its own one-job-at-a-time logits."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import CACHE_MODES, greedy_jobs, logit_atol, make_generator, random_prompts, run_jobs

from evalrun.engine import DynamicJob, Model


@pytest.fixture(scope="module")
def model(tiny_kv32_dir):
    return Model.load(tiny_kv32_dir, dtype="float32")


@pytest.fixture(params=CACHE_MODES)
def mode(request) -> str:
    return request.param


def _shared_prefix_prompts(vocab: int, n: int = 48, prefix_len: int = 700):
    prefix = random_prompts(1, [prefix_len], vocab, seed=11)[0]
    g = torch.Generator().manual_seed(12)
    suffixes = []
    for i in range(n):
        length = int(torch.randint(20, 41, (1,), generator=g))
        suffix = torch.randint(3, vocab, (length,), generator=g).tolist()
        suffix[0] = 1000 + i                       # distinct from the first token on
        suffixes.append(suffix)
    return prefix, [prefix + s for s in suffixes]


@pytest.mark.parametrize("page_size", [16, 256])
def test_shared_prefix_is_computed_once(model, page_size, mode):
    prefix, prompts = _shared_prefix_prompts(model.config.vocab_size)
    gen = make_generator(model, max_tokens=page_size * 200, page_size=page_size, mode=mode)
    # a windowed (quantized) cache reuses whole blocks of its window: the rest of the shared
    # prefix's last block is computed again by each job, for its exact K/V
    block = gen.cache.window or 1
    shared = len(prefix) // block * block
    unique = len(prefix) + sum(len(p) - shared for p in prompts[1:])
    jobs = [DynamicJob(p, max_new_tokens=2, identifier=i, return_logits=True) for i, p in enumerate(prompts)]
    results = run_jobs(gen, jobs)
    stats = gen.stats()
    assert stats["prompt_tokens"] == sum(map(len, prompts))
    assert stats["prefill_tokens"] <= 1.05 * unique, (stats, unique)
    assert stats["prefill_tokens"] + stats["cached_tokens"] == stats["prompt_tokens"]
    cached = sorted(r["cached_tokens"] for r in results.values())
    assert cached[0] == 0 and all(c == shared for c in cached[1:]), (cached, shared)
    # Dedup must not change a single logit: compare with jobs computed alone.
    for i in (0, 1, 17, 47):
        alone = run_jobs(make_generator(model, max_tokens=2048, page_size=page_size, mode=mode),
                         [jobs_copy(prompts[i], i)])[i]
        torch.testing.assert_close(results[i]["all_logits"], alone["all_logits"], atol=logit_atol(mode), rtol=0)


def jobs_copy(prompt, identifier):
    return DynamicJob(prompt, max_new_tokens=2, identifier=identifier, return_logits=True)


def test_prompt_cache_rerun_computes_at_most_one_page(model, mode):
    prompts = random_prompts(3, [100, 64, 37], model.config.vocab_size, seed=5)
    gen = make_generator(model, max_tokens=16 * 64, page_size=16, mode=mode)
    first = run_jobs(gen, greedy_jobs(prompts, 6, return_logits=True))
    for i, p in enumerate(prompts):
        before = gen.stats()["prefill_tokens"]
        again = run_jobs(gen, greedy_jobs([p], 6, return_logits=True))[0]
        computed = gen.stats()["prefill_tokens"] - before
        assert computed <= 16 and computed >= 1
        assert again["cached_tokens"] == len(p) - computed
        assert again["all_token_ids"] == first[i]["all_token_ids"]
        torch.testing.assert_close(again["all_logits"], first[i]["all_logits"], atol=logit_atol(mode), rtol=0)


def test_eviction_then_recompute_is_correct(model, mode):
    vocab = model.config.vocab_size
    target = random_prompts(1, [80], vocab, seed=21)[0]
    gen = make_generator(model, max_tokens=16 * 12, page_size=16, mode=mode)      # 12 pages only
    first = run_jobs(gen, greedy_jobs([target], 5, return_logits=True))[0]
    run_jobs(gen, greedy_jobs(random_prompts(6, [90, 70], vocab, seed=22), 5))   # evicts the target's pages
    before = gen.stats()["prefill_tokens"]
    again = run_jobs(gen, greedy_jobs([target], 5, return_logits=True))[0]
    assert gen.stats()["prefill_tokens"] - before == len(target)           # fully recomputed
    assert again["cached_tokens"] == 0
    assert again["all_token_ids"] == first["all_token_ids"]
    torch.testing.assert_close(again["all_logits"], first["all_logits"], atol=logit_atol(mode), rtol=0)


def test_defragment_keeps_cache_hits_and_outputs(model, mode):
    vocab = model.config.vocab_size
    prompts = random_prompts(5, [50, 33, 70], vocab, seed=31)
    gen = make_generator(model, max_tokens=16 * 40, page_size=16, mode=mode)
    first = run_jobs(gen, greedy_jobs(prompts, 4, return_logits=True))
    pool = gen.cache.pool
    # The generator compacts automatically once idle: cached pages sit at the lowest ids.
    assert sorted(pool.cached) == list(range(len(pool.cached)))
    assert list(pool.free) == list(range(len(pool.cached), pool.num_pages))
    for i, p in enumerate(prompts):
        before = gen.stats()["prefill_tokens"]
        again = run_jobs(gen, greedy_jobs([p], 4, return_logits=True))[0]
        assert gen.stats()["prefill_tokens"] - before <= 16
        assert again["all_token_ids"] == first[i]["all_token_ids"]
        torch.testing.assert_close(again["all_logits"], first[i]["all_logits"], atol=logit_atol(mode), rtol=0)


def test_defragment_moves_pages(model, mode):
    """Force a fragmented layout, compact it, and check K/V moved with the pages."""
    vocab = model.config.vocab_size
    a, b = random_prompts(2, [40, 40], vocab, seed=41)
    gen = make_generator(model, max_tokens=16 * 20, page_size=16, mode=mode)
    first = run_jobs(gen, greedy_jobs([a, b], 3, return_logits=True))
    pool = gen.cache.pool
    # Drop job a's pages from the cache to leave holes at low ids, then compact.
    holes = [pid for pid in list(pool.cached) if pool.pages[pid].tokens[:1] == (a[0],)]
    assert holes
    for pid in holes:
        pool.cached.pop(pid)
        pool._forget(pool.pages[pid])
        pool.free[pid] = None
    plan = pool.compaction_plan()
    assert any(old != new for old, new in plan.items())
    gen.defragment()
    again = run_jobs(gen, greedy_jobs([b], 3, return_logits=True))[0]
    assert again["cached_tokens"] >= 32
    torch.testing.assert_close(again["all_logits"], first[1]["all_logits"], atol=logit_atol(mode), rtol=0)
