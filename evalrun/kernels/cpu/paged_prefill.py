"""Native CPU paged prefill attention (evalrun/kernels/cpu/csrc/paged_prefill.c), for every KVFormat without a
recent-token window.

    q           [T, Hq, D]   the query rows of the prefill sequences, packed in order, already in
                             the attention domain (rotated for rotating formats: kernels.attention.attend)
    layer       LayerKV      each sequence's head read through the page table: float32 rows in place,
                             other kinds converted or dequantized into per-thread float32 rows,
                             once per thread and head
    page_table  [B, max_pages] int32, seq_lens [B] int32 (the new tokens included), q_lens [B]:
                             sequence b's last q_lens[b] positions are its queries, causal
Same contract as the torch reference (kernels.attention.attend: SDPA on the gathered context).
Each query row's arithmetic is its own (evalrun/kernels/cpu/csrc/paged_prefill.c), so a token's output is
bitwise the same however its sequence is chunked and whatever else is in the batch.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from . import native
from ..attention import AttentionMetadata, check_pages
from ..kv_format import LayerKV
from .paged_decode import kinds, layout_supported

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {
    "paged_prefill": (_I32, [_P, _P, _P, _P, _P, _I32, _I32, _I32,     # q, k, v, scales, kinds, group
                             _P, _I32, _P, _P, _P, _P,                 # table, width, lens, q starts, q lens, out
                             _I32, _I32, _I32, _I32, _I32, ctypes.c_float,   # B, Hq, Hkv, D, S, scale
                             _P, _I32, _I32,                           # scratch, lmax, threads
                             _I32, ctypes.c_float]),                   # sliding window, soft-capping
    "paged_prefill_scratch_floats": (_I64, [_I32, _I32, _I32, _I32, _I32, _I32]),
}
LANES = 16                 # D must be a multiple of the widest vector the kernel may use
_local = threading.local()   # per calling thread: a scratch buffer kept between calls


def _lib() -> Optional[ctypes.CDLL]:
    return native.load("paged_prefill", SIGNATURES, require="paged_prefill_supported")


def available() -> bool:
    return _lib() is not None


def supported(q: torch.Tensor, layer: LayerKV) -> bool:
    """As the decode kernel (paged_decode.layout_supported), for formats without a recent-token
    window and head sizes that are a multiple of 16, with the kernel built for this CPU."""
    return (not layer.fmt.window and q.dim() == 3 and q.shape[-1] % LANES == 0
            and layout_supported(q, layer) and available())


def num_threads(work: int, hq: int, d: int) -> int:
    """Threads for `work` query-key pairs per head: a second thread pays for its hand-over only with
    enough work (~2M multiply-adds)."""
    return 1 if work * hq * d < 2 ** 21 else max(1, torch.get_num_threads())


@dataclass(frozen=True)
class Sequences:
    """The prefill sequences as the C kernel reads them (int32, contiguous)."""
    table: torch.Tensor            # [B, max_pages]
    lens: torch.Tensor             # [B] context lengths
    q_lens: torch.Tensor           # [B]
    q_starts: torch.Tensor         # [B] first row of each in the packed q
    lmax: int                      # max(1, max(lens))
    work: int                      # sum of q_len * length (query-key pairs per head)

    @classmethod
    def of(cls, page_table: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor) -> "Sequences":
        qn = q_lens.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        return cls(page_table.to(torch.int32).contiguous(), lens, qn,
                   (torch.cumsum(qn, 0, dtype=torch.int32) - qn).contiguous(),
                   max(1, int(lens.max())) if len(lens) else 1, int((qn.long() * lens.long()).sum()))


def prefill_native(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                   out: Optional[torch.Tensor] = None, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The prefill sequences of a batch whose metadata build_metadata checked (a `PrefillFn`):
    q [T, Hq, D] of the whole batch -> [T - first prefill row, Hq, D]. Their int32 tables are made
    once per forward (kept on the metadata, which every layer shares). out: where to write that
    result, used when it is a contiguous float32 tensor of its shape (the rows of the batch's
    output), and returned; else a new tensor is. sliding_window, softcap: the layer's (0: none)."""
    seqs = meta.kernel_args.get("paged_prefill")
    if seqs is None:
        nd = meta.num_decode
        cu = meta.cu_seqlens_q[nd:].long()
        seqs = meta.kernel_args["paged_prefill"] = Sequences.of(meta.page_table[nd:], meta.seq_lens_k[nd:],
                                                                cu[1:] - cu[:-1])
    return _call(q[meta.prefill[0].q_start:], layer, seqs, scale, out, sliding_window=sliding_window, softcap=softcap)


def paged_prefill_native(q: torch.Tensor, layer: LayerKV, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         q_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                         softcap: float = 0.0) -> torch.Tensor:
    """q [sum(q_lens), Hq, D] -> [sum(q_lens), Hq, D] in q's dtype, float32 math. Page ids,
    lengths and query counts are checked before the C code reads the cache."""
    if not supported(q, layer):
        raise ValueError(f"paged_prefill_native cannot take q {tuple(q.shape)} {q.device} with a "
                         f"{layer.fmt.name} cache of K {tuple(layer.k.shape)} {layer.k.dtype} "
                         f"(kernel built: {available()})")
    b = page_table.shape[0]
    if seq_lens.shape != (b,) or q_lens.shape != (b,):
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} / "
                         f"q_lens {tuple(q_lens.shape)} do not match {b} sequences")
    if b and (bool((q_lens < 1).any()) or bool((q_lens > seq_lens).any())):
        raise ValueError("every sequence needs 1 <= q_len <= its length")
    if int(q_lens.sum()) != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows, the sequences' q_lens sum to {int(q_lens.sum())}")
    check_pages(page_table, seq_lens, layer.page_size, layer.k.shape[0] - 1)
    if not isinstance(sliding_window, int) or sliding_window < 0 or not softcap >= 0.0:
        raise ValueError(f"sliding_window must be an integer >= 0 and softcap >= 0, got {sliding_window!r}, {softcap!r}")
    return _call(q, layer, Sequences.of(page_table, seq_lens, q_lens), scale, sliding_window=sliding_window,
                 softcap=softcap)


def _scratch(floats: int) -> torch.Tensor:
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < floats:
        buf = _local.scratch = torch.empty(floats, dtype=torch.float32)
    return buf


def _call(q: torch.Tensor, layer: LayerKV, seqs: Sequences, scale: float,
          dest: Optional[torch.Tensor] = None, lib: Optional[ctypes.CDLL] = None, sliding_window: int = 0,
          softcap: float = 0.0) -> torch.Tensor:
    """lib: another build of paged_prefill.c with the same SIGNATURES (benchmarks/bench_prefill_attention.py
    times an older source against this one); default the one native.load built."""
    t, hq, d = q.shape
    b, s, hkv = seqs.table.shape[0], layer.page_size, layer.num_kv_heads
    if b == 0:
        return torch.empty(0, hq, d, dtype=q.dtype)
    lib = lib or _lib()
    qf = q.float().contiguous()
    threads = num_threads(seqs.work, hq, d)
    k_kind, v_kind = kinds(layer)
    scratch = _scratch(threads * lib.paged_prefill_scratch_floats(hq, hkv, d, seqs.lmax, k_kind, v_kind))
    # straight into the caller's rows where it can take them: a torch copy of a prefill chunk's
    # [T, Hq, D] runs on torch's threads, which then spin on the cores the next kernels use
    direct = (dest is not None and q.dtype == torch.float32 and dest.dtype == torch.float32
              and dest.shape == (t, hq, d) and dest.is_contiguous() and dest.device.type == "cpu")
    out = dest if direct else torch.empty(t, hq, d, dtype=torch.float32)
    ptr = lambda x: None if x is None else x.data_ptr()     # noqa: E731
    rc = lib.paged_prefill(qf.data_ptr(), layer.k.data_ptr(), layer.v.data_ptr(), ptr(layer.k_scale),
                           ptr(layer.v_scale), k_kind, v_kind, layer.fmt.group_size, seqs.table.data_ptr(),
                           seqs.table.shape[1], seqs.lens.data_ptr(), seqs.q_starts.data_ptr(),
                           seqs.q_lens.data_ptr(), out.data_ptr(), b, hq, hkv, d, s, scale, scratch.data_ptr(),
                           seqs.lmax, threads, sliding_window, softcap)
    if rc != 0:
        raise ValueError(f"native paged prefill does not support Hq={hq}, Hkv={hkv}, D={d}, "
                         f"format {layer.fmt.name}")
    return out.to(q.dtype)
