"""Native fused RMSNorm and SiLU*up (evalrun/kernels/cpu/fused.py) against their torch references, and
bitwise batch invariance (a row's result alone equals the same row among many)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from evalrun.kernels.cpu import fused
from evalrun.kernels.ref import fused as ref_fused
from evalrun.kernels.backend import NativeCpuKernels, PlanKey, TorchKernels
from evalrun.kernels.kv_format import KV_FORMATS


def _need_native() -> None:
    if not fused.available():
        pytest.skip("no C compiler: the native fused ops are off (evalrun/kernels/cpu/native.py)")


@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 13), (32, 576), (300, 576), (2048, 64), (3, 8)])
def test_rms_norm_matches_torch(rows, hidden):
    _need_native()
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g) * 4
    w = torch.randn(hidden, generator=g)
    torch.testing.assert_close(fused.rms_norm_native(x, w, 1e-5), ref_fused.rms_norm_reference(x, w, 1e-5),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 13), (40, 2100), (300, 1024)])
def test_rms_norm_to_bf16_is_the_float32_norm_rounded(rows, hidden):
    """out_dtype bfloat16 (the rows the bf16 GEMM reads): bitwise the float32 norm rounded as torch
    rounds, over rows longer than its staging chunk, odd widths and values down to the subnormals."""
    _need_native()
    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=g) * 4
    w = torch.randn(hidden, generator=g)
    w[: hidden // 3] *= 1e-38                                   # products in the float32 subnormal range
    y = fused.rms_norm_native(x, w, 1e-5, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y.view(torch.int16), fused.rms_norm_native(x, w, 1e-5).to(torch.bfloat16).view(torch.int16))
    with pytest.raises(ValueError, match="to float32 or bfloat16"):
        fused.rms_norm_native(x, w, 1e-5, torch.float16)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 11), (32, 1536), (300, 64), (2048, 96)])
def test_silu_mul_matches_torch(rows, inter):
    _need_native()
    gu = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows + inter)) * 8
    gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])       # zero, both saturations
    torch.testing.assert_close(fused.silu_mul_native(gu), ref_fused.silu_mul_reference(gu), atol=1e-5, rtol=1e-5)


def test_rows_are_batch_invariant():
    _need_native()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(512, 576, generator=g), torch.randn(576, generator=g)
    gu = torch.randn(512, 3072, generator=g)
    full_n, full_s = fused.rms_norm_native(x, w, 1e-5), fused.silu_mul_native(gu)   # several threads
    for n in (1, 8, 64):
        assert torch.equal(fused.rms_norm_native(x[:n], w, 1e-5), full_n[:n])
        assert torch.equal(fused.silu_mul_native(gu[:n]), full_s[:n])
        assert torch.equal(fused.rms_norm_native(x[-n:], w, 1e-5), full_n[-n:])


def test_plans_route_norms_by_dtype():
    """The plan of a bf16 model on the bf16 GEMM keeps float32 rows and runs the native RMSNorm on
    them (with its bf16 weights widened); a bf16 model on torch's linears (no vdpbf16ps) and a
    float16 model run the reference RMSNorm on their rows (the native one takes float32 rows
    only), the native one on the head's float32 rows; a float32 model both natively."""
    _need_native()
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    key = PlanKey("cpu", torch.bfloat16, KV_FORMATS["bf16"], 16, 2, 1, 16)
    plan = NativeCpuKernels().plan(key)
    assert plan.head_norm is fused.rms_norm_native and plan.names["head_norm"] == "native-c"
    if key.linear == "native-bf16":
        assert plan.stream_dtype == torch.float32 and plan.names["norm_act"] == "native-c"
        assert torch.equal(plan.rms_norm(x.float(), w, 1e-6), fused.rms_norm_native(x.float(), w.float(), 1e-6))
    else:
        assert plan.rms_norm is ref_fused.rms_norm_reference and plan.names["norm_act"] == "torch"
    fp16_key = dataclasses.replace(key, dtype=torch.float16, fmt=KV_FORMATS["fp16"])
    fp16 = NativeCpuKernels().plan(fp16_key)
    assert fp16.rms_norm is ref_fused.rms_norm_reference and fp16.names["norm_act"] == "torch"
    assert torch.equal(fp16.rms_norm(x.half(), w.half(), 1e-6), TorchKernels().plan(fp16_key).rms_norm(x.half(), w.half(), 1e-6))
    f32 = NativeCpuKernels().plan(dataclasses.replace(key, dtype=torch.float32, fmt=KV_FORMATS["fp32"]))
    assert f32.rms_norm is fused.rms_norm_native and f32.names["norm_act"] == "native-c"
    with pytest.raises(ValueError, match="float32 CPU rows"):
        fused.rms_norm_native(x, w, 1e-6)


def _rope_case(t: int, hq: int, hkv: int, d: int, seed: int):
    from evalrun.engine.rope import rope_table
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    cos, sin = rope_table(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 4096)
    pos = torch.randint(0, 4096, (t,), generator=g)
    pages, size = 6, 16
    k_cache = torch.full((pages + 1, size, hkv, d), float("nan"))
    slots = torch.randperm(pages * size, generator=g)[:t]
    return qkv, cos[pos], sin[pos], k_cache, slots


@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (7, 4, 4, 32), (40, 8, 2, 16)])
def test_rope_write_matches_the_reference(t, hq, hkv, d):
    _need_native()
    qkv, cos, sin, k_ref, slots = _rope_case(t, hq, hkv, d, seed=t + hq)
    v_ref, k_nat, v_nat = k_ref.clone(), k_ref.clone(), k_ref.clone()

    def write(k, v):
        k_ref.view(-1, hkv, d)[slots] = k
        v_ref.view(-1, hkv, d)[slots] = v

    q_ref, _, _ = ref_fused.rope_write_reference(qkv, cos, sin, hq, hkv, write)
    q = fused.rope_write_native(qkv, cos, sin, hq, hkv, k_nat, v_nat, slots)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_nat, k_ref, atol=1e-6, rtol=1e-6, equal_nan=True)   # untouched slots stay NaN
    assert torch.equal(v_nat.nan_to_num(), v_ref.nan_to_num())                       # v is copied as it is
    # a row alone gives bitwise the same q as among the others
    assert torch.equal(fused.rope_write_native(qkv[-1:], cos[-1:], sin[-1:], hq, hkv, k_nat.clone(),
                                               v_nat.clone(), slots[-1:]), q[-1:])


def test_rope_write_refuses_slots_outside_the_cache():
    _need_native()
    qkv, cos, sin, k_cache, slots = _rope_case(3, 4, 2, 16, seed=1)
    before = k_cache.clone()
    bad = slots.clone()
    bad[1] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises(ValueError, match="outside the cache"):
        fused.rope_write_native(qkv, cos, sin, 4, 2, k_cache, k_cache.clone(), bad)
    assert torch.equal(k_cache.nan_to_num(), before.nan_to_num())                   # nothing written


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (32, 49152), (5, 7), (3, 1), (70, 1003)])
def test_argmax_matches_torch(rows, vocab):
    _need_native()
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.equal(fused.argmax_rows(x), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("rows,vocab", [(32, 49152), (5, 7), (3, 1), (70, 1003), (2, 0)])
def test_finite_rows_matches_torch(rows, vocab):
    """Each non-finite kind (NaN, +inf, -inf, the largest finite float, a subnormal) at the start,
    inside an 8-lane block and in the scalar tail: the row flags equal torch.isfinite(...).all(-1)."""
    _need_native()
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    specials = [float("nan"), float("inf"), float("-inf"), torch.finfo(torch.float32).max, 1e-45]
    if vocab:
        for r in range(rows):
            kind, where = r % (len(specials) + 1), (r * 7) % 3
            if kind < len(specials):
                x[r, (0, vocab // 2, vocab - 1)[where]] = specials[kind]
    want = torch.isfinite(x).all(dim=-1)
    if rows >= 6 and vocab:                                    # both kinds of row are present
        assert want.any() and not want.all()
    assert torch.equal(fused.finite_rows(x), want)
    assert torch.equal(fused.finite_rows(x.double()), torch.isfinite(x.double()).all(dim=-1))   # torch path


def test_argmax_ties_infinities_and_nan_follow_torch():
    """Ties go to the first index, +inf wins, an all -inf row gives 0, a NaN anywhere wins (the
    first NaN): torch.argmax's contract, checked against torch itself."""
    _need_native()
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    x[0, [17, 400, 999]] = 50.0                              # ties inside and across 8-lane blocks
    x[1, [3, 4]] = float("inf")
    x[2] = float("-inf")
    x[3, [12, 700]] = float("nan")
    x[4, 999] = float("nan")                                 # in the last block only
    x[5, 998] = 1e30                                         # the maximum in the scalar tail region
    x[6, 0] = 1e30
    x[7] = 0.0
    assert torch.equal(fused.argmax_rows(x), torch.argmax(x, dim=-1))
    assert fused.argmax_rows(x[:0]).shape == (0,)
    assert torch.equal(fused.argmax_rows(x.double()), torch.argmax(x.double(), dim=-1))   # the torch path


@pytest.mark.parametrize("rows,vocab", [(32, 49152), (9, 1003), (3, 1)])
def test_argmax_finite_rows_is_both_passes_in_one(rows, vocab):
    """The one-visit pass gives torch.argmax and torch.isfinite(...).all(-1) per row, with ties,
    infinities and NaNs placed as in the two tests above (native and torch paths)."""
    _need_native()
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + 3 * vocab))
    specials = [float("nan"), float("inf"), float("-inf"), 50.0]
    for r in range(rows):
        kind = r % (len(specials) + 1)
        if kind < len(specials):
            x[r, [(r * 5) % vocab, vocab - 1]] = specials[kind]        # two of a kind: a tie, or two NaNs
    for t in (x, x.double()):
        top, finite = fused.argmax_finite_rows(t)
        assert torch.equal(top, torch.argmax(t, dim=-1))
        assert torch.equal(finite, torch.isfinite(t).all(dim=-1))
    if rows >= 5:
        assert finite.any() and not finite.all()
