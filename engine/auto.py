"""`auto` engine settings: device, compute dtype and KV-cache storage chosen from facts of the host.

    device  auto -> cpu                  (the CUDA path has no GPU-tested suite yet; say why)
    dtype   auto -> bfloat16 on CUDA, or on a CPU with AVX512-BF16 or AMX-BF16
                 -> float32 elsewhere    (bf16 matmuls are emulated there, ~6x slower)
    cache   auto -> the storage of the compute dtype (bf16 / fp16 / fp32)

Pure functions of a `HostFacts` record, so every case is testable on any machine;
`host_facts()` reads the real host. Nothing here loads a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    import torch
    from kernels.cpu import cpu_flags
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


def choose_cache_mode(requested: str, dtype: str, modes: tuple[str, ...]) -> Choice:
    if requested != AUTO:
        if requested not in modes:
            raise SettingError(f"--cache-mode must be auto or one of {', '.join(modes)}, got {requested!r}")
        return Choice(requested, requested, "as given")
    return Choice(AUTO, CACHE_FOR_DTYPE[dtype], f"the storage of {dtype}")
