"""Other builds of a native kernel, for A/B runs in one process: a source file (the tree's, or an old
copy) compiled as evalrun/kernels/cpu/native.py compiles the tree's (its compiler and flags, the
current csrc/ headers), with extra `-D` flags, loaded after the shared thread pool.

    build(source, out_dir, name, signatures, defines="-DBF_KC=128") -> ctypes.CDLL

A variant is written NAME=DEFINES or NAME=DEFINES@SOURCE (`parse_variants`): "base=" is the tree's
source as it is, "kc128=-DBF_KC=128" the same with a macro set, "old=@/tmp/gemm_bf16.c" an old copy.
"""
from __future__ import annotations

import ctypes
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from evalrun.kernels.cpu import native


@dataclass(frozen=True)
class Variant:
    name: str
    defines: str = ""
    source: Optional[Path] = None        # None: the tree's own source


def parse_variants(text: str) -> list[Variant]:
    """'base=;kc128=-DBF_KC=128;old=@/tmp/x.c' -> its variants (names unique, at least one)."""
    out: list[Variant] = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, rest = item.partition("=")
        if not sep or not name:
            raise ValueError(f"a variant is NAME=DEFINES[@SOURCE], got {item!r}")
        defines, _, source = rest.partition("@")
        out.append(Variant(name, defines.strip(), Path(source) if source else None))
    if not out or len({v.name for v in out}) != len(out):
        raise ValueError(f"variants need distinct names, got {text!r}")
    return out


def build(source: Path, out_dir: Path, name: str, signatures: dict[str, Any], defines: str = "") -> ctypes.CDLL:
    if native.load(native.POOL) is None or native.compiler() is None:
        raise SystemExit("no compiler or thread pool: cannot build a kernel variant")
    lib_path = out_dir / f"{source.stem}_{name}.so"
    cmd = [native.compiler(), *native.FLAGS, *shlex.split(defines), "-I", str(native.CSRC), str(source),
           "-o", str(lib_path), *native.LIBS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise SystemExit(f"building variant {name} failed:\n{proc.stderr[-2000:]}")
    lib = ctypes.CDLL(str(lib_path))
    for fn, (restype, argtypes) in signatures.items():
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
    return lib


def build_variant(variant: Variant, default_source: Path, out_dir: Path, signatures: dict[str, Any]) -> ctypes.CDLL:
    return build(variant.source or default_source, out_dir, variant.name, signatures, variant.defines)
