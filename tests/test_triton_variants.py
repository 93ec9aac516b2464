"""The Triton attention kernels (kernels/cuda/triton_attention.py) with a layer's sliding window (the
query at position t attends keys t - W < p <= t) and soft-capping (each scaled score s becomes
c tanh(s / c)), against the torch reference (decode_torch; TorchKernels().attention, whose prefill is
SDPA with the window's mask or the capped scores written out): float pages and codes, windows within
a page, across pages and splits and longer than the context, caps that bite, both together, the
quantized formats' recent-token window beside a sliding window, and the defaults unchanged.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/triton_setup.py before triton is imported): shapes stay tiny.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_setup import DEVICE, INTERPRET, check_interpreting, interpreter_scalars, triton  # noqa: F401,E402

import triton.language as tl  # noqa: E402

from evalrun.kernels.backend import TorchKernels  # noqa: E402
from evalrun.kernels.cuda import triton_attention  # noqa: E402  (after TRITON_INTERPRET)
from evalrun.kernels.kv_format import kv_format  # noqa: E402
from evalrun.kernels.ref.attention import decode_torch  # noqa: E402
from evalrun.kernels.ref.kv_quant import rotate  # noqa: E402

from triton_cases import PAGE_FORMATS, close_to_reference as _close, paged_case as _case  # noqa: E402

check_interpreting(triton_attention.interpreting())

pytestmark = [pytest.mark.cuda] if DEVICE.type == "cuda" else []     # selected by gpu_check's -m cuda

# (cache mode, query dtype): the float pages read by a query of their dtype, two code formats
MODES = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
         ("q8", torch.float32), ("q4", torch.bfloat16)]
# (sliding window, softcap) with pages of 8: within a page, across pages (and 16-position splits),
# one key, longer than every context; caps that bite on queries scaled by 4 (the Taylor and the exp
# branch of the kernel's tanh), a mild one, and both together
VARIANTS = [(3, 0.0), (13, 0.0), (1, 0.0), (100, 0.0), (0, 1.5), (0, 30.0), (13, 2.0), (5, 50.0)]
IDS = lambda x: str(x).removeprefix("torch.")  # noqa: E731


def _attention_triton(q, layer, meta, scale, window, softcap):
    """paged_attention_triton on q as the model sees it: rotated in and out for rotating formats
    (as the Triton plan calls it)."""
    fmt = layer.fmt
    qr = rotate(q, fmt.group_size).to(q.dtype) if fmt.rotate else q
    out = triton_attention.paged_attention_triton(qr, layer, meta, scale, window, softcap)
    return rotate(out, fmt.group_size).to(q.dtype) if fmt.rotate else out


@pytest.mark.parametrize("mode,q_dtype", MODES, ids=IDS)
def test_decode_variants_match_reference(mode, q_dtype):
    """Rows of 1 to 45 positions over pages of 8, GQA 3; splits of 16 positions (those before a
    row's window are skipped, the first one may start mid-page)."""
    lens = [1, 7, 8, 20, 45]
    layer, q, meta = _case(PAGE_FORMATS[mode], 6, 2, 32, 8, lens, [1] * len(lens), 3, q_dtype)
    q = (q.float() * 4).to(q_dtype)                       # scores large enough for the caps to bite
    for window, softcap in VARIANTS:
        ref = decode_torch(q, layer, meta, 32 ** -0.5, window, softcap)
        out = triton_attention.paged_decode_triton(q, layer, meta.page_table, meta.seq_lens_k, 32 ** -0.5,
                                                   split_len=16, sliding_window=window, softcap=softcap)
        _close(out, ref, q_dtype)
        if window == 13:                          # the metadata's entry (one 512-position split)
            _close(triton_attention.decode_triton(q, layer, meta, 32 ** -0.5, window, softcap), ref, q_dtype)
        if 0 < window < max(lens) or 0 < softcap < 10:                 # the variant changed the answer
            assert not torch.allclose(out.float(), decode_torch(q, layer, meta, 32 ** -0.5).float(), atol=5e-2)


@pytest.mark.parametrize("mode,q_dtype", MODES, ids=IDS)
def test_attention_variants_match_reference(mode, q_dtype):
    """A packed batch (two decode rows, a whole prompt, a chunk after a cached prefix) through
    decode and prefill kernels, against the reference backend; windows shorter than a 16-query
    block leave a block's later rows with no key in its first key blocks."""
    page_size, q_lens, lens = 8, [1, 1, 19, 12], [9, 30, 19, 37]
    layer, q, meta = _case(PAGE_FORMATS[mode], 4, 2, 32, page_size, lens, q_lens, 11, q_dtype)
    q = (q.float() * 4).to(q_dtype)
    for window, softcap in VARIANTS:
        ref = TorchKernels().attention(q, layer, meta, 32 ** -0.5, sliding_window=window, softcap=softcap)
        _close(_attention_triton(q, layer, meta, 32 ** -0.5, window, softcap), ref, q_dtype)


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_recent_token_window_with_variants(mode):
    """A quantized format's recent-token window (8, from the store; NaN in the block no row owns)
    beside a sliding window that ends inside it, before it, or beyond the context, and a cap."""
    lens = [5, 9, 30, 16]
    fmt = kv_format(mode, window=8)
    layer, q, meta = _case(fmt, 4, 2, 32, 16, lens, [1] * len(lens), 7, torch.float32, window_slots=len(lens) + 1)
    g = torch.Generator().manual_seed(1)
    for t in layer.window_tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        t[len(lens)] = float("nan")
    q = q * 4
    for window, softcap in [(4, 0.0), (11, 0.0), (40, 0.0), (0, 2.0), (11, 2.0)]:
        ref = decode_torch(q, layer, meta, 32 ** -0.5, window, softcap)
        _close(triton_attention.decode_triton(q, layer, meta, 32 ** -0.5, window, softcap), ref, torch.float32)
        out = triton_attention.paged_decode_triton(q, layer, meta.page_table, meta.seq_lens_k, 32 ** -0.5,
                                                   window=(meta.window_slots, meta.window_starts), split_len=16,
                                                   sliding_window=window, softcap=softcap)
        _close(out, ref, torch.float32)


@pytest.mark.parametrize("mode,q_dtype", [("bf16", torch.bfloat16), ("q8", torch.float32)], ids=IDS)
def test_defaults_unchanged(mode, q_dtype):
    """The defaults are today's kernels (no window, no cap) and match the reference to today's
    tolerance; a window longer than every context, run by the windowed kernels, gives bit for bit
    the same answer (so the window's bounds and masks add nothing else)."""
    page_size, q_lens, lens = 8, [1, 1, 19, 12], [9, 30, 19, 37]
    layer, q, meta = _case(PAGE_FORMATS[mode], 4, 2, 32, page_size, lens, q_lens, 5, q_dtype)
    full = _attention_triton(q, layer, meta, 0.2, 0, 0.0)
    _close(full, TorchKernels().attention(q, layer, meta, 0.2), q_dtype)
    assert torch.equal(full, _attention_triton(q, layer, meta, 0.2, max(lens), 0.0))
    qa = rotate(q[:2], 32).to(q_dtype) if layer.fmt.rotate else q[:2]          # the decode rows
    decoded = triton_attention.decode_triton(qa, layer, meta, 0.2)
    assert torch.equal(decoded, triton_attention.decode_triton(qa, layer, meta, 0.2, max(lens), 0.0))


def test_windowed_row_does_not_depend_on_the_batch():
    """A windowed row's splits start at its own window: decoded beside a much longer row (more
    splits in the grid) it equals, bit for bit, the same row decoded alone."""
    layer, q, meta = _case(PAGE_FORMATS["fp16"], 4, 2, 32, 8, [37, 90], [1, 1], 4, torch.float16)
    args = dict(split_len=16, sliding_window=21, softcap=3.0)
    both = triton_attention.paged_decode_triton(q, layer, meta.page_table, meta.seq_lens_k, 0.2, **args)
    alone = triton_attention.paged_decode_triton(q[:1], layer, meta.page_table[:1], meta.seq_lens_k[:1], 0.2, **args)
    assert torch.equal(both[:1], alone)


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (2.5, 0.0), (True, 0.0), (0, -1.0), (0, float("nan")),
                                            (0, float("inf"))])
def test_bad_variant_arguments_refused(window, softcap):
    layer, q, meta = _case(PAGE_FORMATS["fp32"], 4, 2, 32, 8, [5, 9], [1, 1], 0, torch.float32)
    with pytest.raises(ValueError, match="sliding_window|softcap"):
        triton_attention.decode_triton(q, layer, meta, 0.2, window, softcap)
    with pytest.raises(ValueError, match="sliding_window|softcap"):
        triton_attention.paged_attention_triton(q, layer, meta, 0.2, window, softcap)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _TANH(tl.load(x_ptr + offs)))


_TANH = triton_attention.kernels().tanh


def test_tanh_within_a_few_ulp():
    """The kernels' tanh (plain arithmetic and exp, as the interpreter has no libdevice) against
    float64 tanh, in float32 ulps of the true value: torch.tanh is within 0.5, ours within 2 here
    (compiled, exp is ex2.approx: within 4)."""
    x = torch.cat([torch.linspace(-12, 12, 2 ** 15), torch.logspace(-7, 1, 2 ** 14), -torch.logspace(-7, 1, 2 ** 14),
                   torch.tensor([0.0, 0.55, -0.55, 0.5499999, 30.0, -30.0])])
    x = torch.nn.functional.pad(x, (0, -len(x) % 1024)).to(DEVICE)
    y = torch.empty_like(x)
    _tanh_kernel[(len(x) // 1024,)](x, y, BLOCK=1024)
    want = torch.tanh(x.double().cpu())
    ulp = torch.from_numpy(np.spacing(want.abs().float().numpy())).double()
    err = ((y.double().cpu() - want).abs() / ulp).max().item()
    assert err <= (2.0 if INTERPRET else 4.0), err


@pytest.mark.parametrize("mode,q_dtype", [("bf16", torch.bfloat16), ("q8", torch.float32)], ids=IDS)
def test_the_triton_plan_runs_variant_layers_on_triton(mode, q_dtype):
    """The TritonKernels plan of a model with sliding windows or soft-capping names the Triton
    kernels for those layers and its attention op (q rotated in and out for q8) gives the reference."""
    from evalrun.kernels.backend import PlanKey, TritonKernels
    page_size, q_lens, lens = 8, [1, 1, 19, 12], [9, 30, 19, 37]
    layer, q, meta = _case(PAGE_FORMATS[mode], 4, 2, 32, page_size, lens, q_lens, 5, q_dtype)
    key = PlanKey(DEVICE.type, q_dtype, layer.fmt, page_size, 4, 2, 32, variants=True)
    plan = TritonKernels().plan(key)
    assert plan.names["variant_decode_attention"] == plan.names["variant_prefill_attention"] == "triton"
    q = (q.float() * 4).to(q_dtype)
    for window, softcap in [(13, 0.0), (0, 2.0), (5, 30.0)]:
        ref = TorchKernels().attention(q, layer, meta, 32 ** -0.5, sliding_window=window, softcap=softcap)
        _close(plan.attention(q, layer, meta, 32 ** -0.5, None, None, window, softcap), ref, q_dtype)
