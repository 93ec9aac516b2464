"""Sampler tests against from-scratch numpy references and hand-computed values."""
import math

import numpy as np
import pytest
import torch

from evalrun.engine.sampler import (
    SamplerSettings,
    apply_penalties,
    greedy_tokens,
    _mask_top_p,
    inverse_cdf,
    make_generator,
    sample,
    sampling_probs,
    top_k_of,
)


def ref_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Plain numpy reference, written without looking at the torch code paths."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    if top_k:
        kth_largest = sorted(x.tolist(), reverse=True)[min(top_k, len(x)) - 1]
        x = np.where(x < kth_largest, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        kept, mass = np.zeros_like(p), 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            if mass >= top_p:
                break
            kept[i] = p[i]
            mass += p[i]
        p = kept / kept.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def _logits(seed, vocab=64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


# ---------------------------------------------------------------- greedy

def test_defaults_are_greedy_without_penalties():
    s = SamplerSettings()
    assert s.is_greedy and not s.needs_history


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax_and_draws_nothing(seed):
    logits = _logits(seed)
    g = make_generator(0)
    state = g.get_state()
    result = sample(logits, SamplerSettings(), None, g)
    assert result.token == int(np.argmax(logits.numpy()))
    assert torch.equal(g.get_state(), state)
    np.testing.assert_allclose(result.probs.numpy(), ref_probs(logits.numpy(), 1.0), atol=1e-6)
    assert result.prob == pytest.approx(float(result.probs[result.token]))


def test_greedy_ties_break_to_lowest_id():
    logits = torch.tensor([0.0, 5.0, 1.0, 5.0, 5.0])
    assert sample(logits, SamplerSettings(), None, None).token == 1
    batch = torch.tensor([[0.0, 5.0, 5.0], [7.0, 7.0, 1.0], [0.0, 1.0, 2.0]])
    assert greedy_tokens(batch).tolist() == [1, 0, 2]


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([3.0, 2.5, 0.0])
    s = SamplerSettings(token_presence_penalty=1.0)
    assert sample(logits, s, torch.tensor([0]), None).token == 1


# ---------------------------------------------------------------- distributions

FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_k=100),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, top_p=1e-6),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, min_p=0.2),
    dict(temperature=1.0, top_k=10, top_p=0.8),
    dict(temperature=1.5, top_k=20, top_p=0.95, min_p=0.02),
    dict(temperature=0.9, top_p=0.7, min_p=0.1),
]


@pytest.mark.parametrize("kwargs", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("seed", range(3))
def test_sampling_probs_match_reference(kwargs, seed):
    logits = _logits(seed)
    got = sampling_probs(logits, SamplerSettings(**kwargs)).numpy()
    want = ref_probs(logits.numpy(), **kwargs)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.array_equal(got > 0, want > 0)


@pytest.mark.parametrize("top_p,seed", [(0.95, 0), (0.99, 1), (0.5, 2)])
def test_top_p_over_a_large_vocab_matches_reference(top_p, seed):
    # Nearly flat logits: the nucleus holds hundreds or thousands of tokens.
    logits = _logits(seed, vocab=5000, scale=0.5)
    got = sampling_probs(logits, SamplerSettings(temperature=1.0, top_p=top_p)).numpy()
    want = ref_probs(logits.numpy(), 1.0, top_p=top_p)
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert np.array_equal(got > 0, want > 0)
    assert (got > 0).sum() > 512 or top_p == 0.5


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25])
    assert _mask_top_p(probs, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0]
    assert _mask_top_p(probs, 0.5001).tolist() == [0.0, 0.5, 0.0, 0.25]
    assert _mask_top_p(probs, 0.75).tolist() == [0.0, 0.5, 0.0, 0.25]
    assert _mask_top_p(probs, 0.8).tolist() == [0.125, 0.5, 0.125, 0.25]  # tie at the cut-off


def test_filters_keep_ties_at_the_cutoff():
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])
    np.testing.assert_allclose(sampling_probs(logits, SamplerSettings(temperature=1.0, top_k=1)).numpy(),
                               [0, 0.5, 0.5, 0], atol=1e-7)
    np.testing.assert_allclose(sampling_probs(logits, SamplerSettings(temperature=1.0, top_p=0.1)).numpy(),
                               [0, 0.5, 0.5, 0], atol=1e-7)


def test_tiny_temperature_does_not_produce_nan():
    probs = sampling_probs(torch.tensor([1.0, 3.0, -2.0]), SamplerSettings(temperature=1e-30))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_sampling_probs_does_not_mutate_logits():
    logits = _logits(0)
    before = logits.clone()
    sampling_probs(logits, SamplerSettings(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- penalties

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])
HISTORY = torch.tensor([0, 1, 1, 4, 4, 4])  # counts: 0->1, 1->2, 4->3; 2 and 3 unseen


@pytest.mark.parametrize("kwargs,want", [
    (dict(token_repetition_penalty=2.0), [1.0, -2.0, 0.5, 3.0, -8.0]),
    (dict(token_repetition_penalty=0.5), [4.0, -0.5, 0.5, 3.0, -2.0]),
    (dict(token_frequency_penalty=0.5), [1.5, -2.0, 0.5, 3.0, -5.5]),
    (dict(token_presence_penalty=0.25), [1.75, -1.25, 0.5, 3.0, -4.25]),
    (dict(token_frequency_penalty=-1.0), [3.0, 1.0, 0.5, 3.0, -1.0]),
    (dict(token_repetition_penalty=2.0, token_frequency_penalty=0.5, token_presence_penalty=0.25),
     [0.25, -3.25, 0.5, 3.0, -9.75]),
])
def test_penalties_match_hand_computed(kwargs, want):
    s = SamplerSettings(**kwargs)
    assert s.needs_history
    before = LOGITS.clone()
    got = apply_penalties(LOGITS, HISTORY, s)
    assert got.tolist() == pytest.approx(want)
    assert torch.equal(LOGITS, before)


def test_no_penalty_is_identity_and_empty_history_is_fine():
    assert torch.equal(apply_penalties(LOGITS, HISTORY, SamplerSettings()), LOGITS)
    s = SamplerSettings(token_repetition_penalty=1.3, token_frequency_penalty=0.4)
    assert torch.equal(apply_penalties(LOGITS, torch.tensor([], dtype=torch.int64), s), LOGITS)


def test_penalties_reject_out_of_range_history():
    with pytest.raises(ValueError, match="outside"):
        apply_penalties(LOGITS, torch.tensor([5]), SamplerSettings(token_presence_penalty=1.0))


def test_sample_needs_history_and_generator_when_used():
    with pytest.raises(ValueError, match="history"):
        sample(LOGITS, SamplerSettings(token_presence_penalty=1.0), None, None)
    with pytest.raises(ValueError, match="generator"):
        sample(LOGITS, SamplerSettings(temperature=1.0), None, None)


# ---------------------------------------------------------------- draws and reproducibility

def test_one_draw_per_token_by_inverse_cdf():
    s = SamplerSettings(temperature=0.9, top_k=20, top_p=0.9)
    g, twin = make_generator(123), make_generator(123)
    for step in range(50):
        logits = _logits(1000 + step)
        token = sample(logits, s, None, g).token
        u = torch.rand(1, generator=twin, dtype=torch.float64).item()
        p = ref_probs(logits.numpy(), 0.9, top_k=20, top_p=0.9)
        want = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
        assert token == want
    assert torch.equal(g.get_state(), twin.get_state())


def test_inverse_cdf_never_returns_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])
    assert inverse_cdf(probs, 0.0) == 1
    assert inverse_cdf(probs, 0.5) == 3
    assert inverse_cdf(probs, 1.0 - 1e-16) == 3
    assert inverse_cdf(probs, 1.0) == 3  # past the last bucket, as float rounding could do
    assert inverse_cdf(torch.tensor([0.0, 0.0, 1.0]), 0.0) == 2


def test_inverse_cdf_scales_u_by_the_total_mass():
    probs = torch.tensor([1.0, 3.0])  # not normalised
    assert inverse_cdf(probs, 0.2) == 0
    assert inverse_cdf(probs, 0.3) == 1


def _job_logits(job, step, vocab=50):
    return _logits(10_000 * job + step, vocab=vocab)


JOBS = [
    (SamplerSettings(temperature=1.0), 7),
    (SamplerSettings(temperature=0.8, top_k=10), 7),  # same seed as job 0, independent generator
    (SamplerSettings(), None),
    (SamplerSettings(temperature=1.2, top_p=0.9, min_p=0.05, token_repetition_penalty=1.3), 99),
    (SamplerSettings(temperature=0.6, token_frequency_penalty=0.5, token_presence_penalty=0.2), 2024),
]


def _run_jobs(order_per_step, steps=12):
    gens = [make_generator(seed if seed is not None else 0) for _, seed in JOBS]
    histories = [[j, j + 1] for j in range(len(JOBS))]  # a tiny "prompt" per job
    for step in range(steps):
        for j in order_per_step(step):
            s = JOBS[j][0]
            result = sample(_job_logits(j, step), s, torch.tensor(histories[j]), gens[j])
            histories[j].append(result.token)
    return histories


def test_samples_do_not_depend_on_batch_mix():
    jobs = range(len(JOBS))
    sequential = _run_jobs(lambda step: jobs)
    reversed_ = _run_jobs(lambda step: reversed(jobs))
    rng = np.random.default_rng(0)
    shuffled = _run_jobs(lambda step: rng.permutation(len(JOBS)).tolist())
    assert sequential == reversed_ == shuffled
    assert _run_jobs(lambda step: jobs) == sequential  # same seeds, same logits => same tokens
    assert sequential[0] != sequential[1]


def test_one_job_alone_matches_the_same_job_in_a_batch():
    s, seed = JOBS[3]
    alone, g = [3, 4], make_generator(seed)
    for step in range(12):
        alone.append(sample(_job_logits(3, step), s, torch.tensor(alone), g).token)
    assert _run_jobs(lambda step: range(len(JOBS)))[3] == alone


def test_make_generator_without_seed_differs():
    a, b = make_generator(None), make_generator(None)
    assert not torch.equal(a.get_state(), b.get_state())


def test_empirical_distribution_matches_probs():
    want = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    logits = torch.tensor(np.log(want), dtype=torch.float32)
    s, g, n = SamplerSettings(temperature=1.0), make_generator(31337), 12_000
    counts = np.zeros(5)
    for _ in range(n):
        counts[sample(logits, s, None, g).token] += 1
    # std of a frequency is <= sqrt(0.3 * 0.7 / 12k) ~ 0.0042; allow 4 sigma
    np.testing.assert_allclose(counts / n, want, atol=0.017)


# ---------------------------------------------------------------- banned tokens

def test_banned_tokens_are_never_chosen():
    logits = torch.tensor([0.0, 9.0, 8.5, 1.0, 8.9])
    assert sample(logits, SamplerSettings(), None, None, banned_tokens=[1]).token == 4
    s, g = SamplerSettings(temperature=2.0), make_generator(5)
    tokens = set()
    for _ in range(1000):
        result = sample(logits, s, None, g, banned_tokens=(1, 4))
        assert result.probs[1] == 0 and result.probs[4] == 0
        tokens.add(result.token)
    assert tokens == {0, 2, 3}


def test_banning_does_not_mutate_and_rejects_bad_ids():
    logits = torch.tensor([1.0, 2.0, 3.0])
    sample(logits, SamplerSettings(), None, None, banned_tokens=[2])
    assert logits.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="banned"):
        sample(logits, SamplerSettings(), None, None, banned_tokens=[3])
    with pytest.raises(ValueError, match="every token"):
        sample(logits, SamplerSettings(), None, None, banned_tokens=[0, 1, 2])


# ---------------------------------------------------------------- top_k_of

def test_top_k_of():
    probs = torch.tensor([0.1, 0.3, 0.05, 0.3, 0.25])
    ids, values = top_k_of(probs, 3)
    assert ids == [1, 3, 4]
    assert values == pytest.approx([0.3, 0.3, 0.25])
    assert top_k_of(probs, 0) == ([], [])
    assert top_k_of(probs, 10)[0] == [1, 3, 4, 0, 2]
    with pytest.raises(ValueError):
        top_k_of(probs, -1)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", -0.1, ">= 0"),
    ("temperature", math.inf, "finite"),
    ("temperature", math.nan, "finite"),
    ("temperature", "1.0", "finite"),
    ("top_k", -1, ">= 0"),
    ("top_k", 2.5, "integer"),
    ("top_k", True, "integer"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", math.nan, "(0, 1]"),
    ("min_p", 1.0, "[0, 1)"),
    ("min_p", -0.01, "[0, 1)"),
    ("token_repetition_penalty", 0.0, "> 0"),
    ("token_repetition_penalty", -1.0, "> 0"),
    ("token_frequency_penalty", math.inf, "finite"),
    ("token_presence_penalty", math.nan, "finite"),
    ("token_presence_penalty", None, "finite"),
])
def test_validation_names_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as info:
        SamplerSettings(**{field: value})
    message = str(info.value)
    assert field in message and repr(value) in message and allowed in message


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        SamplerSettings().temperature = 1.0  # type: ignore[misc]


def test_greedy_rows_take_the_checked_argmax_unless_it_is_banned():
    """check_rows hands the greedy path each row's argmax from the finite check's visit; a row whose
    argmax is a banned stop token (min_new_tokens) still gets the banned argmax, and non-finite rows
    (replaced for the sampler) never use it: the tokens equal choose_tokens without it."""
    from evalrun.engine import DynamicJob
    from evalrun.engine.verify import check_rows, choose_tokens
    torch.manual_seed(1)
    with torch.inference_mode():
        logits = torch.randn(6, 300)
    top = logits.argmax(dim=1)
    jobs = [DynamicJob([1], max_new_tokens=8, min_new_tokens=4 if i % 2 else 0,
                       stop_conditions=[int(top[i]), 7]) for i in range(6)]
    checked, got_top = check_rows(jobs, logits)
    assert checked is logits and torch.equal(got_top, top)
    want = choose_tokens(jobs, [()] * 6, logits)
    got = choose_tokens(jobs, [()] * 6, logits, top=got_top)
    assert [r[0].token for r in got] == [r[0].token for r in want]
    assert [int(top[i]) != r[0].token for i, r in enumerate(got)] == [False, True] * 3   # banned rows moved
    bad = logits.clone()
    bad[2, 5] = float("nan")
    checked, got_top = check_rows(jobs, bad)
    assert got_top is None and checked is not bad                          # a row was replaced
    sampled = SamplerSettings(temperature=0.7)
    assert check_rows([DynamicJob([1], 4, gen_settings=sampled, seed=1)], logits[:1])[1] is None   # no greedy job


def test_greedy_rows_use_the_checked_argmax_without_another_pass(monkeypatch):
    """Where no greedy row's argmax is banned, choose_tokens takes every greedy row's token from
    `top` (the banned-argmax pass is never made: patched to fail here), with stop tokens banned
    elsewhere in a row, a job with drafts (several rows) and a sampled job among them; the tokens
    equal those chosen without `top`."""
    import evalrun.engine.verify as verify
    from evalrun.engine import DynamicJob
    torch.manual_seed(2)
    with torch.inference_mode():
        logits = torch.randn(6, 300)
    top = logits.argmax(dim=1)
    drafts = [(), (int(top[1]), (int(top[2]) + 1) % 300), (), ()]   # rows 0 | 1-3 | 4 | 5

    def jobs():
        other = [t for t in range(300) if t != int(top[0])][:2]
        return [DynamicJob([1], 8, min_new_tokens=4, stop_conditions=other),   # banned, not the argmax
                DynamicJob([1], 8), DynamicJob([1], 8, gen_settings=SamplerSettings(temperature=0.8), seed=3),
                DynamicJob([1], 8)]

    want = [[r.token for r in kept] for kept in verify.choose_tokens(jobs(), drafts, logits)]
    monkeypatch.setattr(verify, "_argmax_with_bans", lambda *a: pytest.fail("the argmax was taken again"))
    got = [[r.token for r in kept] for kept in verify.choose_tokens(jobs(), drafts, logits, top=top)]
    assert got == want
    assert got[0] == [int(top[0])] and got[1] == [int(top[1]), int(top[2])] and got[3] == [int(top[5])]


def test_batched_greedy_bans_stop_tokens_before_min_new_tokens_like_sample():
    """The one-argmax greedy path takes jobs whose stop tokens are still banned (min_new_tokens):
    each row's token is what `sample` gives on that row with the ban, and the logits the caller
    holds (returned to return_logits jobs) are not changed."""
    from evalrun.engine import DynamicJob
    from evalrun.engine.verify import banned as _banned, sample_rows as _sample_rows
    from evalrun.engine.sampler import SamplerSettings, sample
    torch.manual_seed(0)
    with torch.inference_mode():                  # as the model makes them
        logits = torch.randn(5, 50)
    top = logits.argmax(dim=1)
    jobs = [DynamicJob([1], max_new_tokens=8, min_new_tokens=4 if i % 2 else 0,
                       stop_conditions=[int(top[i]), 7]) for i in range(5)]
    before = logits.clone()
    got = [r.token for r in _sample_rows(jobs, logits)]
    want = [sample(logits[i], SamplerSettings(), None, None, _banned(j)).token for i, j in enumerate(jobs)]
    assert got == want
    assert [got[i] != int(top[i]) for i in range(5)] == [False, True, False, True, False]   # banned rows moved
    assert torch.equal(logits, before)
