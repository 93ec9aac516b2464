"""Speculative decoding with a draft model (issue 14): exactness, the draft's own cache, stops,
options; against plain decoding."""
from __future__ import annotations

import pytest

from evalrun.engine import DynamicJob, Model
from engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs

from spec_helpers import (  # noqa: F401,F811  (fixtures)
    _assert_same, _with_draft, other_tiny, run_forwards, smollm2_plain, tiny, tiny32, tiny_tok, vocab5
)


@pytest.mark.parametrize("which", ["itself", "truncated", "other"])
def test_draft_model_greedy_is_bitwise_plain_greedy(tiny, other_tiny, which):
    from evalrun.engine.draft_model import truncated_model
    draft = {"itself": tiny, "truncated": truncated_model(tiny, 1), "other": other_tiny}[which]
    prompts = random_prompts(8, [6, 21, 40], tiny.config.vocab_size, seed=50)
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 24, return_logits=True))
    gen = _with_draft(tiny, draft, max_batch_size=3, max_chunk_size=29)
    got = run_jobs(gen, greedy_jobs(prompts, 24, return_logits=True))
    _assert_same(ref, got, logits=True)
    st = gen.stats()
    assert st["drafted_tokens"] > 0 and st["draft_forward_passes"] > 0
    if which == "itself":
        assert st["accepted_draft_tokens"] == st["drafted_tokens"]       # the same model: every draft kept
        assert st["forward_passes"] < run_forwards(tiny, prompts, 24) / 2
    assert gen.draft.cache.pool.num_in_use == 0 and not gen.draft.mirrors   # freed with the jobs


def test_draft_cache_dedups_and_caches_prompts(tiny):
    """The draft model's own cache shares a common prefix among jobs and keeps prompts for the next
    round; outputs stay plain greedy's."""
    shared = random_prompts(1, [48], tiny.config.vocab_size, seed=60)[0]
    prompts = [shared + t for t in random_prompts(5, [4, 7], tiny.config.vocab_size, seed=61)]
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 12))
    gen = _with_draft(tiny, tiny)
    _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 12)))
    first = gen.stats()["draft_cached_tokens"]
    assert first >= 4 * 32                          # four jobs reuse the first's 3 full pages of 16 (or more)
    _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 12)))
    assert gen.stats()["draft_cached_tokens"] - first >= 5 * 48


def test_draft_model_stops_exactly(tiny, tiny_tok):
    prompts = random_prompts(4, [10, 17], tiny.config.vocab_size, seed=70)
    free = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 20))
    stop = free[2]["all_token_ids"][5]

    def jobs():
        return [DynamicJob(p, max_new_tokens=n, stop_conditions=[stop], identifier=i)
                for i, (p, n) in enumerate(zip(prompts, (20, 3, 20, 7)))]
    ref = run_jobs(make_generator(tiny, max_tokens=8192, tokenizer=tiny_tok), jobs())
    got = run_jobs(_with_draft(tiny, tiny, tokenizer=tiny_tok, num_draft_tokens=4), jobs())
    _assert_same(ref, got)


def test_draft_model_options_are_checked(tiny, vocab5):
    with pytest.raises(ValueError, match="vocabulary"):
        make_generator(tiny, draft_model=vocab5)
    with pytest.raises(ValueError, match="not both"):
        make_generator(tiny, draft_model=tiny, use_ngram_draft=True)
    with pytest.raises(ValueError, match="without a draft_model"):
        make_generator(tiny, draft_cache=make_generator(tiny).cache)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_generator(tiny, use_ngram_draft=True, num_draft_tokens=0)


@pytest.mark.parametrize("which", ["itself", "first 4 layers", "tiny random"])
def test_smollm2_greedy_with_a_draft_model_is_plain_greedy(smollm2_plain, tiny_model_dir, which):
    """Issue 14's first acceptance item, draft models: SmolLM2 as the target, 50 prompts; as drafts
    SmolLM2 itself (every draft kept), its first 4 layers with its own head, a tiny random model."""
    from evalrun.engine.draft_model import truncated_model
    model, prompts, ref = smollm2_plain
    draft = {"itself": lambda: model, "first 4 layers": lambda: truncated_model(model, 4),
             "tiny random": lambda: Model.load(tiny_model_dir, dtype="float32")}[which]()
    gen = make_generator(model, max_tokens=64 * 256, page_size=256, draft_model=draft, adaptive_draft=False)
    _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 24)))
    st = gen.stats()
    assert st["drafted_tokens"] > 500
    if which == "itself":
        assert st["accepted_draft_tokens"] == st["drafted_tokens"]


def test_a_draft_model_with_a_cut_draft_and_few_window_blocks(tiny32):
    """Drafts cut by the chunk budget (the mirror then holds every kept token, and feeds the last one
    again), and a draft cache with fewer window blocks than the target's running jobs (a job whose
    mirror finds none drafts nothing)."""
    from evalrun.engine import PagedCache
    prompts = random_prompts(3, [9, 5], tiny32.config.vocab_size, seed=90)
    ref = run_jobs(make_generator(tiny32, max_tokens=8192), greedy_jobs(prompts, 16))
    got = run_jobs(make_generator(tiny32, max_tokens=8192, draft_model=tiny32, adaptive_draft=False, max_chunk_size=3),
                   greedy_jobs(prompts, 16))
    _assert_same(ref, got)
    q8 = run_jobs(make_generator(tiny32, max_tokens=1024, mode="q8"), greedy_jobs(prompts, 16))
    small = PagedCache(tiny32, max_tokens=1024, page_size=16, mode="q8", max_jobs=2)
    gen = make_generator(tiny32, max_tokens=1024, mode="q8", draft_model=tiny32, draft_cache=small,
                         adaptive_draft=False)
    _assert_same(q8, run_jobs(gen, greedy_jobs(prompts, 16)))
    assert gen.stats()["drafted_tokens"] > 0 and small.pool.num_in_use == 0


def test_mirrors_waiting_on_a_copy_are_freed_with_their_jobs(tiny):
    """Mirrors admitted in one step share a prefix: the later ones wait for the first one's pages
    and hold a pending page copy; jobs that end before their mirror ever computes must release all
    of it (the idle generator defragments both caches, which needs every page unreferenced)."""
    shared = random_prompts(1, [20], tiny.config.vocab_size, seed=97)[0]        # a full page + 4 tokens
    prompts = [shared + t for t in random_prompts(6, [3, 5], tiny.config.vocab_size, seed=98)]
    for n in (2, 3, 6):
        ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, n))
        gen = _with_draft(tiny, tiny)
        _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, n)))
        assert gen.draft.cache.pool.num_in_use == 0 and not gen.draft.mirrors
