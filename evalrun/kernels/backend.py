"""Kernel backends and the kernel plan: which kernel runs each op, decided once.

A backend is chosen per (device, deterministic) when a model loads (`choose_kernels`). For each
cache format the model serves, the backend resolves a `KernelPlan` once from a `PlanKey` (the
model's head shapes, the cache format and page size, the model dtype and device): one callable
per op, each kernel's preconditions checked then against the shapes and layouts (the cache's
tensors are laid out by LayerKV.allocate, contiguous, in the format's shapes). Per-call code calls
the plan's ops with no check and no fallback; `KernelPlan.names` is what the run manifest records.

    kv_write(k, v, layer, slot_mapping)                      new tokens into their slots
    copy_page_prefix(layers, src, dst, n)                    first n slots of a page
    attention(q, layer, meta, scale, k, v, sliding_window=0, softcap=0.0) -> [T, Hq, D]
                                                             prefill and decode of a packed batch; a
                                                             layer's sliding window or soft-capping
                                                             (0: none) picks the plan's kernels for
                                                             such layers (the "variant" ones)
    rope_write_kv(qkv, cos, sin, hq, hkv, layer, slots)      -> q, k, v (k, v None where unused)
    rms_norm(x, w, eps) / head_norm(h, w, eps)               layer rows (model dtype) / the head's float32 rows
    norm_in(x, w, eps)                                       rms_norm of rows only a linear reads (the
                                                             native bf16 plan: rounded to bf16 once, as
                                                             the bf16 GEMM would; None: rms_norm)
    gate_up_silu(h, gate_up) -> [T, I]                       silu(gate) * up of the fused projection
    gate_up_gelu(h, gate_up) -> [T, I]                       gelu_tanh(gate) * up (GeGLU: Gemma)

Backends: `TorchKernels` (the references, CPU and CUDA); `NativeCpuKernels` (kernels/cpu: the C
kernels where the plan's key fits them); `TritonKernels` (kernels/cuda, CUDA or Triton's
interpreter); `FlashAttnKernels` (kernels/cuda/flash_attn.py: flash-attn's paged attention for
unquantized 16-bit caches whose page size is a multiple of 256, else the Triton attention; not in
deterministic mode, since flash-attn splits long contexts by the batch's size).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch

from .attention import AttentionMetadata
from .cpu import (decode_step, fused as native_fused, gemm, gemm_bf16, kv_quant as native_quant, paged_decode,
                  paged_prefill)
from .cuda import flash_attn, triton_attention, triton_cache_ops, triton_linear
from .kv_format import KVFormat, LayerKV
from .linear import Linear, linear, linear_backend
from .ref.attention import attend
from .ref.cache_ops import copy_page_prefix_torch, write_kv_torch
from .ref.fused import gelu_tanh_mul_reference, rms_norm_reference, rope_write_reference, silu_mul_reference
from .ref.kv_quant import rotate

log = logging.getLogger(__name__)

WriteFn = Callable[[torch.Tensor, torch.Tensor, LayerKV, torch.Tensor], None]
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class PlanKey:
    """What a plan is resolved for: the model's shapes, the cache's format, dtype and device."""
    device: str                  # "cpu" | "cuda"
    dtype: torch.dtype           # the model's (activations, layer norms)
    fmt: KVFormat
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0   # 0: unknown (no fused gate/up epilogue)
    deterministic: bool = False
    # the cache's tensors are as LayerKV.allocate lays them out (a PagedCache's are); False: a layer
    # made by hand that does not fit (for_layer), which every backend's plan sends to the reference
    standard_layout: bool = True
    variants: bool = False       # some layer has a sliding window or soft-capping (the plan names their kernels)
    act: str = "silu"            # the gated MLP's activation: "silu" or "gelu_tanh" (the plan names its kernel)

    @classmethod
    def for_layer(cls, q: torch.Tensor, layer: LayerKV, deterministic: bool = False) -> "PlanKey":
        """The key of a query [T, Hq, D] against one layer's cache (tests and benchmarks of one op)."""
        fits = (q.dim() == 3 and q.shape[-1] == layer.head_dim and q.shape[1] >= 1 and layer.standard_layout()
                and all(t.device == q.device for t in layer.tensors()))
        return cls(q.device.type, q.dtype, layer.fmt, layer.page_size, q.shape[1], layer.num_kv_heads,
                   layer.head_dim, 0, deterministic, fits)

    @property
    def linear(self) -> str:
        return linear_backend(self.device, self.dtype, self.deterministic)


@dataclass(frozen=True)
class KernelPlan:
    """One callable per op (the module docstring), and what they are (`names`, for the manifest)."""
    backend: str
    kv_write: WriteFn
    copy_page_prefix: Callable[[list[LayerKV], int, int, int], None]
    attention: Callable[..., torch.Tensor]
    rope_write_kv: Callable[..., tuple[Any, ...]]
    rms_norm: NormFn
    head_norm: NormFn
    gate_up_silu: Callable[[torch.Tensor, Linear], torch.Tensor]
    decode_step: bool            # the native all-layer decode step (kernels/cpu/decode_step.py) runs decode batches
    cuda_graphs: bool            # decode steps may be captured as CUDA graphs (no host sync in any op)
    names: dict[str, str] = field(default_factory=dict)
    # the residual stream's dtype between the ops, None: the model's. The native CPU plan of a bf16
    # model on the bf16 GEMM keeps it float32: weights and pages are bf16, each GEMM rounds its rows
    # to bf16 and accumulates in float32, and the element-wise ops run on the float32 rows
    stream_dtype: Optional[torch.dtype] = None
    gate_up_gelu: Optional[Callable[[torch.Tensor, Linear], torch.Tensor]] = None
    norm_in: Optional[NormFn] = None

    def input_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """The norm before a linear (an attention's or an MLP's input): norm_in where the plan has one."""
        return (self.norm_in or self.rms_norm)(x, w, eps)

    def describe(self) -> dict[str, str]:
        """What runs each op (recorded in run manifests)."""
        return dict(self.names)


# --- op builders: each returns the op's callable, made once per plan ---------------------------
def _attention(decode: Optional[Callable] = None, rotation: Callable = rotate,
               prefill: Optional[Callable] = None) -> Callable[..., torch.Tensor]:
    """decode / prefill (None: the references), which take a layer's sliding window and soft-capping."""
    def attention(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                  sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return attend(q, layer, meta, scale, decode, rotation, k, v, prefill, sliding_window, softcap)
    return attention


def _variants_by(full: Callable[..., torch.Tensor], variant: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An attention op whose kernel has no sliding window or soft-capping (Triton, flash-attn):
    such layers go to `variant` (the plan names it)."""
    def attention(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                  sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        if sliding_window or softcap:
            return variant(q, layer, meta, scale, k, v, sliding_window, softcap)
        return full(q, layer, meta, scale, k, v)
    return attention


def _variant_names(key: "PlanKey", names: dict[str, str], decode: str, prefill: str) -> None:
    """What runs the attention of layers with a sliding window or soft-capping, where the model has any."""
    if key.variants:
        names["variant_decode_attention"], names["variant_prefill_attention"] = decode, prefill


def _rope_write(write: WriteFn) -> Callable[..., tuple[Any, ...]]:
    def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, layer: LayerKV,
                      slot_mapping: torch.Tensor) -> tuple[Any, ...]:
        return rope_write_reference(qkv, cos, sin, hq, hkv, lambda k, v: write(k, v, layer, slot_mapping))
    return rope_write_kv


def _rope_write_native(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, layer: LayerKV,
                       slot_mapping: torch.Tensor) -> tuple[Any, ...]:
    q = native_fused.rope_write_native(qkv, cos, sin, hq, hkv, layer.k, layer.v, slot_mapping)
    return q, None, None                 # a float cache: attention reads k, v from the pages


def _gated(act_mul: Callable[[torch.Tensor], torch.Tensor], rows: Optional[torch.dtype] = None
           ) -> Callable[[torch.Tensor, Linear], torch.Tensor]:
    """The fused gate/up projection (its output in `rows`, default h's dtype), then act(gate) * up
    (silu_mul, gelu_tanh_mul)."""
    def gate_up_act(h: torch.Tensor, gate_up: Linear) -> torch.Tensor:
        return act_mul(linear(h, gate_up, out_dtype=rows))
    return gate_up_act


def _silu_epilogue(gemm_silu: Callable[[torch.Tensor, torch.Tensor, int], Optional[torch.Tensor]]
                   ) -> Callable[[torch.Tensor, Linear], torch.Tensor]:
    """The SiLU in a native GEMM's epilogue (kernels/cpu/gemm.py and gemm_bf16.py gemm_silu: the same
    bits as the GEMM then silu_mul, without the [T, 2I] product); where that path declines (gemm.py:
    one or two rows) or the projection has a bias (the epilogue adds none), those two calls (float32)."""
    def gate_up_silu(h: torch.Tensor, gate_up: Linear) -> torch.Tensor:
        out = None if gate_up.bias is not None else gemm_silu(h, gate_up.panels, gate_up.weight.shape[0] // 2)
        return out if out is not None else native_fused.silu_mul_native(linear(h, gate_up, out_dtype=torch.float32))
    return gate_up_silu


# the bf16 plan's SiLU output is only read by the down projection's bf16 GEMM: rounded to bf16 as it would be
_gate_up_silu_gemm = _silu_epilogue(gemm.gemm_silu)
_gate_up_silu_bf16 = _silu_epilogue(partial(gemm_bf16.gemm_silu, out_dtype=torch.bfloat16))


def _rms_norm_f32_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The native RMSNorm of float32 rows with a bf16 model's weights (widened: exact)."""
    return native_fused.rms_norm_native(x, w if w.dtype == torch.float32 else w.float(), eps)


def _rms_norm_to_bf16(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """_rms_norm_f32_rows rounded to bf16 in the norm: the rows the bf16 GEMM reads, in place."""
    return native_fused.rms_norm_native(x, w if w.dtype == torch.float32 else w.float(), eps, torch.bfloat16)


def _heads_fit(key: PlanKey) -> bool:
    return key.num_kv_heads >= 1 and key.num_heads % key.num_kv_heads == 0


class TorchKernels:
    name = "torch"
    device = "cpu"               # where `describe` resolves a plan when not told

    def plan(self, key: PlanKey) -> KernelPlan:
        """The plan of this backend for `key`: resolved when a cache is made (PagedCache keeps it for
        its life) and for the manifest, each time from the same facts (the key, the libraries built,
        EVALRUN_* switches)."""
        return self._resolve(key)

    def _resolve(self, key: PlanKey) -> KernelPlan:
        names = {"kv_write": "torch", "decode_attention": "torch", "prefill_attention": "torch-sdpa",
                 "rope_write": "torch", "norm_act": "torch", "norm_in": "torch", "head_norm": "torch",
                 "gate_up_silu": "torch",
                 "decode_step": "off", "cuda_graphs": "off", "stream": str(key.dtype).removeprefix("torch.")}
        _variant_names(key, names, "torch", "torch-sdpa")
        if key.act == "gelu_tanh":
            names["gate_up_gelu"] = "torch"
        return KernelPlan(self.name, write_kv_torch, copy_page_prefix_torch, _attention(), _rope_write(write_kv_torch),
                          rms_norm_reference, rms_norm_reference, _gated(silu_mul_reference), False, False,
                          names, gate_up_gelu=_gated(gelu_tanh_mul_reference))

    # one op on one layer, through the plan of its key (tests and benchmarks; the engine calls its plan)
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        self.plan(PlanKey(k.device.type, k.dtype, layer.fmt, layer.page_size, k.shape[1], layer.num_kv_heads,
                          layer.head_dim)).kv_write(k, v, layer, slot_mapping)

    def attention(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                  k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                  sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return self.plan(PlanKey.for_layer(q, layer)).attention(q, layer, meta, scale, k, v, sliding_window, softcap)

    def describe(self, fmt: KVFormat, dtype: torch.dtype = torch.float32, device: Optional[str] = None,
                 page_size: int = 256) -> dict[str, str]:
        """The plan's names for a nominal model (8 heads of 64 over 8 KV heads) over `fmt`."""
        return self.plan(PlanKey(device or self.device, dtype, fmt, page_size, 8, 8, 64)).describe()


class NativeCpuKernels(TorchKernels):
    name = "native-cpu"

    def _resolve(self, key: PlanKey) -> KernelPlan:
        ref = super()._resolve(key)
        fmt, bf16_gemm = key.fmt, key.dtype == torch.bfloat16 and key.linear == "native-bf16"
        f32 = key.dtype == torch.float32 or bf16_gemm          # the rows the element-wise ops see
        if not key.standard_layout:
            return KernelPlan(**{**ref.__dict__, "backend": self.name})
        if key.device != "cpu":
            raise ValueError(f"the native CPU kernels run on the CPU, not {key.device}")
        names = dict(ref.names)
        kinds_ok = fmt.quantized or fmt.dtype in paged_decode._FLOAT_KINDS
        decode = paged_decode.decode_native if kinds_ok and _heads_fit(key) and paged_decode.available() else None
        prefill = None
        if decode is not None and not fmt.window and key.head_dim % paged_prefill.LANES == 0 and paged_prefill.available():
            prefill = paged_prefill.prefill_native
        rotation = native_quant.rotate_native if native_quant.available() else rotate
        names["decode_attention"] = "native-c" if decode else "torch"
        names["prefill_attention"] = "native-c" if prefill else "torch-sdpa"
        _variant_names(key, names, names["decode_attention"], names["prefill_attention"])
        write = write_kv_torch
        if fmt.quantized and native_quant.quantize_available():
            write, names["kv_write"] = native_quant.write_kv_native, "native-c"
        fused_ok = native_fused.available()
        rope = _rope_write(write)
        float_pages = not fmt.quantized and fmt.dtype in native_fused.PAGE_KINDS
        if fused_ok and f32 and float_pages:      # float32 rows rotated, rounded once into the pages
            rope, names["rope_write"] = _rope_write_native, "native-c"
            names["kv_write"] = "native-c rope_write"        # the model's K/V are written by the rope kernel
        norm = rms_norm_reference
        if fused_ok and f32:
            norm = _rms_norm_f32_rows if bf16_gemm else native_fused.rms_norm_native
        head = native_fused.rms_norm_native if fused_ok else rms_norm_reference
        silu = native_fused.silu_mul_native if fused_ok and f32 else silu_mul_reference
        rows = torch.float32 if fused_ok and f32 else None          # what the native element-wise ops take
        gate_up = _gated(silu, rows)
        names["gate_up_silu"] = "native-c silu" if silu is not silu_mul_reference else "torch"
        if fused_ok and f32 and key.linear == "native-gemm" and gemm.silu_fusable(key.intermediate_size):
            gate_up, names["gate_up_silu"] = _gate_up_silu_gemm, "native-gemm silu epilogue"
        if fused_ok and f32 and key.linear == "native-bf16" and gemm_bf16.silu_fusable(key.intermediate_size):
            gate_up, names["gate_up_silu"] = _gate_up_silu_bf16, "native-bf16 silu epilogue"
        gelu = _gated(native_fused.gelu_tanh_mul_native if fused_ok and f32 else gelu_tanh_mul_reference, rows)
        if key.act == "gelu_tanh":
            names["gate_up_gelu"] = "native-c gelu_tanh" if fused_ok and f32 else "torch"
        names["norm_act"] = names["norm_in"] = "native-c" if norm is not rms_norm_reference else "torch"
        names["head_norm"] = "native-c" if fused_ok else "torch"
        step = (fused_ok and f32 and key.linear in ("native-gemm", "native-bf16") and float_pages
                and decode_step.available())
        names["decode_step"] = "native-c" if step else "off"
        names["stream"] = "float32" if bf16_gemm else names["stream"]
        norm_in = None
        if norm is _rms_norm_f32_rows and key.linear == "native-bf16":     # rows only the bf16 GEMM reads
            norm_in, names["norm_in"] = _rms_norm_to_bf16, "native-c, rounded to bf16"
        return KernelPlan(self.name, write, copy_page_prefix_torch, _attention(decode, rotation, prefill), rope,
                          norm, head, gate_up, step, False, names, torch.float32 if bf16_gemm else None, gelu,
                          norm_in)


class TritonKernels(TorchKernels):
    name = "triton"
    device = "cuda"

    def _resolve(self, key: PlanKey) -> KernelPlan:
        ref = super()._resolve(key)
        fmt = key.fmt
        if not key.standard_layout:
            return KernelPlan(**{**ref.__dict__, "backend": self.name})
        if key.device != "cuda" and not triton_attention.interpreting():
            raise ValueError(f"the Triton kernels run on CUDA (or under TRITON_INTERPRET=1), not {key.device}")
        names = dict(ref.names)
        write: WriteFn = write_kv_torch
        if not fmt.quantized:
            write, names["kv_write"] = triton_cache_ops.write_kv_triton, "triton"
        elif key.head_dim % fmt.group_size == 0 and key.head_dim & (key.head_dim - 1) == 0:
            write, names["kv_write"] = triton_cache_ops.write_kv_quant_triton, "triton"
        attention = ref.attention
        if key.dtype in triton_attention._FLOATS and _heads_fit(key):
            if fmt.window:           # the window's prefill stays with the reference (SDPA)
                attention = _attention(triton_attention.decode_triton)
                names["decode_attention"], names["prefill_attention"] = "triton", "torch-sdpa"
            else:
                attention = _triton_attention
                names["decode_attention"] = names["prefill_attention"] = "triton"
        _variant_names(key, names, names["decode_attention"], names["prefill_attention"])
        names["norm_act"], names["head_norm"] = "triton rms_norm, torch silu", "triton"
        names["norm_in"] = "triton rms_norm"
        graphs = (write is not write_kv_torch and names["decode_attention"] == "triton" and not fmt.window
                  and not key.variants)       # the reference's variant decode reads the lengths on the host
        names["cuda_graphs"] = "on" if graphs else "off"
        return KernelPlan(self.name, write, copy_page_prefix_torch, attention, _rope_write(write),
                          triton_linear.rms_norm_triton, triton_linear.rms_norm_triton, ref.gate_up_silu, False,
                          graphs, names, gate_up_gelu=ref.gate_up_gelu)


def _triton_attention(q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, scale: float,
                      k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                      sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    fmt = layer.fmt
    qr = rotate(q, fmt.group_size).to(q.dtype) if fmt.rotate else q
    out = triton_attention.paged_attention_triton(qr, layer, meta, scale, sliding_window, softcap)
    return rotate(out, fmt.group_size).to(q.dtype) if fmt.rotate else out


class FlashAttnKernels(TritonKernels):
    name = "flash-attn"

    def __init__(self, module: Any = None, require_cuda: bool = True) -> None:
        """module: flash_attn (default: imported); require_cuda=False lets tests run a stand-in on CPU."""
        self._flash, self._require_cuda = module if module is not None else flash_attn.load(), require_cuda

    def usable(self, key: PlanKey) -> bool:
        """kernels/cuda/flash_attn.py usable, GQA-compatible heads, a standard layout, on CUDA."""
        return (flash_attn.usable(key.fmt, key.dtype, key.page_size, key.head_dim) and _heads_fit(key)
                and key.standard_layout and (key.device == "cuda" or not self._require_cuda))

    def _resolve(self, key: PlanKey) -> KernelPlan:
        plan = super()._resolve(key)
        names = {**plan.names, "cuda_graphs": "off"}      # flash-attn reads the lengths on the host
        attention = plan.attention
        if self.usable(key):
            attention = _variants_by(flash_attn.attention_op(self._flash), plan.attention)
            names["decode_attention"] = names["prefill_attention"] = "flash-attn"
        return KernelPlan(**{**plan.__dict__, "backend": self.name, "attention": attention, "cuda_graphs": False,
                             "names": names})


def flash_attn_available() -> bool:
    return flash_attn.available()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


BACKENDS: dict[str, type[TorchKernels]] = {"torch": TorchKernels, "native-cpu": NativeCpuKernels,
                                           "triton": TritonKernels, "flash-attn": FlashAttnKernels}


def choose_kernels(device: "str | torch.device", deterministic: bool = False) -> TorchKernels:
    """The backend for a device: native CPU kernels when the C kernel builds; on CUDA flash-attn's
    attention when flash_attn imports (not in deterministic mode) over Triton kernels when triton
    is installed; else the reference. `EVALRUN_KERNELS=torch|native-cpu|triton|flash-attn` asks
    for one (tests and A/B runs); ValueError where it cannot be made (its plan says where it runs)."""
    asked = os.environ.get("EVALRUN_KERNELS", "").strip().lower()
    if asked:
        if asked not in BACKENDS:
            raise ValueError(f"EVALRUN_KERNELS={asked!r} is not one of {', '.join(BACKENDS)}")
        if asked == "native-cpu" and not paged_decode.available():
            raise ValueError("EVALRUN_KERNELS=native-cpu: the native CPU kernels did not build here (see kernels.cpu.native)")
        return BACKENDS[asked]()
    kind = torch.device(device).type
    if kind == "cpu" and paged_decode.available():
        return NativeCpuKernels()
    if kind == "cuda" and triton_available():
        if flash_attn_available() and not deterministic:
            try:
                return FlashAttnKernels()
            except ImportError as e:
                log.warning("flash_attn did not import (%s): CUDA attention runs the Triton kernels", e)
        return TritonKernels()
    return TorchKernels()
