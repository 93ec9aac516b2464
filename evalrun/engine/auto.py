"""`auto` engine settings: device, compute dtype and KV-cache storage chosen from facts of the host.

    device  auto -> cpu                  (the CUDA path has no GPU-tested suite yet; say why)
    dtype   auto -> bfloat16 on CUDA, or on a CPU with AVX512-BF16 or AMX-BF16
                 -> float32 elsewhere    (bf16 matmuls are emulated there, ~6x slower)
    cache   auto -> the storage of the compute dtype (bf16 / fp16 / fp32)
    deterministic (batch-invariant linears, evalrun/kernels/linear.py)
            auto -> on  for float32 (the fast linears are batch-invariant already: no cost), and
                        for bf16/fp16 on a CPU without native bf16 (its matmuls are emulated; the
                        invariant float32-accumulating GEMM is faster)
                 -> off on a CPU with AVX512-BF16/AMX-BF16 at bf16/fp16 (oneDNN's native bf16
                        matmuls are several times the float32 GEMM's speed), on CUDA (the Triton
                        invariant linears' cost against cuBLAS is not measured yet), and where the
                        invariant linears cannot run (no native GEMM; no triton)

Pure functions of a `HostFacts` record, so every case is testable on any machine;
`host_facts()` reads the real host. Nothing here loads a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from evalrun.kernels.cpu.host import cpu_flags

AUTO = "auto"
DEVICES = ("cpu", "cuda")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
CACHE_FOR_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class SettingError(ValueError):
    """An engine setting that this host cannot honour (e.g. --device cuda without CUDA)."""


@dataclass(frozen=True)
class HostFacts:
    cpu_flags: Optional[frozenset[str]]      # None: unknown (no /proc/cpuinfo)
    cuda_available: bool
    torch_cuda_build: Optional[str]          # torch.version.cuda; None for a CPU-only build
    cuda_devices: int = 0                    # torch.cuda.device_count()


@dataclass(frozen=True)
class Choice:
    """One resolved setting: what was asked, what is used, and why."""
    requested: str
    value: str
    reason: str


def host_facts() -> HostFacts:
    available = torch.cuda.is_available()
    return HostFacts(cpu_flags(), available, torch.version.cuda, torch.cuda.device_count() if available else 0)


def choose_device(requested: str, facts: HostFacts) -> Choice:
    if requested == AUTO:
        why = ("CUDA is available, but the CUDA path is not yet verified on a GPU; pass --device cuda to use it"
               if facts.cuda_available else "no CUDA device")
        return Choice(AUTO, "cpu", why)
    kind, _, index = requested.partition(":")
    if kind not in DEVICES or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise SettingError(f"--device must be auto, cpu or cuda[:N], got {requested!r}")
    if kind == "cuda" and not facts.cuda_available:
        build = (f"this torch is built for CUDA {facts.torch_cuda_build} but sees no GPU"
                 if facts.torch_cuda_build else "this torch is a CPU-only build")
        raise SettingError(f"--device {requested}: no CUDA device ({build}); use --device cpu or auto")
    if index and int(index) >= max(facts.cuda_devices, 1):
        raise SettingError(f"--device {requested}: this host has {facts.cuda_devices} CUDA device(s), "
                           f"numbered from 0")
    return Choice(requested, requested, "as given")


def choose_dtype(requested: str, device: str, facts: HostFacts) -> Choice:
    if requested != AUTO:
        if requested not in DTYPE_NAMES:
            raise SettingError(f"--dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {requested!r}")
        return Choice(requested, requested, "as given")
    if device.startswith("cuda"):
        return Choice(AUTO, "bfloat16", "CUDA device")
    flags = facts.cpu_flags or frozenset()
    native = [f for f in CPU_BF16_FLAGS if f in flags]
    if native:
        return Choice(AUTO, "bfloat16", f"the CPU has {'/'.join(native)}")
    why = ("the CPU flags could not be read" if facts.cpu_flags is None
           else "the CPU has no AVX512-BF16 or AMX-BF16: bf16 matmuls would be emulated, ~6x slower")
    return Choice(AUTO, "float32", why)


def choose_deterministic(requested: str, device: str, dtype: str, facts: HostFacts,
                         unavailable: Optional[str]) -> Choice:
    """on/off. unavailable: why batch-invariant linears cannot run here (None: they can)."""
    if requested not in (AUTO, "on", "off"):
        raise SettingError(f"--deterministic must be auto, on or off, got {requested!r}")
    if requested == "off":
        return Choice(requested, "off", "as given")
    if unavailable is not None:
        if requested == "on":
            raise SettingError(f"--deterministic on: {unavailable}; use --deterministic off")
        return Choice(AUTO, "off", f"{unavailable}: results may change with the batch")
    if requested == "on":
        return Choice(requested, "on", "as given")
    if device.startswith("cuda"):
        return Choice(AUTO, "off", "on CUDA the batch-invariant Triton linears' cost against cuBLAS is not measured "
                                   "yet; pass --deterministic on for results that do not change with the batch")
    if dtype == "float32":
        return Choice(AUTO, "on", "float32 linears are batch-invariant at no cost")
    native = [f for f in CPU_BF16_FLAGS if f in (facts.cpu_flags or frozenset())]
    if native:
        return Choice(AUTO, "off", f"the CPU has {'/'.join(native)}: its native {dtype} matmuls are several times "
                                   "faster than the batch-invariant float32-accumulating GEMM; pass "
                                   "--deterministic on for results that do not change with the batch")
    return Choice(AUTO, "on", f"{dtype} matmuls are emulated on this CPU: the batch-invariant float32-accumulating "
                              "GEMM is faster")


def choose_cache_mode(requested: str, dtype: str, modes: tuple[str, ...]) -> Choice:
    if requested != AUTO:
        if requested not in modes:
            raise SettingError(f"--cache-mode must be auto or one of {', '.join(modes)}, got {requested!r}")
        return Choice(requested, requested, "as given")
    return Choice(AUTO, CACHE_FOR_DTYPE[dtype], f"the storage of {dtype}")
