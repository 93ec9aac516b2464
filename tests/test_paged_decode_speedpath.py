"""The native decode kernel's float-page path (evalrun/kernels/cpu/csrc/paged_decode.c): on AVX-512
hosts float32/bf16/fp16 pages without a window, head sizes a multiple of 16 up to 128, take the
16-lane tiles (bf16 rows read in even/odd column order, 4-head tiles, keys in blocks of 16 with
a masked tail); elsewhere the AVX2 tiles. Checked against the torch reference on head sizes,
group sizes, page sizes and context lengths that hit every tile and tail, and for bitwise
invariance under batch composition and thread count."""
from __future__ import annotations

import pytest
import torch

from evalrun.kernels.attention import build_metadata
from evalrun.kernels.cpu import native, paged_decode
from evalrun.kernels.kv_format import LayerKV, kv_format
from evalrun.kernels.ref.attention import decode_torch
from evalrun.kernels.ref.cache_ops import write_kv_torch


def _need_native():
    if native.load("paged_decode") is None:
        pytest.skip("the native decode kernel is not built here (no compiler or EVALRUN_NATIVE=0)")


def _case(mode, hq, hkv, d, page_size, lens, seed):
    """q [B, Hq, D] and a `mode` cache holding each sequence on shuffled pages, every other slot
    NaN, with its metadata."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 2
    layer = LayerKV.allocate(kv_format(mode), num_pages + 1, page_size, hkv, d, torch.device("cpu"))
    for t in layer.data_tensors():
        t[:num_pages] = float("nan")          # the last page is the null page: zeros
    perm, tables = torch.randperm(num_pages, generator=g).tolist(), []
    for n, k in zip(lens, need):
        pages, perm = perm[:k], perm[k:]
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        write_kv_torch(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), layer, slots)
        tables.append(pages)
    meta = build_metadata([1] * len(lens), lens, tables, page_size, num_pages, torch.device("cpu"))
    return torch.randn(len(lens), hq, d, generator=g), layer, meta


SHAPES = [(9, 3, 64), (5, 1, 48), (8, 2, 128), (4, 4, 16), (10, 2, 80), (7, 1, 32), (12, 3, 112)]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("page_size", [5, 16, 256])
def test_float_pages_match_the_reference(mode, hq, hkv, d, page_size):
    """Lengths around the 16-key blocks and the 4-key tiles, within and across pages; query
    groups of 1-6 heads (4-head tiles plus a remainder); head sizes with and without a last
    16 columns outside the bf16 pairs of 32."""
    _need_native()
    lens = [1, 3, 15, 16, 17, 33, 130, 2 * page_size + 3]
    q, layer, meta = _case(mode, hq, hkv, d, page_size, lens, seed=hq * d + page_size)
    out = paged_decode.paged_decode_native(q, layer, meta.page_table, meta.seq_lens_k, d ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_torch(q, layer, meta, d ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_rows_are_bitwise_invariant_to_batch_and_threads(monkeypatch, mode):
    """Each row alone on one thread gives the bits it gives among 31 others on two (the
    SmolLM2 decode shape: 9/3 heads of 64, pages of 256)."""
    _need_native()
    lens = [100 + (i * 37) % 160 for i in range(32)]
    q, layer, meta = _case(mode, 9, 3, 64, 256, lens, seed=7)
    monkeypatch.setattr(paged_decode, "num_threads", lambda *args: 2)
    full = paged_decode.paged_decode_native(q, layer, meta.page_table, meta.seq_lens_k, 0.125)
    monkeypatch.setattr(paged_decode, "num_threads", lambda *args: 1)
    for b in (0, 5, 31):
        one = paged_decode.paged_decode_native(q[b:b + 1], layer, meta.page_table[b:b + 1],
                                               meta.seq_lens_k[b:b + 1], 0.125)
        assert torch.equal(one, full[b:b + 1])


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (10, 2, 80), (4, 4, 16)])
def test_bf16_pages_score_q_rounded_to_bf16(hq, hkv, d):
    """Keys in bfloat16 are scored against q rounded to bfloat16 (kernels/ref/attention.py
    scoring_query): a float32 q gives bitwise the output of that q rounded first, on whichever tile
    path this CPU takes (vdpbf16ps with AVX512_BF16), and an fp32-page cache does not round."""
    _need_native()
    lens = [1, 17, 130, 300]
    q, layer, meta = _case("bf16", hq, hkv, d, 16, lens, seed=d)
    q = q * 1.2345                                            # not bfloat16 values
    rounded = q.bfloat16().float()
    assert not torch.equal(q, rounded)
    out = paged_decode.paged_decode_native(q, layer, meta.page_table, meta.seq_lens_k, d ** -0.5)
    assert torch.equal(out, paged_decode.paged_decode_native(rounded, layer, meta.page_table, meta.seq_lens_k, d ** -0.5))
    q32, layer32, meta32 = _case("fp32", hq, hkv, d, 16, lens, seed=d)
    q32 = q32 * 1.2345
    assert not torch.equal(paged_decode.paged_decode_native(q32, layer32, meta32.page_table, meta32.seq_lens_k, 0.125),
                           paged_decode.paged_decode_native(q32.bfloat16().float(), layer32, meta32.page_table,
                                                            meta32.seq_lens_k, 0.125))
