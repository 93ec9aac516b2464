"""All decoder layers of a decode step in one native call (evalrun/kernels/cpu/csrc/decode_step.c).

A decode step (one new token per sequence) otherwise makes ~10 Python calls per layer into
the native kernels: norm, QKV, rope + page write, attention, output projection, norm, gate/up,
SiLU, down. `DecodeStep` makes one: the C code runs those same kernel functions in the same
order, so its residual stream is bitwise what the per-op path computes (tests/test_decode_step.py
checks that), without the per-layer Python between them.

It applies on the CPU to float32 models whose linears are on the native GEMM and to bfloat16
models whose linears are on the bf16 GEMM (their residual stream is float32: KernelPlan.stream_dtype),
with float32, bfloat16 or float16 pages (no codes, no recent-token window), to batches whose every
row is a decode token. `EVALRUN_DECODE_STEP=0` turns it off (the per-op path then runs).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import fused, native, paged_decode
from ..attention import AttentionMetadata
from ..kv_format import LayerKV
from ..ref.linear import Linear


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "post_norm", "wqkv", "bqkv", "wo", "w_gate_up", "w_down", "k_pages", "v_pages",
                 "bo", "b_gate_up", "b_down")] + [("sliding", ctypes.c_int), ("softcap", ctypes.c_float),
                                                  ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                                                  ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                                                  ("rope", ctypes.c_int), ("qk_whole", ctypes.c_int)]


class _Threads(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("gemm", "norm", "act", "attn")]


class _Model(ctypes.Structure):
    _fields_ = [("L", ctypes.c_int), ("H", ctypes.c_int), ("Hq", ctypes.c_int), ("Hkv", ctypes.c_int),
                ("D", ctypes.c_int), ("I", ctypes.c_int), ("S", ctypes.c_int), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("n_slots", ctypes.c_int64), ("layers", ctypes.POINTER(_Layer)),
                ("weight_kind", ctypes.c_int), ("page_kind", ctypes.c_int), ("act", ctypes.c_int),
                ("n_ropes", ctypes.c_int), ("rot", ctypes.c_int)]
ACTS = {"silu": 0, "gelu_tanh": 1}                               # the gated MLP's activation
WEIGHT_KINDS = {"native-gemm": 0, "native-bf16": 1}              # the Linear's kernel_name -> its panels'
WEIGHT_DTYPES = {torch.float32: "native-gemm", torch.bfloat16: "native-bf16"}   # model dtype -> its linears'
PAGE_KINDS = paged_decode._FLOAT_KINDS                           # float32 0, bfloat16 1, float16 2


_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {
    "decode_step_work_floats": (_I64, [ctypes.POINTER(_Model), _I32, _I32, _I32]),
    "decode_step_f32": (_I32, [ctypes.POINTER(_Model), _P, _P, _P, _P, _P, _I32, _P, _I32, _P, _I32,
                               ctypes.POINTER(_Threads)]),
    "decode_step_profile": (None, [_I32, ctypes.POINTER(ctypes.c_double)]),
}


def _lib() -> Optional[ctypes.CDLL]:
    return native.load("decode_step", SIGNATURES, require="gemm_supported")


STAGES = ("norms", "qkv", "rope_write", "attention", "o_proj", "gate_up", "silu_mul", "down")


def profile(start: bool) -> dict[str, float]:
    """Wall seconds per stage of every native decode step since the last `profile(True)`
    (summed over layers); start=True zeroes the sums and turns timing on, False turns it off."""
    lib = _lib()
    if lib is None:
        return {}
    out = (ctypes.c_double * len(STAGES))()
    lib.decode_step_profile(1 if start else 0, out)
    return dict(zip(STAGES, out))


def available() -> bool:
    """The decode step is on (EVALRUN_DECODE_STEP) and its library built for this CPU."""
    return enabled() and _lib() is not None


def enabled() -> bool:
    return os.environ.get("EVALRUN_DECODE_STEP", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class LayerParts:
    """One decoder layer as the step needs it (evalrun/engine/model.py's LayerWeights and the layer's pages)."""
    input_norm: Optional[torch.Tensor]       # [H], None: no norm before the attention / the MLP (OLMo 2)
    post_norm: Optional[torch.Tensor]
    wqkv: Linear
    wo: Linear
    w_gate_up: Linear
    w_down: Linear
    kv: LayerKV
    sliding_window: int = 0            # the layer's sliding window (0: full attention)
    softcap: float = 0.0               # the layer's attention soft-capping (0: none)
    q_norm: Optional[torch.Tensor] = None    # [D] per-head q/k RMSNorm weights (Qwen3), or None
    k_norm: Optional[torch.Tensor] = None
    attn_out_norm: Optional[torch.Tensor] = None   # [H] norms of the attention's and the MLP's outputs (Gemma)
    mlp_out_norm: Optional[torch.Tensor] = None
    rope: int = 0                      # which of the model's rope tables the layer reads


class DecodeStep:
    """The native step for one model and one cache (built once: the pointers stay valid as long
    as the weights and pages live, which this object keeps referenced)."""

    def __init__(self, parts: Sequence[LayerParts], hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate: int, eps: float, scale: Optional[float] = None, act: str = "silu",
                 n_ropes: int = 1, rotary_dim: Optional[int] = None):
        lib = _lib()
        if lib is None:
            raise RuntimeError("the native decode step is not available (see kernels.native)")
        self._lib, self._parts = lib, list(parts)
        # float32 norm weights (a bf16 model's, widened: exact) and biases (qkv, o, gate/up, down)
        norms = [tuple(None if t is None else t.float().contiguous() for t in (p.input_norm, p.post_norm))
                 for p in self._parts]
        head_norms = [(None, None) if p.q_norm is None else (p.q_norm.float().contiguous(), p.k_norm.float().contiguous())
                      for p in self._parts]
        out_norms = [tuple(None if t is None else t.float().contiguous() for t in (p.attn_out_norm, p.mlp_out_norm))
                     for p in self._parts]
        biases = [[None if lin.bias is None else lin.bias.float().contiguous()
                   for lin in (p.wqkv, p.wo, p.w_gate_up, p.w_down)] for p in self._parts]
        # the tensors themselves (not only their containers) stay referenced while the C code holds
        # their addresses; pages_match compares the pages by address and shape
        self._keep = [t for p, n, b, hn, on in zip(self._parts, norms, biases, head_norms, out_norms)
                      for t in (*n, *b, *hn, *on, p.wqkv.panels, p.wo.panels, p.w_gate_up.panels, p.w_down.panels,
                                p.kv.k, p.kv.v) if t is not None]
        self._pages = [(p.kv.k.data_ptr(), p.kv.v.data_ptr(), tuple(p.kv.k.shape)) for p in self._parts]
        page_size = self._parts[0].kv.k.shape[1]
        self._layers = (_Layer * len(self._parts))()
        ptr = lambda t: None if t is None else t.data_ptr()     # noqa: E731
        for i, (p, (n_in, n_post), (bqkv, bo, bgu, bd), (qn, kn), (an, mn)) in enumerate(
                zip(self._parts, norms, biases, head_norms, out_norms)):
            self._layers[i] = _Layer(ptr(n_in), ptr(n_post), p.wqkv.panels.data_ptr(), ptr(bqkv),
                                     p.wo.panels.data_ptr(), p.w_gate_up.panels.data_ptr(),
                                     p.w_down.panels.data_ptr(), p.kv.k.data_ptr(), p.kv.v.data_ptr(),
                                     ptr(bo), ptr(bgu), ptr(bd), p.sliding_window, p.softcap, ptr(qn), ptr(kn),
                                     ptr(an), ptr(mn), p.rope, int(qn is not None and qn.shape[0] != head_dim))
        first = self._parts[0]
        self._model = _Model(len(self._parts), hidden, num_heads, num_kv_heads, head_dim, intermediate, page_size,
                             eps, head_dim ** -0.5 if scale is None else scale, first.kv.k.shape[0] * page_size,
                             self._layers, WEIGHT_KINDS[first.wqkv.kernel_name], PAGE_KINDS[first.kv.k.dtype],
                             ACTS[act], n_ropes, rotary_dim or head_dim)

    @staticmethod
    def supports(parts: Sequence[LayerParts], dtype: torch.dtype, device: torch.device, hidden: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int) -> bool:
        """Float32 CPU weights on the native GEMM or bfloat16 ones on the bf16 GEMM, with the model's
        shapes (biases of their output sizes), float pages (float32, bfloat16, float16) of one shape and dtype
        [P + 1, S, Hkv, D] without a window, contiguous; and the library built here."""
        kernel = WEIGHT_DTYPES.get(dtype)
        if not enabled() or kernel is None or device.type != "cpu" or not parts or _lib() is None:
            return False
        qkv = (num_heads + 2 * num_kv_heads) * head_dim
        shapes = ((qkv, hidden), (hidden, num_heads * head_dim), (2 * intermediate, hidden), (hidden, intermediate))
        pages = parts[0].kv.k.shape
        for p in parts:
            lins = (p.wqkv, p.wo, p.w_gate_up, p.w_down)
            if any(lin.panels is None or lin.kernel_name != kernel or tuple(lin.weight.shape) != shape
                   for lin, shape in zip(lins, shapes)):
                return False
            if any(lin.bias is not None and tuple(lin.bias.shape) != (shape[0],) for lin, shape in zip(lins, shapes)):
                return False
            if not isinstance(p.sliding_window, int) or p.sliding_window < 0 or not p.softcap >= 0.0:
                return False
            if (p.q_norm is None) != (p.k_norm is None) or (p.q_norm is not None and (
                    tuple(p.q_norm.shape), tuple(p.k_norm.shape)) not in (
                    ((head_dim,), (head_dim,)), ((num_heads * head_dim,), (num_kv_heads * head_dim,)))):
                return False
            if any(t is not None and tuple(t.shape) != (hidden,) for t in (p.attn_out_norm, p.mlp_out_norm)):
                return False
            if not all(t is None or (t.dtype in (dtype, torch.float32) and t.shape == (hidden,))
                       for t in (p.input_norm, p.post_norm)):
                return False
            kv = p.kv
            if kv.fmt.quantized or kv.fmt.window or kv.k.dtype not in PAGE_KINDS or kv.v.dtype != kv.k.dtype:
                return False
            if kv.k.dtype != parts[0].kv.k.dtype:
                return False
            if kv.k.shape != pages or kv.v.shape != pages or tuple(pages[2:]) != (num_kv_heads, head_dim):
                return False
            if not (kv.k.is_contiguous() and kv.v.is_contiguous() and kv.k.device.type == "cpu"):
                return False
        return True

    def pages_match(self, layers: Sequence[LayerKV]) -> bool:
        """Whether these are still the pages the step was built on (same storage)."""
        return len(layers) == len(self._pages) and all(
            (kv.k.data_ptr(), kv.v.data_ptr(), tuple(kv.k.shape)) == kept for kv, kept in zip(layers, self._pages))

    @staticmethod
    def applies(meta: AttentionMetadata, rows: int) -> bool:
        """Every row is the one new token of its sequence."""
        return rows > 0 and meta.num_decode == rows and not meta.prefill and not meta.window

    def run(self, x: torch.Tensor, ropes: Sequence[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """x [T, H] float32 (contiguous: updated in place) -> x after every layer; ropes: the
        model's (cos, sin) [T, D] float32 at the tokens' positions, one pair per rope table."""
        t = x.shape[0]
        if not (x.is_contiguous() and x.dtype == torch.float32):
            raise ValueError(f"the native decode step takes contiguous float32 rows, got {x.dtype}")
        if len(ropes) != self._model.n_ropes:
            raise ValueError(f"the native decode step reads {self._model.n_ropes} rope tables, got {len(ropes)}")
        if any(c.shape != (t, self._model.rot) for c, _ in ropes):
            raise ValueError(f"the native decode step reads rope tables [{t}, {self._model.rot}]")
        cos = torch.stack([c for c, _ in ropes]).contiguous()
        sin = torch.stack([s for _, s in ropes]).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        table = meta.page_table.to(torch.int32).contiguous()
        lens = meta.seq_lens_k.to(torch.int32).contiguous()
        lmax = max(1, meta.max_seqlen_k)
        m = self._model
        threads = _Threads(max(1, min(torch.get_num_threads(), 64)), fused.num_threads(t * m.H, t),
                           fused.num_threads(t * m.I, t), paged_decode.num_threads(t, lmax, m.Hq, m.D))
        work = torch.empty(self._lib.decode_step_work_floats(ctypes.byref(m), t, lmax, threads.attn),
                           dtype=torch.float32)
        rc = self._lib.decode_step_f32(ctypes.byref(self._model), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                       slots.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(), t,
                                       work.data_ptr(), lmax, ctypes.byref(threads))
        if rc != 0:
            raise ValueError(f"the native decode step refused layer {rc - 1}'s input (T={t}, lmax={lmax})")
        return x
