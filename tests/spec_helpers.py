"""Shared pieces of the speculative decoding tests (tests/test_speculative*.py, test_draft_model.py):
reference comparison, the oracle drafter, model fixtures and the sampling-law helpers.

Drafts come from the n-gram drafter, or from an "oracle" put in its place that proposes the
reference's own continuation with chosen tokens corrupted, so acceptance of 100%, 0% and every
run length between is exercised on purpose (a tiny random model rarely repeats itself).
"""
from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch

from evalrun.engine import DynamicJob, Model, SamplerSettings, Tokenizer
from evalrun.engine import generator as generator_module
from engine_helpers import greedy_jobs, make_generator, run_jobs


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


def run_forwards(model, prompts, n) -> int:
    gen = make_generator(model, max_tokens=8192, max_batch_size=4, max_chunk_size=37)
    run_jobs(gen, greedy_jobs(prompts, n))
    return gen.stats()["forward_passes"]


@pytest.fixture(scope="module")
def vocab5(tiny_model_factory):
    return Model.load(tiny_model_factory("llama", vocab_size=5, seed=2), dtype="float32")


@pytest.fixture(scope="module")
def other_tiny(tiny_model_factory, tiny_model_dir):
    """A second random model with the tiny model's vocabulary: its drafts are almost never kept."""
    return Model.load(tiny_model_factory("llama", seed=7, num_layers=1), dtype="float32")


def _with_draft(model, draft, **kwargs):
    kwargs.setdefault("adaptive_draft", False)
    gen = make_generator(model, max_tokens=8192, draft_model=draft, **kwargs)
    return gen


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
