"""The native rope + K/V write (kernels/cpu/fused.py rope_write_native, csrc/fused_ops.c rope_write_kind)
into bfloat16 and float16 pages from float32 rows: bitwise torch's float32 rope then .to(page dtype).

The bitwise reference is `_rope_f32`, torch's `x * c - y * s` with each product rounded (the C
kernel's arithmetic, and rope_write_f32's since it was written). rope_write_reference fuses the
second product (addcmul_ on AVX2 CPUs: an FMA), so against it the checks are within an ulp.
"""
from __future__ import annotations

import pytest
import torch

from evalrun.kernels.cpu import fused
from evalrun.kernels.ref import fused as ref_fused

PAGES, PAGE_SIZE = 6, 16
SPECIALS = [float("nan"), float("inf"), float("-inf"), 3.0e38, -3.4e38, 65504.0, 65519.0, 65520.0, -7.0e4,
            1.0e-40, -1.0e-40, 2.0 ** -25, 3.0 * 2.0 ** -26, 6.0e-8, 0.0, -0.0, 1.0 + 2.0 ** -8,
            1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -2.5, 1.0e5]


def _need_native() -> None:
    if not fused.available():
        pytest.skip("no C compiler: the native fused ops are off (evalrun/kernels/cpu/native.py)")


def _case(t: int, hq: int, hkv: int, d: int, seed: int, dtype: torch.dtype):
    """qkv [T, (hq + 2 hkv) d] float32, cos/sin [T, d] at random positions, NaN pages
    [PAGES + 1, PAGE_SIZE, hkv, d] of dtype, t distinct slots scattered over the pages."""
    from evalrun.engine.rope import rope_table
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3
    cos, sin = rope_table(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 4096)
    pos = torch.randint(0, 4096, (t,), generator=g)
    pages = torch.full((PAGES + 1, PAGE_SIZE, hkv, d), float("nan"), dtype=dtype)
    slots = torch.randperm((PAGES + 1) * PAGE_SIZE, generator=g)[:t]
    return qkv, cos[pos], sin[pos], pages, slots


def _rope_f32(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int):
    """q, k, v [T, H, D] float32: rope with each product rounded before the add."""
    t, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
    h = d // 2
    x = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    c, s = cos[:, None, :], sin[:, None, :]
    qk = torch.cat([x[..., :h] * c[..., :h] - x[..., h:] * s[..., :h],
                    x[..., h:] * c[..., h:] + x[..., :h] * s[..., h:]], dim=-1)
    return qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d)


def _expected_pages(pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    k_pages, v_pages = pages.clone(), pages.clone()
    k_pages.view(-1, *pages.shape[2:])[slots] = k.to(pages.dtype)
    v_pages.view(-1, *pages.shape[2:])[slots] = v.to(pages.dtype)
    return k_pages, v_pages


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.float32: torch.int32}.get(x.dtype, torch.int16))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (torch's own NaN bits differ by path)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan]))


def _run(qkv, cos, sin, hq, hkv, pages, slots):
    k_pages, v_pages = pages.clone(), pages.clone()
    q = fused.rope_write_native(qkv, cos, sin, hq, hkv, k_pages, v_pages, slots)
    return q, k_pages, v_pages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 32, 20, 160])          # 20: scalar tails; 160: two stack chunks
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4)])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_pages_are_the_float32_rope_rounded_like_torch(t, hq, hkv, d, dtype):
    _need_native()
    qkv, cos, sin, pages, slots = _case(t, hq, hkv, d, seed=t * 100 + d + hq, dtype=dtype)
    q, k_pages, v_pages = _run(qkv, cos, sin, hq, hkv, pages, slots)
    q_want, k_want, v_want = _rope_f32(qkv, cos, sin, hq, hkv)
    k_exp, v_exp = _expected_pages(pages, slots, k_want, v_want)
    assert torch.equal(_bits(q), _bits(q_want))
    assert torch.equal(_bits(k_pages), _bits(k_exp))                                  # NaN slots untouched
    assert torch.equal(_bits(v_pages), _bits(v_exp))
    # against the reference (its rope fuses one product): within an ulp
    q_ref, k_ref, v_ref = ref_fused.rope_write_reference(qkv, cos, sin, hq, hkv, lambda k, v: None)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    k_ref_pages, v_ref_pages = _expected_pages(pages, slots, k_ref, v_ref)
    torch.testing.assert_close(k_pages, k_ref_pages, equal_nan=True)
    assert torch.equal(_bits(v_pages), _bits(v_ref_pages))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_row_is_the_same_alone_or_among_8_and_64(dtype):
    _need_native()
    qkv, cos, sin, pages, slots = _case(64, 9, 3, 64, seed=5, dtype=dtype)
    q64, k64, v64 = _run(qkv, cos, sin, 9, 3, pages, slots)
    k64, v64 = k64.view(-1, 3, 64)[slots], v64.view(-1, 3, 64)[slots]
    for rows in (slice(0, 1), slice(63, 64), slice(0, 8), slice(56, 64)):
        q, k, v = _run(qkv[rows], cos[rows], sin[rows], 9, 3, pages, slots[rows])
        assert torch.equal(_bits(q), _bits(q64[rows]))
        assert torch.equal(_bits(k.view(-1, 3, 64)[slots[rows]]), _bits(k64[rows]))
        assert torch.equal(_bits(v.view(-1, 3, 64)[slots[rows]]), _bits(v64[rows]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 20, 160])
def test_nan_inf_and_large_values_round_like_torch(dtype, d):
    """Special values everywhere (vector lanes and scalar tails): v is rounded as it is, k after a
    rope with cos = 1, sin = 0 on some rows (the values pass through) and the real tables on others."""
    _need_native()
    qkv, cos, sin, pages, slots = _case(9, 4, 3, d, seed=d, dtype=dtype)
    g = torch.Generator().manual_seed(d + 1)
    pick = torch.randint(0, len(SPECIALS), qkv.shape, generator=g)
    qkv = torch.where(torch.rand(qkv.shape, generator=g) < 0.5, torch.tensor(SPECIALS)[pick], qkv * 1e4)
    cos[:4], sin[:4] = 1.0, 0.0
    q, k_pages, v_pages = _run(qkv, cos, sin, 4, 3, pages, slots)
    q_want, k_want, v_want = _rope_f32(qkv, cos, sin, 4, 3)
    k_exp, v_exp = _expected_pages(pages, slots, k_want, v_want)
    assert _same(q, q_want) and _same(k_pages, k_exp) and _same(v_pages, v_exp)
    assert v_pages.isinf().any() and k_pages.isinf().any() and v_pages.view(-1, 3, d)[slots].isnan().any()


def test_float32_pages_are_rope_write_f32s_bits():
    """float32 pages through rope_write_kind, and rope_write_f32 called directly: the same bits, which
    are the two-rounding rope (what rope_write_f32 wrote before the page kinds came)."""
    _need_native()
    hq, hkv, d = 9, 3, 64
    qkv, cos, sin, pages, slots = _case(33, hq, hkv, d, seed=7, dtype=torch.float32)
    q, k_pages, v_pages = _run(qkv, cos, sin, hq, hkv, pages, slots)
    k_f32, v_f32, q_f32 = pages.clone(), pages.clone(), torch.empty_like(q)
    rc = fused._ready().rope_write_f32(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), 33, hq, hkv,
                                       d, slots.data_ptr(), pages.shape[0] * PAGE_SIZE, k_f32.data_ptr(),
                                       v_f32.data_ptr(), q_f32.data_ptr())
    assert rc == 0
    assert torch.equal(_bits(q), _bits(q_f32)) and torch.equal(_bits(k_pages), _bits(k_f32))
    assert torch.equal(_bits(v_pages), _bits(v_f32))
    q_want, k_want, v_want = _rope_f32(qkv, cos, sin, hq, hkv)
    k_exp, v_exp = _expected_pages(pages, slots, k_want, v_want)
    assert torch.equal(_bits(q), _bits(q_want)) and torch.equal(_bits(k_pages), _bits(k_exp))
    assert torch.equal(_bits(v_pages), _bits(v_exp))


def test_refuses_other_pages_and_slots_outside_the_cache():
    _need_native()
    qkv, cos, sin, pages, slots = _case(3, 4, 2, 16, seed=1, dtype=torch.bfloat16)
    assert fused.rope_write_supported(qkv, cos, pages)
    assert not fused.rope_write_supported(qkv, cos, pages.double())
    assert not fused.rope_write_supported(qkv.bfloat16(), cos, pages)
    with pytest.raises(ValueError, match="cannot take"):
        fused.rope_write_native(qkv, cos, sin, 4, 2, pages.double(), pages.double(), slots)
    with pytest.raises(ValueError, match="do not hold"):
        fused.rope_write_native(qkv, cos, sin, 4, 2, pages.clone(), pages.half(), slots)
    bad = slots.clone()
    bad[1] = pages.shape[0] * PAGE_SIZE
    k_pages = pages.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        fused.rope_write_native(qkv, cos, sin, 4, 2, k_pages, pages.clone(), bad)
    assert torch.equal(_bits(k_pages), _bits(pages))                                  # nothing written
