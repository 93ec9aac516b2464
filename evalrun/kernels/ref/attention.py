"""Paged attention, torch reference (CPU and CUDA): every other backend's attention is checked
against it. Layouts and the metadata: evalrun/kernels/attention.py.

The torch reference gathers each sequence's keys through slot indices
(page * S + offset) built once per forward in `AttentionMetadata` and shared by
every layer; positions beyond a sequence's length read the null page, so stale
or NaN slots are never touched.

Quantized formats that rotate (q8/q6/q4) are attended in the rotated domain: the query is
rotated once per head before the kernels run and the output rotated back once after
(`attend`), so no cached vector is ever rotated back.

Formats with a recent-token window of W (evalrun/kernels/kv_format.py): query position t attends
the keys of its own block [floor(t/W)W, t] exactly (in the window dtype) and the earlier
ones through the codes. The exact values come from this forward's new K/V and, for the
part of the block computed in earlier forwards, from the job's block of the window store,
which `attend` keeps: a decode token is stored before the kernel reads it, a prefill
sequence's last partial block after its attention.

Pages of bfloat16 keys are scored against q rounded to bfloat16 (`scoring_query`), as torch's bf16
attention and flash-attention score them: each product of a key and a query element is then exact
in float32, which lets the native CPU kernels use the AVX512_BF16 dot instruction.

A layer with a sliding window of W (a model's, unrelated to the cache's recent-token window)
lets the query at position t attend the keys at positions t - W < p <= t only (transformers'
sliding_window_overlay); every path here takes it as `sliding_window` (0: full attention).
A layer with soft-capping c (Gemma 2) caps each scaled score s as c * tanh(s / c) before the
mask and the softmax (`softcap`, 0: none).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..attention import AttentionMetadata, DecodeFn, PrefillFn, PrefillSeq, RotateFn, decode_gather
from ..kv_format import LayerKV
from .cache_ops import gather_kv
from .kv_quant import rotate


def attend(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
           decode: Optional[DecodeFn] = None, rotation: RotateFn = rotate,
           k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
           prefill: Optional[PrefillFn] = None, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Paged attention of every sequence of the batch, in q's dtype [T, Hq, D]: the decode
    group through `decode` (default: the torch reference), prefill sequences through `prefill`
    (formats without a window; default: SDPA on each one's gathered context). Rotating formats:
    q rotated in, the output rotated out (with `rotation`, default the torch reference). k, v [T, Hkv, D]: this forward's new
    K/V (as written to the cache), which a windowed format needs. sliding_window, softcap: the
    layer's (0: none); `decode` then takes them as fifth and sixth arguments and `prefill` as
    keywords (where None: SDPA with the window's mask, or the scores written out where capped)."""
    fmt = layer.fmt
    if fmt.rotate:
        q = rotation(q, fmt.group_size).to(q.dtype)
    fresh = None
    if fmt.window:
        if k is None or v is None or meta.window != fmt.window:
            raise ValueError(f"cache mode {fmt.name} attends a window of {fmt.window} tokens: attention "
                             f"needs the new k and v and metadata built with that window (got {meta.window})")
        fresh = window_values(k, v, layer, rotation)
        store_window(layer, fresh, *meta.window_store_decode)
    out = torch.empty_like(q)
    variant = bool(sliding_window or softcap)
    if meta.num_decode:
        dec = decode or decode_torch
        qd = q[: meta.num_decode]
        out[: meta.num_decode] = dec(qd, layer, meta, scale, sliding_window, softcap) if variant else dec(qd, layer, meta, scale)
    native_prefill = prefill is not None and fresh is None
    if native_prefill and meta.prefill:
        rows = out[meta.prefill[0].q_start:]
        extra = {"sliding_window": sliding_window, "softcap": softcap} if variant else {}
        done = prefill(q, layer, meta, scale, out=rows, **extra)
        if done.data_ptr() != rows.data_ptr():            # the kernel could not write in place
            rows.copy_(done)
    for seq in () if native_prefill else meta.prefill:
        if fresh is not None:
            _prefill_windowed(q, fresh, layer, seq, scale, out, sliding_window, softcap)
            continue
        qs = scoring_query(q[seq.q_start: seq.q_start + seq.q_len], layer)       # [q, Hq, D]
        k, v = gather_kv(layer, seq.slots, q.dtype)                              # [L, Hkv, D]
        mask = sliding_mask(meta, seq, sliding_window) if sliding_window else seq.mask
        out[seq.q_start: seq.q_start + seq.q_len] = _sdpa(qs, k, v, mask, scale, softcap)
    if fresh is not None:                     # after every read: a sequence's last partial block
        store_window(layer, fresh, *meta.window_store_prefill)
    return rotation(out, fmt.group_size).to(q.dtype) if fmt.rotate else out


def scoring_query(q: torch.Tensor, layer: LayerKV) -> torch.Tensor:
    """q as the scores read it: rounded to bfloat16 (to nearest even) where the pages hold bfloat16
    keys, else unchanged; in q's dtype."""
    return q.to(torch.bfloat16).to(q.dtype) if layer.k.dtype == torch.bfloat16 else q


def key_in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """[q, k] bool: key position k_pos within the sliding window of query position q_pos (causal too)."""
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - sliding_window)


def sliding_mask(meta: AttentionMetadata, seq: PrefillSeq, sliding_window: int) -> torch.Tensor:
    """The [q_len, L] mask of a prefill sequence under a sliding window, made once per forward
    (every windowed layer of the batch reads it)."""
    key = ("sliding_mask", sliding_window, seq.q_start)
    if key not in meta.kernel_args:
        length = seq.slots.shape[0]
        device = seq.slots.device
        q_pos = torch.arange(length - seq.q_len, length, device=device)
        meta.kernel_args[key] = key_in_window(q_pos, torch.arange(length, device=device), sliding_window)
    return meta.kernel_args[key]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
          softcap: float = 0.0) -> torch.Tensor:
    """q [n, Hq, D] over k, v [L, Hkv, D] with mask [n, L] (None: causal, n == L) -> [n, Hq, D]:
    SDPA, or with soft-capping the scores written out, capped, masked and softmaxed in float32
    (as transformers' eager attention computes them)."""
    if not softcap:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vv).to(q.dtype)


# --- recent-token window --------------------------------------------------------------
def window_values(k: torch.Tensor, v: torch.Tensor, layer: LayerKV,
                  rotation: RotateFn = rotate) -> tuple[torch.Tensor, torch.Tensor]:
    """New K/V as the window holds them: in the attention domain, rounded to the window
    dtype (so a token reads the same from this forward as from the store later)."""
    fmt = layer.fmt
    if fmt.rotate:
        k, v = rotation(k, fmt.group_size), rotation(v, fmt.group_size)
    return k.to(fmt.window_dtype), v.to(fmt.window_dtype)


def store_window(layer: LayerKV, fresh: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor,
                 store_rows: torch.Tensor) -> None:
    """fresh[rows] -> the window store's flat rows (block * W + position % W)."""
    if len(rows):
        for store, x in zip(layer.window_tensors(), fresh):
            store.view(-1, *store.shape[2:]).index_copy_(0, store_rows, x[rows])


def _prefill_windowed(q: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor], layer: LayerKV,
                      seq: PrefillSeq, scale: float, out: torch.Tensor, sliding_window: int = 0,
                      softcap: float = 0.0) -> None:
    """One prefill sequence in one SDPA call: the codes before its last block, then the exact
    values from its first query's block on (from the store, computed earlier, and from this
    forward); seq.window_mask picks for each query the codes before its block and the exact
    values of its block."""
    w, dt = layer.fmt.window, q.dtype
    length = seq.slots.shape[0]
    start = length - seq.q_len                                          # first new position
    span = slice(seq.q_start, seq.q_start + seq.q_len)
    codes = gather_kv(layer, seq.slots[: (length - 1) // w * w], dt)
    kv = [torch.cat([c, store[seq.window_slot, : start % w].to(dt), new[span].to(dt)])
          for c, store, new in zip(codes, layer.window_tensors(), fresh)]               # [keys, Hkv, D]
    mask = seq.window_mask
    if sliding_window:                   # the keys' positions: the codes', then the block's on
        dev = mask.device
        k_pos = torch.cat([torch.arange((length - 1) // w * w, device=dev), torch.arange(start // w * w, length, device=dev)])
        mask = mask & key_in_window(torch.arange(start, length, device=dev), k_pos, sliding_window)
    out[span] = _sdpa(q[span], kv[0], kv[1], mask, scale, softcap)


def window_overlay(layer: LayerKV, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor,
                   lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode group: gathered [Bd, L, Hkv, D] K/V with the positions of each query's block
    replaced by the store's rows."""
    bd, lmax = k.shape[:2]
    w = layer.fmt.window
    starts = meta.window_starts[:bd].long()
    pos = torch.arange(lmax, device=k.device)
    inside = (pos[None] >= starts[:, None]) & (pos[None] < lens[:, None].long())       # [Bd, L]
    rows = meta.window_slots[:bd].long()[:, None] * w + (pos[None] - starts[:, None]).clamp(0, w - 1)
    out = []
    for x, store in zip((k, v), layer.window_tensors()):
        win = store.view(-1, *store.shape[2:])[rows.view(-1)].view(bd, lmax, *store.shape[2:]).to(x.dtype)
        out.append(torch.where(inside[..., None, None], win, x))
    return out[0], out[1]


def paged_attention_torch(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference implementation for every format; runs on CPU and CUDA. Returns [T, Hq, D]."""
    return attend(q, layer, meta, scale)


def decode_torch(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                 sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence (already in the attention domain), in float32. One pair of
    batched matmuls per KV head reads the gathered [Bd, L, Hkv, D] keys in place (row
    stride Hkv * D), so no permuted copy of the context is made; SDPA's CPU kernel is
    several times slower at q_len 1. Quantized formats: the gathered context is dequantized
    (this is the reference; the native kernel dequantizes a few head rows at a time into an
    L1-sized buffer and never copies the context)."""
    decode_slots, decode_mask = decode_gather(meta)
    bd, lmax = decode_slots.shape
    hkv, d = layer.num_kv_heads, layer.head_dim
    group = q.shape[1] // hkv
    k, v = gather_kv(layer, decode_slots.view(-1), torch.float32)
    k, v = k.view(bd, lmax, hkv, d), v.view(bd, lmax, hkv, d)                  # [Bd, L, Hkv, D]
    if layer.fmt.window:
        k, v = window_overlay(layer, meta, k, v, meta.seq_lens_k[:bd])
    qs = scoring_query(q, layer).view(bd, hkv, group, d).float()               # [Bd, Hkv, G, D]
    masked = ~decode_mask[:, 0]                                            # [Bd, 1, L]
    if sliding_window:                   # positions before the last `sliding_window`
        first = meta.seq_lens_k[:bd].long() - sliding_window
        masked = masked | (torch.arange(lmax, device=q.device)[None, None, :] < first[:, None, None])
    out = torch.empty(bd, hkv, group, d, dtype=torch.float32, device=q.device)
    for h in range(hkv):
        scores = torch.bmm(qs[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)  # [Bd, G, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(masked, float("-inf"))
        out[:, h] = torch.bmm(scores.softmax(dim=-1), v[:, :, h])              # [Bd, G, D]
    return out.view(bd, hkv * group, d).to(q.dtype)
