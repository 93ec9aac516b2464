"""The AMX-BF16 path of the bf16 GEMM (evalrun/kernels/cpu/csrc/gemm_bf16_amx.h), off by default.

Here (any CPU): the torch models of tdpbf16ps's sums (dot_bf16_reference pair_order="even_first",
the Intrinsics Guide's order; "split16", the SDM's) against the float64 product, and that the orders
really differ where order matters; `set_path("amx")` refusing, and EVALRUN_GEMM_BF16=amx falling
back to the default path's bits, where AMX cannot run.

On a CPU with amx_bf16 (skipped elsewhere, naming the flag): the AMX tiles against float64, a row's
bits whatever its batch, bitwise its reference, and against the vdpbf16ps paths. This file is the
check to run on the first AMX CPU: until then which of Intel's two descriptions the hardware follows
is unknown (test_amx_bitwise_its_reference says which one it matched).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from evalrun.kernels.cpu import gemm_bf16
from evalrun.kernels.ref.linear import PAIR_ORDERS, dot_bf16_reference
from tests.test_gemm_bf16 import _case, _same, check_bias_residual_dtypes_and_layouts

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not gemm_bf16.available(), reason=f"{gemm_bf16.unavailable_reason()}")
AMX = gemm_bf16.amx_available()
needs_amx = pytest.mark.skipif(not AMX, reason=gemm_bf16.amx_unavailable_reason() or "")
AMX_ORDER = "even_first"        # what the AMX path is taken to compute (the Intrinsics Guide); see _amx_order
CHAIN_PATH = "native" if gemm_bf16.native_instructions() else "emulated"    # vdpbf16ps's chain, either way
TINY = 2.0 ** -24


def _within_the_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """bf16 inputs, exact products, float32 sums: |err| <= K * 2^-24 * sum |x_k w_k| (test_gemm_bf16's bound)."""
    xb = x.to(torch.bfloat16).double()
    exact = xb @ w.double().T
    bound = (xb.abs() @ w.double().abs().T) * x.shape[1] * 2.0 ** -24 + 1e-30
    return bool(((y.double() - exact).abs() <= bound).all())


def _crafted() -> tuple[torch.Tensor, torch.Tensor]:
    """Two pairs whose products (w = 1) are, in k order, 1, 2^-24, -1, 2^-24 (exact sum 2^-23):
    odd first  ((2^-24 + 1) + 2^-24) - 1 = 0                  (each 1 + 2^-24 rounds to 1)
    even first ((1 + 2^-24) - 1) + 2^-24 = 2^-24
    split16    (1 - 1) + (2^-24 + 2^-24) = 2^-23"""
    x = torch.tensor([[1.0, TINY, -1.0, TINY]])
    return x, torch.ones(1, 4, dtype=torch.bfloat16)


def _gemm_on(path: str, x: torch.Tensor, panels: torch.Tensor, n: int, **kw) -> torch.Tensor:
    before = gemm_bf16.path()
    try:
        gemm_bf16.set_path(path)
        return gemm_bf16.gemm(x, panels, n, **kw)
    finally:
        gemm_bf16.set_path(before)


# ---- the references, here ----

@pytest.mark.parametrize("order", ["even_first", "split16"])
@pytest.mark.parametrize("n,k,m", [(17, 33, 3), (40, 7, 2), (100, 130, 30), (64, 576, 4)])
def test_the_amx_references_against_float64_within_the_bound(order, n, k, m):
    w, x = _case(n, k, m, seed=n + k + m)
    y = dot_bf16_reference(x, w, pair_order=order)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert _within_the_bound(y, x, w)


def test_the_orders_differ_where_order_matters():
    x, w = _crafted()
    got = {order: dot_bf16_reference(x, w, pair_order=order).item() for order in PAIR_ORDERS}
    assert got == {"odd_first": 0.0, "even_first": TINY, "split16": 2 * TINY}
    assert dot_bf16_reference(x, w).item() == 0.0          # the default stays vdpbf16ps's order
    with pytest.raises(ValueError, match="pair_order"):
        dot_bf16_reference(x, w, pair_order="reversed")


def test_the_orders_agree_where_order_cannot_matter():
    g = torch.Generator().manual_seed(1)
    # one pair from +0: a + b == b + a
    w, x = _case(48, 2, 5, seed=2)
    # small integers: every partial sum is exact, so every order gives the float64 product
    wi = torch.randint(-8, 9, (40, 70), generator=g).to(torch.bfloat16)
    xi = torch.randint(-8, 9, (6, 70), generator=g).float()
    # odd elements zero, one block of 16 pairs: their +-0 products leave a nonzero (or +0) sum as it is
    wz, xz = _case(33, 32, 4, seed=3)
    xz[:, 1::2] = 0.0
    for a, b in ((x, w), (xi, wi), (xz, wz)):
        odd = dot_bf16_reference(a, b)
        for order in ("even_first", "split16"):
            assert _same(dot_bf16_reference(a, b, pair_order=order), odd), order
    assert torch.equal(dot_bf16_reference(xi, wi).double(), xi.double() @ wi.double().T)


# ---- the path's switch where AMX cannot run ----

@pytest.mark.skipif(AMX, reason="this CPU runs AMX: set_path('amx') has nothing to refuse")
def test_set_path_amx_refuses_where_it_cannot_run():
    before = gemm_bf16.path()
    with pytest.raises(ValueError, match="path 'amx' cannot run here: .*amx_bf16"):
        gemm_bf16.set_path("amx")
    assert gemm_bf16.path() == before


def test_env_amx_runs_amx_only_where_available(tmp_path: Path):
    """EVALRUN_GEMM_BF16=amx in a fresh process: the AMX tiles where they can run, else the default
    path (vdpbf16ps or its emulation) with the default's bits."""
    w, x = _case(70, 130, 19, seed=4)
    torch.save({"w": w, "x": x}, tmp_path / "case.pt")
    script = ("import sys, torch\n"
              "from evalrun.kernels.cpu import gemm_bf16\n"
              "c = torch.load(sys.argv[1])\n"
              "y = gemm_bf16.gemm(c['x'], gemm_bf16.pack(c['w']), c['w'].shape[0])\n"
              "torch.save({'path': gemm_bf16.path(), 'y': y}, sys.argv[2])\n")
    env = {**os.environ, "EVALRUN_GEMM_BF16": "amx"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
                   cwd=ROOT, env=env, check=True, timeout=300)
    out = torch.load(tmp_path / "out.pt")
    expected = "amx" if AMX else CHAIN_PATH
    assert out["path"] == expected
    assert _same(out["y"], _gemm_on(expected, x, gemm_bf16.pack(w), 70))


# ---- the AMX tiles, on a CPU with amx_bf16 ----

@pytest.fixture
def amx():
    before = gemm_bf16.path()
    yield gemm_bf16.set_path("amx")
    gemm_bf16.set_path(before)


def _amx_order() -> Optional[str]:
    """Which torch model the AMX tiles match bitwise (the crafted pairs and a random case), or None."""
    x, w = _crafted()
    wr, xr = _case(33, 100, 5, seed=9)
    got = [_gemm_on("amx", a, gemm_bf16.pack(b), b.shape[0]) for a, b in ((x, w), (xr, wr))]
    for order in PAIR_ORDERS:
        if all(_same(y, dot_bf16_reference(a, b, pair_order=order)) for y, (a, b) in zip(got, ((x, w), (xr, wr)))):
            return order
    return None


@needs_amx
@pytest.mark.parametrize("n,k,m", [(960, 576, 1), (17, 33, 3), (3072, 576, 32), (576, 1536, 65), (40, 7, 2),
                                   (100, 130, 300), (50, 62, 17)])
def test_amx_against_float64_within_the_bound(amx, n, k, m):
    w, x = _case(n, k, m, seed=n + k + m)
    y = gemm_bf16.gemm(x, gemm_bf16.pack(w), n)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert _within_the_bound(y, x, w)


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (49, 100), (33, 62)])
def test_amx_a_rows_bits_do_not_depend_on_its_batch(amx, n, k):
    """N not a multiple of 16, K not of 32 (a k tail tile), M not of 16 (a tile of fewer rows)."""
    w, x = _case(n, k, 64, seed=3)
    panels = gemm_bf16.pack(w)
    alone = gemm_bf16.gemm(x[:1], panels, n)
    for rows in (1, 8, 17, 33, 64):
        assert _same(gemm_bf16.gemm(x[:rows], panels, n)[:1], alone), rows
    mid = gemm_bf16.gemm(x[40:41], panels, n)
    assert _same(gemm_bf16.gemm(x, panels, n)[40:41], mid)
    assert _same(gemm_bf16.gemm(x[33:48], panels, n)[7:8], mid)
    assert _same(gemm_bf16.gemm(x[30:49], panels, n)[10:11], mid)


@needs_amx
@pytest.mark.parametrize("n,k,m", [(48, 64, 5), (17, 33, 9), (64, 7, 1), (33, 100, 20)])
def test_amx_bitwise_its_reference(amx, n, k, m):
    w, x = _case(n, k, m, seed=7 * n + k)
    y = gemm_bf16.gemm(x, gemm_bf16.pack(w), n)
    ref = dot_bf16_reference(x, w, pair_order=AMX_ORDER)
    assert _same(y, ref), (f"the AMX tiles are not {AMX_ORDER!r} (max |diff| {(y - ref).abs().max().item():.3g}); "
                           f"they match the model {_amx_order()!r} (None: no model here)")


@needs_amx
def test_amx_bias_residual_and_dtypes(amx):
    check_bias_residual_dtypes_and_layouts()


@needs_amx
def test_amx_against_the_vdpbf16ps_chain():
    """Bitwise equal where the AMX tiles add in vdpbf16ps's order; elsewhere an expected failure that
    records how far apart the two paths are."""
    n, k, m = 960, 576, 64
    w, x = _case(n, k, m, seed=5)
    panels = gemm_bf16.pack(w)
    a, b = _gemm_on("amx", x, panels, n), _gemm_on(CHAIN_PATH, x, panels, n)
    order = _amx_order()
    if order == "odd_first":
        assert _same(a, b)
        return
    differ = int((a != b).sum())
    rel = ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()
    pytest.xfail(f"AMX tiles add in the order {order!r}, not vdpbf16ps's: {differ} of {a.numel()} outputs "
                 f"differ, max |diff| {(a - b).abs().max().item():.3g} (relative {rel:.3g})")
