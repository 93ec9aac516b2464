"""Triton kernels (kernels/cuda/triton_*.py) against their torch reference (evalrun/kernels/ref/attention.py,
evalrun/kernels/ref/cache_ops.py), for every KV cache format they claim, over page sizes, GQA ratios,
ragged lengths and NaN-poisoned unused slots.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is
set by tests/triton_setup.py before triton is imported). With a GPU they run compiled on it, and
benchmarks/gpu_check.py runs this file a second time with TRITON_INTERPRET=1. The engine
through the Triton backend, CUDA graphs, the sm_90 compile and flash-attn: tests/test_triton_engine.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

from triton_setup import DEVICE, check_interpreting, interpreter_scalars  # noqa: F401,E402

from evalrun.kernels.cuda import triton_attention, triton_cache_ops  # noqa: E402  (after TRITON_INTERPRET)
from evalrun.kernels.ref.attention import decode_torch  # noqa: E402
from evalrun.kernels.backend import TorchKernels, TritonKernels, choose_kernels  # noqa: E402
from evalrun.kernels.ref.cache_ops import write_kv_torch  # noqa: E402
from evalrun.kernels.kv_format import KV_FORMATS, LayerKV, kv_format  # noqa: E402

from triton_cases import PAGE_FORMATS, close_to_reference as _close, paged_case as _case  # noqa: E402

check_interpreting(triton_attention.interpreting())

pytestmark = [pytest.mark.cuda] if DEVICE.type == "cuda" else []     # selected by gpu_check's -m cuda

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
    rest = {"rope_write": "torch", "norm_in": "triton rms_norm", "head_norm": "triton", "gate_up_silu": "torch",
            "decode_step": "off", "stream": "bfloat16"}
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
