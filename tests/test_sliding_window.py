"""Attention variants of model families: sliding windows (the query at position t attends keys
t - W < p <= t) and soft-capping (each scaled score s becomes c tanh(s / c), Gemma 2). The torch
reference against a plain dense float64 computation on the gathered context, the native CPU decode
kernel against the reference for every cache format, and the prefill reference (SDPA with the
window's mask, or the capped scores written out) against the same dense computation."""
from __future__ import annotations

import pytest
import torch

from evalrun.kernels.attention import build_metadata
from evalrun.kernels.backend import NativeCpuKernels, TorchKernels
from evalrun.kernels.cpu import paged_decode
from evalrun.kernels.kv_format import KV_FORMATS
from evalrun.kernels.ref.attention import decode_torch, scoring_query
from evalrun.kernels.ref.cache_ops import gather_kv
from evalrun.kernels.ref.kv_quant import rotate
from tests.test_native_kernels import _need_native, _paged_case


def dense_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], window: int,
                 scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q [n, Hq, D] at positions q_pos over k, v [L, Hkv, D]: float64 softmax over each query's
    keys max(0, t - W + 1) .. t (all keys up to t without a window), scores capped if softcap."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, t in enumerate(q_pos):
        lo = max(0, t - window + 1) if window else 0
        kk = k[lo: t + 1].double().repeat_interleave(hq // hkv, dim=1)        # [n_keys, Hq, D]
        vv = v[lo: t + 1].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,phd->hp", q[i].double(), kk).mul(scale)
        w = (torch.tanh(s / softcap) * softcap if softcap else s).softmax(-1)
        out[i] = torch.einsum("hp,phd->hd", w, vv)
    return out


FLOAT_MODES = [m for m, f in KV_FORMATS.items() if not f.quantized]


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("mode", FLOAT_MODES)
def test_decode_reference_is_the_dense_window(mode, window):
    page_size, lens = 16, [1, 5, 16, 17, 39, 70]
    q, layer, meta = _paged_case(6, 2, 32, page_size, lens, mode, seed=window)
    scale = 32 ** -0.5
    got = decode_torch(q, layer, meta, scale, window)
    for b, n in enumerate(lens):
        slots = torch.tensor([meta.page_table[b, p // page_size] * page_size + p % page_size for p in range(n)])
        k, v = gather_kv(layer, slots, torch.float32)
        want = dense_window(scoring_query(q[b: b + 1], layer), k, v, [n - 1], window, scale)
        torch.testing.assert_close(got[b: b + 1].double(), want, atol=2e-6, rtol=1e-5)
    if window < max(lens):               # the window changes the result where a context outgrows it
        assert not torch.allclose(got, decode_torch(q, layer, meta, scale), atol=1e-3)


@pytest.mark.parametrize("window", [1, 7, 16, 33])
@pytest.mark.parametrize("mode", list(KV_FORMATS))
@pytest.mark.parametrize("hq,hkv,d,page_size", [(9, 3, 64, 16), (4, 2, 32, 8), (8, 8, 32, 256)])
def test_native_decode_with_window_matches_reference(mode, window, hq, hkv, d, page_size):
    """Every format (the AVX-512 float path and the generic one, codes too), windows within a page,
    across pages and longer than some contexts."""
    _need_native()
    if KV_FORMATS[mode].quantized and d % KV_FORMATS[mode].group_size:
        pytest.skip("head size not a multiple of the format's group")
    lens = [1, 6, page_size, page_size + 3, 45, 90]
    q, layer, meta = _paged_case(hq, hkv, d, page_size, lens, mode, seed=window + d)
    qa = rotate(q, layer.fmt.group_size).to(q.dtype) if layer.fmt.rotate else q
    scale = d ** -0.5
    tol = {"atol": 2e-6, "rtol": 1e-5} if not layer.fmt.quantized else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(paged_decode.decode_native(qa, layer, meta, scale, window),
                               decode_torch(qa, layer, meta, scale, window), **tol)
    torch.testing.assert_close(NativeCpuKernels().attention(q, layer, meta, scale, sliding_window=window),
                               TorchKernels().attention(q, layer, meta, scale, sliding_window=window), **tol)


def test_native_decode_refuses_a_negative_window():
    _need_native()
    q, layer, meta = _paged_case(4, 2, 32, 16, [5, 9], "fp32", seed=1)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode.paged_decode_native(q, layer, meta.page_table, meta.seq_lens_k, 0.2, sliding_window=-1)


@pytest.mark.parametrize("window", [3, 16, 50])
def test_prefill_reference_is_the_dense_window(window):
    """Prefill chunks after a cached prefix (queries are a context's last tokens) and whole prompts."""
    page_size, lens, q_lens = 16, [30, 64, 9], [30, 20, 4]
    q, layer, meta = _paged_case(4, 2, 32, page_size, lens, "fp32", seed=window, q_lens=q_lens)
    scale = 32 ** -0.5
    got = TorchKernels().attention(q, layer, meta, scale, sliding_window=window)
    start = 0
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        slots = torch.tensor([meta.page_table[b, p // page_size] * page_size + p % page_size for p in range(n)])
        k, v = gather_kv(layer, slots, torch.float32)
        want = dense_window(q[start: start + m], k, v, list(range(n - m, n)), window, scale)
        torch.testing.assert_close(got[start: start + m].double(), want, atol=2e-6, rtol=1e-5)
        start += m


def test_metadata_mask_is_made_once_per_forward():
    """Every windowed layer of a forward reads one mask per sequence (kept in the metadata)."""
    q, layer, meta = _paged_case(4, 2, 32, 16, [40], "fp32", seed=2, q_lens=[40])
    meta = build_metadata([40], [40], [meta.page_table[0].tolist()], 16, meta.null_page, torch.device("cpu"))
    TorchKernels().attention(q, layer, meta, 0.2, sliding_window=8)
    masks = [v for k, v in meta.kernel_args.items() if k[0] == "sliding_mask"]
    TorchKernels().attention(q, layer, meta, 0.2, sliding_window=8)
    assert len(masks) == 1 and [v for k, v in meta.kernel_args.items() if k[0] == "sliding_mask"][0] is masks[0]


@pytest.mark.parametrize("softcap", [0.5, 2.0, 50.0])
@pytest.mark.parametrize("window", [0, 9])
def test_softcap_decode_reference_is_dense(softcap, window):
    page_size, lens = 16, [1, 5, 17, 39]
    q, layer, meta = _paged_case(6, 2, 32, page_size, lens, "fp32", seed=int(softcap * 10) + window)
    q = q * 4                                             # scores large enough for the cap to bite
    got = decode_torch(q, layer, meta, 0.2, window, softcap)
    for b, n in enumerate(lens):
        slots = torch.tensor([meta.page_table[b, p // page_size] * page_size + p % page_size for p in range(n)])
        k, v = gather_kv(layer, slots, torch.float32)
        want = dense_window(q[b: b + 1], k, v, [n - 1], window, 0.2, softcap)
        torch.testing.assert_close(got[b: b + 1].double(), want, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(got, decode_torch(q, layer, meta, 0.2, window), atol=1e-3)


@pytest.mark.parametrize("softcap", [1.0, 30.0])
@pytest.mark.parametrize("mode", list(KV_FORMATS))
def test_native_decode_softcap_matches_reference(mode, softcap):
    _need_native()
    lens = [1, 6, 16, 19, 45]
    q, layer, meta = _paged_case(8, 2, 32, 16, lens, mode, seed=int(softcap))
    q = q * 4
    qa = rotate(q, layer.fmt.group_size).to(q.dtype) if layer.fmt.rotate else q
    tol = {"atol": 2e-6, "rtol": 1e-5} if not layer.fmt.quantized else {"atol": 1e-5, "rtol": 1e-5}
    for window in (0, 7):
        torch.testing.assert_close(paged_decode.decode_native(qa, layer, meta, 0.2, window, softcap),
                                   decode_torch(qa, layer, meta, 0.2, window, softcap), **tol)


@pytest.mark.parametrize("softcap,window", [(1.0, 0), (5.0, 12)])
def test_softcap_prefill_reference_is_dense(softcap, window):
    page_size, lens, q_lens = 16, [30, 64], [30, 20]
    q, layer, meta = _paged_case(4, 2, 32, page_size, lens, "fp32", seed=7, q_lens=q_lens)
    q = q * 4
    got = TorchKernels().attention(q, layer, meta, 0.2, sliding_window=window, softcap=softcap)
    start = 0
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        slots = torch.tensor([meta.page_table[b, p // page_size] * page_size + p % page_size for p in range(n)])
        k, v = gather_kv(layer, slots, torch.float32)
        want = dense_window(q[start: start + m], k, v, list(range(n - m, n)), window, 0.2, softcap)
        torch.testing.assert_close(got[start: start + m].double(), want, atol=2e-6, rtol=1e-5)
        start += m


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (5, 0.0), (16, 0.0), (40, 0.0), (0, 2.0), (9, 30.0)])
@pytest.mark.parametrize("mode", list(KV_FORMATS))
def test_native_prefill_variants_match_reference(mode, window, softcap):
    """The native prefill kernel with a window and/or soft-capping against the reference: whole
    prompts and chunks after a cached prefix, tasks of several query positions (16 per task)
    whose rows see different key ranges, GQA groups."""
    from evalrun.kernels.cpu import paged_prefill
    from evalrun.kernels.ref.attention import attend
    _need_native()
    if not paged_prefill.available():
        pytest.skip("the prefill kernel needs AVX2 and FMA")
    if KV_FORMATS[mode].quantized and 32 % KV_FORMATS[mode].group_size:
        pytest.skip("head size not a multiple of the format's group")
    lens, q_lens = [30, 70, 9, 45], [30, 40, 9, 1]
    q, layer, meta = _paged_case(6, 2, 32, 16, lens, mode, seed=window + int(softcap), q_lens=q_lens)
    q = q * 3
    qa = rotate(q, layer.fmt.group_size).to(q.dtype) if layer.fmt.rotate else q
    tol = {"atol": 2e-6, "rtol": 1e-5} if not layer.fmt.quantized else {"atol": 1e-5, "rtol": 1e-5}
    got = attend(qa, layer, meta, 0.2, paged_decode.decode_native, prefill=paged_prefill.prefill_native,
                 sliding_window=window, softcap=softcap)
    want = attend(qa, layer, meta, 0.2, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(NativeCpuKernels().attention(q, layer, meta, 0.2, sliding_window=window, softcap=softcap),
                               TorchKernels().attention(q, layer, meta, 0.2, sliding_window=window, softcap=softcap),
                               **tol)
