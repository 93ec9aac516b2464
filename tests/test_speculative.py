"""Speculative decoding in the generator (issue 14), against non-speculative decoding as the reference.

Drafts come from the n-gram drafter, or from an "oracle" put in its place that proposes the
reference's own continuation with chosen tokens corrupted, so acceptance of 100%, 0% and every
run length between is exercised on purpose (a tiny random model rarely repeats itself).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import pytest
import torch

from engine import DynamicJob, Model, SamplerSettings, Tokenizer
from engine import generator as generator_module
from engine import speculation
from engine_helpers import greedy_jobs, logit_atol, make_generator, random_prompts, run_jobs


class Oracle:
    """Stands in for NgramDrafter: proposes reference[n: n + k] after n kept tokens, with the
    tokens at the positions where wrong(position) is True replaced by another id."""
    reference: dict[tuple[int, ...], list[int]] = {}
    wrong: Callable[[int], bool] = staticmethod(lambda pos: False)
    loose: set[tuple[int, ...]] = set()          # prompts whose jobs sample: nothing to check

    def __init__(self, tokens: Sequence[int], max_ngram: int = 4, min_ngram: int = 1):
        self.prompt = tuple(tokens)
        self.kept: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        self.kept.extend(tokens)

    def propose(self, k: int) -> list[int]:
        ref = self.reference[self.prompt]
        n = len(self.kept)
        if self.prompt not in self.loose:
            assert self.kept == ref[:n], "the job kept a token the reference did not make"
        return [(t + 1) % 50 + 3 if self.wrong(n + i) else t for i, t in enumerate(ref[n: n + k])]


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setattr(generator_module, "NgramDrafter", Oracle)
    Oracle.reference, Oracle.wrong, Oracle.loose = {}, staticmethod(lambda pos: False), set()
    return Oracle


def _spec(model, **kwargs):
    kwargs.setdefault("adaptive_draft", False)
    return make_generator(model, max_tokens=8192, use_ngram_draft=True, **kwargs)


def _assert_same(ref: dict, got: dict, logits: bool = False) -> None:
    for key, r in ref.items():
        assert got[key]["all_token_ids"] == r["all_token_ids"], key
        assert got[key]["eos_reason"] == r["eos_reason"]
        if logits:
            assert torch.equal(got[key]["all_logits"], r["all_logits"]), key


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Model.load(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def tiny32(tiny_kv32_dir):
    return Model.load(tiny_kv32_dir, dtype="float32")


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return Tokenizer.load(tiny_model_dir)


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


def run_forwards(model, prompts, n) -> int:
    gen = make_generator(model, max_tokens=8192, max_batch_size=4, max_chunk_size=37)
    run_jobs(gen, greedy_jobs(prompts, n))
    return gen.stats()["forward_passes"]


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
        for idx, pid in enumerate(st.page_table):
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


# --- sampling: the law of the output is that of plain sampling ---------------------------------
def _sampled_outcomes(model, speculative: bool, n: int, seed0: int) -> list[tuple[int, ...]]:
    prompt = [0, 1, 2, 3, 4, 2, 0, 3, 1, 4]      # every token seen: n-gram lookup always proposes
    hot = SamplerSettings(temperature=1.5)
    gen = make_generator(model, max_tokens=16 * (n + 8), page_size=16, use_ngram_draft=speculative,
                         adaptive_draft=False, num_draft_tokens=3, sampling_rule="rejection",
                         max_chunk_size=16 * n)            # every prompt in the first forward: drafts from the second
    jobs = [DynamicJob(prompt, max_new_tokens=4, gen_settings=hot, seed=seed0 + i, identifier=i) for i in range(n)]
    out = run_jobs(gen, jobs)
    if speculative:
        assert gen.stats()["drafted_tokens"] > n and gen.stats()["accepted_draft_tokens"] > n / 4
    return [tuple(out[i]["all_token_ids"]) for i in range(n)]


def _homogeneity_p(a: list, b: list) -> float:
    """Chi-square test that two samples share one law (outcomes seen < 10 times pooled)."""
    from collections import Counter
    from scipy.stats import chi2_contingency
    ca, cb = Counter(a), Counter(b)
    keys = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= 10]
    rest = [len(a) - sum(ca[k] for k in keys), len(b) - sum(cb[k] for k in keys)]
    table = [[ca[k] for k in keys] + [rest[0]], [cb[k] for k in keys] + [rest[1]]]
    if not rest[0] + rest[1]:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table)[1])


@pytest.fixture(scope="module")
def vocab5(tiny_model_factory):
    return Model.load(tiny_model_factory("llama", vocab_size=5, seed=2), dtype="float32")


def test_speculative_sampling_has_the_law_of_plain_sampling(vocab5, monkeypatch):
    """The rejection rule. Four tokens sampled 3,000 times with n-gram drafts (accepted by the point-mass rule) and
    3,000 times plainly: a chi-square test does not tell them apart at alpha = 0.01; a rule that
    accepts drafts too often (probability 2 p instead of p) is told apart."""
    from engine import verify
    n = 3000
    plain = _sampled_outcomes(vocab5, False, n, seed0=0)
    assert len(set(plain)) > 20                                    # a spread law, not one sequence
    spec = _sampled_outcomes(vocab5, True, n, seed0=10_000)
    assert _homogeneity_p(plain, spec) > 0.01
    monkeypatch.setattr(verify, "accept_point_mass", lambda p, token, u: u < 2 * float(p[token]))
    broken = _sampled_outcomes(vocab5, True, n, seed0=20_000)
    assert _homogeneity_p(plain, broken) < 0.01
    monkeypatch.undo()
    monkeypatch.setattr(verify, "residual_point_mass", lambda p, token: p)   # a replacement may repeat the draft
    broken = _sampled_outcomes(vocab5, True, n, seed0=20_000)
    assert _homogeneity_p(plain, broken) < 0.01


# --- SmolLM2: the real model ---------------------------------------------------------------------
def smollm2_prompts(tokenizer) -> list[list[int]]:
    """50 prompts: 20 HumanEval, 20 MMLU-style (tests/data/mmlu), 10 repetitive (benchmarks/spec_workloads.py)."""
    from benchmarks.spec_workloads import workload_texts
    texts = workload_texts("humaneval", 20) + workload_texts("mmlu", 20) + workload_texts("repetitive", 10)
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def smollm2_plain(smollm2_dir):
    """SmolLM2, its 50 prompts and plain greedy's 24 tokens for each (the reference of the tests below)."""
    model, tok = Model.load(smollm2_dir, dtype="float32"), Tokenizer.load(smollm2_dir)
    prompts = smollm2_prompts(tok)
    return model, prompts, run_jobs(make_generator(model, max_tokens=64 * 256, page_size=256), greedy_jobs(prompts, 24))


def test_smollm2_greedy_with_ngram_drafts_is_plain_greedy(smollm2_plain):
    """Issue 14's first acceptance item, n-gram drafting: 50 prompts, every proposal verified."""
    model, prompts, ref = smollm2_plain
    gen = make_generator(model, max_tokens=64 * 256, page_size=256, use_ngram_draft=True, adaptive_draft=False)
    _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 24)))
    stats = gen.stats()
    assert stats["accepted_draft_tokens"] > 100 and stats["drafted_tokens"] > stats["accepted_draft_tokens"]


# --- draft models ----------------------------------------------------------------------------------
def _with_draft(model, draft, **kwargs):
    kwargs.setdefault("adaptive_draft", False)
    gen = make_generator(model, max_tokens=8192, draft_model=draft, **kwargs)
    return gen


@pytest.fixture(scope="module")
def other_tiny(tiny_model_factory, tiny_model_dir):
    """A second random model with the tiny model's vocabulary: its drafts are almost never kept."""
    return Model.load(tiny_model_factory("llama", seed=7, num_layers=1), dtype="float32")


@pytest.mark.parametrize("which", ["itself", "truncated", "other"])
def test_draft_model_greedy_is_bitwise_plain_greedy(tiny, other_tiny, which):
    from engine.draft_model import truncated_model
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


def _draft_sampled(model, draft, n: int, seed0: int) -> list[tuple[int, ...]]:
    prompt = [0, 1, 2, 3, 4, 2, 0, 3, 1, 4]
    hot = SamplerSettings(temperature=1.5)
    gen = make_generator(model, max_tokens=16 * (n + 8), draft_model=draft, adaptive_draft=False, num_draft_tokens=3,
                         sampling_rule="rejection", max_chunk_size=16 * n)
    out = run_jobs(gen, [DynamicJob(prompt, max_new_tokens=4, gen_settings=hot, seed=seed0 + i, identifier=i)
                         for i in range(n)])
    assert gen.stats()["drafted_tokens"] > n
    return [tuple(out[i]["all_token_ids"]) for i in range(n)]


def test_draft_model_sampling_has_the_law_of_plain_sampling(vocab5, tiny_model_factory, monkeypatch):
    """The rejection rule. A draft model whose law q differs from the target's p (another random model): the ratio rule
    with the residual max(0, p - q) gives plain sampling's law; drawing the replacement from p
    instead is told apart."""
    from engine import verify
    draft = Model.load(tiny_model_factory("llama", vocab_size=5, seed=9), dtype="float32")
    n = 3000
    plain = _sampled_outcomes(vocab5, False, n, seed0=0)
    assert _homogeneity_p(plain, _draft_sampled(vocab5, draft, n, seed0=40_000)) > 0.01
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    assert _homogeneity_p(plain, _draft_sampled(vocab5, draft, n, seed0=50_000)) < 0.01


@pytest.mark.parametrize("which", ["itself", "first 4 layers", "tiny random"])
def test_smollm2_greedy_with_a_draft_model_is_plain_greedy(smollm2_plain, tiny_model_dir, which):
    """Issue 14's first acceptance item, draft models: SmolLM2 as the target, 50 prompts; as drafts
    SmolLM2 itself (every draft kept), its first 4 layers with its own head, a tiny random model."""
    from engine.draft_model import truncated_model
    model, prompts, ref = smollm2_plain
    draft = {"itself": lambda: model, "first 4 layers": lambda: truncated_model(model, 4),
             "tiny random": lambda: Model.load(tiny_model_dir, dtype="float32")}[which]()
    gen = make_generator(model, max_tokens=64 * 256, page_size=256, draft_model=draft, adaptive_draft=False)
    _assert_same(ref, run_jobs(gen, greedy_jobs(prompts, 24)))
    st = gen.stats()
    assert st["drafted_tokens"] > 500
    if which == "itself":
        assert st["accepted_draft_tokens"] == st["drafted_tokens"]


# --- the coupled rule: a seeded job's tokens are plain sampling's -----------------------------------
COUPLED_SETTINGS = [SamplerSettings(temperature=1.0), SamplerSettings(temperature=0.8, top_p=0.9, top_k=40),
                    SamplerSettings(temperature=1.2, min_p=0.05, token_repetition_penalty=1.3)]


def _seeded_jobs(prompts, n):
    return [DynamicJob(p, max_new_tokens=n, gen_settings=COUPLED_SETTINGS[i % 3], seed=100 + i, identifier=i)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("drafts", ["ngram", "draft model"])
def test_coupled_sampling_gives_plain_sampling_tokens(tiny, vocab5, drafts):
    """With the default rule, seeded sampled jobs keep exactly the tokens of plain sampling, for any
    draft length, batch and chunking: drafting changes how many forwards, never what is drawn.
    (n-gram drafts on the 5-token model, where a sampled token often is the guess; the tiny model
    drafting for itself, where it always is.)"""
    model = vocab5 if drafts == "ngram" else tiny
    g = torch.Generator().manual_seed(80)
    prompts = [torch.randint(0, 5, (n,), generator=g).tolist() * 3 for n in (3, 4, 6)]
    prompts += [torch.randint(0, 5, (n,), generator=g).tolist() for n in (9, 15, 9)]
    opts = {"use_ngram_draft": True} if drafts == "ngram" else {"draft_model": tiny}
    for k, batch, chunk in ((1, None, 2048), (4, 2, 2048), (3, None, 7)):
        # NOTE: the reference chunks prompts the same way: a prompt's last token computed alone goes
        # through the decode kernel, otherwise through the prefill one, which agree only to rounding
        ref = run_jobs(make_generator(model, max_tokens=8192, max_chunk_size=chunk), _seeded_jobs(prompts, 20))
        gen = make_generator(model, max_tokens=8192, adaptive_draft=False, num_draft_tokens=k, max_batch_size=batch,
                             max_chunk_size=chunk, **opts)
        got = run_jobs(gen, _seeded_jobs(prompts, 20))
        _assert_same(ref, got)
        assert gen.stats()["accepted_draft_tokens"] > 0


def test_a_draft_model_with_a_cut_draft_and_few_window_blocks(tiny32):
    """Drafts cut by the chunk budget (the mirror then holds every kept token, and feeds the last one
    again), and a draft cache with fewer window blocks than the target's running jobs (a job whose
    mirror finds none drafts nothing)."""
    from engine import PagedCache
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


def test_prompt_logits_do_not_depend_on_how_the_budget_cuts_prompts(tiny):
    """Drafts take chunk budget, so they move where other jobs' prompts are cut: the first token's
    logits must not depend on that (plain decoding, several budgets, bitwise)."""
    prompts = random_prompts(6, [9, 15, 4, 22], tiny.config.vocab_size, seed=95)
    ref = run_jobs(make_generator(tiny, max_tokens=8192), greedy_jobs(prompts, 2, return_logits=True))
    for chunk in (3, 5, 7, 11):
        got = run_jobs(make_generator(tiny, max_tokens=8192, max_chunk_size=chunk), greedy_jobs(prompts, 2, return_logits=True))
        _assert_same(ref, got, logits=True)


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
