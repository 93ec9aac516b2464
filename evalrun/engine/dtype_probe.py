"""The `--dtype auto` probe: what one model layer's linears cost in float32 and in bfloat16 on this
CPU, through the engine's own linear kernels, measured once per CPU and kept on disk.

    shapes   SmolLM2-135M's layer (weight [out, in]): qkv [960, 576], o [576, 576],
             gate_up [3072, 576], down [576, 1536]; rows 1 (decode-like), 32 and 256 (prefill-like)
    timing   `make_linear(weight)` then `linear(x, lin)`: one warm-up call, then the best of REPS
             calls per (linear, rows), the dtypes interleaved; 0.5-1 s on the 2-core AVX-512 BF16
             development machine under load (2026-12-04), kernel builds aside; BUDGET_S caps the repeats
    ratio    bf16's total / float32's total over every (linear, rows); auto picks bf16 below
             BF16_MARGIN (evalrun/engine/auto.py choose_dtype)
    cache    $EVALRUN_CACHE/dtype-probe/<key hash>.json (else ~/.cache/evalrun/...), written
             atomically; the key: CPU model name, CPU flags, torch version, torch threads, the
             linear-choosing environment (EVALRUN_LINEAR, EVALRUN_GEMM_WIDTH) and a hash of the
             kernel sources (kernels/cpu/csrc/*.c *.h, kernels/cpu/*.py, kernels/linear.py),
             so a new kernel is measured again. A corrupt or foreign file is measured over.

Nothing runs at import; `probe()` is called through `auto.host_facts(probe=True)` only, which
engine_config asks for where `--dtype auto` resolves on a CPU with native bf16.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from evalrun.kernels import linear as linear_mod
from evalrun.kernels.linear import linear, make_linear

log = logging.getLogger(__name__)

BF16_MARGIN = 0.9          # bf16 is chosen only where its linears take < 0.9x float32's time
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 32, 256)
REPS = 7
BUDGET_S = 2.0             # stop repeating (keeping at least one timed call each) past this
ENV_KEYS = ("EVALRUN_LINEAR", "EVALRUN_GEMM_WIDTH")
FORMAT = 1                 # of the cache file


@dataclass(frozen=True)
class Timing:
    """One (linear, rows): the best seconds of one `linear(x, lin)` call in each dtype."""
    linear: str
    shape: tuple[int, int]      # weight [out, in]
    rows: int
    float32_s: float
    bfloat16_s: float


@dataclass(frozen=True)
class ProbeResult:
    timings: tuple[Timing, ...]
    float32_backend: str        # the kernel each dtype's linears ran on (Linear.kernel_name)
    bfloat16_backend: str
    measured: str               # UTC date of the measurement, "2026-12-04"
    cached: bool                # read from the cache file (False: measured by this process)
    path: Optional[str]         # the cache file (None: it could not be written)

    @property
    def float32_total_s(self) -> float:
        return sum(t.float32_s for t in self.timings)

    @property
    def bfloat16_total_s(self) -> float:
        return sum(t.bfloat16_s for t in self.timings)

    @property
    def ratio(self) -> float:
        """bf16's time over float32's: < 1 where bf16 is faster."""
        return self.bfloat16_total_s / self.float32_total_s

    def record(self) -> dict[str, Any]:
        """manifest["engine_choices"]["dtype"]["probe"]: the figures behind an auto dtype."""
        return {"ratio": round(self.ratio, 4), "margin": BF16_MARGIN,
                "float32_total_s": self.float32_total_s, "bfloat16_total_s": self.bfloat16_total_s,
                "seconds": [{"linear": t.linear, "shape": list(t.shape), "rows": t.rows,
                             "float32": t.float32_s, "bfloat16": t.bfloat16_s} for t in self.timings],
                "backends": {"float32": self.float32_backend, "bfloat16": self.bfloat16_backend},
                "measured": self.measured, "cached": self.cached, "cache_file": self.path}


Measure = Callable[[], ProbeResult]


def enabled() -> bool:
    """False where EVALRUN_DTYPE_PROBE=0 (then `auto` follows the CPU flags alone)."""
    return os.environ.get("EVALRUN_DTYPE_PROBE", "").strip() != "0"


def cache_root() -> Path:
    """$EVALRUN_CACHE, else ~/.cache/evalrun (the convention of kernels/cpu/native.py and demo.py)."""
    env = os.environ.get("EVALRUN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "evalrun"


def cpu_model_name() -> Optional[str]:
    """/proc/cpuinfo's "model name" (e.g. "AMD EPYC 9B45"), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == "model name":
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def kernel_sources_hash() -> str:
    """sha256 over the sources of the CPU linear kernels: a changed kernel is measured again."""
    kernels = Path(linear_mod.__file__).resolve().parent
    files = sorted([*kernels.glob("cpu/csrc/*.c"), *kernels.glob("cpu/csrc/*.h"), *kernels.glob("cpu/*.py"),
                    kernels / "linear.py"])
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(kernels)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(flags: Optional[frozenset[str]]) -> dict[str, Any]:
    """What the figures depend on; a change of any of it means measuring again."""
    return {"format": FORMAT, "cpu_model": cpu_model_name(), "cpu_flags": sorted(flags or ()),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in ENV_KEYS}, "kernels": kernel_sources_hash()}


def cache_path(key: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "dtype-probe" / f"{name}.json"


def probe(flags: Optional[frozenset[str]], measure: Optional[Measure] = None) -> ProbeResult:
    """The float32/bf16 figures of this CPU: from the cache file of `cache_key(flags)`, else measured
    (by `measure`, default `measure_linears`) and written there. A file that cannot be read as this
    key's result is measured over; one that cannot be written leaves `path` None."""
    key = cache_key(flags)
    path = cache_path(key)
    kept = _read(path, key)
    if kept is not None:
        return kept
    result = (measure or measure_linears)()
    stored = _write(path, key, result)
    return ProbeResult(result.timings, result.float32_backend, result.bfloat16_backend, result.measured,
                       cached=False, path=str(path) if stored else None)


def measure_linears() -> ProbeResult:
    """Time SHAPES x ROWS in float32 and bf16 through make_linear + linear (see the module header)."""
    dtypes = (torch.float32, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)         # NOTE: a generator of its own: the global RNG is untouched
    cases: list[tuple[str, tuple[int, int], int, torch.dtype, torch.Tensor, Any]] = []
    for name, (out_f, in_f) in SHAPES.items():
        weight = torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5                   # [out, in]
        lins = {dt: make_linear(weight.to(dt)) for dt in dtypes}
        for rows in ROWS:
            x = torch.randn(rows, in_f, generator=gen)                                    # [rows, in]
            cases += [(name, (out_f, in_f), rows, dt, x.to(dt), lins[dt]) for dt in dtypes]
    for *_, x, lin in cases:                                                              # warm-up
        linear(x, lin)
    best = [float("inf")] * len(cases)
    deadline = time.perf_counter() + BUDGET_S
    for rep in range(REPS):
        if rep and time.perf_counter() > deadline:
            break
        for i, (*_, x, lin) in enumerate(cases):           # the dtypes interleaved: drift hits both alike
            best[i] = min(best[i], _time_call(x, lin))
    timings = tuple(Timing(name, shape, rows, best[i], best[i + 1])
                    for i, (name, shape, rows, *_) in enumerate(cases) if i % 2 == 0)
    return ProbeResult(timings, cases[0][5].kernel_name, cases[1][5].kernel_name, _today(), cached=False,
                       path=None)


def _time_call(x: torch.Tensor, lin: Any) -> float:
    start = time.perf_counter()
    linear(x, lin)
    return time.perf_counter() - start


def _today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def _read(path: Path, key: dict[str, Any]) -> Optional[ProbeResult]:
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        res = data["result"]
        timings = tuple(Timing(t["linear"], tuple(t["shape"]), int(t["rows"]), float(t["float32_s"]),
                               float(t["bfloat16_s"])) for t in res["timings"])
        if not timings or sum(t.float32_s for t in timings) <= 0:
            return None
        return ProbeResult(timings, str(res["float32_backend"]), str(res["bfloat16_backend"]),
                           str(res["measured"]), cached=True, path=str(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("dtype probe cache %s unreadable (%s): measuring again", path, exc)
        return None


def _write(path: Path, key: dict[str, Any], result: ProbeResult) -> bool:
    """Atomically (a temp file in the same folder, then os.replace); False where it cannot be written."""
    res = {k: v for k, v in asdict(result).items() if k not in ("cached", "path")}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "result": res}, f, indent=1)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as exc:
        log.warning("dtype probe cache %s not written (%s)", path, exc)
        return False
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
