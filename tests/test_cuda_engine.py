"""The whole engine on a CUDA GPU, through the backend chosen there (Triton kernels when triton
imports): logits and greedy tokens against transformers, batched + paged + deduplicated
generation against one job at a time in every cache mode, the prompt cache, bf16 against fp32.

Self-contained (no conftest fixture) so that benchmarks/gpu_check.py can run it with
--noconftest on a machine without the test extras; skipped without a GPU.
"""
from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy_jobs, logit_atol, make_generator, random_prompts, run_jobs
from tiny_models import make_tiny_model

from evalrun.engine import Model, kernel_backends
from evalrun.kernels.backend import TritonKernels, triton_available

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA_MODES = ["fp32", "bf16", "fp16", "q8", "q4"]
# fp32 on the GPU: cuBLAS picks other kernels for other row counts, so a job's logits move by
# float noise with the batch (~1e-5 on logits of std 3); a wrong slot moves them by far more
FP32_GPU_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer llama, head dimension 32 (quantized modes), 8 query / 2 KV heads (GQA 4)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-cuda"), "llama", hidden_size=256, num_heads=8,
                           num_kv_heads=2, intermediate_size=256)


@pytest.fixture(scope="module")
def model32(tiny_dir):
    return Model.load(tiny_dir, dtype="float32", device="cuda")


def _prompts(vocab: int) -> list[list[int]]:
    shared = random_prompts(1, [40], vocab, seed=1)[0]
    prompts = random_prompts(10, [5, 17, 33, 48, 300], vocab, seed=0)
    return prompts + [shared + p[:9] for p in prompts[:6]]                  # shared prefixes (dedup)


def test_cuda_backend_is_triton(model32):
    if not triton_available():
        pytest.skip("triton is not installed: the CUDA path runs the torch reference")
    assert isinstance(model32.kernels, TritonKernels)
    assert kernel_backends("cuda", "bfloat16", "bf16")["decode_attention"] == "triton"


def test_cuda_greedy_and_logits_match_transformers(tiny_dir, model32):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompts = _prompts(model32.config.vocab_size)
    n_new = 8
    out = run_jobs(make_generator(model32, max_tokens=4096), greedy_jobs(prompts, n_new, return_logits=True))
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                               pad_token_id=0)
            full = ref(gen).logits[0, len(p) - 1: len(p) - 1 + n_new].float()       # [n_new, V]
        assert out[i]["all_token_ids"] == gen[0, len(p):].tolist(), f"prompt {i}"
        torch.testing.assert_close(out[i]["all_logits"].cpu(), full, atol=1e-3, rtol=0)


@pytest.mark.parametrize("mode", CUDA_MODES)
def test_cuda_batched_equals_single(model32, mode):
    prompts = _prompts(model32.config.vocab_size)
    n_new = 10
    gen = make_generator(model32, max_tokens=16 * 60, mode=mode)
    batched = run_jobs(gen, greedy_jobs(prompts, n_new, return_logits=True))
    assert gen.stats()["cached_tokens"] > 0 and gen.stats()["peak_batch_size"] > 1
    single_gen = make_generator(model32, max_tokens=2048, mode=mode)
    atol = FP32_GPU_ATOL if mode == "fp32" else logit_atol(mode)
    for i, p in enumerate(prompts):
        single = run_jobs(single_gen, greedy_jobs([p], n_new, return_logits=True))[0]
        assert batched[i]["all_token_ids"] == single["all_token_ids"], (mode, i)
        torch.testing.assert_close(batched[i]["all_logits"], single["all_logits"], atol=atol, rtol=0)


@pytest.mark.parametrize("mode", ["fp32", "q4"])
def test_cuda_prompt_cache_rerun_gives_the_same_answers(model32, mode):
    prompts = _prompts(model32.config.vocab_size)
    gen = make_generator(model32, max_tokens=8192, mode=mode)
    first = run_jobs(gen, greedy_jobs(prompts, 6, return_logits=True))
    cached_before = gen.stats()["cached_tokens"]
    again = run_jobs(gen, greedy_jobs(prompts, 6, return_logits=True))
    assert gen.stats()["cached_tokens"] > cached_before                     # the rerun hit the prompt cache
    atol = FP32_GPU_ATOL if mode == "fp32" else logit_atol(mode)
    for i in range(len(prompts)):
        assert again[i]["all_token_ids"] == first[i]["all_token_ids"]
        torch.testing.assert_close(again[i]["all_logits"], first[i]["all_logits"], atol=atol, rtol=0)


def test_cuda_bf16_close_to_fp32(tiny_dir, model32):
    """bf16 weights, compute and cache (the 16-bit tensor-core path of the kernels) against the
    fp32 engine on the same prompts: first-token logits within bf16 noise."""
    model16 = Model.load(tiny_dir, dtype="bfloat16", device="cuda")
    prompts = _prompts(model32.config.vocab_size)
    ref = run_jobs(make_generator(model32, max_tokens=4096), greedy_jobs(prompts, 1, return_logits=True))
    out = run_jobs(make_generator(model16, max_tokens=4096, mode="bf16"), greedy_jobs(prompts, 1, return_logits=True))
    for i in range(len(prompts)):
        torch.testing.assert_close(out[i]["all_logits"], ref[i]["all_logits"], atol=0.4, rtol=0.02)


@pytest.mark.parametrize("dtype,mode", [("bfloat16", "bf16"), ("float32", "fp32")])
def test_cuda_deterministic_mode_is_batch_invariant(tiny_dir, dtype, mode):
    """Deterministic mode on the GPU (Triton linears and RMSNorm, issue 16 item 4): job 0's logits
    alone and among 1, 8 and 16 other jobs are bitwise equal."""
    if not triton_available():
        pytest.skip("deterministic mode on CUDA needs triton")
    model = Model.load(tiny_dir, dtype=dtype, device="cuda", deterministic=True)
    assert model.layers[0].wqkv.invariant and model.lm_head.invariant
    prompts = _prompts(model.config.vocab_size)
    runs = []
    for others in (0, 1, 8, len(prompts) - 1):
        gen = make_generator(model, max_tokens=8192, mode=mode)
        runs.append(run_jobs(gen, greedy_jobs(prompts[:1 + others], 6, return_logits=True))[0])
    for r in runs[1:]:
        assert r["all_token_ids"] == runs[0]["all_token_ids"]
        assert torch.equal(r["all_logits"], runs[0]["all_logits"])


def test_cuda_weights_load_straight_to_the_device(tiny_dir, monkeypatch):
    """Each shard is opened with safetensors' device argument: tensors never pass through CPU memory."""
    import evalrun.engine.weights as weights
    opened = []
    real = weights.safe_open

    def spy(path, framework, device="cpu"):
        opened.append(device)
        return real(path, framework=framework, device=device)

    monkeypatch.setattr(weights, "safe_open", spy)
    model = Model.load(tiny_dir, dtype="bfloat16", device="cuda")
    assert opened and set(opened) == {"cuda"} and model.embed.is_cuda


@pytest.mark.parametrize("mode", ["bf16", "q4"])
def test_cuda_graph_decode_equals_eager_decode(tiny_dir, mode):
    """Decode steps replayed as CUDA graphs (evalrun/engine/cuda_graphs.py) against the same engine run
    eagerly: in deterministic mode (every op batch-invariant) the tokens and logits are bitwise
    equal, whatever bucket a step's rows were padded to; the null page is never written."""
    if not triton_available():
        pytest.skip("CUDA graphs run with the Triton kernels")
    from evalrun.kernels.kv_format import KV_FORMATS, kv_format
    fmt = KV_FORMATS[mode] if not KV_FORMATS[mode].quantized else kv_format(KV_FORMATS[mode], window=0)
    outs, captured = [], None
    for graphs in (False, True):
        model = Model.load(tiny_dir, dtype="bfloat16", device="cuda", deterministic=True, cuda_graphs=graphs)
        prompts = _prompts(model.config.vocab_size)
        gen = make_generator(model, max_tokens=8192, mode=fmt)   # a window runs eagerly
        jobs = greedy_jobs(prompts, 12, return_logits=True)
        for i, job in enumerate(jobs):
            job.max_new_tokens = 4 + i                                   # the batch shrinks step by step
        outs.append(run_jobs(gen, jobs))
        if graphs:
            captured = model._graphs[gen.cache]
            null = gen.cache.null_page
            assert all(not t[null].float().nan_to_num(1.0).any() for t in gen.cache.layer(0).tensors())
    assert captured is not None and len(captured._buckets) >= 3
    for i, ref in outs[0].items():
        assert outs[1][i]["all_token_ids"] == ref["all_token_ids"]
        assert torch.equal(outs[1][i]["all_logits"], ref["all_logits"])
