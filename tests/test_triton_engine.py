"""The engine through the Triton backend (kernels/cuda/): whole runs against the reference backend, the
CUDA-graph decode runner with a stand-in capture, the kernels compiled for sm_90 (Hopper) in a
subprocess (no GPU needed), and the flash-attn backend against a stand-in. The kernels one by one
against their torch references: tests/test_triton_kernels.py.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set by
tests/triton_setup.py before triton is imported).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_setup import DEVICE, INTERPRET, check_interpreting, interpreter_scalars  # noqa: F401,E402

from evalrun.demo import default_cache_dir  # noqa: E402
from evalrun.kernels.cuda import triton_attention  # noqa: E402  (after TRITON_INTERPRET)
from evalrun.kernels.backend import FlashAttnKernels, TorchKernels, TritonKernels, choose_kernels  # noqa: E402

from triton_cases import PAGE_FORMATS, close_to_reference as _close, paged_case as _case  # noqa: E402

check_interpreting(triton_attention.interpreting())

pytestmark = [pytest.mark.cuda] if DEVICE.type == "cuda" else []     # selected by gpu_check's -m cuda

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny-triton"), "llama", hidden_size=64, num_heads=2,
                           num_kv_heads=1, num_layers=1, intermediate_size=64)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "q4"])
def test_engine_through_triton_matches_reference_backend(tiny_dir, mode):
    """The whole engine through TritonKernels (K/V writes of strided views, packed batches of
    prefill chunks over cached prefixes and decode rows, dedup, window stores) gives the tokens
    and logits of the reference backend."""
    from engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs

    from evalrun.engine import Model
    outs = []
    for kernels in (TorchKernels(), TritonKernels()):
        model = Model.load(tiny_dir, dtype="float32", device=DEVICE.type, kernels=kernels)
        prompts = random_prompts(3, [5, 37], model.config.vocab_size, seed=0)
        prompts.append(prompts[1][:30] + prompts[0])                         # a shared prefix
        gen = make_generator(model, max_tokens=256, page_size=16, mode=mode, max_chunk_size=24)
        outs.append(run_jobs(gen, greedy_jobs(prompts, 3, return_logits=True)))
    for i, ref in outs[0].items():
        assert outs[1][i]["all_token_ids"] == ref["all_token_ids"]
        torch.testing.assert_close(outs[1][i]["all_logits"], ref["all_logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "q4"])
def test_decode_graphs_replay_the_eager_step(tiny_dir, mode):
    """evalrun/engine/cuda_graphs.py without a GPU: decode steps go through the graph runner (bucket
    choice, static buffers, padding rows with slot -1, the longest-context splits) with a stand-in
    capture that reruns the step on the static buffers. Every decode step of 5 jobs growing and
    finishing at different lengths (buckets 8, 4, 2, 1) gives bitwise the eager engine's
    tokens and logits (native float32 linears and Triton attention are batch-invariant), and no
    padding row writes a page: the null page stays zero."""
    from engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs

    from evalrun.engine import Model
    from evalrun.engine.cuda_graphs import DecodeGraphs, eager_capture
    outs, runs = [], []
    for graphs in (False, True):
        model = Model.load(tiny_dir, dtype="float32", device=DEVICE.type, kernels=TritonKernels())
        model.cuda_graphs, model.graph_capture = graphs, eager_capture
        prompts = random_prompts(5, [5, 19, 40, 3, 27], model.config.vocab_size, seed=4)
        gen = make_generator(model, max_tokens=512, page_size=16, mode=PAGE_FORMATS[mode])   # q4: no window
        calls = []
        if graphs:
            real_run = DecodeGraphs.run

            def counted(self, batch, _run=real_run):
                calls.append(batch.input_ids.shape[0])
                return _run(self, batch)
            DecodeGraphs.run = counted
        try:
            jobs = greedy_jobs(prompts, 9, return_logits=True)
            for i, job in enumerate(jobs):
                job.max_new_tokens = 3 + 2 * i                              # rows finish at different steps
            outs.append(run_jobs(gen, jobs))
        finally:
            if graphs:
                DecodeGraphs.run = real_run
        runs.append(calls)
        if graphs:
            null = gen.cache.null_page
            assert all(not t[null].float().nan_to_num(1.0).any() for t in gen.cache.layer(0).tensors())
            sizes = model._graphs[gen.cache].sizes
            assert set(model._graphs[gen.cache]._buckets) == {next(b for b in sizes if b >= n) for n in calls}
    assert runs[1] and set(runs[1]) >= {5, 4, 3, 2, 1}
    for i, ref in outs[0].items():
        assert outs[1][i]["all_token_ids"] == ref["all_token_ids"]
        assert torch.equal(outs[1][i]["all_logits"], ref["all_logits"])


COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from evalrun.kernels.cuda import triton_attention as ta, triton_cache_ops as tc, triton_linear as tli

import sys
PART, PARTS = int(sys.argv[1]), int(sys.argv[2])       # this process compiles every PARTS-th kernel from PART
built = 0

def build(fn, types, consts):
    global built
    built += 1
    if (built - 1) % PARTS != PART:
        return
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

ptrs = lambda names, t: dict.fromkeys(names, t)
for kv, q, bits, window, native in [("*bf16", "*bf16", (0, 0), 0, True), ("*u8", "*fp32", (8, 4), 128, False),
                                    ("*bf16", "*fp32", (0, 0), 0, False)]:      # the last: q rounded (ROUND_Q)
    types = {**ptrs(["q_ptr", "out_ptr"], q), **ptrs(["k_ptr", "v_ptr"], kv), "scale_log2": "fp32", "cap_log2": "fp32",
             **ptrs(["ks_ptr", "vs_ptr", "wk_ptr", "wv_ptr"], "*fp16"), **ptrs(["acc_ptr", "ml_ptr"], "*fp32"),
             **ptrs(["wslot_ptr", "wstart_ptr", "table_ptr", "lens_ptr", "cu_q_ptr"], "*i32")}
    common = dict(HKV=8, GQA=4, D=128, PAGE=256, K_BITS=bits[0], V_BITS=bits[1], GROUP=32, NATIVE=native,
                  EMULATE=False, BLOCK_N=64, BLOCK_D=128, ROUND_Q=kv == "*bf16" and q != "*bf16")
    for variant in (dict(SLIDING=False, SOFTCAP=False), dict(SLIDING=True, SOFTCAP=True)):   # sliding window, soft-capping
        build(ta.kernels()._decode_kernel, types, dict(common, **variant, WINDOW=window, BLOCK_G=16))
        if not window:
            build(ta.kernels()._prefill_kernel, types, dict(common, **variant, BLOCK_M=64))
for sliding in (False, True):
    build(ta.kernels()._combine_kernel, {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "lens_ptr": "*i32"},
          dict(EMULATE=False, HQ=32, D=128, BLOCK_S=4, BLOCK_D=128, SLIDING=sliding))
build(tc.kernels()._write_kernel, {**ptrs(["k_ptr", "v_ptr", "kc_ptr", "vc_ptr"], "*bf16"), "slot_ptr": "*i64"},
      dict(EMULATE=False, HKV=8, D=128, BLOCK=1024))
for bits in (8, 4):
    build(tc.kernels()._quant_kernel, {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp16", "slot_ptr": "*i64",
                             "norm": "fp32"}, dict(HKV=8, D=128, G=32, LOG2G=5, BITS=bits, ROTATE=True))
for dt, ieee in (("*bf16", False), ("*fp32", True)):
    build(tli.kernels()._linear_kernel, {**ptrs(["x_ptr", "w_ptr", "b_ptr", "y_ptr"], dt)},
          dict(HAS_BIAS=True, IEEE=ieee, EMULATE=False, BM=tli.BLOCK_M, BN=tli.BLOCK_N, BK=tli.BLOCK_K))
build(tli.kernels()._rms_norm_kernel, {**ptrs(["x_ptr", "w_ptr", "y_ptr"], "*bf16"), "eps": "fp32"}, dict(BLOCK=4096))
print("compiled", built)
"""


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the other tests compile and run every kernel")
def test_kernels_compile_for_hopper():
    """Ahead-of-time compile (Triton's own LLVM and ptxas, no GPU needed) of the kernels at a
    7B-like shape for sm_90: what the interpreter cannot check (types, layouts, shared memory).
    Triton's cache is kept between test runs in $EVALRUN_CACHE (~90 s of two cores saved): its key
    is the kernel's source and what it calls, the signature, the constants, the target and Triton's
    version, so a hit is a compile of this very code, and any change compiles afresh. The kernels
    are shared out over one process per core (each compile is single-threaded)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(default_cache_dir() / "test-triton-sm90")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    parts = max(1, min(4, len(os.sched_getaffinity(0))))
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE_SCRIPT, str(i), str(parts)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(parts)]
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0 and out.startswith("compiled "), err[-3000:]
    assert len({out for out, _ in outs}) == 1                    # every part walked the same list of kernels


class _FlashStandIn:
    """flash_attn's `flash_attn_varlen_func` with a paged cache as its documentation states it, in
    torch: k/v caches [num_blocks, block_size, Hkv, D], block_table [B, max_blocks] int32, sequence b's
    queries q[cu_q[b]:cu_q[b+1]] over its cu_k[b+1] - cu_k[b] keys, causal aligned to the end of the
    context, GQA by repeating K/V heads. Records its calls."""

    def __init__(self):
        self.calls = 0

    def flash_attn_varlen_func(self, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None):
        self.calls += 1
        assert causal and block_table is not None and block_table.dtype == torch.int32
        bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        out = torch.empty_like(q)
        for b in range(len(cu_seqlens_q) - 1):
            q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            n, length = q1 - q0, int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            assert n <= max_seqlen_q and length <= max_seqlen_k
            pages = block_table[b, : -(-length // bs)].long()
            k = k_cache[pages].reshape(-1, hkv, d)[:length].float().repeat_interleave(q.shape[1] // hkv, 1)
            v = v_cache[pages].reshape(-1, hkv, d)[:length].float().repeat_interleave(q.shape[1] // hkv, 1)
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * softmax_scale
            pos = torch.arange(max(length, n), device=q.device)
            allowed = pos[None, :length] <= (length - n + pos[:n])[:, None]
            p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
        return out


@pytest.mark.parametrize("mode,page_size,flash", [("bf16", 256, True), ("fp16", 512, True),
                                                   ("bf16", 16, False), ("q8", 256, False)])
def test_flash_attn_backend_plumbing(mode, page_size, flash):
    """FlashAttnKernels hands the packed batch (decode rows and prefill chunks over cached pages) to
    flash_attn_varlen_func with the page table as block_table and the metadata's cumulative lengths;
    against a stand-in of flash-attn's documented semantics it gives the reference's output. Pages
    not a multiple of 256 and quantized caches stay with the Triton kernels / reference."""
    fmt = PAGE_FORMATS[mode]
    stand_in = _FlashStandIn()
    kernels = FlashAttnKernels(stand_in, require_cuda=DEVICE.type == "cuda")
    dtype = fmt.dtype if not fmt.quantized else torch.bfloat16
    fresh = 300 if flash else 48             # a whole prompt (in Triton's interpreter: shorter, the same paths)
    layer, q, meta = _case(fmt, 6, 2, 32, page_size, [1 + page_size, 40, 3 * page_size // 2, fresh],
                           [1, 1, 20, fresh], 3, dtype)
    out = kernels.attention(q, layer, meta, 0.125)
    ref = TorchKernels().attention(q, layer, meta, 0.125)
    _close(out, ref, dtype)
    assert stand_in.calls == (1 if flash else 0)
    described = kernels.describe(fmt, dtype, page_size=page_size)
    assert (described["decode_attention"] == "flash-attn") == flash
    assert described["prefill_attention"] == ("flash-attn" if flash else "triton" if not fmt.window else "torch-sdpa")
    assert described["cuda_graphs"] == "off"                  # flash-attn reads the lengths on the host


def test_flash_attn_chosen_where_it_imports_except_in_deterministic_mode(monkeypatch):
    from evalrun.kernels import backend
    monkeypatch.setattr(backend, "flash_attn_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", _FlashStandIn())
    assert type(choose_kernels("cuda")) is FlashAttnKernels
    assert type(choose_kernels("cuda", deterministic=True)) is TritonKernels    # flash-attn splits by batch size
    monkeypatch.setattr(backend, "flash_attn_available", lambda: False)
    assert type(choose_kernels("cuda")) is TritonKernels
