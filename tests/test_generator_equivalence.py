"""Batched + paged + deduplicated generation == one-at-a-time == transformers (greedy, fp32)."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import CACHE_MODES, greedy_jobs, make_generator, random_prompts, run_jobs
from transformers import AutoModelForCausalLM

from evalrun.engine import Model, Tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n\ndef normalize(x):\n",
    "The following are multiple choice questions (with answers) about biology.\n\nWhat is DNA?",
    "The following are multiple choice questions (with answers) about biology.\n\nWhat is RNA?",
    "The following are multiple choice questions (with answers) about biology.\n\nWhat is ATP?",
    "Translate to French: Good morning, my friend.",
    "List three planets: Mercury,",
    "In 1969, Neil Armstrong",
    "The quick brown fox",
    "A haiku about autumn leaves:\n",
    "SELECT name FROM users WHERE",
    "Water boils at a temperature of",
    "The largest ocean on Earth is",
    "My favourite programming language is Python because",
    "Photosynthesis converts sunlight into",
    "Here is a recipe for pancakes:\n1.",
    "The theory of relativity was proposed by",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def _reference_greedy(ref, prompt_ids, n_new, eos=None):
    """transformers' greedy generate; with eos, cut after the first eos (as our stop token)."""
    out = ref.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                       max_new_tokens=n_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def test_tiny_model_batched_equals_single_and_transformers(tiny_model_dir):
    model = Model.load(tiny_model_dir, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    shared = random_prompts(1, [40], model.config.vocab_size, seed=1)[0]
    prompts = random_prompts(16, [5, 17, 33, 48], model.config.vocab_size, seed=0)
    prompts += [shared + p[:9] for p in prompts[:8]]                 # shared prefixes (dedup)
    n_new = 12
    batched = run_jobs(make_generator(model, max_tokens=16 * 20), greedy_jobs(prompts, n_new))
    for i, p in enumerate(prompts):
        single = run_jobs(make_generator(model, max_tokens=1024), greedy_jobs([p], n_new))[0]
        assert batched[i]["all_token_ids"] == single["all_token_ids"]
        assert batched[i]["all_token_ids"] == _reference_greedy(ref, p, n_new)


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_tiny_model_batched_equals_single_per_cache_mode(tiny_kv32_dir, mode):
    """In every cache mode, batched + paged + deduplicated greedy generation gives the tokens
    and logits of the same mode run one job at a time (the reference of a quantized cache:
    there is no transformers equivalent); fp32 also matches transformers."""
    model = Model.load(tiny_kv32_dir, dtype="float32")
    shared = random_prompts(1, [40], model.config.vocab_size, seed=1)[0]
    prompts = random_prompts(12, [5, 17, 33, 48], model.config.vocab_size, seed=0)
    prompts += [shared + p[:9] for p in prompts[:6]]                 # shared prefixes (dedup)
    n_new = 12
    gen = make_generator(model, max_tokens=16 * 20, mode=mode)
    batched = run_jobs(gen, greedy_jobs(prompts, n_new, return_logits=True))
    assert gen.stats()["cached_tokens"] > 0 and gen.stats()["peak_batch_size"] > 1
    single_gen = make_generator(model, max_tokens=1024, mode=mode)
    for i, p in enumerate(prompts):
        single = run_jobs(single_gen, greedy_jobs([p], n_new, return_logits=True))[0]
        assert batched[i]["all_token_ids"] == single["all_token_ids"], (mode, i)
        torch.testing.assert_close(batched[i]["all_logits"], single["all_logits"], atol=2e-5, rtol=0)
    if mode == "fp32":
        ref = AutoModelForCausalLM.from_pretrained(tiny_kv32_dir, dtype=torch.float32).eval()
        assert all(batched[i]["all_token_ids"] == _reference_greedy(ref, p, n_new) for i, p in enumerate(prompts))


@pytest.mark.slow
def test_smollm2_batched_equals_single_and_transformers(smollm2_dir):
    model = Model.load(smollm2_dir, dtype="float32")
    tok = Tokenizer.load(smollm2_dir)
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [tok.encode(p, add_bos=True, encode_special_tokens=True) for p in PROMPTS]
    n_new = 16
    # 24 pages of 16 tokens: at most ~6 jobs fit at once, so the queue and page reuse are exercised.
    gen = make_generator(model, max_tokens=16 * 24, page_size=16)
    eos = tok.eos_token_id
    batched = run_jobs(gen, greedy_jobs(prompts, n_new, stop=[eos]))
    stats = gen.stats()
    assert stats["peak_batch_size"] < len(prompts)                 # queueing happened
    assert stats["cached_tokens"] > 0                              # the biology preamble was shared
    single_gen = make_generator(model, max_tokens=1024, page_size=16)
    for i, p in enumerate(prompts):
        single = run_jobs(single_gen, greedy_jobs([p], n_new, stop=[eos]))[0]
        expected = _reference_greedy(ref, p, n_new, eos)
        assert single["all_token_ids"] == expected, f"prompt {i}: single != transformers"
        assert batched[i]["all_token_ids"] == expected, f"prompt {i}: batched != transformers"
