"""Model correctness against transformers (an independent reference).

Every engine run here goes through the public path (Model.load -> PagedCache ->
DynamicGenerator -> DynamicJob(return_logits=True)) with the cache's unused slots
poisoned with NaN, so a logit that reads a stale or unwritten slot turns NaN and fails.
"""
from __future__ import annotations

import dataclasses

from pathlib import Path
from typing import Optional, Sequence

import pytest
import torch

from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer

from tiny_models import LLAMA3_ROPE  # noqa: E402

transformers = pytest.importorskip("transformers")

TINY_TOL = 1e-4
SMOLLM2_TOL = 1e-3


# --- helpers -----------------------------------------------------------------------------


def load_hf(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: Sequence[int], positions: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Reference logits [len(positions), V] (default: every position) for one prompt."""
    hidden = hf.model(torch.tensor([list(ids)])).last_hidden_state[0]     # [S, H], final norm applied
    if positions is not None:
        hidden = hidden[list(positions)]
    return hf.lm_head(hidden).float()


def engine_logits(model: Model, prompts: Sequence[Sequence[int]], page_size: int = 16,
                  max_tokens: int = 4096, mode: str = "fp32", max_chunk_size: int = 2048) -> list[torch.Tensor]:
    """Logits [V] of the first sampled token for each prompt, all jobs in one generator."""
    cache = PagedCache(model, max_tokens=max_tokens, page_size=page_size, mode=mode)
    cache.fill_unused()
    generator = DynamicGenerator(model, cache, max_chunk_size=max_chunk_size)
    generator.enqueue([DynamicJob(list(p), max_new_tokens=1, return_logits=True, identifier=i)
                       for i, p in enumerate(prompts)])
    out: dict[int, torch.Tensor] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            assert result["eos"] and result["eos_reason"] == "max_new_tokens"
            logits = result["logits"]
            assert logits.shape == (1, model.config.vocab_size) and logits.dtype == torch.float32
            out[result["identifier"]] = logits[0]
    assert sorted(out) == list(range(len(prompts)))
    return [out[i] for i in range(len(prompts))]


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())  # NaN propagates: NaN <= tol is False


# --- tiny random-weight models -------------------------------------------------------------

TINY_CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 2048}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "llama-sharded": ("llama", {"sharded": True}),
}
TINY_LENGTHS = (1, 5, 16, 17, 50, 600)   # 600 > 256: past llama3's original_max_position_embeddings


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_last_position_logits_match_transformers(tiny_model_factory, case: str) -> None:
    arch, kwargs = TINY_CASES[case]
    model_dir = tiny_model_factory(arch, seed=11, **kwargs)
    model = Model.load(model_dir, dtype="float32")
    if "rope_scaling" in kwargs:
        assert model.config.rope.rope_type == "llama3"
    if kwargs.get("sharded"):
        assert (model_dir / "model.safetensors.index.json").is_file()
    hf = load_hf(model_dir)
    vocab = model.config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in TINY_LENGTHS]
    got = engine_logits(model, prompts, page_size=16)
    for prompt, logits in zip(prompts, got):
        want = hf_logits(hf, prompt, [len(prompt) - 1])[0]
        assert max_diff(logits, want) <= TINY_TOL, f"{case}: prompt of {len(prompt)} tokens"


def test_tiny_llama3_rope_scaling_matters(tiny_model_factory) -> None:
    """Guard for the test above: scaled and unscaled rope give different logits past a few tokens."""
    scaled = Model.load(tiny_model_factory("llama", seed=11, rope_scaling=LLAMA3_ROPE), dtype="float32")
    plain = Model.load(tiny_model_factory("llama", seed=11), dtype="float32")
    prompt = random_prompt(600, scaled.config.vocab_size, seed=600)
    (a,), (b,) = engine_logits(scaled, [prompt]), engine_logits(plain, [prompt])
    assert max_diff(a, b) > 1e-2


def test_tiny_every_position_through_shared_prefix_pages(tiny_model_factory) -> None:
    """One job per prefix length of a 40-token prompt, all queued together with page_size 16:
    they share full pages and copy partial pages (dedup), and each must still give
    transformers' logits at its last position. Unused slots are NaN."""
    model_dir = tiny_model_factory("llama", seed=12)
    model = Model.load(model_dir, dtype="float32")
    hf = load_hf(model_dir)
    prompt = random_prompt(40, model.config.vocab_size, seed=40)
    want = hf_logits(hf, prompt)                                             # [40, V]
    cache = PagedCache(model, max_tokens=4096, page_size=16, mode="fp32")
    cache.fill_unused()
    generator = DynamicGenerator(model, cache)
    generator.enqueue([DynamicJob(prompt[:n], max_new_tokens=1, return_logits=True, identifier=n)
                       for n in range(1, 41)])
    got: dict[int, torch.Tensor] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            got[result["identifier"]] = result["logits"][0]
    assert sorted(got) == list(range(1, 41))
    bad = {n: max_diff(got[n], want[n - 1]) for n in got if not max_diff(got[n], want[n - 1]) <= TINY_TOL}
    assert not bad, f"prefix lengths with wrong logits (max abs diff): {bad}"
    stats = generator.stats()
    assert stats["cached_tokens"] > 0                  # dedup really happened
    assert stats["prefill_tokens"] < stats["prompt_tokens"]


def _prefill_forward(model: Model, prompts: Sequence[Sequence[int]], rows: Optional[list[int]],
                     page_size: int = 16) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One packed prefill forward of `prompts` on a fresh cache, logits at `rows` of the batch
    (None: every row); returns the logits and every layer's K and V at the slots written."""
    from evalrun.engine.model import ForwardBatch
    from evalrun.kernels.attention import build_metadata
    cache = PagedCache(model, max_tokens=1024, page_size=page_size, mode="fp32")
    cache.fill_unused()                                                   # NaN wherever nothing is written
    ids, positions, slots, tables, page = [], [], [], [], 0
    for prompt in prompts:
        n_pages = -(-len(prompt) // page_size)
        table = list(range(page, page + n_pages))
        page += n_pages
        tables.append(table)
        ids.extend(prompt)
        positions.extend(range(len(prompt)))
        slots.extend(table[p // page_size] * page_size + p % page_size for p in range(len(prompt)))
    lens = [len(p) for p in prompts]
    attn = build_metadata(lens, lens, tables, page_size, cache.null_page, model.device)
    every = list(range(len(ids)))
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), attn,
                         torch.tensor(every if rows is None else rows, dtype=torch.long))
    logits = model.eager_forward(batch, cache)
    written = torch.tensor(slots)
    return logits, [t.flatten(0, 1).index_select(0, written) for t in cache.k + cache.v]


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_tiny_last_layer_runs_only_the_logit_rows(tiny_model_factory, backend: str, monkeypatch) -> None:
    """A forward that needs logits at a few rows runs the last layer's output projection and MLP
    on those rows alone: their logits are bitwise the rows of a forward that computes every row
    (the native float32 GEMM gives a row the same bits at any row count), and the K/V written at
    every position (the last layer's too) are bitwise the same. Rows in any order, repeated, or
    none (a chunk in which no prompt ends). The attention kernels of both backends."""
    from evalrun.kernels.backend import TorchKernels
    model_dir = tiny_model_factory("llama", seed=13)
    model = Model.load(model_dir, dtype="float32", kernels=TorchKernels() if backend == "torch" else None)
    mlp_rows: list[int] = []
    real_plan = model.kernel_plan

    def counting_plan(fmt, page_size):                # each cache's plan, its MLP op counting rows
        plan = real_plan(fmt, page_size)
        return dataclasses.replace(plan, gate_up_silu=lambda h, w: mlp_rows.append(h.shape[0]) or plan.gate_up_silu(h, w))

    monkeypatch.setattr(model, "kernel_plan", counting_plan)
    vocab, layers = model.config.vocab_size, model.config.num_layers
    prompts = [random_prompt(n, vocab, seed=100 + n) for n in (5, 17, 33)]
    last_rows = [4, 21, 54]                                           # each prompt's last token
    every, kv_every = _prefill_forward(model, prompts, None)
    assert mlp_rows == [55] * layers
    mlp_rows.clear()
    some, kv_some = _prefill_forward(model, prompts, last_rows)
    assert mlp_rows == [55] * (layers - 1) + [3]                      # the last layer: 3 rows only
    assert torch.equal(some, every[last_rows])
    assert all(torch.equal(a, b) for a, b in zip(kv_some, kv_every))
    for rows in ([21, 3], [21, 21, 0], []):                           # any order, repeated, none
        picked, kv = _prefill_forward(model, prompts, rows)
        assert picked.shape == (len(rows), vocab) and torch.equal(picked, every[rows])
        assert all(torch.equal(a, b) for a, b in zip(kv, kv_every))
    hf = load_hf(model_dir)
    for prompt, logits in zip(prompts, some):
        assert max_diff(logits, hf_logits(hf, prompt, [len(prompt) - 1])[0]) <= TINY_TOL


def test_tiny_prompt_cache_after_defragment(tiny_model_factory) -> None:
    """Pages cached by finished jobs, moved by the idle-time defragment, still give exact logits."""
    model_dir = tiny_model_factory("llama", seed=15)
    model = Model.load(model_dir, dtype="float32")
    hf = load_hf(model_dir)
    vocab = model.config.vocab_size
    prompt = random_prompt(50, vocab, seed=50)
    other = random_prompt(70, vocab, seed=70)
    cache = PagedCache(model, max_tokens=1024, page_size=16, mode="fp32")
    cache.fill_unused()
    generator = DynamicGenerator(model, cache)
    # `other` takes the low pages; evicting them leaves holes below `prompt`'s pages, which
    # the defragment then moves down
    generator.enqueue([DynamicJob(other, max_new_tokens=6), DynamicJob(prompt[:40], max_new_tokens=1)])
    while generator.num_remaining_jobs():
        generator.iterate()
    pool = cache.pool
    assert pool.num_in_use == 0
    first = next(p.page_id for p in pool.pages if p.tokens == tuple(prompt[:16]))
    for pid in [pid for pid in pool.cached if pid < first]:
        pool.cached.pop(pid)
        pool._forget(pool.pages[pid])
        pool.free[pid] = None
    generator.defragment()
    moved = next(p.page_id for p in pool.pages if p.tokens == tuple(prompt[:16]))
    assert moved < first and sorted(pool.cached) == list(range(len(pool.cached)))
    jobs = [DynamicJob(prompt[:n], max_new_tokens=1, return_logits=True, identifier=n) for n in (35, 40, 50)]
    generator.enqueue(jobs)
    got: dict[int, torch.Tensor] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            got[result["identifier"]] = result["logits"][0]
    assert [job.state.cached_tokens for job in jobs] == [34, 39, 40]   # whole pages + copied slots
    want = hf_logits(hf, prompt)
    for n, logits in got.items():
        assert max_diff(logits, want[n - 1]) <= TINY_TOL, f"prefix of {n} tokens"


def test_tiny_chunked_prefill_matches_transformers(tiny_model_factory) -> None:
    """A prompt split over several forwards (max_chunk_size 7) alongside other prompts."""
    model_dir = tiny_model_factory("qwen2", seed=13)
    model = Model.load(model_dir, dtype="float32")
    hf = load_hf(model_dir)
    prompts = [random_prompt(n, model.config.vocab_size, seed=100 + n) for n in (3, 30, 45)]
    got = engine_logits(model, prompts, page_size=16, max_chunk_size=7)
    for prompt, logits in zip(prompts, got):
        assert max_diff(logits, hf_logits(hf, prompt, [len(prompt) - 1])[0]) <= TINY_TOL


# --- dtype plumbing (tiny model only: bf16 matmuls are slow on this CPU) -------------------


@pytest.fixture(scope="module")
def tiny_dtype_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", seed=14)


# max abs logit diff vs float32 (logits have std ~3); measured: ~0.1 with bf16 weights,
# ~0.02 with fp16 weights or a bf16 cache, ~0.003 with an fp16 cache
@pytest.mark.parametrize("dtype,mode,tol", [
    ("float32", "fp32", TINY_TOL), ("float32", "bf16", 0.06), ("float32", "fp16", 0.01),
    ("bfloat16", "bf16", 0.25), ("bfloat16", "fp32", 0.25), ("float16", "fp16", 0.06), ("float16", "fp32", 0.06),
])
def test_model_dtype_and_cache_mode(tiny_dtype_dir: Path, dtype: str, mode: str, tol: float) -> None:
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    cache_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    reference = Model.load(tiny_dtype_dir, dtype="float32")
    model = Model.load(tiny_dtype_dir, dtype=dtype)
    assert model.dtype == torch_dtype
    assert model.embed.dtype == torch_dtype and model.layers[0].wqkv.dtype == torch_dtype
    cache = PagedCache(model, max_tokens=256, page_size=16, mode=mode)
    assert cache.k[0].dtype == cache_dtype and cache.v[-1].dtype == cache_dtype
    prompts = [random_prompt(n, model.config.vocab_size, seed=200 + n) for n in (1, 20, 37)]
    want = engine_logits(reference, prompts)
    got = engine_logits(model, prompts, mode=mode, max_tokens=256)
    exact = dtype == "float32" and mode == "fp32"
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert max_diff(g, w) <= tol
        if not exact:
            assert max_diff(g, w) > 0               # the low precision really was used


# --- SmolLM2-135M-Instruct ------------------------------------------------------------------

SMOLLM2_LENGTHS = (1, 7, 64, 300, 1000, 3000)


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2_dir: Path) -> list[int]:
    """A 3000-token prompt of varied text; shorter prompts are its prefixes."""
    tokenizer = Tokenizer.load(smollm2_dir)
    topics = ["rivers", "prime numbers", "baking bread", "the moon", "chess openings", "old maps",
              "bird songs", "train timetables", "volcanoes", "paper folding", "tide pools"]
    paragraphs = [
        f"{i}. On day {i * 7 % 31 + 1}, note {i} about {topics[i % len(topics)]}: the value {i * i % 97} "
        f"was recorded next to {topics[(i * 5) % len(topics)]}, and {i % 4 + 2} people agreed."
        for i in range(1, 400)
    ]
    ids = tokenizer.encode("\n".join(paragraphs), add_bos=True)
    assert len(ids) >= 3000
    return ids[:3000]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir: Path, smollm2_prompt: list[int]) -> dict[int, torch.Tensor]:
    """transformers' logits at the last position of every tested prefix length (one forward)."""
    hf = load_hf(smollm2_dir)
    logits = hf_logits(hf, smollm2_prompt, [n - 1 for n in SMOLLM2_LENGTHS])
    del hf
    return dict(zip(SMOLLM2_LENGTHS, logits))


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_dir: Path) -> Model:
    return Model.load(smollm2_dir, dtype="float32")


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_fp32: Model, smollm2_prompt: list[int],
                                           smollm2_reference: dict[int, torch.Tensor]) -> None:
    """Each length alone in a fresh cache (page_size 256), except 1000, which runs below."""
    for n in (1, 7, 64, 300, 3000):
        (logits,) = engine_logits(smollm2_fp32, [smollm2_prompt[:n]], page_size=256,
                                  max_tokens=-(-(n + 1) // 256) * 256)
        diff = max_diff(logits, smollm2_reference[n])
        assert diff <= SMOLLM2_TOL, f"prompt of {n} tokens: max abs diff {diff}"


@pytest.mark.slow
def test_smollm2_chunked_prefill_small_pages(smollm2_fp32: Model, smollm2_prompt: list[int],
                                             smollm2_reference: dict[int, torch.Tensor]) -> None:
    """1000 tokens with page_size 16 and max_chunk_size 512: two forwards over 63 pages."""
    (logits,) = engine_logits(smollm2_fp32, [smollm2_prompt[:1000]], page_size=16, max_tokens=1024,
                              max_chunk_size=512)
    assert max_diff(logits, smollm2_reference[1000]) <= SMOLLM2_TOL
