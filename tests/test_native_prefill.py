"""The native paged prefill attention kernel (evalrun/kernels/cpu/csrc/paged_prefill.c) against the torch
reference (SDPA on the gathered context), for every format without a recent-token window, and its
invariance: a token's output is bitwise the same however its sequence is chunked or batched."""
from __future__ import annotations

import pytest
import torch

from evalrun.kernels.cpu import paged_prefill
from evalrun.kernels.attention import build_metadata
from evalrun.kernels.ref.attention import attend, paged_attention_torch
from evalrun.kernels.backend import NativeCpuKernels
from evalrun.kernels.kv_format import KV_FORMATS
from tests.test_native_kernels import _machine_has_cc, _paged_case


def _need_native():
    if not _machine_has_cc():
        pytest.skip("no C compiler on this machine: prefill runs on SDPA")
    if not paged_prefill.available():
        from evalrun.kernels.cpu.host import cpu_flags
        assert not {"avx2", "fma"} <= (cpu_flags() or frozenset()), "the CPU has AVX2 and FMA but the prefill kernel did not build"
        pytest.skip("the prefill kernel needs AVX2 and FMA, which this CPU lacks")


def _native(q, layer, meta, scale):
    """The kernel as the model calls it: through attend, rotated in and out for rotating formats."""
    return attend(q, layer, meta, scale, prefill=paged_prefill.prefill_native)


SHAPES = [(9, 3, 64, 256), (4, 2, 32, 16), (8, 8, 16, 4), (4, 1, 128, 16), (6, 3, 48, 8)]
CASES = [(mode, *shape) for mode, f in KV_FORMATS.items() for shape in SHAPES
         if not f.quantized or shape[2] % f.group_size == 0]


@pytest.mark.parametrize("mode,hq,hkv,d,page_size", CASES)
def test_native_prefill_matches_torch_reference(mode, hq, hkv, d, page_size):
    """Fresh prompts (q_len == length), prompts after a cached prefix, one-token chunks, and
    chunks crossing pages and the kernel's 16-position tiles."""
    _need_native()
    lens = [5, 40, 300, 17, 64, 33]
    q_lens = [5, 3, 130, 1, 64, 17]
    q, layer, meta = _paged_case(hq, hkv, d, page_size, lens, mode, seed=hq * d + page_size, q_lens=q_lens)
    assert meta.num_decode == 0
    ref = paged_attention_torch(q, layer, meta, d ** -0.5)
    assert torch.isfinite(ref).all()
    out = _native(q, layer, meta, d ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-6 if not layer.fmt.quantized else 1e-5, rtol=1e-5)
    torch.testing.assert_close(NativeCpuKernels().attention(q, layer, meta, d ** -0.5), out, atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["fp32", "q8", "q4"])
def test_native_prefill_softmax_over_a_wide_score_range(mode):
    _need_native()
    q, layer, meta = _paged_case(9, 3, 64, 16, [7, 40, 300], mode, seed=11, q_lens=[7, 20, 100])
    q = q * 40.0                                                    # scores spread over hundreds
    ref = paged_attention_torch(q, layer, meta, 0.125)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(_native(q, layer, meta, 0.125), ref, atol=1e-5, rtol=1e-5)


def _whole(q, layer, meta, b):
    """Sequence b's rows of q and its page table row, length and query count."""
    cu = meta.cu_seqlens_q.long()
    return (q[int(cu[b]):int(cu[b + 1])], meta.page_table[b:b + 1], meta.seq_lens_k[b:b + 1],
            cu[b + 1:b + 2] - cu[b:b + 1])


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (17, 0.0), (9, 3.0), (0, 3.0)])
@pytest.mark.parametrize("mode,threads", [("fp32", 1), ("fp32", 2), ("bf16", 2), ("bf16", 3), ("q8", 2)])
def test_native_prefill_is_chunk_and_batch_invariant(mode, threads, window, softcap):
    """Each sequence's outputs, bitwise: alone, among the others, split into chunks of 1, 7 and 16
    positions (each chunk attending the positions before it, as chunked prefill runs), and at one
    to three threads (each thread reuses the K/V rows it converted for its previous task of the same
    head, and takes tasks from the others' ranges when its own are done); with a sliding window
    and soft-capping too (a windowed task converts no key before its window)."""
    _need_native()
    lens = [300, 45, 130, 17, 64]
    q, layer, meta = _paged_case(9, 3, 64, 16, lens, mode, seed=5, q_lens=[300, 20, 130, 17, 40])
    for t in layer.data_tensors():
        t.nan_to_num_(0.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        full = paged_prefill.paged_prefill_native(q, layer, meta.page_table, meta.seq_lens_k,
                                                  meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1], 0.125,
                                                  window, softcap)
    finally:
        torch.set_num_threads(before)
    if not layer.fmt.rotate:                                  # rotating formats: through attend (the test above)
        torch.testing.assert_close(full, attend(q, layer, meta, 0.125, sliding_window=window, softcap=softcap),
                                   atol=2e-6, rtol=1e-5)
    cu = meta.cu_seqlens_q.long()
    for b in range(len(lens)):
        qb, table, length, n = _whole(q, layer, meta, b)
        alone = paged_prefill.paged_prefill_native(qb, layer, table, length, n, 0.125, window, softcap)
        assert torch.equal(alone, full[int(cu[b]):int(cu[b + 1])])
        start = int(length) - int(n)
        for chunk in (1, 7, 16):
            parts = []
            for i in range(0, int(n), chunk):
                m = min(chunk, int(n) - i)
                parts.append(paged_prefill.paged_prefill_native(
                    qb[i:i + m], layer, table, torch.tensor([start + i + m], dtype=torch.int32),
                    torch.tensor([m]), 0.125, window, softcap))
            assert torch.equal(torch.cat(parts), alone), (b, chunk)


def test_unsupported_layouts_fall_back_to_sdpa():
    """A head size the kernel cannot take, or a format with a recent-token window, is not
    supported: the backend answers through SDPA, the kernel's checked entry raises."""
    _need_native()
    q, layer, meta = _paged_case(4, 2, 24, 8, [9, 30], "fp32", seed=2, q_lens=[9, 4])
    assert not paged_prefill.supported(q, layer)
    ref = paged_attention_torch(q, layer, meta, 0.2)
    torch.testing.assert_close(NativeCpuKernels().attention(q, layer, meta, 0.2), ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cannot take"):
        paged_prefill.paged_prefill_native(q, layer, meta.page_table, meta.seq_lens_k, torch.tensor([9, 4]), 0.2)


def test_bad_query_counts_raise_before_the_kernel_reads():
    _need_native()
    q, layer, meta = _paged_case(4, 2, 32, 8, [9, 30], "fp32", seed=2, q_lens=[9, 4])
    table, lens = meta.page_table, meta.seq_lens_k
    for q_lens, match in (([0, 13], "q_len"), ([9, 31], "q_len"), ([9, 3], "rows"), ([9], "match")):
        with pytest.raises(ValueError, match=match):
            paged_prefill.paged_prefill_native(q, layer, table, lens, torch.tensor(q_lens), 0.2)
    with pytest.raises(ValueError, match="lengths"):
        paged_prefill.paged_prefill_native(q, layer, table, torch.tensor([9, 10_000], dtype=torch.int32),
                                           torch.tensor([9, 4]), 0.2)
    bad_table = table.clone()
    bad_table[1, 0] = layer.k.shape[0] + 5
    with pytest.raises(ValueError, match="page ids"):
        paged_prefill.paged_prefill_native(q, layer, bad_table, lens, torch.tensor([9, 4]), 0.2)


def test_metadata_prefill_rows_follow_the_decode_group():
    """prefill_native takes the batch's q and returns the rows after the decode group."""
    _need_native()
    q, layer, meta = _paged_case(6, 2, 32, 8, [3, 20, 9, 30], "fp32", seed=3, q_lens=[1, 1, 9, 4])
    out = paged_prefill.prefill_native(q, layer, meta, 0.2)
    assert out.shape == (13, 6, 32)
    seqs = meta.kernel_args["paged_prefill"]                 # derived once, for every layer
    assert seqs.q_lens.tolist() == [9, 4] and seqs.q_starts.tolist() == [0, 9] and seqs.lmax == 30
    assert torch.equal(paged_prefill.prefill_native(q, layer, meta, 0.2), out)
    assert meta.kernel_args["paged_prefill"] is seqs
    torch.testing.assert_close(out, paged_attention_torch(q, layer, meta, 0.2)[2:], atol=2e-6, rtol=1e-5)
    only = build_metadata([9, 4], [9, 30], [meta.page_table[2].tolist(), meta.page_table[3].tolist()],
                          8, layer.k.shape[0] - 1, torch.device("cpu"))
    assert torch.equal(paged_prefill.prefill_native(q[2:], layer, only, 0.2), out)


def test_prefill_writes_into_the_callers_rows_when_it_can():
    """out= (the batch output's rows after the decode group): float32 rows of the right shape are
    written in place and returned, bitwise the result of a fresh tensor; anything else (a strided
    view, another dtype, a wrong shape) is left untouched and a new tensor is returned."""
    _need_native()
    q, layer, meta = _paged_case(6, 2, 32, 8, [3, 20, 9, 30], "fp32", seed=5, q_lens=[1, 1, 9, 4])
    fresh = paged_prefill.prefill_native(q, layer, meta, 0.2)
    batch = torch.full((15, 6, 32), float("nan"))
    rows = batch[2:]
    got = paged_prefill.prefill_native(q, layer, meta, 0.2, out=rows)
    assert got.data_ptr() == rows.data_ptr() and torch.equal(batch[2:], fresh)
    assert batch[:2].isnan().all()                           # the decode rows are not touched
    for bad in (torch.full((32, 6, 13), float("nan")).transpose(0, 2), torch.zeros(13, 6, 32, dtype=torch.float64),
                torch.zeros(12, 6, 32)):
        before = bad.clone()
        got = paged_prefill.prefill_native(q, layer, meta, 0.2, out=bad)
        assert got.data_ptr() != bad.data_ptr() and torch.equal(got, fresh)
        assert torch.equal(bad.nan_to_num(), before.nan_to_num())
    # attend() with both groups: the same as the torch reference, through the in-place path
    torch.testing.assert_close(attend(q, layer, meta, 0.2, prefill=paged_prefill.prefill_native),
                               paged_attention_torch(q, layer, meta, 0.2), atol=2e-6, rtol=1e-5)


def test_many_query_heads_per_kv_head():
    """72 query heads on one KV head (Falcon-7B has 71): more rows per task than any fixed bound."""
    _need_native()
    q, layer, meta = _paged_case(72, 1, 16, 8, [9, 40], "fp32", seed=4, q_lens=[9, 23])
    assert paged_prefill.supported(q, layer)
    torch.testing.assert_close(NativeCpuKernels().attention(q, layer, meta, 0.25),
                               paged_attention_torch(q, layer, meta, 0.25), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_value_reaches_only_the_rows_that_see_it(bad):
    """A token whose value row is not finite (an fp16 overflow, say) poisons the rows at and after
    its position; the rows before it stay finite and bitwise the same however the prompt is
    chunked (SDPA on the gathered context poisons every row)."""
    _need_native()
    q, layer, meta = _paged_case(9, 3, 64, 16, [40], "fp16", seed=9, q_lens=[40])
    table, lens = meta.page_table, meta.seq_lens_k
    at = 37                                                       # the poisoned position
    layer.v.view(-1, *layer.v.shape[2:])[int(table[0, at // 16]) * 16 + at % 16, 1] = bad
    whole = paged_prefill.paged_prefill_native(q, layer, table, lens, torch.tensor([40]), 0.125)
    assert torch.isfinite(whole[:at]).all() and not torch.isfinite(whole[at:, 3:6]).any()
    parts = [paged_prefill.paged_prefill_native(q[i:i + 1], layer, table, torch.tensor([i + 1], dtype=torch.int32),
                                                torch.tensor([1]), 0.125) for i in range(40)]
    assert torch.equal(torch.cat(parts)[:at], whole[:at])


@pytest.mark.parametrize("mode,rounds", [("bf16", True), ("fp32", False), ("fp16", False)])
def test_prefill_scores_q_rounded_to_bf16_on_bf16_pages(mode, rounds):
    """Keys in bfloat16 are scored against q rounded to bfloat16, as in the decode kernel and the
    reference (scoring_query): a float32 q gives bitwise the output of that q rounded first; other
    page kinds keep q as it is."""
    _need_native()
    lens = [40, 130]
    q, layer, meta = _paged_case(9, 3, 64, 16, lens, mode, seed=11, q_lens=[40, 20])
    for t in layer.data_tensors():
        t.nan_to_num_(0.0)
    q = q * 1.2345
    n = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]

    def run(x):
        return paged_prefill.paged_prefill_native(x, layer, meta.page_table, meta.seq_lens_k, n, 0.125)
    assert torch.equal(run(q), run(q.bfloat16().float())) == rounds
