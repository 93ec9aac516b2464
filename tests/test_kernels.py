"""Paged attention and cache ops vs a dense, naive attention over contiguous K/V (float
formats; the quantized formats are checked in test_kv_quant.py)."""
from __future__ import annotations

import math

import pytest
import torch

from evalrun.kernels.attention import build_metadata
from evalrun.kernels.ref.attention import paged_attention_torch
from evalrun.kernels.backend import NativeCpuKernels, TorchKernels, choose_kernels
from evalrun.kernels.ref.cache_ops import copy_page_prefix, gather_kv, write_kv
from evalrun.kernels.kv_format import KV_FORMATS, LayerKV, kv_format

# page storage alone: the formats without their recent-token window (that: tests/test_kv_window.py)
PAGE_FORMATS = {m: kv_format(f, window=0) if f.quantized else f for m, f in KV_FORMATS.items()}

HQ, HKV, D = 6, 2, 16
CPU = torch.device("cpu")


def _naive(q, k, v, scale):
    """q [q, Hq, D], k/v [L, Hkv, D]: causal attention, queries are the last q positions."""
    qn, kn = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(kn - qn, kn)[:, None]
    scores = scores.masked_fill(torch.arange(kn)[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def _scatter(contexts, page_size, num_pages, g):
    """Place each context's K/V on random distinct pages of a NaN-filled fp32 cache."""
    layer = LayerKV.allocate(PAGE_FORMATS["fp32"], num_pages + 1, page_size, HKV, D, CPU)
    layer.k[:num_pages] = float("nan")
    layer.v[:num_pages] = float("nan")
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for k, v in contexts:
        n_pages = -(-k.shape[0] // page_size)
        pages, perm = perm[:n_pages], perm[n_pages:]
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(k.shape[0])])
        write_kv(k, v, layer, slots)
        tables.append(pages)
    return layer, tables


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_attention_matches_dense(page_size):
    g = torch.Generator().manual_seed(0)
    q_lens = [1, 1, 1, 7, 20, 33, 1]        # decode group first, then prefill chunks (and a 1-token chunk)
    k_lens = [1, 9, 40, 7, 45, 33, 5]
    contexts = [(torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)) for n in k_lens]
    layer, tables = _scatter(contexts, page_size, 64, g)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    meta = build_metadata(q_lens, k_lens, tables, page_size, null_page=64, device=CPU)
    assert meta.num_decode == 3
    out = paged_attention_torch(q, layer, meta, D ** -0.5)
    assert torch.isfinite(out).all()
    start = 0
    for (k, v), qn in zip(contexts, q_lens):
        ref = _naive(q[start:start + qn], k, v, D ** -0.5)
        torch.testing.assert_close(out[start:start + qn].double(), ref, atol=1e-5, rtol=1e-5)
        start += qn
    for kernels in (TorchKernels(), NativeCpuKernels(), choose_kernels("cpu")):   # every dispatch
        torch.testing.assert_close(kernels.attention(q, layer, meta, D ** -0.5), out, atol=2e-6, rtol=1e-5)


def test_metadata_layout_matches_flash_attn_conventions():
    meta = build_metadata([1, 3, 5], [10, 3, 8], [[2, 0], [1], [3, 4]], 8, null_page=9,
                          device=CPU)
    assert meta.cu_seqlens_q.tolist() == [0, 1, 4, 9]
    assert meta.cu_seqlens_k.tolist() == [0, 10, 13, 21]
    assert meta.page_table.dtype == torch.int32
    assert meta.page_table.tolist() == [[2, 0], [1, 9], [3, 4]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (5, 10)


def test_copy_page_prefix_copies_only_the_prefix():
    layers = [LayerKV(KV_FORMATS["fp32"], torch.randn(4, 8, HKV, D), torch.randn(4, 8, HKV, D))
              for _ in range(3)]
    before = [[t.clone() for t in layer.tensors()] for layer in layers]
    copy_page_prefix(layers, src_page=1, dst_page=3, num_tokens=5)
    for layer, old in zip(layers, before):
        for t, b in zip(layer.tensors(), old):
            torch.testing.assert_close(t[3, :5], b[1, :5])
            torch.testing.assert_close(t[3, 5:], b[3, 5:])
            torch.testing.assert_close(t[:3], b[:3])


@pytest.mark.parametrize("mode,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_write_kv_casts_to_storage_dtype(mode, dtype):
    layer = LayerKV.allocate(PAGE_FORMATS[mode], 3, 4, HKV, D, CPU)
    assert layer.k.dtype == layer.v.dtype == dtype and layer.k_scale is None
    k, v = torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    write_kv(k, v, layer, torch.tensor([5, 0]))
    torch.testing.assert_close(layer.k[1, 1], k[0].to(dtype))
    torch.testing.assert_close(layer.v[0, 0], v[1].to(dtype))
    gk, gv = gather_kv(layer, torch.tensor([5, 0]), torch.float32)       # [2, Hkv, D]
    torch.testing.assert_close(gk, k.to(dtype).float())
    torch.testing.assert_close(gv, v.to(dtype).float())


@pytest.mark.parametrize("rows", [1, 7, 32, 64, 65, 300, 2048])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_dispatch_matches_reference(rows, with_bias):
    from evalrun.kernels.linear import linear, linear_reference, make_linear
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    from evalrun.kernels.cpu import gemm
    lin = make_linear(w, b)
    if gemm.available():                                       # AVX2 + FMA and a C compiler here
        assert lin.panels is not None and lin.packed is None
    else:
        assert (lin.packed is not None) == torch.backends.mkldnn.is_available()   # torch's own build fact
    ref = linear_reference(x.double(), make_linear(w.double(), None if b is None else b.double(), pack=False))
    torch.testing.assert_close(linear(x, lin).double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x[:, :], make_linear(w, b, pack=False)).double(), ref, rtol=1e-5, atol=1e-4)
    bf = make_linear(w.bfloat16(), None if b is None else b.bfloat16())
    from evalrun.kernels.linear import linear_backend
    # bf16: the bf16 GEMM's panels where the CPU has vdpbf16ps, else torch's unpacked weight
    assert bf.packed is None and (bf.panels is not None) == (linear_backend("cpu", torch.bfloat16) == "native-bf16")
    assert bf.kernel_name == linear_backend("cpu", torch.bfloat16)
    torch.testing.assert_close(linear(x.bfloat16(), bf).double(), ref, rtol=3e-2, atol=0.3)


@pytest.mark.parametrize("env", ["onednn", "torch"])
def test_linear_without_onednn_falls_back_unpacked(monkeypatch, env):
    """Asked for oneDNN (or torch) where torch reports no oneDNN (mkldnn): nothing is prepacked and
    the result is the reference's."""
    from evalrun.kernels.linear import linear, linear_backend, linear_reference, make_linear
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setenv("EVALRUN_LINEAR", env)
    assert linear_backend("cpu", torch.float32) == "torch"
    gen = torch.Generator().manual_seed(7)
    w, b, x, r = (torch.randn(*shape, generator=gen) for shape in ((96, 80), (96,), (33, 80), (33, 96)))
    lin = make_linear(w, b)
    assert lin.packed is None and lin.panels is None
    ref = linear_reference(x.double(), make_linear(w.double(), b.double(), pack=False), residual=r.double())
    torch.testing.assert_close(linear(x, lin, residual=r).double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 32, 65, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_with_residual_matches_reference(rows, with_bias, monkeypatch):
    """residual + x @ w^T (+ b): the native GEMM, the oneDNN fused post-op, the small-row and F.linear paths."""
    from evalrun.kernels.linear import linear, linear_reference, make_linear
    gen = torch.Generator().manual_seed(100 + rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    r = torch.randn(rows, 96, generator=gen)
    r_before = r.clone()
    ref = linear_reference(x.double(), make_linear(w.double(), None if b is None else b.double(), pack=False),
                           residual=r.double())
    lins = [make_linear(w, b), make_linear(w, b, pack=False)]
    if torch.backends.mkldnn.is_available():
        monkeypatch.setenv("EVALRUN_LINEAR", "onednn")
        lins.append(make_linear(w, b))
        assert lins[-1].packed is not None
    for lin in lins:
        out = linear(x, lin, residual=r)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
        assert torch.equal(r, r_before)                      # the residual is not written to
