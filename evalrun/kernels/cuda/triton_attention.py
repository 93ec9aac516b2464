"""Triton paged attention (the CUDA path), same contract as the torch reference in
evalrun/kernels/ref/attention.py: `decode_torch` for the decode group, `attend`'s SDPA loop for prefill.

Layouts (evalrun/kernels/attention.py, evalrun/kernels/kv_format.py):
    q            [T, Hq, D]        packed queries, model dtype, last dim contiguous; the decode
                                   group (q_len 1) first, already in the attention domain
                                   (rotated by the caller for rotating formats)
    layer        LayerKV           contiguous pages [P + 1, S, Hkv, row]: floats (fp32 / bf16 /
                                   fp16) or uint8 codes + fp16 group scales (q8 / q6 / q4);
                                   windowed formats also read the store wk / wv [J, W, Hkv, D]
    page_table   [B, max_pages] int32, seq_lens [B] int32, cu_seqlens_q [B + 1] int32

Decode: one program per (sequence, KV head, split of SPLIT_LEN positions). It holds the Hq / Hkv
query heads of its KV head as the rows of one tile (GQA: each K/V row is read once for the
whole group), walks its split in blocks of BLOCK_N positions, finds each position's slot
through the page table (page * S + pos % S; a block may cross pages) and keeps an online
softmax in float32. A second kernel merges the splits by their maxima and sums:

    context of b:  | split 0 | split 1 | ... |        partials acc [Bd, Hq, splits, D], (m, l)
    out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s        (M = max_s m_s)

Prefill: one program per (sequence, query head, block of BLOCK_M queries), causal over
its context read through the page table (query i sits at position L - q_len + i).

Layer variants (both kernels; 0 turns each off, and the kernels built without it are today's):
    sliding window W   query at position t attends keys t - W < p <= t: a decode row's splits
                       start at max(0, L - W) (so it has cdiv(min(L, W), SPLIT_LEN) of them),
                       a prefill block's key loop at its first query's t - W + 1, masked per query
    soft-capping c     each scaled score s becomes c tanh(s / c) in float32 before the mask and
                       the online softmax (scores are kept in base 2: s log2(e) = c' tanh(s' / c')
                       with s' = s log2(e), c' = c log2(e)); tanh from plain arithmetic (triton_tiles.tanh)

Device helpers (K/V rows from pages, codes or the window store; the dot; the online softmax;
tanh): kernels/cuda/triton_tiles.py, jitted with these kernels in one scope.

Numerics: 16-bit caches read by a query of the same dtype multiply in that dtype on the
tensor cores with float32 accumulation (products exact) and round the probabilities to it
for P @ V, as flash-attn does; every other case (fp32, mixed dtypes, dequantized codes)
runs in float32 ("ieee" dot). Masked loads never touch a slot beyond a sequence's length,
so NaN-poisoned slots stay unread. Triton's interpreter (TRITON_INTERPRET=1, read when
this module is imported) runs the same kernels on CPU tensors; its tl.dot misreads bf16,
so there the 16-bit dot is emulated in float32 from the same rounded inputs.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..attention import AttentionMetadata, check_pages, check_window
from ..kv_format import LayerKV
from .jit import cdiv, jit_kernels, next_power_of_2
from .triton_tiles import TILES, cast, load_kv, mma, online_softmax, soft_cap

if TYPE_CHECKING:              # the kernel bodies' names, bound by jit_kernels
    import triton.language as tl

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when this module's kernels were built for Triton's interpreter."""
    return kernels().interpreting


def supported(q: torch.Tensor, layer: LayerKV) -> bool:
    """What these kernels read: contiguous storage of any KVFormat with float window and
    scales, a query [T, Hq, D] of the layer's head size with Hq a multiple of Hkv, on a CUDA
    device (any device under the interpreter)."""
    if q.dim() != 3 or q.dtype not in _FLOATS or q.stride(-1) != 1 or layer.k.dim() != 4:
        return False
    hq, d = q.shape[1:]
    hkv = layer.num_kv_heads
    if hkv < 1 or hq % hkv or layer.head_dim != d:
        return False
    try:
        want = layer.fmt.slot_shapes(hkv, d)
    except ValueError:
        return False
    got = {"k": layer.k, "v": layer.v, "k_scale": layer.k_scale, "v_scale": layer.v_scale}
    lead = tuple(layer.k.shape[:2])
    if any(got[n] is None or tuple(got[n].shape) != (*lead, *shape) or got[n].dtype != dt
           for n, (shape, dt) in want.items()):
        return False
    if layer.fmt.window and not all(t is not None and t.dtype in _FLOATS and tuple(t.shape[1:]) ==
                                    (layer.fmt.window, hkv, d) for t in (layer.wk, layer.wv)):
        return False
    tensors = [q] + layer.tensors() + layer.window_tensors()
    on_device = interpreting() or all(t.device.type == "cuda" for t in tensors)
    return on_device and len({t.device for t in tensors}) == 1 and all(t.is_contiguous() for t in tensors[1:])


# --- decode ---------------------------------------------------------------------------------
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, wk_ptr, wv_ptr, wslot_ptr, wstart_ptr,
                   table_ptr, lens_ptr, acc_ptr, ml_ptr,
                   scale_log2, q_stride_t, q_stride_h, table_stride, split_len, num_splits,
                   sliding_window, cap_log2,
                   HKV: tl.constexpr, GQA: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, WINDOW: tl.constexpr,
                   NATIVE: tl.constexpr, EMULATE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
                   ROUND_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * split_len
    if SLIDING:                    # the row's splits start at its window's first key
        start += tl.maximum(seq_len - sliding_window, 0)
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, BLOCK_G)
    col = tl.arange(0, BLOCK_D)
    dmask = col < D
    heads = kh * GQA + g                                                          # [G]
    q = tl.load(q_ptr + b.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h + col[None, :],
                mask=(g < GQA)[:, None] & dmask[None, :], other=0.0)              # [G, D]
    if ROUND_Q:                    # bfloat16 keys: q rounded to bfloat16 (kernels/ref/attention.py)
        q = cast(q, tl.bfloat16, EMULATE).to(tl.float32)
    w_slot = 0
    w_start = 0
    if WINDOW > 0:
        w_slot = tl.load(wslot_ptr + b)
        w_start = tl.load(wstart_ptr + b)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)                                          # [N]
        pmask = pos < end
        page = tl.load(table_ptr + b * table_stride + pos // PAGE, mask=pmask, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        k, v = load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, wk_ptr, wv_ptr, slot, pos, pmask, kh, col, dmask,
                       w_slot, w_start, HKV, D, K_BITS, V_BITS, GROUP, WINDOW)    # [N, D]
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], tl.float32), NATIVE, EMULATE) * scale_log2
        s = tl.where(pmask[None, :], soft_cap(s, cap_log2, SOFTCAP), float("-inf"))   # [G, N]
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, NATIVE, EMULATE, False)
    part = (b * (HKV * GQA) + heads).to(tl.int64) * num_splits + split           # [G]
    gmask = (g < GQA) & (start < seq_len)          # a split past the row's length stores nothing: the
    tl.store(acc_ptr + part[:, None] * D + col[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=gmask)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=gmask)


def _combine_kernel(acc_ptr, ml_ptr, out_ptr, lens_ptr, out_stride_t, out_stride_h, num_splits, split_len,
                    sliding_window, EMULATE: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SLIDING: tl.constexpr):
    """A row's own splits (those its length reaches) merged in a fixed order, BLOCK_S at a time:
    its result depends on them alone, not on how many splits the grid has for a longer row of the
    batch or for the longest context a CUDA graph was captured for (masked lanes weigh exactly 0).
    SLIDING: the row's keys are its last min(L, sliding_window)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    col = tl.arange(0, BLOCK_D)
    base = (b * HQ + h).to(tl.int64) * num_splits
    keys = tl.maximum(tl.load(lens_ptr + b), 1)
    if SLIDING:
        keys = tl.minimum(keys, sliding_window)
    own = tl.minimum(tl.cdiv(keys, split_len), num_splits)
    m_max = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    for s0 in range(0, own, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        m_max = tl.maximum(m_max, tl.max(tl.load(ml_ptr + (base + sp) * 2, mask=sp < own,
                                                 other=float("-inf")), 0))
    o = tl.zeros([BLOCK_D], tl.float32)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    for s0 in range(0, own, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        smask = sp < own
        m = tl.load(ml_ptr + (base + sp) * 2, mask=smask, other=float("-inf"))
        w = tl.exp2(m - m_max)                         # empty splits (m = -inf) weigh 0
        den += tl.sum(tl.load(ml_ptr + (base + sp) * 2 + 1, mask=smask, other=0.0) * w, 0)
        acc = tl.load(acc_ptr + (base + sp)[:, None] * D + col[None, :], mask=smask[:, None] & (col < D)[None, :],
                      other=0.0)                                                   # [S, D]
        o += tl.sum(acc * w[:, None], 0)
    tl.store(out_ptr + b.to(tl.int64) * out_stride_t + h * out_stride_h + col,
             cast(o / den, out_ptr.dtype.element_ty, EMULATE), mask=col < D)


# --- prefill ---------------------------------------------------------------------------------
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, table_ptr, lens_ptr, cu_q_ptr,
                    scale_log2, q_stride_t, q_stride_h, out_stride_t, out_stride_h, table_stride, first_seq,
                    sliding_window, cap_log2,
                    HKV: tl.constexpr, GQA: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr,
                    NATIVE: tl.constexpr, EMULATE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
                    ROUND_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = first_seq + tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m0 < q_len:
        seq_len = tl.load(lens_ptr + b)
        kh = h // GQA
        rows = m0 + tl.arange(0, BLOCK_M)
        col = tl.arange(0, BLOCK_D)
        rmask = rows < q_len
        dmask = col < D
        q_pos = seq_len - q_len + rows                                            # [M]
        tok = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * q_stride_t + h * q_stride_h + col[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)              # [M, D]
        if ROUND_Q:
            q = cast(q, tl.bfloat16, EMULATE).to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_end = tl.minimum(seq_len, seq_len - q_len + m0 + BLOCK_M)              # past the last query
        k_start = 0
        if SLIDING:                # the first query's window: rows after it mask its first keys
            k_start = tl.maximum(seq_len - q_len + m0 - sliding_window + 1, 0)
        for n0 in range(k_start, k_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < k_end
            page = tl.load(table_ptr + b * table_stride + pos // PAGE, mask=pmask, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            k, v = load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, k_ptr, v_ptr, slot, pos, pmask, kh, col, dmask,
                           0, 0, HKV, D, K_BITS, V_BITS, GROUP, 0)
            s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), NATIVE, EMULATE) * scale_log2
            keep = (pos[None, :] <= q_pos[:, None]) & pmask[None, :]
            if SLIDING:
                keep = keep & (pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(keep, soft_cap(s, cap_log2, SOFTCAP), float("-inf"))           # [M, N]
            m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, NATIVE, EMULATE, SLIDING)
        if SLIDING:                # padding rows past the context may have seen no key (not stored)
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * out_stride_t + h * out_stride_h + col[None, :],
                 cast(o, out_ptr.dtype.element_ty, EMULATE), mask=rmask[:, None] & dmask[None, :])


# --- host side ----------------------------------------------------------------------------------
LOG2E = 1.4426950408889634


def _format_args(q: torch.Tensor, layer: LayerKV) -> dict:
    fmt = layer.fmt
    native = not fmt.quantized and layer.k.dtype == q.dtype and q.dtype != torch.float32
    return dict(HKV=layer.num_kv_heads, GQA=q.shape[1] // layer.num_kv_heads, D=layer.head_dim,
                PAGE=layer.page_size, K_BITS=fmt.k_bits or 0, V_BITS=fmt.v_bits or 0, GROUP=fmt.group_size,
                NATIVE=native, EMULATE=interpreting(), BLOCK_D=max(16, next_power_of_2(layer.head_dim)),
                ROUND_Q=layer.k.dtype == torch.bfloat16 and q.dtype != torch.bfloat16)


def _variant_args(sliding_window: int, softcap: float) -> dict:
    """The kernels' arguments for a layer's sliding window (0: full causal) and soft-capping
    (0.0: none); either off builds the kernel without it."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0 (0: full attention), got {sliding_window!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0: none), got {softcap!r}")
    return dict(sliding_window=min(sliding_window, 2 ** 31 - 1), cap_log2=float(softcap) * LOG2E,
                SLIDING=sliding_window > 0, SOFTCAP=softcap > 0)


def _scales(layer: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale tensors, or the code tensors as unused stand-ins for float formats."""
    return (layer.k_scale, layer.v_scale) if layer.fmt.quantized else (layer.k, layer.v)


SPLIT_LEN = 512      # decode positions per program: fixed, so a row's result never depends on the batch


def _decode(q: torch.Tensor, layer: LayerKV, page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
            max_len: int, window: Optional[tuple[torch.Tensor, torch.Tensor]],
            split_len: Optional[int], block_n: Optional[int], variant: dict) -> torch.Tensor:
    bd, hq, d = q.shape
    out = torch.empty_like(q)
    if bd == 0:
        return out
    args = _format_args(q, layer)
    block_n = block_n or (16 if interpreting() else 64)
    split_len = -(-(split_len or SPLIT_LEN) // block_n) * block_n             # whole blocks
    keys = min(max_len, variant["sliding_window"]) if variant["SLIDING"] else max_len      # a row's most keys
    splits = -(-max(1, keys) // split_len)
    acc = torch.empty(bd, hq, splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bd, hq, splits, 2, dtype=torch.float32, device=q.device)
    ks, vs = _scales(layer)
    w_slots, w_starts = window if layer.fmt.window else (seq_lens, seq_lens)
    wk, wv = (layer.wk, layer.wv) if layer.fmt.window else (layer.k, layer.v)
    kernels()._decode_kernel[(bd, layer.num_kv_heads, splits)](
        q, layer.k, layer.v, ks, vs, wk, wv, w_slots, w_starts, page_table, seq_lens, acc, ml,
        scale * LOG2E, q.stride(0), q.stride(1), page_table.stride(0), split_len, splits,
        WINDOW=layer.fmt.window, BLOCK_G=max(16, next_power_of_2(args["GQA"])), BLOCK_N=block_n, **args, **variant)
    kernels()._combine_kernel[(bd, hq)](acc, ml, out, seq_lens, out.stride(0), out.stride(1), splits, split_len,
                                        variant["sliding_window"], interpreting(), HQ=hq, D=d, BLOCK_S=16,
                                        BLOCK_D=args["BLOCK_D"], SLIDING=variant["SLIDING"])
    return out


def decode_triton(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The decode group of a batch whose metadata build_metadata checked (a `DecodeFn` for
    kernels.attention.attend): q [Bd, Hq, D] -> [Bd, Hq, D] in q's dtype. sliding_window,
    softcap: the layer's (0: none), as decode_torch takes them."""
    nd = meta.num_decode
    window = (meta.window_slots[:nd], meta.window_starts[:nd]) if layer.fmt.window else None
    return _decode(q, layer, meta.page_table[:nd], meta.seq_lens_k[:nd], scale, meta.max_seqlen_k,
                   window, None, None, _variant_args(sliding_window, softcap))


def paged_decode_triton(q: torch.Tensor, layer: LayerKV, page_table: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, window: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                        split_len: Optional[int] = None, block_n: Optional[int] = None,
                        sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] (same contract as paged_decode.paged_decode_native); page
    ids, lengths and window rows are checked first (this syncs with the device)."""
    variant = _variant_args(sliding_window, softcap)
    if not supported(q, layer):
        raise ValueError(f"the Triton decode kernel cannot take q {tuple(q.shape)} {q.dtype} {q.device} "
                         f"with a {layer.fmt.name} cache of K {tuple(layer.k.shape)} {layer.k.dtype}")
    if page_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match {q.shape[0]} sequences")
    check_pages(page_table.cpu(), seq_lens.cpu(), layer.page_size, layer.k.shape[0] - 1)
    check_window(layer, seq_lens, window)
    if q.shape[0] and int(seq_lens.min()) < 1:
        raise ValueError("decode rows attend at least their own token: seq_lens must be >= 1")
    max_len = int(seq_lens.max()) if q.shape[0] else 0
    return _decode(q, layer, page_table.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
                   scale, max_len, window, split_len, block_n, variant)


def prefill_triton(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                   block_m: Optional[int] = None, block_n: Optional[int] = None,
                   sliding_window: int = 0, softcap: float = 0.0) -> None:
    """Rows of the prefill sequences (after the decode group) of out [T, Hq, D]; formats
    without a recent-token window (the caller rotates q and out for rotating ones)."""
    variant = _variant_args(sliding_window, softcap)
    num_prefill = len(meta.prefill)
    if not num_prefill:
        return
    if layer.fmt.window:
        raise ValueError("the Triton prefill kernel reads no recent-token window: use kernels.attention.attend")
    args = _format_args(q, layer)
    block_m = block_m or (16 if interpreting() else 64)
    block_n = block_n or (16 if interpreting() else 64)
    ks, vs = _scales(layer)
    grid = (num_prefill, q.shape[1], cdiv(meta.max_seqlen_q, block_m))
    kernels()._prefill_kernel[grid](q, layer.k, layer.v, ks, vs, out, meta.page_table, meta.seq_lens_k, meta.cu_seqlens_q,
                          scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                          meta.page_table.stride(0), meta.num_decode, BLOCK_M=block_m, BLOCK_N=block_n, **args,
                          **variant)


def paged_attention_triton(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                           sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode group and prefill sequences of a packed batch, formats without a window; q in
    the attention domain. sliding_window, softcap: the layer's (0: none). Returns [T, Hq, D]
    in q's dtype."""
    out = torch.empty_like(q)
    if meta.num_decode:
        out[: meta.num_decode] = decode_triton(q[: meta.num_decode], layer, meta, scale, sliding_window, softcap)
    prefill_triton(q, layer, meta, scale, out, sliding_window=sliding_window, softcap=softcap)
    return out


JIT = (*TILES, _decode_kernel, _combine_kernel, _prefill_kernel)


@functools.cache
def kernels() -> Any:
    """This module's kernels, jitted on first use (kernels/cuda/jit.py)."""
    return jit_kernels(globals(), JIT)
