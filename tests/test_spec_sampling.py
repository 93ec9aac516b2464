"""Speculative sampling (issue 14): the rejection rule keeps plain sampling's law (chi-square), the
coupled rule keeps plain sampling's very tokens."""
from __future__ import annotations

import pytest
import torch

from evalrun.engine import DynamicJob, Model, SamplerSettings
from engine_helpers import make_generator, run_jobs

from spec_helpers import (  # noqa: F401,F811  (fixtures)
    _assert_same, _homogeneity_p, _sampled_outcomes, tiny, vocab5
)


def test_speculative_sampling_has_the_law_of_plain_sampling(vocab5, monkeypatch):
    """The rejection rule. Four tokens sampled 3,000 times with n-gram drafts (accepted by the point-mass rule) and
    3,000 times plainly: a chi-square test does not tell them apart at alpha = 0.01; a rule that
    accepts drafts too often (probability 2 p instead of p) is told apart."""
    from evalrun.engine import verify
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
    from evalrun.engine import verify
    draft = Model.load(tiny_model_factory("llama", vocab_size=5, seed=9), dtype="float32")
    n = 3000
    plain = _sampled_outcomes(vocab5, False, n, seed0=0)
    assert _homogeneity_p(plain, _draft_sampled(vocab5, draft, n, seed0=40_000)) > 0.01
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    assert _homogeneity_p(plain, _draft_sampled(vocab5, draft, n, seed0=50_000)) < 0.01


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
