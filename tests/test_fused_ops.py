"""Native fused RMSNorm and SiLU*up (kernels/fused.py) against their torch references, and
bitwise batch invariance (a row's result alone equals the same row among many)."""
from __future__ import annotations

import pytest
import torch

from kernels import fused
from kernels.backend import NativeCpuKernels, TorchKernels


def _need_native() -> None:
    if not fused.available():
        pytest.skip("no C compiler: the native fused ops are off (kernels/native.py)")


@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 13), (32, 576), (300, 576), (2048, 64), (3, 8)])
def test_rms_norm_matches_torch(rows, hidden):
    _need_native()
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g) * 4
    w = torch.randn(hidden, generator=g)
    torch.testing.assert_close(fused.rms_norm_native(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 11), (32, 1536), (300, 64), (2048, 96)])
def test_silu_mul_matches_torch(rows, inter):
    _need_native()
    gu = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows + inter)) * 8
    gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])       # zero, both saturations
    torch.testing.assert_close(fused.silu_mul_native(gu), fused.silu_mul_reference(gu), atol=1e-5, rtol=1e-5)


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


def test_backends_route_by_dtype():
    _need_native()
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    ref = TorchKernels().rms_norm(x, w, 1e-6)
    assert torch.equal(NativeCpuKernels().rms_norm(x, w, 1e-6), ref)           # bf16: the reference runs
    with pytest.raises(ValueError, match="float32 CPU rows"):
        fused.rms_norm_native(x, w, 1e-6)
