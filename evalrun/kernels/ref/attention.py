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
           prefill: Optional[PrefillFn] = None) -> torch.Tensor:
    """Paged attention of every sequence of the batch, in q's dtype [T, Hq, D]: the decode
    group through `decode` (default: the torch reference), prefill sequences through `prefill`
    (formats without a window; default: SDPA on each one's gathered context). Rotating formats:
    q rotated in, the output rotated out (with `rotation`, default the torch reference). k, v [T, Hkv, D]: this forward's new
    K/V (as written to the cache), which a windowed format needs."""
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
    if meta.num_decode:
        out[: meta.num_decode] = (decode or decode_torch)(q[: meta.num_decode], layer, meta, scale)
    native_prefill = prefill is not None and fresh is None
    if native_prefill and meta.prefill:
        rows = out[meta.prefill[0].q_start:]
        done = prefill(q, layer, meta, scale, out=rows)
        if done.data_ptr() != rows.data_ptr():            # the kernel could not write in place
            rows.copy_(done)
    for seq in () if native_prefill else meta.prefill:
        if fresh is not None:
            _prefill_windowed(q, fresh, layer, seq, scale, out)
            continue
        qs = q[seq.q_start: seq.q_start + seq.q_len].transpose(0, 1)[None]      # [1, Hq, q, D]
        k, v = gather_kv(layer, seq.slots, q.dtype)                              # [L, Hkv, D]
        o = F.scaled_dot_product_attention(qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=seq.mask, is_causal=seq.mask is None,
                                           scale=scale, enable_gqa=True)
        out[seq.q_start: seq.q_start + seq.q_len] = o[0].transpose(0, 1)
    if fresh is not None:                     # after every read: a sequence's last partial block
        store_window(layer, fresh, *meta.window_store_prefill)
    return rotation(out, fmt.group_size).to(q.dtype) if fmt.rotate else out


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
                      seq: PrefillSeq, scale: float, out: torch.Tensor) -> None:
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
    o = F.scaled_dot_product_attention(q[span].transpose(0, 1)[None], kv[0].transpose(0, 1)[None],
                                       kv[1].transpose(0, 1)[None], attn_mask=seq.window_mask,
                                       scale=scale, enable_gqa=True)
    out[span] = o[0].transpose(0, 1)


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


def decode_torch(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
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
    qs = q.view(bd, hkv, group, d).float()                                     # [Bd, Hkv, G, D]
    masked = ~decode_mask[:, 0]                                            # [Bd, 1, L]
    out = torch.empty(bd, hkv, group, d, dtype=torch.float32, device=q.device)
    for h in range(hkv):
        scores = torch.bmm(qs[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)  # [Bd, G, L]
        scores.masked_fill_(masked, float("-inf"))
        out[:, h] = torch.bmm(scores.softmax(dim=-1), v[:, :, h])              # [Bd, G, D]
    return out.view(bd, hkv * group, d).to(q.dtype)
