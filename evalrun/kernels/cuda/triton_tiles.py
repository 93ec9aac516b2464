"""Device helpers of the Triton attention kernels (kernels/cuda/triton_attention.py), jitted
with them in one scope (kernels/cuda/jit.py): K/V rows read from float pages, dequantized from
codes (q8 / q6 / q4) or from the recent-token window's store, the block dot with its 16-bit or
float32 numerics, flash attention's online softmax, and soft-capping's tanh.

Shapes: a block is N positions of one KV head, rows [N, BLOCK_D] (BLOCK_D >= D, masked columns
read as 0); scores [M, N] are in base 2 (scale * log2(e) folded in), so the softmax uses exp2.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:              # the kernel bodies' names, bound by jit_kernels
    import triton.language as tl


def load_rows(x_ptr, s_ptr, slot, head, col, mask,
              HKV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Rows [N, BLOCK_D] of one KV head at flat slots [N] (int64): float storage in its own
    dtype (BITS 0), codes as dequantized float32 (code - offset) * scale (BITS 8 or 4)."""
    if BITS == 0:
        rows = tl.load(x_ptr + (slot[:, None] * HKV + head) * D + col[None, :], mask=mask, other=0.0)
    else:
        row_bytes: tl.constexpr = D * BITS // 8
        if BITS == 8:
            byte = col
        else:                  # byte j of a group: element j low nibble, element j + G/2 high
            byte = col // GROUP * (GROUP // 2) + col % (GROUP // 2)
        c = tl.load(x_ptr + (slot[:, None] * HKV + head) * row_bytes + byte[None, :], mask=mask, other=0)
        c = c.to(tl.int32)
        if BITS == 4:
            c = tl.where((col % GROUP < GROUP // 2)[None, :], c & 15, c >> 4) - 8
        else:
            c = c - 128
        groups: tl.constexpr = D // GROUP
        s = tl.load(s_ptr + (slot[:, None] * HKV + head) * groups + (col // GROUP)[None, :], mask=mask, other=0.0)
        rows = c.to(tl.float32) * s.to(tl.float32)
    return rows


def cast(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """x.to(dtype). EMULATE (the interpreter): a cast to bfloat16 rounds to nearest even as on
    the GPU (Triton 3.6's interpreter truncates), NaN kept."""
    if EMULATE and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x.to(tl.float32), bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


def online_softmax(s, v, m_i, l_i, acc, NATIVE: tl.constexpr, EMULATE: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """One block of base-2 scores s [M, N] and its values v [N, D] folded into the running
    max m_i, sum l_i and output acc (flash attention's online softmax). EMPTY_ROWS: a row may
    have seen no key yet (m_new -inf, as before a sliding window's keys); it subtracts 0 instead,
    so its alpha and p are 0 rather than NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if EMPTY_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), mma(p, v, acc * alpha[:, None], NATIVE, EMULATE)


def tanh(x):
    """tanh of float32 x from plain arithmetic and exp, so the interpreter (which has no libdevice)
    runs what the GPU runs: tanh's odd Taylor polynomial to x^15 below |x| 0.55, 1 - 2e / (1 + e)
    with e = exp(-2|x|) above. Within 2 ulp of the true value with an exact exp (measured over
    [-12, 12]); the GPU's exp (ex2.approx) may add about 2 more near |x| 0.55."""
    ax = tl.abs(x)
    x2 = x * x
    p = -929569.0 / 638512875.0
    p = p * x2 + 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = x * (p * x2 + 1.0)
    e = tl.exp(-2.0 * ax)
    big = 1.0 - 2.0 * e / (1.0 + e)
    return tl.where(ax < 0.55, small, tl.where(x < 0, -big, big))


def soft_cap(s, cap_log2, SOFTCAP: tl.constexpr):
    """Base-2 scores s soft-capped at cap_log2 (c log2(e)) when SOFTCAP."""
    if SOFTCAP:
        s = tanh(s / cap_log2) * cap_log2
    return s


def mma(a, b, acc, NATIVE: tl.constexpr, EMULATE: tl.constexpr):
    """acc + a @ b, float32 accumulation. NATIVE: a rounded to b's 16-bit dtype and multiplied
    on the tensor cores (EMULATE: the same rounded inputs multiplied in float32); else exact
    float32 of both."""
    if NATIVE:
        a = cast(a, b.dtype, EMULATE)
    if NATIVE and not EMULATE:
        out = tl.dot(a, b, acc)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return out


def load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, wk_ptr, wv_ptr, slot, pos, pmask, head, col, dmask,
            w_slot, w_start, HKV: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr,
            V_BITS: tl.constexpr, GROUP: tl.constexpr, WINDOW: tl.constexpr):
    """K and V rows [N, BLOCK_D] at positions pos; with a window, positions >= w_start come
    from store rows w_slot * W + pos - w_start instead of the pages."""
    if WINDOW > 0:
        in_win = pos >= w_start
        page_mask = (pmask & (pos < w_start))[:, None] & dmask[None, :]
        win_mask = (pmask & in_win)[:, None] & dmask[None, :]
        w_off = ((w_slot.to(tl.int64) * WINDOW + (pos - w_start))[:, None] * HKV + head) * D + col[None, :]
        k = load_rows(k_ptr, ks_ptr, slot, head, col, page_mask, HKV, D, K_BITS, GROUP)
        v = load_rows(v_ptr, vs_ptr, slot, head, col, page_mask, HKV, D, V_BITS, GROUP)
        k = tl.where(in_win[:, None], tl.load(wk_ptr + w_off, mask=win_mask, other=0.0).to(tl.float32), k)
        v = tl.where(in_win[:, None], tl.load(wv_ptr + w_off, mask=win_mask, other=0.0).to(tl.float32), v)
    else:
        mask = pmask[:, None] & dmask[None, :]
        k = load_rows(k_ptr, ks_ptr, slot, head, col, mask, HKV, D, K_BITS, GROUP)
        v = load_rows(v_ptr, vs_ptr, slot, head, col, mask, HKV, D, V_BITS, GROUP)
    return k, v


TILES = (load_rows, cast, online_softmax, tanh, soft_cap, mma, load_kv)
