"""Paged attention: varlen queries against a paged K/V cache.

Layouts (the flash-attn `block_table` layout, one tensor per layer):
    q           [T, Hq, D]        packed query tokens of all sequences (model dtype)
    k_cache     [P + 1, S, Hkv, D] pages of S = page_size slots; page P is the
    v_cache     [P + 1, S, Hkv, D] "null page" (zeros, never allocated)
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
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import native


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    slots: torch.Tensor            # [L] slot ids of the whole context
    mask: Optional[torch.Tensor]   # [q_len, L] bool; None when q_len == L (plain causal)


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
    # torch reference path: single-token (decode) sequences first, batched
    num_decode: int
    decode_slots: Optional[torch.Tensor]   # [Bd, Lmax] int64
    decode_mask: Optional[torch.Tensor]    # [Bd, 1, 1, Lmax] bool
    prefill: list[PrefillSeq]


def build_metadata(q_lens: list[int], seq_lens: list[int], page_tables: list[list[int]],
                   page_size: int, null_page: int, device: torch.device) -> AttentionMetadata:
    """Sequences with q_len == 1 must come first (the decode group)."""
    num_decode = 0
    while num_decode < len(q_lens) and q_lens[num_decode] == 1:
        num_decode += 1
    max_pages = max(len(p) for p in page_tables)
    table = torch.full((len(page_tables), max_pages), null_page, dtype=torch.int32)
    for b, pages in enumerate(page_tables):
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    _check_pages(table, lens, page_size, null_page)
    decode_slots = decode_mask = None
    if num_decode:
        decode_slots, decode_mask = _decode_gather(table[:num_decode], lens[:num_decode], page_size, null_page)
    prefill = []
    for b in range(num_decode, len(q_lens)):
        slots = _slots(table[b], seq_lens[b], page_size)
        prefill.append(PrefillSeq(int(cu[b]), q_lens[b], slots.to(device),
                                  _causal_mask(q_lens[b], seq_lens[b], device)))
    return AttentionMetadata(
        cu_seqlens_q=cu.to(device), cu_seqlens_k=torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device),
        seq_lens_k=lens.to(device), max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
        page_table=table.to(device),
        page_size=page_size, num_decode=num_decode,
        decode_slots=None if decode_slots is None else decode_slots.to(device),
        decode_mask=None if decode_mask is None else decode_mask.to(device),
        prefill=prefill,
    )


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


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference implementation; runs on CPU and CUDA. Returns [T, Hq, D] in q's dtype."""
    out = torch.empty_like(q)
    k_flat = k_cache.view(-1, *k_cache.shape[2:])              # [(P+1)*S, Hkv, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if meta.num_decode:
        out[: meta.num_decode] = _decode(q[: meta.num_decode], k_flat, v_flat, meta, scale)
    _prefill_into(out, q, k_flat, v_flat, meta.prefill, scale)
    return out


def _prefill_into(out: torch.Tensor, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                  prefill: list[PrefillSeq], scale: float) -> None:
    """Each prefill sequence: SDPA over its gathered context, written to its rows of out."""
    for seq in prefill:
        qs = q[seq.q_start: seq.q_start + seq.q_len].transpose(0, 1)[None]      # [1, Hq, q, D]
        k = k_flat.index_select(0, seq.slots).to(q.dtype).transpose(0, 1)[None]   # [1, Hkv, L, D]
        v = v_flat.index_select(0, seq.slots).to(q.dtype).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=seq.mask, is_causal=seq.mask is None,
                                           scale=scale, enable_gqa=True)
        out[seq.q_start: seq.q_start + seq.q_len] = o[0].transpose(0, 1)


def _decode(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence, in float32. One pair of batched matmuls per KV head reads
    the gathered [Bd, L, Hkv, D] keys in place (row stride Hkv * D), so no permuted copy
    of the context is made; SDPA's CPU kernel is several times slower at q_len 1."""
    bd, lmax = meta.decode_slots.shape
    hkv, d = k_flat.shape[1:]
    group = q.shape[1] // hkv
    slots = meta.decode_slots.view(-1)
    k = k_flat.index_select(0, slots).view(bd, lmax, hkv, d).float()          # [Bd, L, Hkv, D]
    v = v_flat.index_select(0, slots).view(bd, lmax, hkv, d).float()
    qs = q.view(bd, hkv, group, d).float()                                     # [Bd, Hkv, G, D]
    masked = ~meta.decode_mask[:, 0]                                            # [Bd, 1, L]
    out = torch.empty(bd, hkv, group, d, dtype=torch.float32, device=q.device)
    for h in range(hkv):
        scores = torch.bmm(qs[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)  # [Bd, G, L]
        scores.masked_fill_(masked, float("-inf"))
        out[:, h] = torch.bmm(scores.softmax(dim=-1), v[:, :, h])              # [Bd, G, D]
    return out.view(bd, hkv * group, d).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Dispatch. CPU: decode sequences go to the native paged kernel when it is built
    (`kernels.native`), prefill sequences to the torch reference (SDPA on a gathered
    context). Elsewhere the torch reference; a flash-attn paged backend
    (`flash_attn_varlen_func` with `block_table`) slots in here on CUDA."""
    nd = meta.num_decode
    if not (nd and decode_native_supported(q, k_cache, v_cache)):
        return paged_attention_torch(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    # build_metadata checked the page table and lengths once for the forward
    out[:nd] = _paged_decode_call(q[:nd], k_cache, v_cache, meta.page_table[:nd], meta.seq_lens_k[:nd], scale)
    _prefill_into(out, q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), meta.prefill, scale)
    return out


# --- native CPU decode ---------------------------------------------------------------
_NATIVE_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _decode_lib() -> Optional[ctypes.CDLL]:
    lib = native.load("paged_decode")
    if lib is not None and not getattr(lib, "_evalrun_typed", False):
        lib.paged_decode.restype = ctypes.c_int
        lib.paged_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib._evalrun_typed = True
    return lib


def decode_backend(device: str | torch.device, cache_dtype: torch.dtype) -> str:
    """The decode attention `paged_attention` runs for a device and KV storage dtype:
    "native-c" or "torch"."""
    native_ok = torch.device(device).type == "cpu" and cache_dtype in _NATIVE_CACHE_DTYPES
    return "native-c" if native_ok and _decode_lib() is not None else "torch"


def decode_native_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """CPU tensors, float32/bfloat16 contiguous K/V of one shape and dtype whose head size
    matches q's, GQA-compatible head counts, and the kernel built."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return False
    hq, d = q.shape[1:]
    hkv = k_cache.shape[2]
    shapes_ok = hq >= 1 and hkv >= 1 and hq % hkv == 0 and k_cache.shape[3] == d and d >= 1
    on_cpu = q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
    return (shapes_ok and on_cpu and k_cache.dtype in _NATIVE_CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and _decode_lib() is not None)


def paged_decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence) -> [B, Hq, D] in q's dtype, read from the pages
    in place; float32 math. Same contract as `_decode` (the reference). Page ids and
    lengths are checked against the cache and the table before the C code reads them."""
    if _decode_lib() is None:
        raise RuntimeError("the native paged decode kernel is not available (see kernels.native)")
    if not decode_native_supported(q, k_cache, v_cache):
        raise ValueError(f"paged_decode_native cannot take q {tuple(q.shape)} {q.device} with K/V "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)} {k_cache.dtype}/{v_cache.dtype}")
    b, s = q.shape[0], k_cache.shape[1]
    if page_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match {b} sequences")
    _check_pages(page_table, seq_lens, s, k_cache.shape[0] - 1)
    return _paged_decode_call(q, k_cache, v_cache, page_table, seq_lens, scale)


def _check_pages(table: torch.Tensor, lens: torch.Tensor, page_size: int, last_page: int) -> None:
    """Lengths within the table's pages and every page a length reaches within [0, last_page]:
    what the native kernel relies on before it reads the cache."""
    if not len(lens):
        return
    if int(lens.min()) < 0 or int(lens.max()) > table.shape[1] * page_size:
        raise ValueError(f"sequence lengths must lie in [0, {table.shape[1] * page_size}] "
                         "(page table width x page size)")
    used = table[torch.arange(table.shape[1])[None, :] * page_size < lens[:, None]]   # pages read
    if used.numel() and (int(used.min()) < 0 or int(used.max()) > last_page):
        raise ValueError(f"page ids must lie in [0, {last_page}]")


def _paged_decode_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The C call on inputs already checked (shapes by decode_native_supported, pages by
    _check_pages)."""
    b, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    if b == 0:
        return torch.empty(0, hq, d, dtype=q.dtype)
    qf = q.float().contiguous()
    table = page_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    lmax = max(1, int(lens.max()))
    # a second thread pays for its start only with enough work (~2M multiply-adds per pass)
    threads = 1 if b * lmax * hq * d < 2 ** 21 else max(1, min(torch.get_num_threads(), b, 64))
    per_thread = hq * lmax + hq * d + hkv * d + hq          # SCRATCH() in paged_decode.c
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    out = torch.empty(b, hq, d, dtype=torch.float32)
    rc = _decode_lib().paged_decode(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    _NATIVE_CACHE_DTYPES[k_cache.dtype], table.data_ptr(), table.shape[1],
                                    lens.data_ptr(), out.data_ptr(), b, hq, hkv, d, s, scale,
                                    scratch.data_ptr(), lmax, threads)
    if rc != 0:
        raise ValueError(f"native paged decode does not support Hq={hq}, Hkv={hkv}, D={d}")
    return out.to(q.dtype)
