"""`auto` engine settings: device, compute dtype and KV-cache storage chosen from facts of the host.

    device  auto -> cpu                  (the CUDA path has no GPU-tested suite yet; say why)
    dtype   auto -> bfloat16 on CUDA
                 -> on a CPU with AVX512-BF16 or AMX-BF16: bfloat16 where a layer's bf16 linears
                    measured < BF16_MARGIN (0.9) x float32's time (evalrun/engine/dtype_probe.py,
                    once per CPU, cached), else float32; bfloat16 unmeasured (EVALRUN_DTYPE_PROBE=0)
                 -> float32 elsewhere    (bf16 matmuls are emulated there, ~6x slower; not measured)
    cache   auto -> the storage of the compute dtype (bf16 / fp16 / fp32)
    deterministic (batch-invariant linears, evalrun/kernels/linear.py)
            auto -> on  where the linear the model uses by default is the batch-invariant one
                        (no cost: `linears`, from kernels.linear.linear_backend), and
                        for float32 (the fast linears are batch-invariant already: no cost), and
                        for bf16/fp16 on a CPU without native bf16 (its matmuls are emulated; the
                        invariant float32-accumulating GEMM is faster)
                 -> off on a CPU with AVX512-BF16/AMX-BF16 at bf16/fp16 (oneDNN's native bf16
                        matmuls are several times the float32 GEMM's speed), on CUDA (the Triton
                        invariant linears' cost against cuBLAS is not measured yet), and where the
                        invariant linears cannot run (no native GEMM; no triton)

Pure functions of a `HostFacts` record, so every case is testable on any machine;
`host_facts()` reads the real host, and `host_facts(probe=True)` adds the dtype probe's figures
where `--dtype auto` needs them (a CPU with native bf16). Nothing here loads a model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from evalrun.engine import dtype_probe
from evalrun.engine.dtype_probe import BF16_MARGIN, Measure, ProbeResult
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
    dtype_probe: Optional[ProbeResult] = None    # bf16 vs float32 linears measured (host_facts(probe=True))
    dtype_probe_skipped: Optional[str] = None    # why a CPU with native bf16 has no figures, e.g. the env


@dataclass(frozen=True)
class Choice:
    """One resolved setting: what was asked, what is used, and why."""
    requested: str
    value: str
    reason: str
    probe: Optional[ProbeResult] = None      # the figures behind an auto dtype (manifest: engine_choices)


def host_facts(probe: bool = False) -> HostFacts:
    """This host's facts; probe: with the dtype probe's figures where the CPU has native bf16
    (measured once per CPU, then read from the cache: evalrun/engine/dtype_probe.py)."""
    available = torch.cuda.is_available()
    facts = HostFacts(cpu_flags(), available, torch.version.cuda, torch.cuda.device_count() if available else 0)
    return with_dtype_probe(facts) if probe else facts


def with_dtype_probe(facts: HostFacts, measure: Optional[Measure] = None) -> HostFacts:
    """facts with the dtype probe's figures, or the reason there are none; unchanged on a CPU
    without native bf16 (emulated bf16 is known slow: nothing is measured)."""
    if not _native_bf16(facts):
        return facts
    if not dtype_probe.enabled():
        return replace(facts, dtype_probe_skipped="not measured: EVALRUN_DTYPE_PROBE=0")
    try:
        return replace(facts, dtype_probe=dtype_probe.probe(facts.cpu_flags, measure))
    except (RuntimeError, ValueError, OSError) as exc:
        return replace(facts, dtype_probe_skipped=f"not measured: the probe failed: {exc}")


def _native_bf16(facts: HostFacts) -> list[str]:
    return [f for f in CPU_BF16_FLAGS if f in (facts.cpu_flags or frozenset())]


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
    native = "/".join(_native_bf16(facts))
    if not native:
        why = ("the CPU flags could not be read" if facts.cpu_flags is None
               else "the CPU has no AVX512-BF16 or AMX-BF16: bf16 matmuls would be emulated, ~6x slower")
        return Choice(AUTO, "float32", why)
    probe = facts.dtype_probe
    if probe is None:
        return Choice(AUTO, "bfloat16", f"the CPU has {native} ({facts.dtype_probe_skipped or 'not measured'})")
    figures = (f"bf16 linears {probe.ratio:.2f}x float32's time on this CPU "
               f"(measured {probe.measured}, {'cached' if probe.cached else 'fresh'})")
    if probe.ratio < BF16_MARGIN:
        return Choice(AUTO, "bfloat16", f"the CPU has {native} and {figures}", probe)
    return Choice(AUTO, "float32", f"the CPU has {native}, but {figures}: bf16 is chosen below {BF16_MARGIN}x",
                  probe)


def choose_deterministic(requested: str, device: str, dtype: str, facts: HostFacts,
                         unavailable: Optional[str], linears: Optional[tuple[str, str]] = None) -> Choice:
    """on/off. unavailable: why batch-invariant linears cannot run here (None: they can).
    linears: (the default, the batch-invariant) linear backend for (device, dtype), as
    kernels.linear.linear_backend names them; None: not known."""
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
    if linears is not None and linears[0] == linears[1]:
        return Choice(AUTO, "on", f"the {dtype} linears run on the batch-invariant kernel ({linears[0]}) "
                                  "by default: no cost")
    if device.startswith("cuda"):
        return Choice(AUTO, "off", "on CUDA the batch-invariant Triton linears' cost against cuBLAS is not measured "
                                   "yet; pass --deterministic on for results that do not change with the batch")
    if dtype == "float32":
        return Choice(AUTO, "on", "float32 linears are batch-invariant at no cost")
    native = _native_bf16(facts)
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
