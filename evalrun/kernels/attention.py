"""The metadata of a packed batch's paged attention, built once per forward and read by every
layer and every backend (the torch reference: kernels/ref/attention.py; native: kernels/cpu;
Triton and flash-attn: kernels/cuda).


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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .kv_format import LayerKV


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


def check_window(layer: LayerKV, seq_lens: torch.Tensor, window: Optional[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Window blocks within the store and every position read from it within a block."""
    if not layer.fmt.window:
        return
    if window is None:
        raise ValueError(f"cache mode {layer.fmt.name} reads a recent-token window: pass window_slots and starts")
    slots, starts = window
    if slots.shape != seq_lens.shape or starts.shape != seq_lens.shape:
        raise ValueError("window slots and starts need one entry per sequence")
    if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= layer.window_slots):
        raise ValueError(f"window slots must lie in [0, {layer.window_slots})")
    if len(starts) and (bool((starts < 0).any()) or bool((seq_lens.long() - starts.long() > layer.fmt.window).any())):
        raise ValueError(f"window starts must be >= 0 and within {layer.fmt.window} of the sequence length")
