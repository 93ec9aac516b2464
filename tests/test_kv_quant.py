"""Quantized KV cache formats (evalrun/kernels/ref/kv_quant.py, evalrun/kernels/kv_format.py, evalrun/kernels/ref/cache_ops.py)
against independent references: the error bound the scheme promises, a Hadamard matrix
built from its closed form, a 4-bit layout packed with plain integers, and attention over
the dequantized cache computed naively in float64."""
from __future__ import annotations

import math

import pytest
import torch

from evalrun.kernels.attention import build_metadata
from evalrun.kernels.ref.attention import paged_attention_torch
from evalrun.kernels.ref.cache_ops import copy_page_prefix, gather_kv, write_kv
from evalrun.kernels.kv_format import KV_FORMATS, KVFormat, LayerKV, kv_format
from evalrun.kernels.ref.kv_quant import dequantize, hadamard, quantize, rotate

# page storage alone: the formats without their recent-token window (that: tests/test_kv_window.py)
PAGE_FORMATS = {m: kv_format(f, window=0) if f.quantized else f for m, f in KV_FORMATS.items()}

G = 32                                   # the group size of every KV_FORMATS entry
QMAX = {8: 127, 4: 7}
CPU = torch.device("cpu")
QUANTIZED = [name for name, f in KV_FORMATS.items() if f.quantized]      # q8, q6, q4


def _hadamard_ref(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(n), float64 (the closed form of Sylvester's H)."""
    return torch.tensor([[(-1) ** (i & j).bit_count() for j in range(n)] for i in range(n)],
                        dtype=torch.float64) / math.sqrt(n)


def _groups(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // G, G)                     # [..., D/G, G]


def _unrotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] in the rotated domain -> float64 original domain (H is its own inverse)."""
    return (_groups(x.double()) @ _hadamard_ref(G)).reshape(x.shape)


def _data(kind: str, g: torch.Generator) -> torch.Tensor:
    """[64, 128] float32 test vectors (4 groups of 32 per row)."""
    x = torch.randn(64, 128, generator=g)
    if kind == "outliers":                        # one value per group 100x larger
        rows = torch.arange(64)[:, None]
        cols = torch.arange(0, 128, G)[None, :] + torch.randint(0, G, (64, 4), generator=g)
        x[rows, cols] *= 100
    elif kind == "student-t":                     # 2 degrees of freedom: heavy tails
        chi2 = torch.randn(64, 128, 2, generator=g).pow(2).sum(-1)
        x = x / (chi2 / 2).sqrt()
    elif kind == "zero-groups":                   # every third group zero, and a whole zero row
        _groups(x)[:, ::3] = 0
        x[5] = 0
    elif kind == "tiny":                          # scales in the float16 subnormal range and below
        x = x * torch.logspace(-10, -4, 64)[:, None]
    elif kind == "large":
        x = x * 1e4
    return x


DATA = ["normal", "outliers", "student-t", "zero-groups", "tiny", "large"]


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rotation", [False, True])
def test_quantize_error_within_the_group_bound(kind, bits, rotation):
    """Per value |error| <= scale / 2 in the quantized domain; per group L2 error
    <= sqrt(G) * scale / 2 in the original domain; the scale is the least float16 that
    keeps every code within +-qmax."""
    x = _data(kind, torch.Generator().manual_seed(bits * 10 + rotation))
    codes, scales = quantize(x, bits, G, rotation)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 128 * bits // 8)
    assert scales.dtype == torch.float16 and scales.shape == (64, 128 // G)
    s = scales.double()                                                      # [64, D/G]
    quantized = rotate(x, G) if rotation else x                              # what was rounded
    exact = _groups(quantized.double()).abs().amax(-1) / QMAX[bits]
    assert (s >= exact * (1 - 2 ** -23)).all()                               # no code clips
    below = torch.nextafter(scales, torch.zeros_like(scales)).double()
    assert ((below < exact) | (s == 0)).all()                                # and no larger than needed
    assert torch.equal(s == 0, exact == 0)

    deq = dequantize(codes, scales, bits, G)                                 # [64, D], quantized domain
    err = _groups(deq.double() - quantized.double()).abs()                   # [64, D/G, G]
    slack = 1e-6 * _groups(quantized.double()).abs()                         # float32 rounding
    assert (err <= s[..., None] / 2 + slack).all()

    back = _unrotate(deq) if rotation else deq.double()
    l2 = _groups(back - x.double()).norm(dim=-1)                             # [64, D/G]
    assert (l2 <= math.sqrt(G) * s / 2 + 1e-5 * _groups(x.double()).norm(dim=-1)).all()
    if kind == "zero-groups":
        assert torch.equal(back[5], torch.zeros(128, dtype=torch.float64))   # zeros stay exact zeros


@pytest.mark.parametrize("kind", ["outliers", "student-t"])
@pytest.mark.parametrize("bits", [8, 4])
def test_rotation_lowers_the_error_on_outlier_heavy_data(kind, bits):
    """An outlier sets its group's scale; rotating spreads it over the group first, so the
    other values are rounded on a finer grid. Outliers: one value per group 10x larger.
    (At 100x a 4-bit group is dominated by the outlier either way: the gain is ~10%.)"""
    g = torch.Generator().manual_seed(bits)
    x = _data(kind, g)
    if kind == "outliers":
        x = _data("normal", g)
        _groups(x)[..., 7] *= 10
    errors = {}
    for rotation in (False, True):
        deq = dequantize(*quantize(x, bits, G, rotation), bits, G)
        back = _unrotate(deq) if rotation else deq.double()
        errors[rotation] = (back - x.double()).pow(2).mean().item()
    assert errors[True] < 0.5 * errors[False], errors


def test_rotation_changes_nothing_much_on_gaussian_data():
    """The other side of the trade: without outliers rotation neither helps nor hurts much."""
    x = _data("normal", torch.Generator().manual_seed(3))
    for bits in (8, 4):
        errors = [(_unrotate(dequantize(*quantize(x, bits, G, True), bits, G)) - x.double()).pow(2).mean(),
                  (dequantize(*quantize(x, bits, G, False), bits, G).double() - x.double()).pow(2).mean()]
        assert 0.8 < float(errors[0] / errors[1]) < 1.25


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = hadamard(n)
    assert h.dtype == torch.float32 and h.shape == (n, n)
    torch.testing.assert_close(h.double(), _hadamard_ref(n), atol=1e-7, rtol=0)
    torch.testing.assert_close(h, h.T, atol=0, rtol=0)
    torch.testing.assert_close(h @ h.T, torch.eye(n), atol=1e-6, rtol=0)
    torch.testing.assert_close(h @ h, torch.eye(n), atol=1e-6, rtol=0)       # its own inverse


@pytest.mark.parametrize("n", [0, 3, 12, 48])
def test_hadamard_needs_a_power_of_two(n):
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(n)


def test_rotate_preserves_dot_products_and_undoes_itself():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 3, 128, generator=g), torch.randn(5, 3, 128, generator=g)
    rx, ry = rotate(x, G), rotate(y, G)
    torch.testing.assert_close((rx * ry).sum(-1), (x * y).sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(_groups(rx).norm(dim=-1), _groups(x).norm(dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate(rx, G), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rx.double(), (_groups(x.double()) @ _hadamard_ref(G)).reshape(x.shape),
                               atol=1e-5, rtol=1e-6)
    assert rotate(x.bfloat16(), G).dtype == torch.float32


def _pack4(values: list[int], group: int) -> list[int]:
    """Signed 4-bit codes -> bytes, plain integers: byte j of a group holds element j in its
    low nibble and element j + group/2 in its high nibble, each offset by 8."""
    out = []
    for start in range(0, len(values), group):
        half = group // 2
        for j in range(half):
            out.append((values[start + j] + 8) | ((values[start + j + half] + 8) << 4))
    return out


def test_4bit_layout_by_hand():
    # group of 4, max 7 -> scale 1: codes 7, -7, 3, 0 -> +8: 15, 1, 11, 8
    # byte 0 = 15 | 11 << 4 = 191, byte 1 = 1 | 8 << 4 = 129;
    # group [14, -2, 6, -8] -> scale 2, codes 7, -1, 3, -4 -> 15, 7, 11, 4 -> bytes 191, 71
    x = torch.tensor([[7.0, -7.0, 3.0, 0.0, 14.0, -2.0, 6.0, -8.0]])
    codes, scales = quantize(x, 4, 4, rotation=False)
    assert codes.tolist() == [[191, 129, 191, 71]]
    assert scales.tolist() == [[1.0, 2.0]]
    assert dequantize(codes, scales, 4, 4).tolist() == x.tolist()


@pytest.mark.parametrize("bits", [8, 4])
def test_code_layout_matches_plain_integer_packing(bits):
    """Values that are exact multiples of a power-of-two scale quantize to known codes;
    their bytes are packed here with Python ints, and unpack back exactly."""
    g = torch.Generator().manual_seed(bits)
    qmax = QMAX[bits]
    ints = torch.randint(-qmax, qmax + 1, (3, 2 * G), generator=g)
    ints[:, 0] = qmax                                  # fixes each group's max: scale = 0.25 exactly
    ints[:, G] = -qmax
    x = ints.float() * 0.25
    codes, scales = quantize(x, bits, G, rotation=False)
    assert scales.tolist() == [[0.25, 0.25]] * 3
    for row, want in zip(codes.tolist(), ints.tolist()):
        assert row == (_pack4(want, G) if bits == 4 else [c + 128 for c in want])
    hand = torch.tensor([_pack4(r, G) if bits == 4 else [c + 128 for c in r] for r in ints.tolist()],
                        dtype=torch.uint8)
    assert torch.equal(dequantize(hand, scales, bits, G), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_scales_and_the_null_page_read_as_zero(bits):
    g = torch.Generator().manual_seed(0)
    junk = torch.randint(0, 256, (4, 3, 64 * bits // 8), generator=g, dtype=torch.uint8)
    out = dequantize(junk, torch.zeros(4, 3, 2, dtype=torch.float16), bits, G)
    assert torch.equal(out, torch.zeros(4, 3, 64))                          # any code times 0
    codes, scales = quantize(torch.zeros(2, 64), bits, G, rotation=True)
    assert torch.equal(scales, torch.zeros_like(scales))
    offset = 0x88 if bits == 4 else 128                                      # code 0 in both nibbles
    assert torch.equal(codes, torch.full_like(codes, offset))


@pytest.mark.parametrize("mode", QUANTIZED)
def test_null_page_of_an_allocated_cache_gathers_zeros(mode):
    layer = LayerKV.allocate(PAGE_FORMATS[mode], 3, 4, 2, 64, CPU)
    for t in layer.data_tensors():
        t[:2] = float("nan")
    k, v = gather_kv(layer, torch.arange(8, 12), torch.float32)             # page 2, the null page
    assert torch.equal(k, torch.zeros(4, 2, 64)) and torch.equal(v, torch.zeros(4, 2, 64))


def _naive(q, k, v, scale):
    """float64 causal GQA attention; q [q, Hq, D], k/v [L, Hkv, D]; queries are the last q positions."""
    qn, kn = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    future = torch.arange(kn)[None, :] > torch.arange(kn - qn, kn)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(future, -math.inf).softmax(-1), v)


def _unpack(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored codes + scales -> float64 values of the rotated domain, by the documented layout."""
    c = codes.long()
    if bits == 4:
        g = c.reshape(*c.shape[:-1], -1, G // 2)
        c = torch.cat([g & 15, g >> 4], -1).reshape(*c.shape[:-1], -1)
    c = c - (8 if bits == 4 else 128)
    return (_groups(c.double()) * scales.double()[..., None]).reshape(c.shape)


@pytest.mark.parametrize("mode", QUANTIZED)
def test_attention_over_quantized_pages_matches_dense_dequantized(mode):
    """paged_attention_torch (q rotated in, output rotated out, decode and prefill paths)
    equals float64 attention over the cache's codes dequantized and unrotated here."""
    fmt = PAGE_FORMATS[mode]
    hq, hkv, d, page_size, num_pages = 4, 2, 64, 4, 24
    g = torch.Generator().manual_seed(len(mode) + fmt.v_bits)
    q_lens, k_lens = [1, 1, 6, 9], [5, 14, 6, 21]
    layer = LayerKV.allocate(fmt, num_pages + 1, page_size, hkv, d, CPU)
    for t in layer.data_tensors():
        t[:num_pages] = float("nan")
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, dense = [], []
    for n in k_lens:
        need = -(-n // page_size)
        pages, perm = perm[:need], perm[need:]
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        write_kv(k, v, layer, slots)
        flat = [t.view(-1, *t.shape[2:])[slots] for t in layer.tensors()]   # k, v, k_scale, v_scale
        k_hat = _unrotate(_unpack(flat[0], flat[2], fmt.k_bits))
        v_hat = _unrotate(_unpack(flat[1], flat[3], fmt.v_bits))
        for orig, hat, s in ((k, k_hat, flat[2]), (v, v_hat, flat[3])):    # the cache holds k, v
            l2 = _groups(hat - orig.double()).norm(dim=-1)
            assert (l2 <= math.sqrt(G) * s.double() / 2 + 1e-5).all()
        tables.append(pages)
        dense.append((k_hat, v_hat))
    meta = build_metadata(q_lens, k_lens, tables, page_size, num_pages, CPU)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    out = paged_attention_torch(q, layer, meta, d ** -0.5)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    start = 0
    for (k_hat, v_hat), n in zip(dense, q_lens):
        ref = _naive(q[start:start + n], k_hat, v_hat, d ** -0.5)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=2e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("mode", QUANTIZED)
def test_write_kv_writes_only_its_slots(mode):
    fmt = PAGE_FORMATS[mode]
    layer = LayerKV.allocate(fmt, 4, 4, 2, 64, CPU)
    for t in layer.data_tensors():
        t.fill_(float("nan"))
    fills = {"k": 0xA5, "v": 0x5A}
    layer.k.fill_(fills["k"])
    layer.v.fill_(fills["v"])
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    slots = torch.tensor([5, 0, 13])
    write_kv(k, v, layer, slots)
    want = [*quantize(k, fmt.k_bits, G, fmt.rotate), *quantize(v, fmt.v_bits, G, fmt.rotate)]
    rest = torch.ones(layer.k.shape[0] * layer.k.shape[1], dtype=torch.bool)
    rest[slots] = False                                                        # slots not written
    for name, w in zip(("k", "k_scale", "v", "v_scale"), want):
        flat = getattr(layer, name).flatten(0, 1)                              # [(P+1)*S, Hkv, ...]
        assert torch.equal(flat[slots], w)
        assert (flat[rest] == fills[name]).all() if name in fills else flat[rest].isnan().all()
    gk, gv = gather_kv(layer, slots, torch.float32)
    assert torch.isfinite(gk).all() and torch.isfinite(gv).all()


@pytest.mark.parametrize("mode", QUANTIZED)
def test_copy_page_prefix_copies_codes_and_scales_of_the_prefix(mode):
    g = torch.Generator().manual_seed(4)
    layers = []
    for _ in range(2):
        layer = LayerKV.allocate(PAGE_FORMATS[mode], 5, 8, 2, 64, CPU)
        for t in layer.tensors():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
            else:
                t.copy_(torch.rand(t.shape, generator=g).half())
        layers.append(layer)
    before = [[t.clone() for t in layer.tensors()] for layer in layers]
    copy_page_prefix(layers, src_page=1, dst_page=3, num_tokens=5)
    for layer, old in zip(layers, before):
        assert len(layer.tensors()) == 4
        for t, b in zip(layer.tensors(), old):
            assert torch.equal(t[3, :5], b[1, :5])
            assert torch.equal(t[3, 5:], b[3, 5:])
            assert torch.equal(t[:3], b[:3]) and torch.equal(t[4], b[4])
        src, dst = torch.arange(8, 13), torch.arange(24, 29)                  # page 1 / page 3 slots 0..4
        for a, b in zip(gather_kv(layer, src, torch.float32), gather_kv(layer, dst, torch.float32)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", QUANTIZED)
def test_quantized_formats_need_whole_groups(mode):
    with pytest.raises(ValueError, match="not divisible"):
        LayerKV.allocate(PAGE_FORMATS[mode], 2, 4, 2, 48, CPU)
    layer = LayerKV.allocate(PAGE_FORMATS[mode], 2, 4, 2, 96, CPU)
    assert layer.head_dim == 96 and layer.k_scale.shape == (2, 4, 2, 3)
    assert layer.memory_bytes() == KV_FORMATS[mode].bytes_per_token(1, 2, 96) * 2 * 4


def test_kv_format_rejects_mixed_or_odd_widths():
    with pytest.raises(ValueError):
        KVFormat("x", k_bits=8)
    with pytest.raises(ValueError):
        KVFormat("x", k_bits=6, v_bits=6)
    with pytest.raises(ValueError):
        KVFormat("x", k_bits=4, v_bits=4, group_size=24)


@pytest.mark.parametrize("bits", [8, 4])
def test_values_beyond_the_float16_scale_range_stay_finite(bits):
    x = torch.zeros(1, G)
    x[0, 0], x[0, 1] = 65504.0 * QMAX[bits] * 1.5, 1.0
    codes, scales = quantize(x, bits, G, rotation=False)
    assert torch.isfinite(dequantize(codes, scales, bits, G)).all()


# --- the native versions (evalrun/kernels/cpu/csrc/kv_quant.c) against the torch references -----------


def _need_native_quant(monkeypatch):
    """The native module. It holds no torch reference to fall back to (a call its C code cannot take
    raises: test_native_quant_refuses_what_it_cannot_take), so a passing test ran the C code."""
    from evalrun.kernels.cpu import kv_quant as kv_quant_native
    if not kv_quant_native.quantize_available():
        pytest.skip("the native quantize kernel is not built here (no C compiler, native off or no F16C)")
    assert not any(hasattr(kv_quant_native, name) for name in ("write_kv_torch", "rotate", "quantize"))
    return kv_quant_native


def test_native_quant_refuses_what_it_cannot_take(monkeypatch):
    """No silent fallback: an unquantized cache or groups that do not divide the head raise."""
    nq = _need_native_quant(monkeypatch)
    k = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="write_kv_native"):
        nq.write_kv_native(k, k, LayerKV.allocate(KV_FORMATS["fp32"], 3, 4, 2, 32, torch.device("cpu")),
                           torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rotate_native"):
        nq.rotate_native(torch.randn(3, 48), 32)


def test_native_rotation_is_the_reference_bit_for_bit_and_batch_invariant(monkeypatch):
    nq = _need_native_quant(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(257, 9, 64, generator=g) * 7
    out = nq.rotate_native(x, G)
    assert torch.equal(out, rotate(x, G))
    assert torch.equal(out[100:101], nq.rotate_native(x[100:101], G))          # one row alone
    assert torch.equal(nq.rotate_native(x.bfloat16(), G), rotate(x.bfloat16(), G))
    assert torch.equal(x, torch.randn(257, 9, 64, generator=torch.Generator().manual_seed(3)) * 7)  # input untouched


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
@pytest.mark.parametrize("rotation", [True, False])
def test_native_quantize_on_write_is_the_reference_bit_for_bit(monkeypatch, mode, rotation):
    """Same codes and scales as write_kv_torch, on normal, outlier, zero and huge values,
    written only to the given slots; a group holding a NaN reads NaN in both."""
    import dataclasses
    nq = _need_native_quant(monkeypatch)
    fmt = dataclasses.replace(PAGE_FORMATS[mode], rotate=rotation)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(70, 3, 64, generator=g) * 3
    v = torch.randn(70, 3, 64, generator=g)
    k[3, 1, 5], v[9] = 1e6, 0.0                       # an outlier (beyond fp16 at 4 bits) and zero rows
    k[11, 0, :32] = 1e-9                               # scales among float16 subnormals
    slots = torch.randperm(9 * 16, generator=g)[:70]
    ref, got = (LayerKV.allocate(fmt, 9, 16, 3, 64, torch.device("cpu")) for _ in range(2))
    for layer in (ref, got):                           # allocate leaves real pages unwritten: set them alike
        for t in layer.tensors():
            t.zero_()
        for t in layer.data_tensors():
            t.fill_(float("nan"))
    write_kv(k, v, ref, slots)
    nq.write_kv_native(k, v, got, slots)
    for a, b in zip(ref.tensors(), got.tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))          # NaN slots included
    with pytest.raises(ValueError, match="slot ids"):
        nq.write_kv_native(k[:1], v[:1], got, torch.tensor([9 * 16]))
    for bad_k, bad_slots in ((k[:1, :1], slots[:1]), (k[:2], slots[:1]), (k[:1, :, :32], slots[:1])):
        with pytest.raises(ValueError, match="do not fit"):
            nq.write_kv_native(bad_k, bad_k, got, bad_slots)
    k[5, 2, 40] = float("nan")                                                   # one NaN: its group reads NaN
    write_kv(k[5:6], v[5:6], ref, slots[5:6])
    nq.write_kv_native(k[5:6], v[5:6], got, slots[5:6])
    assert torch.equal(ref.k_scale.view(torch.uint8), got.k_scale.view(torch.uint8))
    read = [gather_kv(layer, slots[5:6], torch.float32)[0][0, 2] for layer in (ref, got)]
    for r in read:
        assert r[32:].isnan().all() and not r[:32].isnan().any()


def test_native_backend_writes_and_rotates_natively_for_code_formats(monkeypatch):
    """The backend's q4 write and attention run without ever touching the torch fallbacks,
    and the manifest's description says so; fp32 writes stay torch (a float32 model's are the rope
    kernel's)."""
    _need_native_quant(monkeypatch)
    from evalrun.kernels.backend import NativeCpuKernels
    backend = NativeCpuKernels()
    assert backend.describe(KV_FORMATS["q4"])["kv_write"] == "native-c"
    # a bf16 model's K/V: written by the rope kernel where its rows are float32 (the bf16 GEMM), else torch's
    from evalrun.kernels.linear import linear_backend
    bf16_rows = "native-c rope_write" if linear_backend("cpu", torch.bfloat16) == "native-bf16" else "torch"
    assert backend.describe(KV_FORMATS["fp32"], torch.bfloat16)["kv_write"] == bf16_rows
    assert backend.describe(KV_FORMATS["fp32"], torch.float16)["kv_write"] == "torch"
    assert backend.describe(KV_FORMATS["fp32"])["kv_write"] == "native-c rope_write"
    layer = LayerKV.allocate(PAGE_FORMATS["q4"], 5, 8, 2, 64, torch.device("cpu"))
    backend.write_kv(torch.randn(32, 2, 64), torch.randn(32, 2, 64), layer, torch.arange(32))   # pages 0-3 whole
    meta = build_metadata([1, 3], [9, 11], [[0, 1], [2, 3]], 8, 4, torch.device("cpu"))
    assert torch.isfinite(backend.attention(torch.randn(4, 4, 64), layer, meta, 0.125)).all()
