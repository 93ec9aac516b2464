"""Native CPU kernels: small C files in kernels/cpu/csrc/, compiled on first use and loaded
with ctypes (no torch headers, so a build takes about a second).

Built with the system C compiler (`$CC`, else `cc`/`gcc`) for this CPU (-march=native),
into `$EVALRUN_CACHE/kernels` (else `~/.cache/evalrun/kernels`) under a name that hashes
the source, the flags and the CPU's flags, written atomically so parallel processes
can share it. Without a compiler, or with `EVALRUN_NATIVE=0`, `load()` returns None and
callers use their torch reference.

With `EVALRUN_NATIVE_EMULATE=avx512_bf16` (host.py) the kernels are built for an AVX-512 BF16 CPU
on SIMDe's portable intrinsics (the `simde-py` package's headers; csrc/emulate_avx512.h), at -O1
(the same bits: no -ffast-math, and -std=c11 turns FP contraction off): their AVX-512 paths are
then checked on any x86 CPU with AVX2 (tests/test_emulated_avx512.py). Without SIMDe's headers
the kernels are off (a warning says why) and callers use their torch reference.

csrc/pool.c (the thread pool all kernels share, pool.h) is its own library, loaded first and
with RTLD_GLOBAL so the kernel libraries resolve `evalrun_pool_run` to one pool: workers of
separate pools would spin against each other on few cores.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

from .host import EMULATE_ENV, cpu_flags_line, emulation

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11"]
LIBS = ["-lm", "-lpthread"]
POOL = "pool"                       # csrc/pool.c: the shared thread pool
_loaded: dict[str, Optional[ctypes.CDLL]] = {}


def enabled() -> bool:
    return os.environ.get("EVALRUN_NATIVE", "1") not in ("0", "false", "no", "")


def cache_dir() -> Path:
    env = os.environ.get("EVALRUN_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "evalrun") / "kernels"


def compiler() -> Optional[str]:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc")):
        path = shutil.which(name)
        if path:
            return path
    return None


Signature = tuple[Any, list[Any]]          # (restype, argtypes) of one exported C function


def load(name: str, signatures: Optional[dict[str, Signature]] = None,
         require: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The compiled library for csrc/<name>.c, or None (disabled, no compiler, build error).
    `signatures` are set on its functions once per loaded library; with `require`, the name of a
    no-argument C function, the library counts only where that returns nonzero here (e.g. the
    instructions it was built with), checked once."""
    if not enabled():
        return None
    if name not in _loaded:
        if name != POOL and load(POOL) is None:
            log.warning("native kernel %s disabled: the thread pool it runs on (csrc/pool.c) did not build", name)
            _loaded[name] = None
        else:
            _loaded[name] = _build_and_load(name, ctypes.RTLD_GLOBAL if name == POOL else ctypes.RTLD_LOCAL)
    lib = _loaded[name]
    if lib is None:
        return None
    declared = lib.__dict__.setdefault("_evalrun_declared", {})
    for fn in (signatures or {}).keys() - declared.keys():
        restype, argtypes = signatures[fn]
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
        declared[fn] = True
    if require is not None:
        if require not in declared:
            check = getattr(lib, require)
            check.restype, check.argtypes = ctypes.c_int, []
            declared[require] = bool(check())
        if not declared[require]:
            return None
    return lib


def _build_and_load(name: str, mode: int = ctypes.RTLD_LOCAL) -> Optional[ctypes.CDLL]:
    cc = compiler()
    if cc is None:
        log.info("no C compiler found: native kernel %s disabled, using the torch reference", name)
        return None
    cpu = cpu_flags_line()
    flags = FLAGS if cpu is not None else [f for f in FLAGS if f != "-march=native"]
    emulated = emulation() if name != POOL else None
    if emulated is not None:
        flags = emulation_flags(flags)
        if flags is None:
            log.warning("native kernel %s disabled: %s=%s needs SIMDe's headers (pip install simde-py)",
                        name, EMULATE_ENV, emulated)
            return None
    tmp: Optional[str] = None
    try:
        src = CSRC / f"{name}.c"
        # every file of csrc/: headers are included, and decode_step.c includes other kernels' sources
        others = b"".join(f.read_bytes() for f in sorted(CSRC.iterdir()) if f.suffix in (".c", ".h") and f != src)
        key = hashlib.sha256(src.read_bytes() + others + " ".join([cc, *flags, *LIBS]).encode()
                             + (cpu or f"portable {os.uname().machine}").encode())
        out = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            subprocess.run([cc, *flags, str(src), "-o", tmp, *LIBS], check=True,
                           capture_output=True, text=True, timeout=120)
            os.chmod(tmp, 0o755 & ~_umask())        # mkstemp makes 0600: let other users load it
            os.replace(tmp, out)
            tmp = None
        return ctypes.CDLL(str(out), mode=mode)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("building native kernel %s failed, using the torch reference: %s", name, detail)
        return None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def simde_available() -> bool:
    """Whether simde-py, the emulation's headers, is installed."""
    return importlib.util.find_spec("simde_py") is not None


def emulation_flags(flags: list[str]) -> Optional[list[str]]:
    """`flags` for a build on SIMDe's emulated AVX-512 (see the module's text); None without
    simde-py."""
    try:
        import simde_py
        include, version = simde_py.get_include(), importlib.metadata.version("simde-py")
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return None
    # -mno-avx512f: on a CPU that has AVX-512 too, SIMDe takes its portable code, not the instructions
    # (the build an AVX2 CPU makes; tests/test_emulation_fidelity.py compares it with the native one)
    return [("-O1" if f == "-O3" else f) for f in flags] + [       # the version: a new SIMDe is a new build
        "-mno-avx512f", "-Wno-psabi", f"-DEVALRUN_SIMDE_PY={version}", f"-I{include}",
        "-include", str(CSRC / "emulate_avx512.h")]


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
