"""Paged-attention cases shared by the Triton tests (tests/test_triton_kernels.py,
tests/test_triton_engine.py): contexts written by the reference into NaN-poisoned shuffled pages,
and the tolerance a kernel's output must meet. Import after triton_setup (TRITON_INTERPRET)."""
from __future__ import annotations

import torch

from triton_setup import DEVICE

from evalrun.kernels.attention import build_metadata
from evalrun.kernels.kv_format import KV_FORMATS, KVFormat, LayerKV, kv_format
from evalrun.kernels.ref.cache_ops import write_kv_torch

PAGE_FORMATS = {m: kv_format(f, window=0) if f.quantized else f for m, f in KV_FORMATS.items()}
FLOAT_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def paged_case(fmt: KVFormat, hq: int, hkv: int, d: int, page_size: int, lens: list[int], q_lens: list[int],
          seed: int, q_dtype: torch.dtype, window_slots: int = 0):
    """Random contexts written by the reference on shuffled pages of a cache whose other slots
    are NaN (floats, or scales beside junk codes); queries for the last q_lens[i] tokens."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    layer = LayerKV.allocate(fmt, num_pages + 1, page_size, hkv, d, DEVICE, window_slots=window_slots)
    for t in layer.data_tensors():
        t[:num_pages] = float("nan")
    if fmt.quantized:
        layer.k[:num_pages], layer.v[:num_pages] = 0xA5, 0x5A
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for n in lens:
        pages, perm = perm[: -(-n // page_size)], perm[-(-n // page_size):]
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        k, v = torch.randn(2, n, hkv, d, generator=g)
        write_kv_torch(k.to(DEVICE), v.to(DEVICE), layer, slots.to(DEVICE))
        tables.append(pages)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(q_dtype).to(DEVICE)
    wslots = list(range(len(lens)))[::-1] if fmt.window else None
    meta = build_metadata(q_lens, lens, tables, page_size, num_pages, DEVICE, fmt.window, wslots)
    return layer, q, meta


def close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    tol = FLOAT_TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)
