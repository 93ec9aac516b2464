"""Native CPU kernels (kernels/csrc, built by kernels.native) against their torch reference."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from kernels import native
from kernels.attention import (build_metadata, decode_native_supported, paged_attention,
                               paged_attention_torch, paged_decode_native)


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """An empty kernel cache dir and no library loaded yet in this process."""
    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    return tmp_path


def _machine_has_cc() -> bool:
    """A fact of this machine, looked up here and not by kernels.native: a C compiler on
    PATH under the documented names ($CC, else cc or gcc)."""
    return any(shutil.which(name) for name in (os.environ.get("CC"), "cc", "gcc") if name)


def _need_native():
    if not _machine_has_cc():
        pytest.skip("no C compiler on this machine: the torch reference is used instead")
    assert native.load("paged_decode") is not None, "a compiler exists but the kernel did not build"


def _paged_case(hq, hkv, d, page_size, lens, dtype, seed, q_lens=None):
    """Random K/V for each sequence on shuffled pages of a NaN-poisoned cache; queries are
    the last q_lens[i] tokens of each context (default: one, all decode)."""
    q_lens = q_lens or [1] * len(lens)
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_needed) + 3
    k = torch.full((num_pages + 1, page_size, hkv, d), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    k[num_pages] = 0
    v[num_pages] = 0
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for n, need in zip(lens, pages_needed):
        pages, perm = perm[:need], perm[need:]
        for p in range(n):
            k[pages[p // page_size], p % page_size] = torch.randn(hkv, d, generator=g).to(dtype)
            v[pages[p // page_size], p % page_size] = torch.randn(hkv, d, generator=g).to(dtype)
        tables.append(pages)
    meta = build_metadata(q_lens, lens, tables, page_size, num_pages, torch.device("cpu"))
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    return q, k, v, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,page_size", [(9, 3, 64, 256), (8, 8, 32, 16), (4, 1, 128, 16), (6, 2, 16, 4)])
def test_native_decode_matches_torch_reference(dtype, hq, hkv, d, page_size):
    _need_native()
    lens = [1, 5, page_size, page_size + 1, 3 * page_size - 2, 17, 2 * page_size]
    q, k, v, meta = _paged_case(hq, hkv, d, page_size, lens, dtype, seed=hq * d + page_size)
    ref = paged_attention_torch(q, k, v, meta, d ** -0.5)
    out = paged_decode_native(q, k, v, meta.page_table, meta.seq_lens_k, d ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert decode_native_supported(q, k, v)
    torch.testing.assert_close(paged_attention(q, k, v, meta, d ** -0.5), ref, atol=2e-6, rtol=1e-5)


def test_dispatch_mixes_native_decode_and_torch_prefill():
    """Decode rows through the native kernel, prefill rows through SDPA, in one call."""
    _need_native()
    d = 16
    q, k, v, meta = _paged_case(6, 2, d, 8, [3, 20, 9, 30], torch.float32, seed=3, q_lens=[1, 1, 9, 4])
    assert meta.num_decode == 2 and len(meta.prefill) == 2
    ref = paged_attention_torch(q, k, v, meta, d ** -0.5)
    torch.testing.assert_close(paged_attention(q, k, v, meta, d ** -0.5), ref, atol=2e-6, rtol=1e-5)


def test_native_disabled_by_env_uses_reference(monkeypatch, fresh_native):
    monkeypatch.setenv("EVALRUN_NATIVE", "0")
    q, k, v, meta = _paged_case(6, 2, 16, 8, [3, 9, 17], torch.float32, seed=5)
    assert native.load("paged_decode") is None
    assert not decode_native_supported(q, k, v)
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.25), paged_attention_torch(q, k, v, meta, 0.25))
    assert not list(fresh_native.glob("kernels/*.so"))


def test_failed_build_falls_back_with_a_warning(monkeypatch, fresh_native, caplog):
    monkeypatch.setenv("CC", "false")              # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="kernels.native"):
        assert native.load("paged_decode") is None
    assert "building native kernel paged_decode failed" in caplog.text
    assert not list(fresh_native.glob("kernels/*"))   # no half-written library left behind
    q, k, v, meta = _paged_case(6, 2, 16, 8, [3, 9], torch.float32, seed=6)
    assert not decode_native_supported(q, k, v)


def test_build_is_cached_per_source_and_cpu(monkeypatch, fresh_native):
    _need_native()
    built = list(fresh_native.glob("kernels/paged_decode-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("rebuilt a cached kernel"))
    assert native.load("paged_decode") is not None


# what the machine lacks in each case: nothing, the native switch, every compiler, oneDNN in torch
BACKEND_CASES = ["machine", "native-switched-off", "no-compiler", "no-onednn"]


@pytest.mark.parametrize("case", BACKEND_CASES)
def test_kernel_backends_follow_the_machine(monkeypatch, fresh_native, tmp_path, case):
    """Expected backends come from facts outside our code: a C compiler on PATH, the
    EVALRUN_NATIVE value, and torch's own oneDNN flag. Each fact is also taken away (an
    empty PATH, EVALRUN_NATIVE=0, torch reporting no mkldnn) to see the fallback taken."""
    from engine import kernel_backends
    monkeypatch.delenv("EVALRUN_NATIVE", raising=False)          # documented default: on
    if case == "native-switched-off":
        monkeypatch.setenv("EVALRUN_NATIVE", "0")
    if case == "no-compiler":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
        assert not _machine_has_cc()
    if case == "no-onednn":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    native_on = os.environ.get("EVALRUN_NATIVE") != "0"
    want_decode = "native-c" if native_on and _machine_has_cc() else "torch"
    want_linear = "onednn-prepacked" if torch.backends.mkldnn.is_available() else "torch"

    cpu32 = kernel_backends("cpu", "float32", "fp32")
    assert (cpu32["linear"], cpu32["decode_attention"]) == (want_linear, want_decode)
    assert cpu32["prefill_attention"] == "torch-sdpa"
    assert kernel_backends("cpu", "bfloat16", "fp16")["decode_attention"] == "torch"   # fp16 pages: reference
    assert kernel_backends("cpu", "bfloat16", "bf16")["linear"] == "torch"             # only fp32 is prepacked
    built = list(fresh_native.glob("kernels/paged_decode-*.so"))
    assert len(built) == (want_decode == "native-c")              # built exactly when it is used


def test_unsupported_or_inconsistent_inputs_fall_back_or_raise():
    """Shapes the kernel cannot take go to the reference; bad page ids/lengths raise, never read wild."""
    _need_native()
    q, k, v, meta = _paged_case(6, 2, 16, 8, [3, 9, 17], torch.float32, seed=7)
    assert not decode_native_supported(q[:, :0], k, v)                       # no query heads
    assert not decode_native_supported(q[..., :8], k, v)                      # head size differs from the cache
    assert not decode_native_supported(q, k, v[..., :8].contiguous())         # K/V shapes differ
    assert not decode_native_supported(q, k, v.transpose(1, 2))               # V not contiguous
    assert not decode_native_supported(q, k, v.bfloat16())                    # K/V dtypes differ
    v16 = v.bfloat16()
    torch.testing.assert_close(paged_attention(q, k, v16, meta, 0.25),        # falls back, no error
                               paged_attention_torch(q, k, v16, meta, 0.25))
    bad = meta.page_table.clone()
    bad[0, 0] = k.shape[0]                                                     # one past the null page
    with pytest.raises(ValueError, match="page ids"):
        paged_decode_native(q, k, v, bad, meta.seq_lens_k, 0.25)
    too_long = meta.seq_lens_k.clone()
    too_long[1] = meta.page_table.shape[1] * 8 + 1
    with pytest.raises(ValueError, match="sequence lengths"):
        paged_decode_native(q, k, v, meta.page_table, too_long, 0.25)


def test_empty_context_gives_zeros():
    _need_native()
    q, k, v, meta = _paged_case(4, 2, 8, 4, [2, 5], torch.float32, seed=8)
    out = paged_decode_native(q, k, v, meta.page_table, torch.zeros(2, dtype=torch.int32), 0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_cached_library_is_loadable_by_other_users(fresh_native):
    _need_native()
    (lib,) = fresh_native.glob("kernels/paged_decode-*.so")
    assert lib.stat().st_mode & 0o055 == 0o055          # group/other may read and map it
