"""Speculative decoding in the generator (issue 14), greedy and the drafting policy, against
non-speculative decoding as the reference (helpers and the oracle drafter: tests/spec_helpers.py)."""
from __future__ import annotations

import pytest
import torch

from evalrun.engine import DynamicJob, SamplerSettings
from evalrun.engine import generator as generator_module
from evalrun.engine import speculation
from engine_helpers import greedy_jobs, logit_atol, make_generator, random_prompts, run_jobs

from spec_helpers import (  # noqa: F401,F811  (fixtures)
    _assert_same, _spec, oracle, run_forwards, smollm2_plain, tiny, tiny32, tiny_tok
)


PATTERNS = {"all right": lambda pos: False, "all wrong": lambda pos: True,
            "every third wrong": lambda pos: pos % 3 == 2, "some wrong": lambda pos: pos in (1, 2, 9, 17)}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", ["fp32", "q8"])
def test_greedy_with_drafts_is_bitwise_plain_greedy(tiny, tiny32, oracle, pattern, mode):
    """Tokens and the logits each was chosen from are those of plain decoding (bitwise in fp32), however
    many drafts are kept; in q8 the draft rows also stay inside the recent-token window's block."""
    tiny = tiny if mode == "fp32" else tiny32
    prompts = random_prompts(9, [5, 23, 40], tiny.config.vocab_size, seed=3)
    ref = run_jobs(make_generator(tiny, max_tokens=8192, mode=mode), greedy_jobs(prompts, 30, return_logits=True))
    oracle.reference = {tuple(p): ref[i]["all_token_ids"] for i, p in enumerate(prompts)}
    oracle.wrong = staticmethod(PATTERNS[pattern])
    gen = _spec(tiny, mode=mode, max_batch_size=4, max_chunk_size=37)   # prefill beside drafts; cut drafts
    got = run_jobs(gen, greedy_jobs(prompts, 30, return_logits=True))
    # NOTE: with a recent-token window, prefill attention is SDPA over the gathered context, which is
    # bitwise only for the same prompt cuts, and drafts move when other jobs' prompts are cut
    _assert_same(ref, got, logits=mode == "fp32")
    if mode != "fp32":
        for key, r in ref.items():
            torch.testing.assert_close(got[key]["all_logits"], r["all_logits"], atol=logit_atol(mode), rtol=0)
    stats = gen.stats()
    assert stats["drafted_tokens"] > 0
    if pattern == "all wrong":
        assert stats["accepted_draft_tokens"] == 0
    else:
        assert stats["accepted_draft_tokens"] > 0
    if pattern == "all right" and mode == "fp32":
        assert stats["forward_passes"] < run_forwards(tiny, prompts, 30) / 2
    assert sum(r["accepted_draft_tokens"] for r in got.values()) == stats["accepted_draft_tokens"]
    assert sum(r["drafted_tokens"] for r in got.values()) == stats["drafted_tokens"]


def test_ngram_drafting_on_repetitive_prompts_is_plain_greedy(tiny):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() * 6 for n in (2, 3, 5, 7)]
    prompts += random_prompts(4, [12, 30], tiny.config.vocab_size, seed=4)
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 40))
    for adaptive in (False, True):
        gen = _spec(tiny, adaptive_draft=adaptive, max_batch_size=2)     # a queue: throughput is what counts
        _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 40)))
        assert gen.stats()["drafted_tokens"] > 0


def test_max_new_tokens_is_never_passed_by_a_draft(tiny, oracle):
    prompts = random_prompts(5, [9, 14], tiny.config.vocab_size, seed=8)
    long = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 20))
    oracle.reference = {tuple(p): long[i]["all_token_ids"] for i, p in enumerate(prompts)}   # runs past the limit
    for n in (1, 2, 5, 6):
        ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, n))
        gen = _spec(tiny, num_draft_tokens=4)
        got = run_jobs(gen, greedy_jobs(prompts, n))
        _assert_same(ref, got)
        assert all(r["new_tokens"] == n and r["eos_reason"] == "max_new_tokens" for r in got.values())
        assert gen.stats()["drafted_tokens"] == (0 if n == 1 else gen.stats()["drafted_tokens"])


@pytest.mark.parametrize("min_new", [0, 6])
def test_stop_token_inside_a_draft_ends_the_job_there(tiny, oracle, min_new):
    """The oracle's drafts run on past the stop token (they come from a run without it); the job
    ends at the stop token as plain decoding does, and before min_new_tokens the token is banned on
    every draft row, as on plain ones."""
    prompts = random_prompts(6, [8, 19], tiny.config.vocab_size, seed=11)
    free = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 24))
    oracle.reference = {tuple(p): free[i]["all_token_ids"] for i, p in enumerate(prompts)}
    stop = free[0]["all_token_ids"][3]                       # a token of job 0, fourth place

    def jobs():
        return [DynamicJob(p, max_new_tokens=24, min_new_tokens=min_new, stop_conditions=[stop], identifier=i)
                for i, p in enumerate(prompts)]
    ref = run_jobs(make_generator(tiny, max_tokens=8192), jobs())
    assert ref[0]["eos_reason"] == ("stop_token" if min_new == 0 else ref[0]["eos_reason"])
    if min_new:
        oracle.reference = {tuple(p): ref[i]["all_token_ids"] + free[i]["all_token_ids"][len(ref[i]["all_token_ids"]):]
                            for i, p in enumerate(prompts)}
    got = run_jobs(_spec(tiny, num_draft_tokens=5), jobs())
    _assert_same(ref, got)


def test_stop_string_across_a_draft_boundary(tiny, tiny_tok, oracle):
    """A stop string made of tokens 4..6 of the reference, with drafts of 3 and 4 tokens (so it spans
    rows of two verifications): the same completion, and no text streamed that the stop withdraws."""
    prompts = random_prompts(4, [10, 17], tiny.config.vocab_size, seed=21)
    free = run_jobs(make_generator(tiny, max_tokens=8192, tokenizer=tiny_tok), greedy_jobs(prompts, 20))
    oracle.reference = {tuple(p): free[i]["all_token_ids"] for i, p in enumerate(prompts)}
    stop = tiny_tok.decode(free[1]["all_token_ids"][4:7])
    assert stop.strip()

    def run(gen):
        jobs = [DynamicJob(p, max_new_tokens=20, stop_conditions=[stop], identifier=i) for i, p in enumerate(prompts)]
        streamed = {i: "" for i in range(len(prompts))}
        gen.enqueue(jobs)
        final = {}
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                streamed[r["identifier"]] += r["text"]
                if r["eos"]:
                    final[r["identifier"]] = r
        return final, streamed
    ref, ref_stream = run(make_generator(tiny, max_tokens=8192, tokenizer=tiny_tok))
    assert ref[1]["eos_reason"] == "stop_string"
    for k in (3, 4):
        got, stream = run(_spec(tiny, tokenizer=tiny_tok, num_draft_tokens=k))
        for i in ref:
            assert got[i]["full_completion"] == ref[i]["full_completion"] == stream[i] == ref_stream[i]
            assert got[i]["eos_reason"] == ref[i]["eos_reason"]
            assert got[i]["new_tokens"] == ref[i]["new_tokens"]


def test_rejected_tokens_never_reach_dedup_or_the_prompt_cache(tiny, oracle, monkeypatch):
    """Jobs sharing a prefix (dedup), every draft rejected: no page ever counts a slot past the job's
    kept tokens, and a second round of the same prompts, served from the prompt cache, and a third
    whose prompts go on past the first outputs, match plain decoding."""
    shared = random_prompts(1, [40], tiny.config.vocab_size, seed=30)[0]
    prompts = [shared + tail for tail in random_prompts(6, [3, 9], tiny.config.vocab_size, seed=31)]
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 25))
    oracle.reference = {tuple(p): ref[i]["all_token_ids"] for i, p in enumerate(prompts)}
    oracle.wrong = staticmethod(lambda pos: pos % 2 == 0)
    gen = _spec(tiny, num_draft_tokens=4)
    real_computed = gen.scheduler.computed

    def checked(chunk, num_kept=None):
        real_computed(chunk, num_kept)
        st, ps = chunk.job.state, gen.cache.page_size
        for idx, pid in enumerate(st.kv.page_table):
            page = gen.cache.pool.pages[pid]
            if page.ref_count == 1:                          # the job's own pages
                assert page.num_valid <= max(0, st.num_computed_tokens - idx * ps)
    monkeypatch.setattr(gen.scheduler, "computed", checked)
    _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 25)))
    assert gen.stats()["cached_tokens"] > 0                   # dedup of the shared prefix
    second = run_jobs(gen, greedy_jobs(prompts, 25))
    _assert_same(ref, second)
    assert all(r["cached_tokens"] >= 32 for r in second.values())
    longer = [p + ref[i]["all_token_ids"][:12] for i, p in enumerate(prompts)]
    ref3 = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(longer, 10))
    oracle.reference = {tuple(p): ref3[i]["all_token_ids"] for i, p in enumerate(longer)}
    _assert_same(ref3, run_jobs(gen, greedy_jobs(longer, 10)))


def test_draft_tokens_travel_in_the_step_chunks(tiny, oracle, monkeypatch):
    """Each drafting job's chunk carries exactly its draft rows as a value (the oracle's proposal, cut
    to the budget), on decode chunks only and within the step's max_chunk_size rows; the job's state
    holds no draft, and the output is plain greedy."""
    prompts = random_prompts(3, [6, 14], tiny.config.vocab_size, seed=40)
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 12))
    oracle.reference = {tuple(p): ref[i]["all_token_ids"] for i, p in enumerate(prompts)}
    oracle.wrong = staticmethod(lambda pos: pos % 3 == 2)
    gen = _spec(tiny, num_draft_tokens=3)
    seen = []
    real_build = generator_module.build_forward_batch

    def build(chunks, cache, device, **kwargs):
        assert sum(ch.num_rows for ch in chunks) <= gen.scheduler.max_chunk_size
        for ch in chunks:
            if ch.draft:
                job, kept = ch.job, len(ch.job.state.new_ids)
                assert ch.is_decode and isinstance(ch.draft, tuple)
                seen.append(list(ch.draft))
                ref_next = oracle.reference[tuple(job.prompt_ids)][kept: kept + len(ch.draft)]
                assert list(ch.draft) == [(t + 1) % 50 + 3 if oracle.wrong(kept + i) else t
                                          for i, t in enumerate(ref_next)]        # the oracle's rule
        return real_build(chunks, cache, device, **kwargs)
    monkeypatch.setattr(generator_module, "build_forward_batch", build)
    jobs = greedy_jobs(prompts, 12)
    got = run_jobs(gen, jobs)
    _assert_same(ref, got)
    assert seen and all(len(d) <= 3 for d in seen)
    assert not any("draft_ids" in vars(j.state) for j in jobs)


def test_sampled_and_greedy_jobs_share_a_verification_forward(tiny, oracle):
    """A sampled job beside drafted greedy jobs: the greedy ones match plain decoding, and the sampled
    one is reproducible from its seed."""
    prompts = random_prompts(4, [11, 6], tiny.config.vocab_size, seed=40)
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 15))
    oracle.reference = {tuple(p): ref[i]["all_token_ids"] for i, p in enumerate(prompts)}
    sampled = random_prompts(1, [13], tiny.config.vocab_size, seed=41)[0]
    oracle.reference[tuple(sampled)] = list(range(3, 40))
    oracle.loose = {tuple(sampled)}
    hot = SamplerSettings(temperature=1.0, top_k=20)

    def jobs():
        return greedy_jobs(prompts, 15) + [DynamicJob(sampled, 15, gen_settings=hot, seed=9, identifier="s")]
    a, b = run_jobs(_spec(tiny), jobs()), run_jobs(_spec(tiny), jobs())
    _assert_same(ref, {k: v for k, v in a.items() if k != "s"})
    assert a["s"]["all_token_ids"] == b["s"]["all_token_ids"] and len(a["s"]["all_token_ids"]) == 15


def test_step_cost_fit_recovers_a_line_and_policy_drops_costly_rows():
    cost = speculation.StepCost()
    for rows in (1, 5, 9, 3, 32, 40) * 3:
        cost.observe(rows, 0.02 + 0.001 * rows)
    a, b = cost.fit()
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(0.001, rel=1e-6)
    policy = speculation.DraftPolicy(speculation.SpecSettings(num_draft_tokens=4))
    policy.cost = cost
    good, bad = speculation.DraftRecord(hits=9, trials=10), speculation.DraftRecord(hits=1, trials=10)
    chosen = policy.choose({1: [5, 6, 7, 8], 2: [5, 6, 7, 8]}, {1: good, 2: bad}, base_rows=2, base_tokens=2)
    assert chosen == {1: [5, 6, 7, 8]}                       # 0.1 acceptance does not pay a row
    rows = 400                                               # the row cost b E / t: 0.4 / 0.42 ~ 0.95
    chosen = policy.choose({1: [5, 6, 7, 8]}, {1: good}, base_rows=rows, base_tokens=rows)
    assert chosen == {}


def test_makespan_rule_drafts_for_every_longest_job_or_none():
    """No queue: drafting pays when each job that ends last keeps enough of its drafts; a longest
    job with no proposal, or low acceptance, means no drafting; shorter jobs never draft."""
    policy = speculation.DraftPolicy(speculation.SpecSettings(num_draft_tokens=4))
    for rows in (2, 9):
        policy.cost.observe(rows, 0.02 + 0.001 * rows)          # a = 20 b
    good = speculation.DraftRecord(hits=50, trials=55)           # ~0.9
    low = speculation.DraftRecord(hits=1, trials=20)
    d = [5, 6, 7, 8]
    remaining = {1: 100, 2: 99, 3: 40}
    assert policy.choose({1: d, 2: d, 3: d}, {1: good, 2: good, 3: good}, 3, 3, remaining) == {1: d, 2: d}
    assert policy.choose({1: d, 3: d}, {1: good, 2: good, 3: good}, 3, 3, remaining) == {}    # job 2: no proposal
    assert policy.choose({1: d, 2: d}, {1: good, 2: low, 3: good}, 3, 3, remaining) == {}
    many = {j: 100 for j in range(200)}                          # 200 rows: a row costs 1/220 of a step
    assert policy.choose({j: d for j in many}, {j: good for j in many}, 200, 200, many) == {}


def test_smollm2_greedy_with_ngram_drafts_is_plain_greedy(smollm2_plain):
    """Issue 14's first acceptance item, n-gram drafting: 50 prompts, every proposal verified."""
    model, prompts, ref = smollm2_plain
    gen = make_generator(model, max_tokens=64 * 256, page_size=256, use_ngram_draft=True, adaptive_draft=False)
    _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 24)))
    stats = gen.stats()
    assert stats["accepted_draft_tokens"] > 100 and stats["drafted_tokens"] > stats["accepted_draft_tokens"]


def test_prompt_logits_do_not_depend_on_how_the_budget_cuts_prompts(tiny):
    """Drafts take chunk budget, so they move where other jobs' prompts are cut: the first token's
    logits must not depend on that (plain decoding, several budgets, bitwise)."""
    prompts = random_prompts(6, [9, 15, 4, 22], tiny.config.vocab_size, seed=95)
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 2, return_logits=True))
    for chunk in (3, 5, 7, 11):
        got = run_jobs(make_generator(tiny, max_tokens=8192, max_chunk_size=chunk), greedy_jobs(prompts, 2, return_logits=True))
        _assert_same(ref, got, logits=True)
