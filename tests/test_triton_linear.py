"""The batch-invariant Triton linear and RMSNorm (evalrun/kernels/cuda/triton_linear.py, the CUDA half of
deterministic mode) against F.linear / F.rms_norm, and a row alone against the same row in
calls of 8 and 64 rows: bitwise equal. Without a GPU under Triton's interpreter (tests/triton_setup.py);
with one, compiled and marked `cuda`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_setup import DEVICE, check_interpreting, interpreter_scalars  # noqa: F401,E402

from evalrun.kernels.cuda import triton_linear  # noqa: E402  (after TRITON_INTERPRET)
from evalrun.kernels.linear import linear, make_linear  # noqa: E402

check_interpreting(triton_linear.interpreting())

pytestmark = [pytest.mark.cuda] if DEVICE.type == "cuda" else []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_and_ignores_the_batch(dtype, bias):
    g = torch.Generator().manual_seed(1)
    n, k = 80, 72                                           # neither a multiple of the 64 x 32 tile
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    x = torch.randn(70, k, generator=g).to(dtype).to(DEVICE)
    y = triton_linear.linear_triton(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 8), slice(3, 67)):   # tiles cut at other rows
        assert torch.equal(triton_linear.linear_triton(x[rows], w, b), y[rows])


def test_linear_dispatch_and_refusals():
    w = torch.randn(16, 8, device=DEVICE)
    assert not triton_linear.supported(torch.randn(3, 8, dtype=torch.float64, device=DEVICE), w)
    with pytest.raises(ValueError, match="batch-invariant Triton linear"):
        triton_linear.linear_triton(torch.randn(3, 9, device=DEVICE), w)
    assert triton_linear.linear_triton(torch.empty(0, 8, device=DEVICE), w).shape == (0, 16)
    if DEVICE.type == "cuda":                               # kernels.linear routes an invariant CUDA Linear here
        lin = make_linear(w, invariant=True)
        assert lin.invariant and lin.panels is None
        x = torch.randn(5, 8, device=DEVICE)
        assert torch.equal(linear(x, lin), triton_linear.linear_triton(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [64, 100])
def test_rms_norm_matches_reference_and_ignores_the_batch(dtype, h):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(9, h, generator=g) * 4).to(dtype).to(DEVICE)
    w = torch.randn(h, generator=g).to(dtype).to(DEVICE)
    y = triton_linear.rms_norm_triton(x, w, 1e-5)
    ref = F.rms_norm(x.float(), (h,), w.float(), 1e-5)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    assert torch.equal(triton_linear.rms_norm_triton(x[4:5], w, 1e-5), y[4:5])
    strided = torch.cat([x, x], dim=1)[:, :h]                 # a row stride of 2h
    assert torch.equal(triton_linear.rms_norm_triton(strided, w, 1e-5), y)
