"""The native decode step (evalrun/kernels/cpu/decode_step.py: all layers of a pure-decode batch in one C call)
against the per-op path it replaces: bitwise the same logits and tokens, and the cases where it
must stay out of the way."""
from __future__ import annotations

import pytest
import torch

from evalrun.engine import Model
from evalrun.kernels.cpu import decode_step, gemm
from evalrun.kernels.cpu.decode_step import DecodeStep
from evalrun.kernels.linear import linear_backend
from tests.engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs

pytestmark = pytest.mark.skipif(not gemm.available() or decode_step._lib() is None,
                                reason=f"native kernels unavailable: {gemm.unavailable_reason()}")


@pytest.fixture
def count_steps(monkeypatch):
    calls = {"n": 0}
    real = DecodeStep.run

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return real(self, *args, **kwargs)
    monkeypatch.setattr(DecodeStep, "run", counted)
    return calls


def _generate(model, prompts, n_new, **kwargs):
    return run_jobs(make_generator(model, max_tokens=4096, **kwargs), greedy_jobs(prompts, n_new, return_logits=True))


BF16_GEMM = linear_backend("cpu", torch.bfloat16) == "native-bf16"
needs_bf16_gemm = pytest.mark.skipif(not BF16_GEMM, reason="this CPU lacks avx512_bf16: bf16 linears are torch's")


STEP_MODELS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}),
               "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
               "mistral-window": ("mistral", {"sliding_window": 24}), "qwen3": ("qwen3", {}),
               "gemma2": ("gemma2", {"sliding_window": 24, "attn_logit_softcapping": 2.0}),
               "gemma3": ("gemma3", {"sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"],
                                     "rope_local_base_freq": 1000.0}), "olmo2": ("olmo2", {}),
               "phi3": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 30})}


@pytest.mark.parametrize("dtype,mode", [("float32", "fp32"), ("float32", "fp16"),
                                        pytest.param("bfloat16", "bf16", marks=needs_bf16_gemm)])
@pytest.mark.parametrize("case", list(STEP_MODELS))
def test_decode_step_is_bitwise_the_per_op_path(tiny_model_factory, case, dtype, mode, count_steps, monkeypatch):
    """Same prompts, a cache each: with the native step and with EVALRUN_DECODE_STEP=0 (per-op
    path), every logit of every step is bitwise equal (qwen2: with QKV biases; llama-bias: q, k,
    v, o and MLP biases; mistral-window: a sliding window of 24 that the contexts outgrow; qwen3:
    q/k norms; gemma2/3: the sublayers' output norms, GeGLU, soft-capping, a rope per layer type; olmo2: norms after the sublayers only, q/k norms over
    the projections; phi3: fused projections, partial rotary), for
    float32 models on the float32 GEMM and bf16 models on the bf16 GEMM, over float32, float16 and
    bf16 pages."""
    arch, extra = STEP_MODELS[case]
    model = Model.load(tiny_model_factory(arch, extra_config=extra), dtype=dtype)
    prompts = random_prompts(9, [5, 17, 33, 48], model.config.vocab_size, seed=0)
    native = _generate(model, prompts, 10, mode=mode)
    assert count_steps["n"] > 0
    monkeypatch.setenv("EVALRUN_DECODE_STEP", "0")
    count_steps["n"] = 0
    per_op = _generate(model, prompts, 10, mode=mode)
    assert count_steps["n"] == 0
    for i in range(len(prompts)):
        assert native[i]["all_token_ids"] == per_op[i]["all_token_ids"]
        assert torch.equal(native[i]["all_logits"], per_op[i]["all_logits"]), i


def test_decode_step_keeps_batch_invariance(tiny_model_dir, count_steps):
    """A job alone (pure decode steps: the native step) and among others of other lengths (steps
    that mix prefill chunks and decode rows run per op): bitwise the same logits."""
    model = Model.load(tiny_model_dir, dtype="float32")
    prompts = random_prompts(8, [7, 30, 51, 12], model.config.vocab_size, seed=3)
    together = _generate(model, prompts, 8, max_batch_size=8)
    for i in (0, 5):
        alone = _generate(model, [prompts[i]], 8)[0]
        assert alone["all_token_ids"] == together[i]["all_token_ids"]
        assert torch.equal(alone["all_logits"], together[i]["all_logits"]), i
    assert count_steps["n"] > 0


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_decode_step_stays_out_of_other_cache_modes(tiny_kv32_dir, mode, count_steps):
    model = Model.load(tiny_kv32_dir, dtype="float32")
    prompts = random_prompts(3, [9, 20], model.config.vocab_size, seed=4)
    _generate(model, prompts, 4, mode=mode)
    assert count_steps["n"] == 0


def test_decode_step_stays_out_of_bfloat16_on_torch_linears(tiny_model_dir, count_steps, monkeypatch):
    """A bf16 model whose linears are torch's (bf16 rows between the ops) runs per op."""
    monkeypatch.setenv("EVALRUN_LINEAR", "torch")
    model = Model.load(tiny_model_dir, dtype="bfloat16")
    assert model.layers[0].wqkv.kernel_name == "torch"
    _generate(model, random_prompts(2, [9], model.config.vocab_size, seed=5), 3, mode="bf16")
    assert count_steps["n"] == 0


def test_decode_step_stays_out_of_float16(tiny_model_dir, count_steps):
    model = Model.load(tiny_model_dir, dtype="float16")
    _generate(model, random_prompts(2, [9], model.config.vocab_size, seed=5), 3, mode="fp16")
    assert count_steps["n"] == 0


def test_decode_step_follows_replaced_pages(tiny_model_dir):
    """A step is tied to the pages it was built on: replaced storage makes the model build a new one."""
    model = Model.load(tiny_model_dir, dtype="float32")
    gen = make_generator(model, max_tokens=256)
    step = model._decode_step(gen.cache)
    assert step is not None and model._decode_step(gen.cache) is step
    layer = gen.cache.layer(0)
    layer.k = layer.k.clone()
    assert model._decode_step(gen.cache) is not step


def test_decode_step_refuses_pages_of_another_shape(tiny_model_dir):
    """Pages that do not hold the model's KV heads (or differ between layers) never reach the C code."""
    from evalrun.kernels.cpu.decode_step import LayerParts
    model = Model.load(tiny_model_dir, dtype="float32")
    cache = make_generator(model, max_tokens=256).cache
    cfg = model.config
    parts = [LayerParts(ly.input_norm, ly.post_norm, ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down, cache.layer(i))
             for i, ly in enumerate(model.layers)]
    dims = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
    assert DecodeStep.supports(parts, torch.float32, torch.device("cpu"), *dims)
    kv = parts[-1].kv
    kv.k = kv.k[:, :, :1].contiguous()                        # one KV head fewer than the model has
    kv.v = kv.v[:, :, :1].contiguous()
    assert not DecodeStep.supports(parts, torch.float32, torch.device("cpu"), *dims)
