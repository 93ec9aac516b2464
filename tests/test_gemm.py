"""The native float32 GEMM (evalrun/kernels/cpu/csrc/gemm.c) against F.linear in float64, and its batch
invariance: a row's output is bitwise the same whatever rows share the call, however many
threads run it, and in a forked child."""
from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.nn.functional as F

from evalrun.kernels.cpu import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason=f"native GEMM: {gemm.unavailable_reason()}")


@pytest.fixture(params=gemm.WIDTHS, ids=lambda bits: f"{bits}bit")
def tiles(request):
    """Each test once on the AVX-512 tiles (skipped where the CPU lacks them) and once on AVX2's."""
    before = gemm.width()
    if gemm.set_width(request.param) != request.param:
        gemm.set_width(before)
        pytest.skip(f"this CPU has no {request.param}-bit tiles (AVX-512)")
    yield request.param
    gemm.set_width(before)


def _case(n: int, k: int, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen),
            torch.randn(m, n, generator=gen))


def _reference(x, w, b=None, r=None):
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    return y if r is None else r.double() + y


@pytest.mark.parametrize("n,k", [(960, 576), (37, 5), (16, 1), (17, 33), (576, 1536), (100, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 32, 65, 300])
def test_gemm_matches_reference(n, k, m, tiles):
    w, b, x, r = _case(n, k, m, seed=n * 1000 + k + m)
    panels = gemm.pack(w)
    tol = dict(rtol=1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(gemm.gemm(x, panels, n).double(), _reference(x, w), **tol)
    torch.testing.assert_close(gemm.gemm(x, panels, n, b).double(), _reference(x, w, b), **tol)
    r_before = r.clone()
    torch.testing.assert_close(gemm.gemm(x, panels, n, b, r).double(), _reference(x, w, b, r), **tol)
    assert torch.equal(r, r_before)                          # the residual is only read


def test_gemm_takes_strided_rows():
    """Rows with a stride wider than K (a column slice of a wider tensor) read in place."""
    w, _, _, _ = _case(40, 24, 1, seed=1)
    wide = torch.randn(9, 50)
    x = wide[:, 10:34]
    assert x.stride(0) == 50
    torch.testing.assert_close(gemm.gemm(x, gemm.pack(w), 40).double(), _reference(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(gemm.gemm(x, gemm.pack(w), 40), gemm.gemm(x.contiguous(), gemm.pack(w), 40))


def test_gemm_takes_one_row_with_any_row_stride():
    """A [1, K] view whose row stride torch reports as 1 (a transposed column) is one valid row."""
    w, b, _, _ = _case(40, 24, 1, seed=2)
    x = torch.randn(24, 1).t()
    assert x.shape == (1, 24) and x.stride(0) < 24
    torch.testing.assert_close(gemm.gemm(x, gemm.pack(w), 40, b).double(), _reference(x, w, b), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="bias"):
        gemm.gemm(x, gemm.pack(w), 40, b[:39])


@pytest.mark.parametrize("n,k,m", [(576, 1536, 64), (960, 576, 64), (960, 576, 200)])
def test_gemm_is_batch_invariant(n, k, m, tiles):
    """Each row alone, in a batch of 3, 8 or 32, or of all m, at any position: bitwise the same
    output. The calls take different paths (1-2 rows: wide tiles; one block of rows: k-blocked
    tiles of 3-6 rows; several blocks: whole-k 6-row tiles), so this pins them to one chain."""
    w, b, x, r = _case(n, k, m, seed=3)
    panels = gemm.pack(w)
    full = gemm.gemm(x, panels, n, b, r)
    for i in (0, 5, 17, m - 1):
        assert torch.equal(gemm.gemm(x[i:i + 1], panels, n, b, r[i:i + 1]), full[i:i + 1])
    for size in (2, 3, 8, 32):
        for lo in (0, 3, m - size):
            assert torch.equal(gemm.gemm(x[lo:lo + size], panels, n, b, r[lo:lo + size]), full[lo:lo + size])
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gemm.gemm(x[perm], panels, n, b, r[perm]), full[perm])


@pytest.mark.parametrize("n,m", [(32768, 32), (32776, 40), (32771, 33)])
def test_gemm_large_few_row_outputs_match_and_stay_invariant(n, m, tiles):
    """Calls of under 256 rows whose output reaches 2^20 floats (a decode step's LM head) write y with
    non-temporal stores where N is a multiple of 8 (the last case is not): the same values,
    bitwise those of each row alone (a 1-row call writes normally)."""
    w, b, x, r = _case(n, 24, m, seed=n + m)
    assert m * n >= 1 << 20
    panels = gemm.pack(w)
    full = gemm.gemm(x, panels, n, b, r)
    torch.testing.assert_close(full.double(), _reference(x, w, b, r), rtol=1e-5, atol=1e-4)
    for i in (0, m // 2, m - 1):
        assert torch.equal(gemm.gemm(x[i:i + 1], panels, n, b, r[i:i + 1]), full[i:i + 1])
    assert torch.equal(gemm.gemm(x[:8], panels, n, b, r[:8]), full[:8])


@pytest.mark.parametrize("n,k", [(960, 576), (37, 5), (576, 1536), (48, 1)])
@pytest.mark.parametrize("m", [1, 2, 3, 9, 32, 300])
def test_the_avx512_and_avx2_tiles_give_bitwise_the_same_outputs(n, k, m):
    """Same chains, other register width: the results of a run cannot depend on the CPU's SIMD."""
    before = gemm.width()
    if gemm.set_width(512) != 512:
        pytest.skip("this CPU has no AVX-512: only the AVX2 tiles exist")
    w, b, x, r = _case(n, k, m, seed=5)
    panels = gemm.pack(w)
    try:
        wide = gemm.gemm(x, panels, n, b, r)
        assert gemm.set_width(256) == 256
        narrow = gemm.gemm(x, panels, n, b, r)
    finally:
        gemm.set_width(before)
    assert torch.equal(wide, narrow)


def test_gemm_threads_do_not_change_results():
    n, k = 3072, 576
    w, _, x, _ = _case(n, k, 40, seed=4)
    panels = gemm.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.gemm(x, panels, n)
        torch.set_num_threads(max(2, before))
        many = gemm.gemm(x, panels, n)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def _child(q, x, panels, n):
    q.put(gemm.gemm(x, panels, n).numpy().tobytes())      # plain bytes: no shared-memory handles


def test_gemm_runs_in_a_forked_child():
    """The pool's workers do not survive fork(); a child makes its own and gets the same result."""
    n, k = 960, 576
    w, _, x, _ = _case(n, k, 32, seed=5)
    panels = gemm.pack(w)
    parent = gemm.gemm(x, panels, n)                         # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, x, panels, n))
    p.start()
    child = q.get(timeout=60)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert child == parent.numpy().tobytes()


def test_gemm_refuses_bad_input():
    w, _, x, _ = _case(32, 16, 4, seed=6)
    panels = gemm.pack(w)
    with pytest.raises(ValueError, match="matching the packed weight"):
        gemm.gemm(torch.randn(4, 17), panels, 32)
    with pytest.raises(ValueError, match="float32"):
        gemm.gemm(x.double(), panels, 32)
    with pytest.raises(ValueError, match="residual"):
        gemm.gemm(x, panels, 32, residual=torch.randn(4, 31))
    with pytest.raises(ValueError, match="float32 CPU"):
        gemm.pack(w.double())
    assert gemm.gemm(x[:0], panels, 32).shape == (0, 32)


def test_linear_backend_choice(monkeypatch):
    """native by default here; EVALRUN_LINEAR picks another; EVALRUN_NATIVE=0 falls back with a reason."""
    from evalrun.kernels.linear import linear_backend
    assert linear_backend("cpu", torch.float32) == "native-gemm"
    from evalrun.kernels.cpu import gemm_bf16
    # bf16: the bf16 GEMM where the CPU has vdpbf16ps, else torch's; batch-invariant: the bf16 GEMM
    # wherever it builds (its emulated tiles give the same bits)
    assert linear_backend("cpu", torch.bfloat16) == ("native-bf16" if gemm_bf16.native_instructions() else "torch")
    assert linear_backend("cpu", torch.bfloat16, invariant=True) == "native-bf16"
    assert linear_backend("cpu", torch.float16, invariant=True) == "native-gemm"
    assert linear_backend("cpu", torch.float16) == "torch"
    monkeypatch.setenv("EVALRUN_LINEAR", "torch")
    assert linear_backend("cpu", torch.float32) == "torch"
    assert linear_backend("cpu", torch.bfloat16) == "torch"
    assert linear_backend("cpu", torch.bfloat16, invariant=True) == "native-bf16"
    monkeypatch.setenv("EVALRUN_LINEAR", "native")
    monkeypatch.setenv("EVALRUN_NATIVE", "0")
    assert gemm.unavailable_reason() == "native kernels are disabled (EVALRUN_NATIVE=0)"
    assert linear_backend("cpu", torch.float32) in ("onednn-prepacked", "torch")


@pytest.mark.parametrize("i,k", [(1536, 576), (48, 24), (16, 7)])
@pytest.mark.parametrize("m", [3, 5, 32, 65, 300])
def test_gemm_silu_is_bitwise_the_two_calls(i, k, m):
    """The gate/up GEMM with SiLU in its epilogue: bitwise silu_mul(gemm(...)) (so the fused decode
    step stays bitwise the per-op path), close to the float64 reference, and the same bits for a
    row whatever rows share the call."""
    from evalrun.kernels.cpu import fused
    if gemm.width() != 256:
        pytest.skip("the fused path runs on the AVX2 tiles (AVX-512 tiles in use: the two calls run)")
    if not fused.available():
        pytest.skip("native fused ops unavailable")
    w, _, x, _ = _case(2 * i, k, m, seed=i + k + m)
    panels = gemm.pack(w)
    out = gemm.gemm_silu(x, panels, i)
    assert out is not None and out.shape == (m, i)
    assert torch.equal(out, fused.silu_mul_native(gemm.gemm(x, panels, 2 * i)))
    gu = _reference(x, w)
    torch.testing.assert_close(out.double(), F.silu(gu[:, :i]) * gu[:, i:], rtol=1e-4, atol=1e-4 * k ** 0.5)
    for lo, size in ((0, 3), (m - 3, 3), (1, max(3, m - 1))):
        if lo + size <= m:
            assert torch.equal(gemm.gemm_silu(x[lo:lo + size], panels, i), out[lo:lo + size])


def test_gemm_silu_declines_what_it_does_not_take():
    """1-2 rows, or I not a multiple of 16: None (the caller makes the two calls); a weight of
    another size: ValueError."""
    w, _, x, _ = _case(2 * 40, 16, 8, seed=9)
    assert gemm.gemm_silu(x, gemm.pack(w), 40) is None
    w, _, x, _ = _case(2 * 32, 16, 8, seed=9)
    assert gemm.gemm_silu(x[:2], gemm.pack(w), 32) is None
    with pytest.raises(ValueError, match="gemm_silu"):
        gemm.gemm_silu(x, gemm.pack(w), 48)
