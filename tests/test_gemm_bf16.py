"""The native bf16 GEMM (evalrun/kernels/cpu/csrc/gemm_bf16.c) against its references: the float64
product within bf16-input / float32-accumulation bounds, the torch model of vdpbf16ps's chain to
the bit, the native (AVX512_BF16) and emulated tiles to the bit, and a row's bits whatever the
rows beside it."""
from __future__ import annotations

import pytest
import torch

from evalrun.kernels.cpu import gemm_bf16
from evalrun.kernels.cpu.host import cpu_flags
from evalrun.kernels.ref.linear import dot_bf16_reference

pytestmark = pytest.mark.skipif(not gemm_bf16.available(), reason=f"{gemm_bf16.unavailable_reason()}")
NATIVE = gemm_bf16.native_instructions()
needs_native = pytest.mark.skipif(not NATIVE, reason="this CPU lacks avx512_bf16 (vdpbf16ps): only the emulated "
                                                     "tiles run here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _case(n: int, k: int, m: int, seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale / k ** 0.5).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g) * scale
    return w, x


@pytest.fixture(params=["native", "emulated"])
def path(request):
    if request.param == "native" and not NATIVE:
        pytest.skip("this CPU lacks avx512_bf16 (vdpbf16ps)")
    before = gemm_bf16.path()
    yield gemm_bf16.set_path(request.param)
    gemm_bf16.set_path(before)


@pytest.mark.parametrize("n,k,m", [(960, 576, 1), (17, 33, 3), (3072, 576, 32), (576, 1536, 65), (40, 7, 2),
                                   (100, 130, 300)])
def test_against_float64_within_the_bound(path, n, k, m):
    """bf16 inputs, exact products, float32 sums: |err| <= K * 2^-24 * sum |x_k w_k| per output."""
    w, x = _case(n, k, m, seed=n + k + m)
    y = gemm_bf16.gemm(x, gemm_bf16.pack(w), n)
    xb = x.to(torch.bfloat16).double()
    exact = xb @ w.double().T
    bound = (xb.abs() @ w.double().abs().T) * k * 2.0 ** -24 + 1e-30
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("n,k,m", [(48, 64, 5), (17, 33, 9), (64, 7, 1)])
def test_bitwise_the_vdpbf16ps_chain(path, n, k, m):
    """The torch model of the chain (odd product, then even, per pair, in order) to the bit."""
    w, x = _case(n, k, m, seed=7 * n + k)
    assert _same(gemm_bf16.gemm(x, gemm_bf16.pack(w), n), dot_bf16_reference(x, w))


@needs_native
@pytest.mark.parametrize("scale", [1.0, 1e-19, 3e-20, 1e-39, 1e18])
def test_native_and_emulated_tiles_give_the_same_bits(scale):
    """Including sums that underflow (flushed to a zero of their sign), denormal inputs (read as
    zero) and overflow: the emulation follows the instruction, not just the ordinary cases."""
    for n, k, m in ((48, 64, 4), (33, 577, 9), (960, 576, 32)):
        w, x = _case(n, k, m, seed=n, scale=scale)
        if scale == 1e18:
            x[0, :3] = float("inf")
            x[1, 5] = float("nan")
        panels = gemm_bf16.pack(w)
        before = gemm_bf16.path()
        try:
            gemm_bf16.set_path("native")
            a = gemm_bf16.gemm(x, panels, n)
            gemm_bf16.set_path("emulated")
            b = gemm_bf16.gemm(x, panels, n)
        finally:
            gemm_bf16.set_path(before)
        assert torch.equal(a.isnan(), b.isnan())
        assert _same(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("n,k", [(960, 576), (49, 100)])
def test_a_rows_bits_do_not_depend_on_its_batch(path, n, k):
    w, x = _case(n, k, 64, seed=3)
    panels = gemm_bf16.pack(w)
    alone = gemm_bf16.gemm(x[:1], panels, n)
    for rows in (1, 8, 64):
        assert _same(gemm_bf16.gemm(x[:rows], panels, n)[:1], alone)
    mid = gemm_bf16.gemm(x[40:41], panels, n)
    assert _same(gemm_bf16.gemm(x, panels, n)[40:41], mid)
    assert _same(gemm_bf16.gemm(x[33:48], panels, n)[7:8], mid)


def test_bias_residual_dtypes_and_layouts(path):
    check_bias_residual_dtypes_and_layouts()


def check_bias_residual_dtypes_and_layouts() -> None:
    """The epilogue and the operand layouts on the path in use (also tests/test_gemm_bf16_amx.py)."""
    n, k, m = 70, 65, 11
    w, x = _case(n, k, m, seed=11)
    panels = gemm_bf16.pack(w)
    bias, residual = torch.randn(n), torch.randn(m, n)
    plain = gemm_bf16.gemm(x, panels, n)
    assert _same(gemm_bf16.gemm(x, panels, n, bias), plain + bias)
    assert _same(gemm_bf16.gemm(x, panels, n, bias, residual), residual + (plain + bias))
    # bf16 rows give the bits of their float32 widening; a bf16 output is the float32 result rounded once
    xb = x.to(torch.bfloat16)
    assert _same(gemm_bf16.gemm(xb, panels, n, out_dtype=torch.float32), plain)
    assert _same(gemm_bf16.gemm(xb, panels, n), plain.to(torch.bfloat16))
    # a strided view of rows (every other column block) reads the same values
    wide = torch.randn(m, 2 * k)
    wide[:, :k] = x
    assert _same(gemm_bf16.gemm(wide[:, :k], panels, n), plain)
    assert gemm_bf16.gemm(x[:0], panels, n).shape == (0, n)


def test_refuses_what_it_cannot_take():
    w, x = _case(32, 16, 2)
    panels = gemm_bf16.pack(w)
    with pytest.raises(ValueError, match="bfloat16 CPU"):
        gemm_bf16.pack(w.float())
    with pytest.raises(ValueError, match="matching the packed weight"):
        gemm_bf16.gemm(torch.randn(2, 17), panels, 32)
    with pytest.raises(ValueError, match="matching the packed weight"):
        gemm_bf16.gemm(x.double(), panels, 32)
    with pytest.raises(ValueError, match="residual"):
        gemm_bf16.gemm(x, panels, 32, residual=torch.zeros(3, 32))
    with pytest.raises(ValueError, match="path"):
        gemm_bf16.set_path("vnni")          # not a path ("amx" is one, where the CPU has it: test_gemm_bf16_amx.py)


def test_the_path_follows_the_cpu_flags():
    flags = cpu_flags() or frozenset()
    assert NATIVE == ("avx512_bf16" in flags and "avx512f" in flags)
    assert gemm_bf16.path() in ("native", "emulated")
    if not NATIVE:
        assert gemm_bf16.set_path("native") == "emulated"



@pytest.mark.parametrize("i,k,m", [(1536, 576, 32), (48, 40, 1), (48, 40, 2), (80, 33, 7), (32, 576, 65)])
def test_silu_epilogue_equals_the_two_calls(path, i, k, m):
    """gemm_silu is bitwise silu_mul_native of the GEMM's float32 output (gate and up halves of one
    packed weight), for 1-2 rows (4-panel tiles), odd K, several threads' ranges and a row alone."""
    fused_ops = pytest.importorskip("evalrun.kernels.cpu.fused")
    if not gemm_bf16.silu_fusable(i):
        pytest.skip("the bf16 SiLU epilogue needs AVX-512 tiles")
    w, x = _case(2 * i, k, m, seed=5, scale=3.0)
    panels = gemm_bf16.pack(w)
    out = gemm_bf16.gemm_silu(x, panels, i)
    assert _same(out, fused_ops.silu_mul_native(gemm_bf16.gemm(x, panels, 2 * i, out_dtype=torch.float32)))
    assert _same(gemm_bf16.gemm_silu(x[m - 1:], panels, i), out[m - 1:])
    assert gemm_bf16.gemm_silu(x[:0], panels, i).shape == (0, i)


@pytest.mark.parametrize("i,k,m", [(1536, 576, 32), (48, 40, 2), (32, 576, 65)])
def test_silu_epilogue_to_bf16_is_the_float32_output_rounded(path, i, k, m):
    """out_dtype bfloat16 (the rows the down projection's bf16 GEMM reads): bitwise the float32
    epilogue's values rounded as torch rounds them."""
    if not gemm_bf16.silu_fusable(i):
        pytest.skip("the bf16 SiLU epilogue needs AVX-512 tiles")
    w, x = _case(2 * i, k, m, seed=6, scale=3.0)
    panels = gemm_bf16.pack(w)
    out = gemm_bf16.gemm_silu(x, panels, i, torch.bfloat16)
    assert _same(out, gemm_bf16.gemm_silu(x, panels, i).to(torch.bfloat16))
    with pytest.raises(ValueError, match="out torch.float16"):
        gemm_bf16.gemm_silu(x, panels, i, torch.float16)


@pytest.mark.parametrize("k", [576, 33])
def test_bf16_rows_are_the_float32_rows_they_round(path, k):
    """bfloat16 rows (read in place when K is even and the rows are contiguous, else copied) give
    the bits of the float32 rows they are the rounding of: whole rows, a column slice (row stride
    past K) and an odd K."""
    n, m = 80, 37
    w, x = _case(n, k, m, seed=k)
    xb = x.to(torch.bfloat16)
    panels = gemm_bf16.pack(w)
    want = gemm_bf16.gemm(x, panels, n, out_dtype=torch.float32)
    assert _same(gemm_bf16.gemm(xb, panels, n, out_dtype=torch.float32), want)
    wide = torch.cat([xb, xb[:, :6]], dim=1)[:, :k]              # row stride k + 6
    assert _same(gemm_bf16.gemm(wide, panels, n, out_dtype=torch.float32), want)


def test_silu_epilogue_declines_what_it_does_not_fuse():
    w, x = _case(2 * 40, 16, 3)
    assert not gemm_bf16.silu_fusable(40)                  # I not a multiple of the 16-column panels
    assert gemm_bf16.gemm_silu(x, gemm_bf16.pack(w), 40) is None
    with pytest.raises(ValueError, match="matching the packed weight"):
        gemm_bf16.gemm_silu(x[:, :8], gemm_bf16.pack(w), 40)


def test_streamed_logits_equal_the_stored_ones(path):
    """A decode-shaped call with a megabyte-scale float32 output (an LM head) writes it with
    non-temporal stores; its rows are bitwise those of small calls, which store normally."""
    n, k, m = 65536, 24, 17                          # 17 x 65536 >= 2^20 floats: streamed
    w, x = _case(n, k, m, seed=11)
    panels = gemm_bf16.pack(w)
    y = gemm_bf16.gemm(x, panels, n, out_dtype=torch.float32)
    assert _same(y[5:6], gemm_bf16.gemm(x[5:6], panels, n, out_dtype=torch.float32))
    assert _same(y, dot_bf16_reference(x, w))
