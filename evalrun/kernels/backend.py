"""Kernel backends: one is chosen when a model loads, and every cache op of that model goes
through it with one signature, whatever the cache's KVFormat.

    write_kv(k, v, layer, slot_mapping)          new tokens into their slots (quantize on write)
    copy_page_prefix(layers, src, dst, n)        first n slots of a page, codes and scales together
    attention(q, layer, meta, scale) -> out      prefill and decode of a packed batch

`TorchKernels` is the reference (CPU and CUDA). `NativeCpuKernels` runs the decode group
through the C kernel (evalrun/kernels/csrc/paged_decode.c) for every format it reads, the prefill
sequences of formats without a recent-token window through evalrun/kernels/csrc/paged_prefill.c, quantize on
write and the Hadamard rotations through evalrun/kernels/csrc/kv_quant.c, the rest through the
reference. `TritonKernels` (CUDA, when triton imports) runs decode attention for every
format, prefill attention for formats without a recent-token window and K/V writes of every
format (quantize on write included) and RMSNorm through kernels/triton_*.py, the rest through the
reference; a call its
kernels cannot take (CPU tensors, an unexpected layout) goes to the reference too.
`FlashAttnKernels` (CUDA, when flash_attn also imports, outside deterministic mode) sends the
attention of unquantized 16-bit caches whose page size is a multiple of 256 (flash-attn's paged-KV
requirement) to `flash_attn_varlen_func` with the page table as its `block_table`, one call for the
whole packed batch; everything else stays with the Triton kernels. flash-attn chooses its split of
long contexts by the batch's size, so deterministic mode keeps the Triton kernels (fixed splits).
Untested on a GPU: no machine here has flash-attn; its tests run against a stand-in module.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Optional

import torch

from . import fused, gemm, kv_quant_native, paged_decode, paged_prefill
from .attention import AttentionMetadata, attend
from .cache_ops import copy_page_prefix_torch, write_kv_torch
from .kv_format import KVFormat, LayerKV
from .linear import Linear, linear
from .kv_quant import rotate

log = logging.getLogger(__name__)


class TorchKernels:
    name = "torch"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        write_kv_torch(k, v, layer, slot_mapping)

    def copy_page_prefix(self, layers: list[LayerKV], src_page: int, dst_page: int, num_tokens: int) -> None:
        copy_page_prefix_torch(layers, src_page, dst_page, num_tokens)

    def attention(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> torch.Tensor:
        """k, v: the forward's new K/V (needed by formats with a recent-token window)."""
        return attend(q, layer, meta, scale, k=k, v=v)

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
                      layer: LayerKV, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rope on the fused QKV rows' q and k heads, k and v written into the cache; returns
        q [T, hq, D] and this forward's k, v (None where no op of the format needs them)."""
        return fused.rope_write_reference(qkv, cos, sin, hq, hkv,
                                          lambda k, v: self.write_kv(k, v, layer, slot_mapping))

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm_reference(x, w, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [gate | up] projection output."""
        return fused.silu_mul_reference(gate_up)

    def gate_up_silu(self, h: torch.Tensor, gate_up: Linear) -> torch.Tensor:
        """silu(gate) * up of the fused [gate | up] projection of h."""
        return self.silu_mul(linear(h, gate_up))

    def describe(self, fmt: KVFormat) -> dict[str, str]:
        """Which implementation runs each op for a cache in `fmt` (recorded in run manifests)."""
        return {"kv_write": "torch", "decode_attention": "torch", "prefill_attention": "torch-sdpa",
                "norm_act": "torch"}


class NativeCpuKernels(TorchKernels):
    name = "native-cpu"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        kv_quant_native.write_kv_native(k, v, layer, slot_mapping)

    def attention(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> torch.Tensor:
        native = meta.num_decode and self._supported(paged_decode, q, layer)
        prefill = meta.prefill and self._supported(paged_prefill, q, layer)
        return attend(q, layer, meta, scale, paged_decode.decode_native if native else None,
                      kv_quant_native.rotate_native, k, v, paged_prefill.prefill_native if prefill else None)

    @staticmethod
    def _supported(kernel, q: torch.Tensor, layer: LayerKV) -> bool:
        """kernel.supported (paged_decode or paged_prefill), remembered per layer and query layout:
        a layer's tensors keep their shapes, dtypes and device for its life, and the check costs
        ~50 us per layer and step."""
        key = (kernel.__name__, tuple(q.shape[1:]), q.dtype, q.device.type, q.dim())
        memo = layer.__dict__.setdefault("_native_attention_ok", {})
        if key not in memo:
            memo[key] = kernel.supported(q, layer)
        return memo[key]

    def __init__(self) -> None:
        self._fused = fused.available()           # decided once, when the model loads (not per call)

    @property
    def fused_available(self) -> bool:
        return self._fused

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
                      layer: LayerKV, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._fused and not layer.fmt.quantized and fused.rope_write_supported(qkv, cos, layer.k):
            q = fused.rope_write_native(qkv, cos, sin, hq, hkv, layer.k, layer.v, slot_mapping)
            return q, None, None                          # float caches: attention reads k, v from the pages
        return super().rope_write_kv(qkv, cos, sin, hq, hkv, layer, slot_mapping)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self._fused and fused.supported(x) and w.dtype == torch.float32:
            return fused.rms_norm_native(x, w, eps)
        return fused.rms_norm_reference(x, w, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._fused and fused.supported(gate_up):
            return fused.silu_mul_native(gate_up)
        return fused.silu_mul_reference(gate_up)

    def gate_up_silu(self, h: torch.Tensor, gate_up: Linear) -> torch.Tensor:
        """On the native GEMM's panels (float32, no bias), the SiLU runs in the GEMM's epilogue
        (evalrun/kernels/gemm.py gemm_silu: the same bits as the two calls, without the [T, 2I] product)."""
        if (self._fused and gate_up.panels is not None and gate_up.bias is None
                and h.dtype == torch.float32 and h.device.type == "cpu"):
            out = gemm.gemm_silu(h, gate_up.panels, gate_up.weight.shape[0] // 2)
            if out is not None:
                return out
        return super().gate_up_silu(h, gate_up)

    def describe(self, fmt: KVFormat) -> dict[str, str]:
        out = super().describe(fmt)
        if self._fused:
            out["norm_act"] = "native-c (float32 rows)"
        if fmt.quantized or fmt.dtype in paged_decode._FLOAT_KINDS:
            out["decode_attention"] = "native-c"
            if not fmt.window and paged_prefill.available():
                out["prefill_attention"] = f"native-c (head sizes a multiple of {paged_prefill.LANES}, else torch-sdpa)"
        if fmt.quantized and kv_quant_native.quantize_available():
            out["kv_write"] = "native-c"
        return out


class TritonKernels(TorchKernels):
    name = "triton"

    def __init__(self) -> None:
        from . import triton_attention, triton_cache_ops, triton_linear    # imports triton (slow): only when chosen
        self._attn, self._write, self._norm = triton_attention, triton_cache_ops, triton_linear

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """One program per row (evalrun/kernels/triton_linear.py): the same bits whatever the batch."""
        if self._norm.rms_norm_supported(x, w):
            return self._norm.rms_norm_triton(x, w, eps)
        return fused.rms_norm_reference(x, w, eps)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        if self._write.supported(k, v, layer):
            self._write.write_kv_triton(k, v, layer, slot_mapping)
        elif self._write.quant_supported(k, v, layer):
            self._write.write_kv_quant_triton(k, v, layer, slot_mapping)
        else:
            write_kv_torch(k, v, layer, slot_mapping)

    def attention(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> torch.Tensor:
        fmt = layer.fmt
        if not self._attn.supported(q, layer):
            return attend(q, layer, meta, scale, k=k, v=v)
        if fmt.window:                  # the window's prefill stays with the reference (SDPA)
            return attend(q, layer, meta, scale, self._attn.decode_triton, k=k, v=v)
        qr = rotate(q, fmt.group_size).to(q.dtype) if fmt.rotate else q
        out = self._attn.paged_attention_triton(qr, layer, meta, scale)
        return rotate(out, fmt.group_size).to(q.dtype) if fmt.rotate else out

    def describe(self, fmt: KVFormat) -> dict[str, str]:
        return {"kv_write": "triton", "decode_attention": "triton",
                "prefill_attention": "torch-sdpa" if fmt.window else "triton",
                "norm_act": "triton rms_norm, torch silu"}


class FlashAttnKernels(TritonKernels):
    name = "flash-attn"
    PAGE_MULTIPLE = 256

    def __init__(self, flash_attn=None, require_cuda: bool = True) -> None:
        """flash_attn: the module (default: imported); require_cuda=False lets tests run a stand-in on CPU."""
        super().__init__()
        if flash_attn is None:
            import flash_attn
            import inspect
            if "block_table" not in inspect.signature(flash_attn.flash_attn_varlen_func).parameters:
                raise ImportError(f"flash_attn {getattr(flash_attn, '__version__', '?')} takes no block_table "
                                  "(paged KV needs flash-attn 2.5 or later)")
        self._flash, self._require_cuda = flash_attn, require_cuda

    def usable(self, q: torch.Tensor, layer: LayerKV) -> bool:
        """An unquantized fp16/bf16 cache of q's dtype, pages a multiple of 256 slots, head size a
        multiple of 8 up to 256, contiguous pages on q's (CUDA) device."""
        fmt, k = layer.fmt, layer.k
        return (not fmt.quantized and k.dtype == q.dtype and q.dtype in (torch.float16, torch.bfloat16)
                and k.dim() == 4 and k.shape[1] % self.PAGE_MULTIPLE == 0 and q.dim() == 3
                and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and q.shape[1] % k.shape[2] == 0
                and k.is_contiguous() and layer.v.is_contiguous() and k.device == q.device
                and (q.is_cuda or not self._require_cuda))

    def attention(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.usable(q, layer):
            return super().attention(q, layer, meta, scale, k, v)
        # causal with fewer queries than keys aligns the queries to the end of their context (query i
        # of a sequence with q_len queries and L keys sits at position L - q_len + i), as the pages hold
        return self._flash.flash_attn_varlen_func(
            q, layer.k, layer.v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.page_table)

    def describe(self, fmt: KVFormat) -> dict[str, str]:
        out = super().describe(fmt)
        if not fmt.quantized and fmt.dtype in (torch.float16, torch.bfloat16):
            out["decode_attention"] = out["prefill_attention"] = \
                f"flash-attn (pages a multiple of {self.PAGE_MULTIPLE}, else triton)"
        return out


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_kernels(device: "str | torch.device", deterministic: bool = False) -> TorchKernels:
    """The backend for a device: native CPU kernels when the C kernel builds; on CUDA flash-attn's
    attention when flash_attn imports (not in deterministic mode) over Triton kernels when triton
    is installed; else the reference."""
    kind = torch.device(device).type
    if kind == "cpu" and paged_decode.available():
        return NativeCpuKernels()
    if kind == "cuda" and triton_available():
        try:
            if flash_attn_available() and not deterministic:
                try:
                    return FlashAttnKernels()
                except ImportError as e:
                    log.warning("flash_attn did not import (%s): CUDA attention runs the Triton kernels", e)
            return TritonKernels()
        except ImportError as e:         # a broken triton install: the reference still gives the answers
            log.warning("triton did not import (%s): CUDA cache ops run the torch reference", e)
    return TorchKernels()
