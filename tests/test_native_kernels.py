"""Native CPU kernels (kernels/cpu/csrc, built by kernels.native) against their torch reference,
for every KV cache format."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from evalrun.kernels.cpu import native, paged_decode, paged_prefill
from evalrun.kernels.attention import build_metadata
from evalrun.kernels.ref.attention import decode_torch, paged_attention_torch
from evalrun.kernels.backend import NativeCpuKernels, TorchKernels, choose_kernels
from evalrun.kernels.ref.cache_ops import write_kv_torch
from evalrun.kernels.cpu.host import cpu_flags
from evalrun.kernels.kv_format import KV_FORMATS, KVFormat, LayerKV, kv_format
from evalrun.kernels.ref.kv_quant import rotate

QUANTIZED = [name for name, f in KV_FORMATS.items() if f.quantized]      # q8, q6, q4


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


def _paged_case(hq, hkv, d, page_size, lens, mode, seed, q_lens=None):
    """Random K/V for each sequence, written in `mode` (a name or a KVFormat) on shuffled
    pages of a cache whose other slots are NaN-poisoned (the floats, or the scales of codes
    that are junk); queries are the last q_lens[i] tokens of each context (default: one,
    all decode)."""
    q_lens = q_lens or [1] * len(lens)
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_needed) + 3
    fmt = kv_format(mode)
    fmt = kv_format(fmt, window=0) if fmt.quantized else fmt     # windows: tests/test_kv_window.py
    layer = LayerKV.allocate(fmt, num_pages + 1, page_size, hkv, d, torch.device("cpu"))
    for t in layer.data_tensors():
        t[:num_pages] = float("nan")
    if layer.fmt.quantized:
        layer.k[:num_pages] = 0xA5
        layer.v[:num_pages] = 0x5A
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for n, need in zip(lens, pages_needed):
        pages, perm = perm[:need], perm[need:]
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)], dtype=torch.long)
        write_kv_torch(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), layer, slots)
        tables.append(pages)
    meta = build_metadata(q_lens, lens, tables, page_size, num_pages, torch.device("cpu"))
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    return q, layer, meta


def _decode_native_unrotated(q, layer, table, lens, scale):
    """The native kernel on q as the model sees it: rotated in and out for rotating formats."""
    fmt = layer.fmt
    if not fmt.rotate:
        return paged_decode.paged_decode_native(q, layer, table, lens, scale)
    out = paged_decode.paged_decode_native(rotate(q, fmt.group_size), layer, table, lens, scale)
    return rotate(out, fmt.group_size)


DECODE_SHAPES = [(9, 3, 64, 256), (8, 8, 32, 16), (4, 1, 128, 16), (6, 2, 16, 4), (4, 2, 24, 8), (10, 2, 64, 16)]
DECODE_CASES = [(mode, *shape) for mode, f in KV_FORMATS.items() for shape in DECODE_SHAPES
                if not f.quantized or shape[2] % f.group_size == 0]   # quantized: D a multiple of G


@pytest.mark.parametrize("mode,hq,hkv,d,page_size", DECODE_CASES)
def test_native_decode_matches_torch_reference(mode, hq, hkv, d, page_size):
    _need_native()
    lens = [1, 5, page_size, page_size + 1, 3 * page_size - 2, 17, 2 * page_size]
    q, layer, meta = _paged_case(hq, hkv, d, page_size, lens, mode, seed=hq * d + page_size)
    scale = d ** -0.5
    ref = paged_attention_torch(q, layer, meta, scale)
    assert torch.isfinite(ref).all()
    tol = {"atol": 2e-6, "rtol": 1e-5} if not layer.fmt.quantized else {"atol": 1e-5, "rtol": 1e-5}
    out = _decode_native_unrotated(q, layer, meta.page_table, meta.seq_lens_k, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **tol)
    qa = rotate(q, layer.fmt.group_size) if layer.fmt.rotate else q        # the attention domain
    assert paged_decode.supported(qa, layer)
    torch.testing.assert_close(paged_decode.decode_native(qa, layer, meta, scale),
                               decode_torch(qa, layer, meta, scale), **tol)
    kernels = choose_kernels("cpu")
    assert isinstance(kernels, NativeCpuKernels)
    torch.testing.assert_close(kernels.attention(q, layer, meta, scale), ref, **tol)


@pytest.mark.parametrize("group_size", [4, 8, 16, 64])
@pytest.mark.parametrize("k_bits,v_bits,rotation", [(8, 8, True), (8, 4, False), (4, 4, True)])
def test_native_decode_other_group_sizes(group_size, k_bits, v_bits, rotation):
    """Groups narrower than the vector loop (the C kernel's scalar tails) and wider ones."""
    _need_native()
    fmt = KVFormat(f"test-{k_bits}{v_bits}-g{group_size}", k_bits=k_bits, v_bits=v_bits,
                   group_size=group_size, rotate=rotation)
    q, layer, meta = _paged_case(4, 2, 64, 8, [1, 9, 23], fmt, seed=group_size + k_bits + v_bits)
    ref = paged_attention_torch(q, layer, meta, 0.125)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(_decode_native_unrotated(q, layer, meta.page_table, meta.seq_lens_k, 0.125),
                               ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(NativeCpuKernels().attention(q, layer, meta, 0.125), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,d", [("fp32", 16), ("bf16", 32), ("q8", 32), ("q6", 64), ("q4", 32), ("fp32", 24)])
def test_dispatch_mixes_native_decode_and_prefill(monkeypatch, mode, d):
    """Decode rows through the native decode kernel, prefill rows through the native prefill
    kernel (SDPA where it cannot take the head size), in one call, each kernel called once."""
    _need_native()
    q, layer, meta = _paged_case(6, 2, d, 8, [3, 20, 9, 30], mode, seed=3, q_lens=[1, 1, 9, 4])
    assert meta.num_decode == 2 and len(meta.prefill) == 2
    ref = paged_attention_torch(q, layer, meta, d ** -0.5)
    assert torch.isfinite(ref).all()
    calls = []

    def spy(name, real):
        def call(q, layer, meta, scale, **kw):
            calls.append((name, q.shape[0]))
            return real(q, layer, meta, scale, **kw)
        return call

    monkeypatch.setattr(paged_decode, "decode_native", spy("decode", paged_decode.decode_native))
    monkeypatch.setattr(paged_prefill, "prefill_native", spy("prefill", paged_prefill.prefill_native))
    out = NativeCpuKernels().attention(q, layer, meta, d ** -0.5)
    native_prefill = d % paged_prefill.LANES == 0 and paged_prefill.available()
    assert calls == [("decode", 2)] + ([("prefill", q.shape[0])] if native_prefill else [])
    tol = {"atol": 2e-6, "rtol": 1e-5} if not layer.fmt.quantized else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("mode,d", [("fp32", 16), ("q4", 32)])
def test_native_disabled_by_env_uses_reference(monkeypatch, fresh_native, mode, d):
    monkeypatch.setenv("EVALRUN_NATIVE", "0")
    q, layer, meta = _paged_case(6, 2, d, 8, [3, 9, 17], mode, seed=5)
    assert native.load("paged_decode") is None
    assert not paged_decode.available() and not paged_decode.supported(q, layer)
    kernels = choose_kernels("cpu")
    assert type(kernels) is TorchKernels
    ref = paged_attention_torch(q, layer, meta, 0.25)
    torch.testing.assert_close(kernels.attention(q, layer, meta, 0.25), ref)
    torch.testing.assert_close(NativeCpuKernels().attention(q, layer, meta, 0.25), ref)
    with pytest.raises(RuntimeError, match="not available"):
        paged_decode.paged_decode_native(q, layer, meta.page_table, meta.seq_lens_k, 0.25)
    assert not list(fresh_native.glob("kernels/*.so"))


def test_failed_build_falls_back_with_a_warning(monkeypatch, fresh_native, caplog):
    monkeypatch.setenv("CC", "false")              # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="evalrun.kernels.cpu.native"):
        assert native.load("paged_decode") is None
    assert "building native kernel pool failed" in caplog.text          # the first library it needs
    assert "native kernel paged_decode disabled" in caplog.text
    assert not list(fresh_native.glob("kernels/*"))   # no half-written library left behind
    q, layer, _ = _paged_case(6, 2, 16, 8, [3, 9], "fp32", seed=6)
    assert not paged_decode.supported(q, layer)
    assert type(choose_kernels("cpu")) is TorchKernels


def test_build_is_cached_per_source_and_cpu(monkeypatch, fresh_native):
    _need_native()
    built = list(fresh_native.glob("kernels/paged_decode-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("rebuilt a cached kernel"))
    assert native.load("paged_decode") is not None


# what the machine lacks in each case: nothing, the native switch, every compiler, oneDNN in torch
BACKEND_CASES = ["machine", "native-switched-off", "no-compiler", "no-onednn"]


@pytest.fixture(scope="module")
def compiled_once(tmp_path_factory):
    """One kernel cache for the cases that build the same libraries (the first builds, the next loads)."""
    return tmp_path_factory.mktemp("compiled-once")


@pytest.mark.parametrize("case", BACKEND_CASES)
def test_kernel_backends_follow_the_machine(monkeypatch, fresh_native, compiled_once, tmp_path, case):
    """Expected backends come from facts outside our code: a C compiler on PATH, the
    EVALRUN_NATIVE value, and torch's own oneDNN flag. Each fact is also taken away (an
    empty PATH, EVALRUN_NATIVE=0, torch reporting no mkldnn) to see the fallback taken."""
    from evalrun.engine import kernel_backends
    if case in ("machine", "no-onednn"):                           # both build every library: once
        monkeypatch.setenv("EVALRUN_CACHE", str(compiled_once))
        fresh_native = compiled_once
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
    simd = {"avx2", "fma"} <= (cpu_flags() or frozenset())                  # what the native GEMM needs
    want_linear = ("native-gemm" if native_on and _machine_has_cc() and simd
                   else "onednn-prepacked" if torch.backends.mkldnn.is_available() else "torch")

    cpu32 = kernel_backends("cpu", "float32", "fp32")
    assert (cpu32["linear"], cpu32["decode_attention"]) == (want_linear, want_decode)
    want_prefill = "native-c" if want_decode == "native-c" and simd else "torch-sdpa"
    assert cpu32["prefill_attention"] == want_prefill
    assert cpu32["kv_write"] == ("native-c rope_write" if want_decode == "native-c" else "torch")  # float32 pages
    # a bf16 model on the bf16 GEMM (vdpbf16ps on this CPU) keeps float32 rows: the rope kernel writes its pages
    bf16_gemm = want_decode == "native-c" and "avx512_bf16" in (cpu_flags() or frozenset())
    assert kernel_backends("cpu", "bfloat16", "fp32")["kv_write"] == ("native-c rope_write" if bf16_gemm else "torch")
    assert cpu32["backend"] == ("native-cpu" if want_decode == "native-c" else "torch")
    for mode in KV_FORMATS:                                       # fp16 and the quantized pages too
        assert kernel_backends("cpu", "bfloat16", mode)["decode_attention"] == want_decode, mode
    assert kernel_backends("cpu", "bfloat16", "bf16")["linear"] == ("native-bf16" if bf16_gemm else "torch")
    monkeypatch.setenv("EVALRUN_LINEAR", "onednn")                                 # asked for by name
    assert kernel_backends("cpu", "float32", "fp32")["linear"] == (
        "onednn-prepacked" if torch.backends.mkldnn.is_available() else "torch")
    built = list(fresh_native.glob("kernels/paged_decode-*.so"))
    assert len(built) == (want_decode == "native-c")              # built exactly when it is used


def test_unsupported_or_inconsistent_inputs_fall_back_or_raise():
    """Shapes the kernel cannot take go to the reference; bad page ids/lengths raise, never read wild."""
    _need_native()
    q, layer, meta = _paged_case(6, 2, 16, 8, [3, 9, 17], "fp32", seed=7)
    k, v = layer.k, layer.v
    fp32 = layer.fmt
    supported = paged_decode.supported
    assert supported(q, layer)
    assert not supported(q[:, :0], layer)                                          # no query heads
    assert not supported(q[..., :8], layer)                                        # head size differs from the cache
    assert not supported(q[:, :5], layer)                                          # Hq not a multiple of Hkv
    assert not supported(q, LayerKV(fp32, k, v.transpose(1, 2)))                   # V not contiguous
    assert not supported(q, LayerKV(fp32, k, v.bfloat16()))                        # K/V dtypes differ
    assert not supported(q, LayerKV(fp32, k.double(), v.double()))                 # a dtype the kernel cannot read
    v16 = LayerKV(fp32, k, v.bfloat16())
    torch.testing.assert_close(NativeCpuKernels().attention(q, v16, meta, 0.25),   # falls back, no error
                               paged_attention_torch(q, v16, meta, 0.25))
    bad = meta.page_table.clone()
    bad[0, 0] = k.shape[0]                                                         # one past the null page
    with pytest.raises(ValueError, match="page ids"):
        paged_decode.paged_decode_native(q, layer, bad, meta.seq_lens_k, 0.25)
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="page ids"):
        paged_decode.paged_decode_native(q, layer, bad, meta.seq_lens_k, 0.25)
    too_long = meta.seq_lens_k.clone()
    too_long[1] = meta.page_table.shape[1] * 8 + 1
    with pytest.raises(ValueError, match="sequence lengths"):
        paged_decode.paged_decode_native(q, layer, meta.page_table, too_long, 0.25)
    with pytest.raises(ValueError, match="do not match"):
        paged_decode.paged_decode_native(q, layer, meta.page_table[:2], meta.seq_lens_k[:2], 0.25)


@pytest.mark.parametrize("mode", QUANTIZED)
def test_unsupported_quantized_inputs_fall_back_or_raise(mode):
    """The same guards for a cache of codes and scales."""
    _need_native()
    q, layer, meta = _paged_case(4, 2, 32, 8, [3, 9, 17], mode, seed=9)
    qa = rotate(q, 32)
    assert paged_decode.supported(qa, layer)
    assert not paged_decode.supported(qa[..., :16], layer)                        # head size differs
    assert not paged_decode.supported(qa, LayerKV(layer.fmt, layer.k, layer.v, layer.k_scale,
                                                  layer.v_scale.transpose(1, 2)))  # scales not contiguous
    bad = meta.page_table.clone()
    bad[2, 1] = layer.k.shape[0]
    with pytest.raises(ValueError, match="page ids"):
        paged_decode.paged_decode_native(qa, layer, bad, meta.seq_lens_k, 0.25)


def _mismatched(layer: LayerKV, case: str) -> LayerKV:
    """A LayerKV whose tensors disagree with K's shape, or with its format, in one way."""
    f, k, v, ks, vs = layer.fmt, layer.k, layer.v, layer.k_scale, layer.v_scale
    return {"v-head-size": lambda: LayerKV(f, k, v[..., :8].contiguous(), ks, vs),
            "v-kv-heads": lambda: LayerKV(f, k, v[:, :, :1].contiguous(), ks, vs),
            "v-pages": lambda: LayerKV(f, k, v[:2].contiguous(), ks, vs),
            "scale-groups": lambda: LayerKV(f, k, v, ks, vs[..., :0].contiguous()),
            "code-width": lambda: LayerKV(KV_FORMATS["q8"], k, v, ks, vs)}[case]()


@pytest.mark.parametrize("mode,case", [("fp32", "v-head-size"), ("fp32", "v-kv-heads"), ("fp32", "v-pages"),
                                       ("q4", "v-head-size"), ("q4", "scale-groups"), ("q4", "code-width")])
def test_inconsistent_layer_is_not_supported(mode, case):
    _need_native()
    q, layer, _ = _paged_case(4, 2, 32, 8, [3, 9, 17], mode, seed=10)
    qa = rotate(q, 32) if layer.fmt.rotate else q
    assert paged_decode.supported(qa, layer)
    assert not paged_decode.supported(qa, _mismatched(layer, case))          # checked only: never run


@pytest.mark.parametrize("mode,d", [("fp32", 8), ("bf16", 8), ("q8", 32), ("q6", 32), ("q4", 32)])
def test_empty_context_gives_zeros(mode, d):
    _need_native()
    q, layer, meta = _paged_case(4, 2, d, 4, [2, 5], mode, seed=8)
    out = paged_decode.paged_decode_native(q, layer, meta.page_table, torch.zeros(2, dtype=torch.int32), 0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_cached_library_is_loadable_by_other_users(fresh_native):
    _need_native()
    (lib,) = fresh_native.glob("kernels/paged_decode-*.so")
    assert lib.stat().st_mode & 0o055 == 0o055          # group/other may read and map it


@pytest.mark.parametrize("mode", ["fp32", "q8", "q4"])
def test_native_decode_softmax_over_a_wide_score_range(mode):
    """Scores hundreds apart: the vectorized exp must flush far-below-max weights to 0 as expf's
    underflow does, and stay within tolerance of the reference on the rest."""
    _need_native()
    q, layer, meta = _paged_case(9, 3, 64, 16, [7, 40, 300], mode, seed=11)
    q = q * 40.0                                                    # scores spread over hundreds
    ref = paged_attention_torch(q, layer, meta, 0.125)
    assert torch.isfinite(ref).all()
    out = _decode_native_unrotated(q, layer, meta.page_table, meta.seq_lens_k, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_native_decode_is_batch_invariant():
    """A row's output is bitwise the same alone and among 7 or 31 other rows (MMLU resume,
    batch-size flags and speculative decoding rely on it)."""
    _need_native()
    lens = [300 + (i * 37) % 200 for i in range(32)]
    q, layer, meta = _paged_case(9, 3, 64, 256, lens, "fp32", seed=5)
    for t in layer.data_tensors():
        t.nan_to_num_(0.0)
    full = paged_decode.paged_decode_native(q, layer, meta.page_table, meta.seq_lens_k, 0.125)
    for b in (1, 8, 32):
        part = paged_decode.paged_decode_native(q[:b], layer, meta.page_table[:b], meta.seq_lens_k[:b], 0.125)
        assert torch.equal(part, full[:b])
