"""DynamicJob(score_from=k): each prompt token's log-probability from position k on, as a
log-likelihood request needs, equal to transformers' log-softmax of one whole-sequence forward,
and the same alone, batched, over shared (deduplicated or cached) prefixes and in any chunking."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from evalrun.engine import DynamicJob, Model
from engine_helpers import make_generator, run_jobs


def _reference(ref, ids: list[int], start: int) -> tuple[list[float], list[bool]]:
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)[start - 1: len(ids) - 1]
    target = torch.tensor(ids[start:])
    return lp.gather(1, target[:, None])[:, 0].tolist(), (lp.argmax(-1) == target).tolist()


def _prompts(vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, score_from): choices after one shared context, a context of whole pages, a score
    from position 1 (a rolling window), a single scored token."""
    g = torch.Generator().manual_seed(3)
    context = torch.randint(0, vocab, (37,), generator=g).tolist()
    paged = torch.randint(0, vocab, (32,), generator=g).tolist()
    out = [(context + torch.randint(0, vocab, (n,), generator=g).tolist(), len(context)) for n in (1, 3, 7, 20)]
    out += [(paged + torch.randint(0, vocab, (5,), generator=g).tolist(), 32)]
    out += [(torch.randint(0, vocab, (50,), generator=g).tolist(), 1)]
    out += [(context + [5], len(context))]
    return out


def _jobs(cases, offset: int = 0) -> list[DynamicJob]:
    return [DynamicJob(ids, max_new_tokens=1, score_from=k, identifier=offset + i) for i, (ids, k) in enumerate(cases)]


@pytest.mark.parametrize("chunk", [2048, 9])
def test_prompt_scores_equal_transformers_alone_and_batched(tiny_model_dir, chunk):
    model = Model.load(tiny_model_dir, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cases = _prompts(model.config.vocab_size)
    batched = run_jobs(make_generator(model, max_chunk_size=chunk), _jobs(cases))
    assert sum(r["cached_tokens"] for r in batched.values()) > 0          # the shared context was reused
    for i, (ids, k) in enumerate(cases):
        alone = run_jobs(make_generator(model), _jobs([(ids, k)]))[0]
        want, top = _reference(ref, ids, k)
        got = batched[i]
        assert len(got["prompt_logprobs"]) == len(ids) - k
        assert got["prompt_logprobs"] == alone["prompt_logprobs"]            # bitwise: batch-invariant
        assert got["prompt_greedy"] == alone["prompt_greedy"] == top
        assert max(abs(a - b) for a, b in zip(got["prompt_logprobs"], want)) < 1e-4


def test_prompt_scores_after_a_cached_prompt(tiny_model_dir):
    """A job whose whole prompt was computed before (the prompt cache) still computes its scored
    positions: the reuse stops before position score_from - 1."""
    model = Model.load(tiny_model_dir, dtype="float32")
    gen = make_generator(model, page_size=8)
    ids, k = _prompts(model.config.vocab_size)[3]
    first = run_jobs(gen, _jobs([(ids, k)]))[0]
    again = run_jobs(gen, _jobs([(ids, k)]))[0]
    assert 0 < again["cached_tokens"] <= k - 1
    assert again["prompt_logprobs"] == first["prompt_logprobs"]
    plain = run_jobs(gen, [DynamicJob(ids, max_new_tokens=1, identifier=0)])[0]
    assert plain["cached_tokens"] == len(ids) - 1 and "prompt_logprobs" not in plain


def test_score_from_is_checked():
    with pytest.raises(ValueError, match="score_from"):
        DynamicJob([1, 2, 3], max_new_tokens=1, score_from=0)
    with pytest.raises(ValueError, match="past the prompt"):
        DynamicJob([1, 2, 3], max_new_tokens=1, score_from=4)
