"""Triton kernels (kernels/cuda/triton_*.py) against their torch reference (evalrun/kernels/ref/attention.py,
evalrun/kernels/ref/cache_ops.py), for every KV cache format they claim, over page sizes, GQA ratios,
ragged lengths and NaN-poisoned unused slots.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is
set by tests/triton_setup.py before triton is imported). With a GPU they run compiled on it, and
benchmarks/gpu_check.py runs this file a second time with TRITON_INTERPRET=1. A last test
compiles the kernels for sm_90 (Hopper) in a subprocess, which needs no GPU. Also here: the
CUDA-graph decode runner with a stand-in capture, and the flash-attn backend against a stand-in.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_setup import DEVICE, INTERPRET, check_interpreting, interpreter_scalars  # noqa: F401,E402

from evalrun.kernels.cuda import triton_attention, triton_cache_ops  # noqa: E402  (after TRITON_INTERPRET)
from evalrun.kernels.attention import build_metadata  # noqa: E402
from evalrun.kernels.ref.attention import decode_torch  # noqa: E402
from evalrun.kernels.backend import FlashAttnKernels, TorchKernels, TritonKernels, choose_kernels  # noqa: E402
from evalrun.kernels.ref.cache_ops import write_kv_torch  # noqa: E402
from evalrun.kernels.kv_format import KV_FORMATS, KVFormat, LayerKV, kv_format  # noqa: E402

check_interpreting(triton_attention.interpreting())

pytestmark = [pytest.mark.cuda] if DEVICE.type == "cuda" else []     # selected by gpu_check's -m cuda

ROOT = Path(__file__).resolve().parent.parent
PAGE_FORMATS = {m: kv_format(f, window=0) if f.quantized else f for m, f in KV_FORMATS.items()}
FLOAT_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(fmt: KVFormat, hq: int, hkv: int, d: int, page_size: int, lens: list[int], q_lens: list[int],
          seed: int, q_dtype: torch.dtype, window_slots: int = 0):
    """Random contexts written by the reference on shuffled pages of a cache whose other slots
    are NaN (floats, or scales beside junk codes); queries for the last q_lens[i] tokens."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    layer = LayerKV.allocate(fmt, num_pages + 1, page_size, hkv, d, DEVICE, window_slots=window_slots)
    for t in layer.data_tensors():
        t[:num_pages] = float("nan")
    if fmt.quantized:
        layer.k[:num_pages], layer.v[:num_pages] = 0xA5, 0x5A
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for n in lens:
        pages, perm = perm[: -(-n // page_size)], perm[-(-n // page_size):]
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        k, v = torch.randn(2, n, hkv, d, generator=g)
        write_kv_torch(k.to(DEVICE), v.to(DEVICE), layer, slots.to(DEVICE))
        tables.append(pages)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(q_dtype).to(DEVICE)
    wslots = list(range(len(lens)))[::-1] if fmt.window else None
    meta = build_metadata(q_lens, lens, tables, page_size, num_pages, DEVICE, fmt.window, wslots)
    return layer, q, meta


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    tol = FLOAT_TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


# (page size, Hq, Hkv, head dim, split length, lengths): pages smaller than, equal to and larger
# than a 16-position block; GQA 3, 4 and 1 (9/3, 4/1, 4/4); one to three splits; ragged lengths
DECODE_CASES = [
    (4, 9, 3, 32, 64, [1, 17, 40, 5]),
    (16, 4, 1, 32, 16, [33, 2, 16]),
    (32, 4, 4, 32, 32, [40, 11]),
    (8, 6, 2, 48, 16, [9, 25]),           # a head dim that is no power of two (float formats)
]
# (format, query dtype): every storage read by a query of its dtype, and a mixed one
FORMAT_CASES = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                ("bf16", torch.float32), ("q8", torch.float32), ("q6", torch.float32), ("q4", torch.bfloat16)]


@pytest.mark.parametrize("mode,q_dtype", FORMAT_CASES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_matches_reference(mode, q_dtype, case):
    page_size, hq, hkv, d, split_len, lens = DECODE_CASES[case]
    fmt = PAGE_FORMATS[mode]
    if fmt.quantized and d % fmt.group_size:
        pytest.skip("quantized formats need a head dim divisible by 32")
    layer, q, meta = _case(fmt, hq, hkv, d, page_size, lens, [1] * len(lens), case, q_dtype)
    ref = decode_torch(q, layer, meta, d ** -0.5)
    out = triton_attention.paged_decode_triton(q, layer, meta.page_table, meta.seq_lens_k, d ** -0.5,
                                               split_len=split_len)
    _close(out, ref, q_dtype)        # (decode_triton, from metadata: test_attention_matches_reference)


@pytest.mark.parametrize("mode,q_dtype", [("bf16", torch.bfloat16), ("q4", torch.float32)])
def test_decode_row_does_not_depend_on_the_batch(mode, q_dtype):
    """A row decoded beside a much longer one (more splits in the grid) equals, bit for bit,
    the same row decoded alone."""
    layer, q, meta = _case(PAGE_FORMATS[mode], 4, 2, 32, 8, [21, 70], [1, 1], 4, q_dtype)
    both = triton_attention.paged_decode_triton(q, layer, meta.page_table, meta.seq_lens_k, 0.2, split_len=16)
    alone = triton_attention.paged_decode_triton(q[:1], layer, meta.page_table[:1], meta.seq_lens_k[:1], 0.2,
                                                 split_len=16)
    assert torch.equal(both[:1], alone)


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_windowed_decode_matches_reference(mode):
    """Positions from each row's window start on come from its block of the store (NaN in the
    blocks no row reads), the rest from the codes."""
    fmt = kv_format(mode, window=8)
    lens = [5, 8, 9, 30, 16]
    layer, q, meta = _case(fmt, 4, 2, 32, 16, lens, [1] * len(lens), 7, torch.float32, window_slots=len(lens) + 1)
    g = torch.Generator().manual_seed(1)
    for t in layer.window_tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        t[len(lens)] = float("nan")                         # the block no sequence owns
    ref = decode_torch(q, layer, meta, 32 ** -0.5)
    out = triton_attention.paged_decode_triton(q, layer, meta.page_table, meta.seq_lens_k, 32 ** -0.5,
                                               window=(meta.window_slots, meta.window_starts), split_len=16)
    _close(out, ref, torch.float32)


# (page size, Hq, Hkv, head dim, q_lens, seq_lens): decode rows first, then prefill chunks (a whole
# prompt, chunks over a cached prefix, a one-token chunk after them)
PREFILL_CASES = [
    (4, 6, 2, 32, [1, 1, 7, 20, 1], [9, 40, 7, 30, 5]),
    (16, 4, 1, 32, [1, 33, 18], [3, 33, 40]),
    (8, 2, 2, 32, [12, 3], [12, 21]),
]


@pytest.mark.parametrize("mode,q_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                          ("fp16", torch.float16), ("bf16", torch.float32),
                                          ("q8", torch.float32), ("q4", torch.float32)],
                         ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_attention_matches_reference(mode, q_dtype, case):
    """The whole packed batch through the backend (decode + prefill kernels; rotating formats
    rotate q in and the output out) against the reference backend (SDPA prefill)."""
    page_size, hq, hkv, d, q_lens, lens = PREFILL_CASES[case]
    layer, q, meta = _case(PAGE_FORMATS[mode], hq, hkv, d, page_size, lens, q_lens, 10 + case, q_dtype)
    ref = TorchKernels().attention(q, layer, meta, d ** -0.5)
    _close(TritonKernels().attention(q, layer, meta, d ** -0.5), ref, q_dtype)


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_windowed_attention_matches_reference(mode):
    """Windowed formats through the backend: decode rows by the Triton kernel, prefill by the
    reference; both store the new tokens' window rows the same way."""
    fmt = kv_format(mode, window=8)
    q_lens, lens = [1, 1, 13, 6], [9, 24, 13, 22]
    layer, q, meta = _case(fmt, 4, 2, 32, 16, lens, q_lens, 3, torch.float32, window_slots=len(lens))
    g = torch.Generator().manual_seed(2)
    for t in layer.window_tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    k, v = (torch.randn(sum(q_lens), 2, 32, generator=g).to(DEVICE) for _ in range(2))
    ref_layer = copy.deepcopy(layer)
    ref = TorchKernels().attention(q, ref_layer, meta, 32 ** -0.5, k, v)
    _close(TritonKernels().attention(q, layer, meta, 32 ** -0.5, k, v), ref, torch.float32)
    for a, b in zip(layer.window_tensors(), ref_layer.window_tensors()):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(mode, src_dtype):
    """Strided K/V views (as sliced from the fused QKV projection) into NaN pages: bit for bit
    the reference's cast, every other slot untouched."""
    hkv, d, page_size = 3, 24, 4
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(11, (4 + 2 * hkv) * d, generator=g).to(src_dtype).to(DEVICE)
    k = qkv[:, 4 * d: (4 + hkv) * d].view(11, hkv, d)
    v = qkv[:, (4 + hkv) * d:].view(11, hkv, d)
    slots = torch.randperm(6 * page_size, generator=g)[:11].to(DEVICE)
    layers = []
    for _ in range(2):
        layer = LayerKV.allocate(PAGE_FORMATS[mode], 7, page_size, hkv, d, DEVICE)
        for t in layer.tensors():                      # real pages come unwritten: start both alike
            t.zero_()
        layer.k[:6], layer.v[:6] = float("nan"), float("nan")
        layers.append(layer)
    assert triton_cache_ops.supported(k, v, layers[0])
    triton_cache_ops.write_kv_triton(k, v, layers[0], slots, block=32)       # several blocks per row
    write_kv_torch(k, v, layers[1], slots)
    for a, b in zip(layers[0].tensors(), layers[1].tensors()):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64])
def test_quantized_write_matches_reference(mode, src_dtype, d):
    """Quantize on write: strided K/V views into junk pages; codes and scales bit for bit the
    reference's (rotation, fp16 scale with its one-ulp bump, round half to even, 4-bit packing),
    every other slot untouched. Rows include an all-zero group, evenly spaced values, an
    outlier that saturates fp16's range and a NaN group (its scale NaN, its codes unspecified)."""
    fmt, hkv, page_size, t = PAGE_FORMATS[mode], 2, 4, 9
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(t, (3 + 2 * hkv) * d, generator=g) * 3).to(src_dtype)
    k = qkv[:, 3 * d: (3 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (3 + hkv) * d:].view(t, hkv, d)
    k[0, 0, :32] = 0.0                                              # zero group: scale 0, codes offset
    k[1, 1, :32] = torch.arange(32, dtype=torch.float32).to(src_dtype) - 15.5   # ties after scaling
    v[2, 0, 5] = 1e8                                                # beyond fp16 * qmax * sqrt(G): scale clips
    v[3, 1, 32 % d] = float("nan")
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots = torch.randperm(6 * page_size, generator=g)[:t].to(DEVICE)
    layers = []
    for _ in range(2):
        layer = LayerKV.allocate(fmt, 7, page_size, hkv, d, DEVICE)
        for x in layer.tensors():
            x.fill_(3)                                               # junk codes and scales elsewhere
        layers.append(layer)
    assert triton_cache_ops.quant_supported(k, v, layers[0]) and not triton_cache_ops.supported(k, v, layers[0])
    triton_cache_ops.write_kv_quant_triton(k, v, layers[0], slots)
    write_kv_torch(k, v, layers[1], slots)
    nan_slot = slots[3].item()
    for name, a, b in zip(("k", "v", "k_scale", "v_scale"), layers[0].tensors(), layers[1].tensors()):
        a, b = a.view(-1, *a.shape[2:]).clone(), b.view(-1, *b.shape[2:]).clone()
        if name == "v_scale":
            assert a[nan_slot, 1].isnan().any() and torch.equal(a.isnan(), b.isnan())
        if name == "v":                                              # the NaN group's codes are unspecified
            a[nan_slot, 1], b[nan_slot, 1] = 0, 0
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name


def test_backend_choice_describe_and_fallbacks():
    assert isinstance(choose_kernels("cuda"), TritonKernels)
    kernels = TritonKernels()
    rest = {"rope_write": "torch", "head_norm": "triton", "gate_up_silu": "torch", "decode_step": "off"}
    assert kernels.describe(KV_FORMATS["bf16"], torch.bfloat16) == {
        "kv_write": "triton", "decode_attention": "triton", "prefill_attention": "triton",
        "norm_act": "triton rms_norm, torch silu", "cuda_graphs": "on", **rest}
    assert kernels.describe(KV_FORMATS["q4"], torch.bfloat16) == {    # a window: graphs and prefill not Triton's
        "kv_write": "triton", "decode_attention": "triton", "prefill_attention": "torch-sdpa",
        "norm_act": "triton rms_norm, torch silu", "cuda_graphs": "off", **rest}
    # a layout the kernels do not take goes to the reference, with the reference's answer
    layer, q, meta = _case(PAGE_FORMATS["fp32"], 4, 2, 32, 4, [6, 9], [1, 4], 0, torch.float64)
    assert not triton_attention.supported(q, layer)
    torch.testing.assert_close(kernels.attention(q, layer, meta, 0.2), TorchKernels().attention(q, layer, meta, 0.2))
    q4 = PAGE_FORMATS["q4"]
    for d, triton_write in ((32, True), (96, False)):     # a head size not a power of two: the reference
        k = torch.randn(3, 2, d, device=DEVICE)
        qlayer = LayerKV.allocate(q4, 3, 4, 2, d, DEVICE)
        ref = LayerKV.allocate(q4, 3, 4, 2, d, DEVICE)
        for t in (*qlayer.tensors(), *ref.tensors()):     # real pages come unwritten: compare from alike
            t.zero_()
        assert not triton_cache_ops.supported(k, k, qlayer)
        assert triton_cache_ops.quant_supported(k, k, qlayer) == triton_write
        kernels.write_kv(k, k, qlayer, torch.tensor([0, 5, 2], device=DEVICE))
        write_kv_torch(k, k, ref, torch.tensor([0, 5, 2], device=DEVICE))
        assert all(torch.equal(a, b) for a, b in zip(qlayer.tensors(), ref.tensors()))


def test_decode_checks_pages_and_lengths():
    layer, q, meta = _case(PAGE_FORMATS["fp16"], 4, 2, 32, 4, [6, 9], [1, 1], 0, torch.float16)
    bad_table = meta.page_table.clone()
    bad_table[1, 0] = layer.k.shape[0]                       # beyond the null page
    with pytest.raises(ValueError, match="page ids"):
        triton_attention.paged_decode_triton(q, layer, bad_table, meta.seq_lens_k, 0.2)
    with pytest.raises(ValueError, match="sequence lengths"):
        triton_attention.paged_decode_triton(q, layer, meta.page_table, meta.seq_lens_k + 100, 0.2)


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

def build(fn, types, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

ptrs = lambda names, t: dict.fromkeys(names, t)
for kv, q, bits, window, native in [("*bf16", "*bf16", (0, 0), 0, True), ("*u8", "*fp32", (8, 4), 128, False)]:
    types = {**ptrs(["q_ptr", "out_ptr"], q), **ptrs(["k_ptr", "v_ptr"], kv), "scale_log2": "fp32",
             **ptrs(["ks_ptr", "vs_ptr", "wk_ptr", "wv_ptr"], "*fp16"), **ptrs(["acc_ptr", "ml_ptr"], "*fp32"),
             **ptrs(["wslot_ptr", "wstart_ptr", "table_ptr", "lens_ptr", "cu_q_ptr"], "*i32")}
    common = dict(HKV=8, GQA=4, D=128, PAGE=256, K_BITS=bits[0], V_BITS=bits[1], GROUP=32, NATIVE=native,
                  EMULATE=False, BLOCK_N=64, BLOCK_D=128)
    build(ta.kernels()._decode_kernel, types, dict(common, WINDOW=window, BLOCK_G=16))
    if not window:
        build(ta.kernels()._prefill_kernel, types, dict(common, BLOCK_M=64))
build(ta.kernels()._combine_kernel, {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "lens_ptr": "*i32"},
      dict(EMULATE=False, HQ=32, D=128, BLOCK_S=4, BLOCK_D=128))
build(tc.kernels()._write_kernel, {**ptrs(["k_ptr", "v_ptr", "kc_ptr", "vc_ptr"], "*bf16"), "slot_ptr": "*i64"},
      dict(EMULATE=False, HKV=8, D=128, BLOCK=1024))
for bits in (8, 4):
    build(tc.kernels()._quant_kernel, {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp16", "slot_ptr": "*i64",
                             "norm": "fp32"}, dict(HKV=8, D=128, G=32, LOG2G=5, BITS=bits, ROTATE=True))
for dt, ieee in (("*bf16", False), ("*fp32", True)):
    build(tli.kernels()._linear_kernel, {**ptrs(["x_ptr", "w_ptr", "b_ptr", "y_ptr"], dt)},
          dict(HAS_BIAS=True, IEEE=ieee, EMULATE=False, BM=tli.BLOCK_M, BN=tli.BLOCK_N, BK=tli.BLOCK_K))
build(tli.kernels()._rms_norm_kernel, {**ptrs(["x_ptr", "w_ptr", "y_ptr"], "*bf16"), "eps": "fp32"}, dict(BLOCK=4096))
print("compiled")
"""


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the other tests compile and run every kernel")
def test_kernels_compile_for_hopper(tmp_path):
    """Ahead-of-time compile (Triton's own LLVM and ptxas, no GPU needed) of the kernels at a
    7B-like shape for sm_90: what the interpreter cannot check (types, layouts, shared memory).
    A fresh Triton cache, so nothing compiled earlier stands in."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


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
    layer, q, meta = _case(fmt, 6, 2, 32, page_size, [1 + page_size, 40, 3 * page_size // 2, 300], [1, 1, 20, 300],
                           3, dtype)
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
