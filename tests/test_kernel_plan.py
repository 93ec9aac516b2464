"""The kernel plan (evalrun/kernels/backend.py): resolved once per cache, from the same facts as the
run manifest's `kernels` entry, so the manifest says exactly what ran; per-call code makes no
support check.

Each backend is forced through EVALRUN_KERNELS (native CPU, the torch reference, and Triton under
its interpreter on CPU tensors); the manifest built before the model loads names that backend and
equals the plan of the cache the run then used, with no "else" anywhere in it.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from triton_setup import INTERPRET, interpreter_scalars  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

from engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs
from evalrun.engine import DynamicJob, Model, PagedCache, kernel_backends
from evalrun.kernels import backend
from evalrun.kernels.backend import NativeCpuKernels, PlanKey, TorchKernels, TritonKernels, choose_kernels
from evalrun.kernels.cpu import gemm, gemm_bf16, paged_decode, paged_prefill
from evalrun.kernels.ref import attention as ref_attention
from evalrun.kernels.kv_format import KV_FORMATS
from evalrun.kernels.ref.fused import rms_norm_reference
from evalrun.run.common import model_manifest
from evalrun.run.engine_config import EngineConfig

NATIVE = paged_decode.available() and gemm.available()


def _manifest_and_run(model_dir, dtype: str, mode: str, page_size: int = 16) -> tuple[dict, dict]:
    """The manifest's kernels entry for these settings, and what the loaded model's cache ran."""
    cfg = EngineConfig("cpu", dtype, mode, cache_tokens=512, page_size=page_size)
    kernels = model_manifest(cfg, {"path": str(model_dir)}, model_dir)["kernels"]
    model = Model.load(model_dir, dtype=dtype)
    gen = make_generator(model, max_tokens=512, page_size=page_size, mode=mode)
    prompts = random_prompts(3, [5, 17, 9], model.config.vocab_size, seed=1)
    outs = run_jobs(gen, greedy_jobs(prompts, 4))
    assert all(len(o["all_token_ids"]) == 4 for o in outs.values())
    plan = gen.cache.kernels
    ran = {"backend": plan.backend, "linear": model.layers[0].wqkv.kernel_name,
           "lm_head": model.lm_head.kernel_name, **plan.describe()}
    return kernels, ran


def _no_else(kernels: dict) -> None:
    assert all(isinstance(v, str) and "else" not in v and "(" not in v for v in kernels.values()), kernels


@pytest.mark.parametrize("forced,dtype,mode,backend_name", [
    ("native-cpu", "float32", "fp32", "native-cpu"), ("native-cpu", "bfloat16", "bf16", "native-cpu"),
    ("native-cpu", "float32", "q8", "native-cpu"),
    ("torch", "float32", "fp32", "torch"), ("torch", "bfloat16", "bf16", "torch"),
    ("triton", "float32", "fp32", "triton"), ("triton", "float32", "q4", "triton")])
def test_the_manifest_names_what_ran(tiny_kv32_dir, monkeypatch, forced, dtype, mode, backend_name):
    if forced == "native-cpu" and not NATIVE:
        pytest.skip("native kernels unavailable here")
    if forced == "triton" and not INTERPRET:
        pytest.skip("Triton on CPU tensors needs its interpreter")
    monkeypatch.setenv("EVALRUN_KERNELS", forced)
    kernels, ran = _manifest_and_run(tiny_kv32_dir, dtype, mode)
    assert kernels == ran
    assert kernels["backend"] == backend_name
    _no_else(kernels)
    if forced == "torch":
        assert {kernels[op] for op in ("kv_write", "decode_attention", "norm_act", "rope_write")} == {"torch"}
        assert kernels["prefill_attention"] == "torch-sdpa"
    if forced == "triton":
        assert kernels["decode_attention"] == "triton" and kernels["kv_write"] == "triton"
        assert kernels["prefill_attention"] == ("torch-sdpa" if KV_FORMATS[mode].window else "triton")
    if forced == "native-cpu":
        assert kernels["decode_attention"] == "native-c"
        # a bf16 model on the bf16 GEMM keeps a float32 residual stream: the float32 element-wise kernels,
        # the rope kernel writing its pages, the decode step
        float_rows = dtype == "float32" or kernels["linear"] == "native-bf16"
        float_pages = not KV_FORMATS[mode].quantized
        assert kernels["decode_step"] == ("native-c" if float_rows and float_pages else "off")
        assert kernels["stream"] == ("float32" if float_rows else dtype)
        assert kernels["norm_act"] == ("native-c" if float_rows else "torch")
        assert kernels["head_norm"] == "native-c"                   # the head's rows are float32 in every dtype
        if float_pages:                                             # float pages: written by the rope kernel
            assert kernels["kv_write"] == ("native-c rope_write" if float_rows else "torch")


def test_default_choice_on_this_cpu(tiny_kv32_dir, monkeypatch):
    """Without EVALRUN_KERNELS the CPU gets the native backend where it builds, and the manifest
    still equals what ran."""
    monkeypatch.delenv("EVALRUN_KERNELS", raising=False)
    kernels, ran = _manifest_and_run(tiny_kv32_dir, "float32", "fp32")
    assert kernels == ran and kernels["backend"] == ("native-cpu" if NATIVE else "torch")
    _no_else(kernels)


def test_forward_makes_no_support_check_and_no_fallback(tiny_kv32_dir, monkeypatch):
    """The plan's ops are called as resolved: a forward never asks whether a kernel can take its
    inputs (the native kernels' own argument guards raise; they choose nothing), never reaches a
    torch reference in a plan that has none for the op, and memoizes nothing on the layers."""
    if not NATIVE:
        pytest.skip("native kernels unavailable here")

    def refuse(*args, **kwargs):
        raise AssertionError("a support check ran per call")

    model = Model.load(tiny_kv32_dir, dtype="float32")
    gen = make_generator(model, max_tokens=512, page_size=16, mode="fp32")
    assert gen.cache.kernels.names["prefill_attention"] == "native-c"
    for module, name in ((paged_decode, "supported"), (paged_decode, "layout_supported"), (paged_prefill, "supported"),
                         (ref_attention, "decode_torch"), (ref_attention, "gather_kv"),
                         (backend, "rope_write_reference"), (backend, "write_kv_torch")):
        monkeypatch.setattr(module, name, refuse)
    prompts = random_prompts(3, [5, 17, 9], model.config.vocab_size, seed=2)
    assert all(len(o["all_token_ids"]) == 3 for o in run_jobs(gen, greedy_jobs(prompts, 3)).values())
    assert not any(k.startswith("_native") for layer in gen.cache.layers for k in layer.__dict__)


def test_plan_fields_follow_the_key():
    if not NATIVE:
        pytest.skip("native kernels unavailable here")
    key = PlanKey("cpu", torch.float32, KV_FORMATS["fp32"], 16, 4, 2, 32, 64)
    plan = NativeCpuKernels().plan(key)
    assert plan.decode_step and not plan.cuda_graphs and plan.backend == "native-cpu"
    assert plan.rope_write_kv is not TorchKernels().plan(key).rope_write_kv
    bf16_key = dataclasses.replace(key, dtype=torch.bfloat16, fmt=KV_FORMATS["bf16"])
    bf16 = NativeCpuKernels().plan(bf16_key)
    if bf16_key.linear == "native-bf16":         # the bf16 GEMM: a float32 stream through the float32 kernels
        assert bf16.stream_dtype == torch.float32 and bf16.rms_norm is not rms_norm_reference
    else:
        assert bf16.stream_dtype is None and bf16.rms_norm is rms_norm_reference and not bf16.decode_step
    fp16 = NativeCpuKernels().plan(dataclasses.replace(key, dtype=torch.float16, fmt=KV_FORMATS["fp16"]))
    assert not fp16.decode_step and fp16.rms_norm is rms_norm_reference and fp16.names["rope_write"] == "torch"
    assert fp16.stream_dtype is None
    odd = NativeCpuKernels().plan(dataclasses.replace(key, head_dim=24))    # not a multiple of 16
    assert odd.names["prefill_attention"] == "torch-sdpa" and odd.names["decode_attention"] == "native-c"
    assert TorchKernels().plan(key).names["decode_step"] == "off"


def test_rows_rounded_where_made_change_no_bit(tiny_kv32_dir):
    """The native plan of a bf16 model on the bf16 GEMM rounds an input norm's rows (norm_in) and
    the SiLU's output to bf16 where they are made, not in the GEMM that reads them: every prompt
    log-probability and sampled logit bitwise as with float32 rows handed over."""
    model = Model.load(tiny_kv32_dir, dtype="bfloat16")
    if not NATIVE or model.layers[0].wqkv.kernel_name != "native-bf16":
        pytest.skip("the native bf16 GEMM's plan does not run here (needs avx512_bf16)")
    prompts = random_prompts(3, [5, 40, 19], model.config.vocab_size, seed=3)
    runs = []
    for rounded in (True, False):
        gen = make_generator(model, max_tokens=512, page_size=16, mode="bf16")
        plan = gen.cache.kernels
        assert plan.norm_in is not None and plan.names["norm_in"].startswith("native-c")
        if not rounded:
            gen.cache.kernels = dataclasses.replace(plan, norm_in=None,
                                                    gate_up_silu=backend._silu_epilogue(gemm_bf16.gemm_silu))
        jobs = [DynamicJob(p, max_new_tokens=3, identifier=i, return_logits=True, score_from=1)
                for i, p in enumerate(prompts)]
        runs.append(run_jobs(gen, jobs))
    for i in range(len(prompts)):
        a, b = runs[0][i], runs[1][i]
        assert torch.equal(a["all_logits"].view(torch.int32), b["all_logits"].view(torch.int32))
        assert torch.equal(torch.as_tensor(a["prompt_logprobs"]).view(torch.int32),
                           torch.as_tensor(b["prompt_logprobs"]).view(torch.int32))


def test_triton_plan_records_graph_safety():
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or its interpreter")
    dev = "cuda" if not INTERPRET else "cpu"
    key = PlanKey(dev, torch.bfloat16, KV_FORMATS["bf16"], 16, 4, 2, 32)
    assert TritonKernels().plan(key).cuda_graphs
    assert not TritonKernels().plan(dataclasses.replace(key, fmt=KV_FORMATS["q4"])).cuda_graphs   # a window


def test_forced_backend_that_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv("EVALRUN_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="EVALRUN_KERNELS"):
        choose_kernels("cpu")
    monkeypatch.setenv("EVALRUN_KERNELS", "torch")
    assert type(choose_kernels("cuda")) is TorchKernels
    assert backend.BACKENDS["triton"] is TritonKernels


def test_kernel_backends_without_a_config_is_the_nominal_head():
    names = kernel_backends("cpu", "float32", "fp32")
    _no_else(names)
    assert names["linear"] in ("native-gemm", "onednn-prepacked", "torch") and "decode_attention" in names
    assert os.environ.get("EVALRUN_KERNELS") is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_manifest_resolution_is_the_cache_resolution_for_every_mode(tiny_kv32_dir, monkeypatch, dtype, deterministic):
    """For every cache mode (windowed ones with their default and with no window), page sizes of 16
    and 256: kernel_backends from config.json alone gives the names of the plan the cache gets."""
    monkeypatch.delenv("EVALRUN_KERNELS", raising=False)
    if deterministic and not gemm.available():
        pytest.skip("deterministic mode needs the native GEMM")
    model = Model.load(tiny_kv32_dir, dtype=dtype, deterministic=deterministic)
    for mode, fmt in KV_FORMATS.items():
        for page_size in (16, 256):
            for window in ((None, 0) if fmt.quantized else (None,)):
                cache = PagedCache(model, max_tokens=2 * page_size, page_size=page_size, mode=mode, window=window)
                names = kernel_backends("cpu", dtype, mode, deterministic, model.config, page_size, window)
                assert names == {"backend": cache.kernels.backend, "linear": model.layers[0].wqkv.kernel_name,
                                 "lm_head": model.lm_head.kernel_name, **cache.kernels.describe()}, (mode, window)
                _no_else(names)
