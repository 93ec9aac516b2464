"""Paged attention: varlen queries against a paged K/V cache.

Layouts (the flash-attn `block_table` layout, one storage per layer):
    q           [T, Hq, D]        packed query tokens of all sequences (model dtype)
    layer       LayerKV           one layer's pages of S = page_size slots in its KVFormat
                                  (evalrun/kernels/kv_format.py); page P is the "null page" (zeros,
                                  never allocated)
    page_table  [B, max_pages]     int32 page ids per sequence
    cu_seqlens_q [B + 1]           query offsets into q
    seq_lens_k  [B]                context length of each sequence, new tokens included

Query i of sequence b sits at position seq_lens_k[b] - q_len[b] + i and attends
causally to every key at a position <= its own (queries are the last q_len
tokens of the context, already written to the cache).

    context of b:  |<------------ seq_lens_k[b] ------------>|
                   | cached prefix ....... | new queries     |
                                           ^ seq_lens_k - q_len

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

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .cache_ops import gather_kv
from .kv_format import LayerKV
from .kv_quant import rotate


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    slots: torch.Tensor            # [L] slot ids of the whole context
    mask: Optional[torch.Tensor]   # [q_len, L] bool; None when q_len == L (plain causal)
    window_slot: int = -1          # block of the window store (windowed formats)
    # windowed formats: keys are [codes of positions < (L-1)//W*W | exact values of positions
    # >= start//W*W]; the mask [q_len, both] lets each query see the codes before its block
    # and the exact values of its block up to itself
    window_mask: Optional[torch.Tensor] = None


@dataclass
class AttentionMetadata:
    """Built once per forward; read by every layer."""
    cu_seqlens_q: torch.Tensor     # [B + 1] int32
    cu_seqlens_k: torch.Tensor     # [B + 1] int32 (flash-attn varlen takes both)
    seq_lens_k: torch.Tensor       # [B] int32
    max_seqlen_q: int
    max_seqlen_k: int
    page_table: torch.Tensor       # [B, max_pages] int32
    page_size: int
    # single-token (decode) sequences first; their gathered slots and mask for the torch
    # reference path, made on its first use (decode_gather): the native and Triton kernels read
    # the page table, and building them took ~0.2 ms of every 32-row CPU step
    num_decode: int
    decode_slots: Optional[torch.Tensor]   # [Bd, Lmax] int64
    decode_mask: Optional[torch.Tensor]    # [Bd, 1, 1, Lmax] bool
    prefill: list[PrefillSeq]
    # recent-token window (0: none): per sequence its block of the store and the block
    # start of its last query ((seq_len - 1) // W * W), int32 [B]
    window: int = 0
    window_slots: Optional[torch.Tensor] = None
    window_starts: Optional[torch.Tensor] = None
    # the same for every layer: (rows of the new K/V, flat rows of the store) that a forward
    # stores: decode tokens before attention, prefill sequences' last partial block after
    window_store_decode: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    window_store_prefill: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # what a kernel derived from this metadata for its first layer, kept for the others (by kernel)
    kernel_args: dict[str, Any] = field(default_factory=dict)
    null_page: int = 0             # the page that decode_gather points masked positions at
    # host copies of (page_table, seq_lens_k) that build_metadata made them from (decode_gather
    # reads them: a device's tensors, the meta device's included, need not be readable on the host)
    host_tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None


def decode_gather(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode_slots, decode_mask) of the decode group, made once per metadata."""
    if meta.decode_slots is None or meta.decode_mask is None:
        nd = meta.num_decode
        table, lens = meta.host_tables or (meta.page_table.cpu(), meta.seq_lens_k.cpu())
        slots, mask = _decode_gather(table[:nd], lens[:nd], meta.page_size, meta.null_page)
        dev = meta.page_table.device
        meta.decode_slots, meta.decode_mask = slots.to(dev), mask.to(dev)
    return meta.decode_slots, meta.decode_mask


def build_metadata(q_lens: list[int], seq_lens: list[int], page_tables: list[list[int]],
                   page_size: int, null_page: int, device: torch.device, window: int = 0,
                   window_slots: Optional[list[int]] = None) -> AttentionMetadata:
    """Sequences with q_len == 1 must come first (the decode group). A windowed cache
    passes its window and each sequence's block of the store."""
    if window and (window_slots is None or len(window_slots) != len(q_lens) or any(w is None for w in window_slots)):
        raise ValueError("a windowed cache needs one window slot per sequence")
    num_decode = 0
    while num_decode < len(q_lens) and q_lens[num_decode] == 1:
        num_decode += 1
    max_pages = max(len(p) for p in page_tables)
    # one tensor from padded lists (a copy per row took ~0.55 ms at 32 rows)
    table = torch.tensor([list(p) + [null_page] * (max_pages - len(p)) for p in page_tables], dtype=torch.int32)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    check_pages(table, lens, page_size, null_page)
    prefill = []
    for b in range(num_decode, len(q_lens)):
        slots = _slots(table[b], seq_lens[b], page_size)
        prefill.append(PrefillSeq(int(cu[b]), q_lens[b], slots.to(device),
                                  _causal_mask(q_lens[b], seq_lens[b], device),
                                  window_slots[b] if window else -1,
                                  _window_mask(q_lens[b], seq_lens[b], window, device) if window else None))
    win_slots = win_starts = store_decode = store_prefill = None
    if window:
        win_slots = torch.tensor(window_slots, dtype=torch.int32, device=device)
        win_starts = ((lens - 1).clamp(min=0) // window * window).to(device)
        store_decode, store_prefill = _window_stores(q_lens, seq_lens, window_slots, num_decode, window, device)
    return AttentionMetadata(
        cu_seqlens_q=cu.to(device),
        cu_seqlens_k=torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device),
        seq_lens_k=lens.to(device), max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
        page_table=table.to(device),
        page_size=page_size, num_decode=num_decode,
        decode_slots=None, decode_mask=None, null_page=null_page, host_tables=(table, lens),
        prefill=prefill, window=window, window_slots=win_slots, window_starts=win_starts,
        window_store_decode=store_decode, window_store_prefill=store_prefill,
    )


def _window_mask(q_len: int, length: int, w: int, device: torch.device) -> torch.Tensor:
    """PrefillSeq.window_mask: [q_len, (length-1)//w*w + length - start//w*w] bool."""
    start = length - q_len
    q_pos = torch.arange(start, length, device=device)[:, None]
    block = q_pos // w * w
    codes = torch.arange((length - 1) // w * w, device=device)[None] < block
    exact = torch.arange(start // w * w, length, device=device)[None]
    return torch.cat([codes, (exact >= block) & (exact <= q_pos)], dim=1)


def _window_stores(q_lens: list[int], seq_lens: list[int], window_slots: list[int], num_decode: int,
                   w: int, device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(rows, store rows) of the decode tokens and of each prefill sequence's last partial block."""
    out = []
    for group in (range(num_decode), range(num_decode, len(q_lens))):
        rows, idx, q_start = [], [], sum(q_lens[: group.start])
        for b in group:
            start = seq_lens[b] - q_lens[b]
            first = max(start, seq_lens[b] // w * w) if b >= num_decode else start
            rows += range(q_start + first - start, q_start + q_lens[b])
            idx += (window_slots[b] * w + p % w for p in range(first, seq_lens[b]))
            q_start += q_lens[b]
        out.append((torch.tensor(rows, dtype=torch.long, device=device),
                    torch.tensor(idx, dtype=torch.long, device=device)))
    return out[0], out[1]


def _slots(pages: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return pages[pos // page_size].long() * page_size + pos % page_size


def _decode_gather(table: torch.Tensor, lens: torch.Tensor, page_size: int,
                   null_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    lmax = int(lens.max())
    pos = torch.arange(lmax)                                    # [L]
    valid = pos[None, :] < lens[:, None]                        # [Bd, L]
    pages = table[:, pos // page_size].long()                   # [Bd, L]
    slots = pages * page_size + pos % page_size
    slots = torch.where(valid, slots, null_page * page_size)
    return slots, valid[:, None, None, :]


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> Optional[torch.Tensor]:
    if q_len == k_len:
        return None
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    k_pos = torch.arange(k_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]                     # [q, L]


DecodeFn = Callable[[torch.Tensor, LayerKV, AttentionMetadata, float], torch.Tensor]
# the prefill sequences of the whole batch's q at once: -> [rows from the first prefill row on, Hq, D]
PrefillFn = Callable[..., torch.Tensor]        # (q, layer, meta, scale, out=None): see paged_prefill.prefill_native
RotateFn = Callable[[torch.Tensor, int], torch.Tensor]


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


def check_pages(table: torch.Tensor, lens: torch.Tensor, page_size: int, last_page: int) -> None:
    """Lengths within the table's pages and every page a length reaches within [0, last_page]:
    what a native kernel relies on before it reads the cache."""
    if not len(lens):
        return
    if int(lens.min()) < 0 or int(lens.max()) > table.shape[1] * page_size:
        raise ValueError(f"sequence lengths must lie in [0, {table.shape[1] * page_size}] "
                         "(page table width x page size)")
    used = table[torch.arange(table.shape[1])[None, :] * page_size < lens[:, None]]   # pages read
    if used.numel() and (int(used.min()) < 0 or int(used.max()) > last_page):
        raise ValueError(f"page ids must lie in [0, {last_page}]")
