"""Native CPU paged decode attention (evalrun/kernels/cpu/csrc/paged_decode.c), for every KVFormat.

    q           [B, Hq, D]   one query per sequence, already in the attention domain
                             (rotated for rotating formats: see kernels.attention.attend)
    layer       LayerKV      read in place: floats converted and codes dequantized a block of
                             head rows at a time into an L1-sized buffer (no copy of the context)
    page_table  [B, max_pages] int32, seq_lens [B] int32
    window      formats with a recent-token window: each sequence reads positions from its
                window start on from its block of the store (layer.wk / layer.wv), rows
                pos - start (window_slots / window_starts [B] int32)
    sliding_window  a layer's sliding window W (0: none): each query attends its last W positions
    softcap     a layer's soft-capping c (0: none): scores s -> c tanh(s / c) before the softmax
Same contract as the torch reference `kernels.attention.decode_torch`.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native
from ..attention import AttentionMetadata, check_pages, check_window
from ..kv_format import LayerKV

# storage kinds of paged_decode.c
_FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CODE_KINDS = {8: 3, 4: 4}


_P, _I32 = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "paged_decode": (_I32, [_P, _P, _P, _P, _P, _I32, _I32, _I32,     # q, k, v, scales, kinds, group
                            _P, _I32, _P, _P,                         # table, width, lens, out
                            _I32, _I32, _I32, _I32, _I32, ctypes.c_float,   # B, Hq, Hkv, D, S, scale
                            _P, _I32, _I32,                           # scratch, lmax, threads
                            _P, _P, _I32, _I32, _P, _P,               # window store, kind, rows, slots, starts
                            _I32, ctypes.c_float]),                   # sliding window, soft-capping
}


def _lib() -> Optional[ctypes.CDLL]:
    return native.load("paged_decode", SIGNATURES)


def num_threads(b: int, lmax: int, hq: int, d: int) -> int:
    """Threads for b sequences of up to lmax positions: a second thread pays for its hand-over
    only with enough work (~2M multiply-adds per pass); one sequence is one task."""
    return 1 if b * lmax * hq * d < 2 ** 21 else max(1, min(torch.get_num_threads(), b, 64))


def available() -> bool:
    return _lib() is not None


def kinds(layer: LayerKV) -> Optional[tuple[int, int]]:
    fmt = layer.fmt
    if fmt.quantized:
        return _CODE_KINDS[fmt.k_bits], _CODE_KINDS[fmt.v_bits]
    kind = _FLOAT_KINDS.get(layer.k.dtype)
    return None if kind is None or layer.v.dtype != layer.k.dtype else (kind, kind)


def supported(q: torch.Tensor, layer: LayerKV) -> bool:
    """CPU tensors, contiguous storage of a kind the kernel reads, a head size matching q's,
    GQA-compatible head counts, and the kernel built."""
    return layout_supported(q, layer) and available()


def layout_supported(q: torch.Tensor, layer: LayerKV) -> bool:
    """q [T, Hq, D] and the layer's tensors as the native attention kernels read them: CPU,
    contiguous, every tensor as the format lays out one cache of this shape (the window store
    too), a head size matching q's and GQA-compatible head counts."""
    if q.dim() != 3 or layer.k.dim() != 4 or kinds(layer) is None:
        return False
    hq, d = q.shape[1:]
    hkv = layer.num_kv_heads
    shapes_ok = hq >= 1 and hkv >= 1 and hq % hkv == 0 and layer.head_dim == d and d >= 1
    if shapes_ok:                      # every tensor as the format lays out one cache of this shape
        try:
            want = layer.fmt.slot_shapes(hkv, d)
        except ValueError:
            return False
        lead = tuple(layer.k.shape[:2])
        got = {"k": layer.k, "v": layer.v, "k_scale": layer.k_scale, "v_scale": layer.v_scale}
        shapes_ok = all(got[name] is not None and tuple(got[name].shape) == (*lead, *shape)
                        and got[name].dtype == dtype for name, (shape, dtype) in want.items())
        shapes_ok = shapes_ok and all(got[name] is None for name in got if name not in want)
    if shapes_ok and layer.fmt.window:
        shapes_ok = all(t is not None and tuple(t.shape[1:]) == (layer.fmt.window, hkv, d)
                        and t.dtype in _FLOAT_KINDS for t in (layer.wk, layer.wv))
    tensors = layer.tensors() + layer.window_tensors()
    on_cpu = q.device.type == "cpu" and all(t.device.type == "cpu" for t in tensors)
    return shapes_ok and on_cpu and all(t.is_contiguous() for t in tensors)


def decode_native(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The decode group of a batch whose metadata build_metadata checked (a `DecodeFn`)."""
    nd = meta.num_decode
    window = None if not layer.fmt.window else (meta.window_slots[:nd], meta.window_starts[:nd])
    return _call(q, layer, meta.page_table[:nd], meta.seq_lens_k[:nd], scale, window, sliding_window, softcap)


def paged_decode_native(q: torch.Tensor, layer: LayerKV, page_table: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float,
                        window: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                        sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] in q's dtype, float32 math. Page ids, lengths and window
    rows are checked against the cache, the table and the store before the C code reads them."""
    if not available():
        raise RuntimeError("the native paged decode kernel is not available (see kernels.native)")
    if not supported(q, layer):
        raise ValueError(f"paged_decode_native cannot take q {tuple(q.shape)} {q.device} with a "
                         f"{layer.fmt.name} cache of K {tuple(layer.k.shape)} {layer.k.dtype}")
    b = q.shape[0]
    if page_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match {b} sequences")
    check_pages(page_table, seq_lens, layer.page_size, layer.k.shape[0] - 1)
    check_window(layer, seq_lens, window)
    if not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an integer >= 0, got {sliding_window!r}")
    if not softcap >= 0.0:
        raise ValueError(f"softcap must be >= 0, got {softcap!r}")
    return _call(q, layer, page_table, seq_lens, scale, window, sliding_window, softcap)


def _call(q: torch.Tensor, layer: LayerKV, page_table: torch.Tensor, seq_lens: torch.Tensor,
          scale: float, window: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
          sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    b, hq, d = q.shape
    s, hkv = layer.page_size, layer.num_kv_heads
    if b == 0:
        return torch.empty(0, hq, d, dtype=q.dtype)
    qf = q.float().contiguous()
    table = page_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    lmax = max(1, int(lens.max()))
    threads = num_threads(b, lmax, hq, d)
    per_thread = hq * lmax + hq * d + 64 * d + hq          # SCRATCH() in paged_decode.c
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    out = torch.empty(b, hq, d, dtype=torch.float32)
    k_kind, v_kind = kinds(layer)
    ptr = lambda t: None if t is None else t.data_ptr()     # noqa: E731
    win_slots = win_starts = None
    w_kind, rows = 0, 0
    if layer.fmt.window:
        win_slots, win_starts = (t.to(torch.int32).contiguous() for t in window)
        w_kind, rows = _FLOAT_KINDS[layer.wk.dtype], layer.fmt.window
    rc = _lib().paged_decode(qf.data_ptr(), layer.k.data_ptr(), layer.v.data_ptr(), ptr(layer.k_scale),
                             ptr(layer.v_scale), k_kind, v_kind, layer.fmt.group_size,
                             table.data_ptr(), table.shape[1], lens.data_ptr(), out.data_ptr(),
                             b, hq, hkv, d, s, scale, scratch.data_ptr(), lmax, threads,
                             ptr(layer.wk if layer.fmt.window else None), ptr(layer.wv if layer.fmt.window else None),
                             w_kind, rows, ptr(win_slots), ptr(win_starts), sliding_window, softcap)
    if rc != 0:
        raise ValueError(f"native paged decode does not support Hq={hq}, Hkv={hkv}, D={d}, "
                         f"format {layer.fmt.name}")
    return out.to(q.dtype)
