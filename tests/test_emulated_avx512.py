"""The native kernels' AVX-512 paths checked on CPUs without AVX-512: the kernel test files run in a
child pytest with EVALRUN_NATIVE_EMULATE=avx512_bf16 (kernels/cpu/native.py), which builds every
kernel for an AVX-512 BF16 CPU on SIMDe's portable intrinsics (csrc/emulate_avx512.h) and reports
those flags as the CPU's; each file's own references then judge the AVX-512 code (float32 and
bfloat16 decode attention tiles, 16-lane prefill tiles, 512-bit GEMM tiles, vdpbf16ps GEMM tiles,
the fused decode step). On a CPU with AVX-512 BF16 the files run natively in the suite instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evalrun.kernels.cpu import host, native
from evalrun.kernels.cpu.host import EMULATE_ENV, EMULATIONS, cpu_flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = cpu_flags() or frozenset()
# the files whose kernels have AVX-512 code (paged_decode_z.h, paged_prefill_tiles.h at 16 lanes,
# gemm.c's 512-bit tiles, gemm_bf16_tiles.h, fused_ops.c, decode_step.c over all of them)
FILES = ["test_paged_decode_speedpath.py", "test_native_prefill.py", "test_gemm.py", "test_gemm_bf16.py",
         "test_fused_ops.py", "test_decode_step.py"]


pytestmark = [
    pytest.mark.skipif(set(EMULATIONS["avx512_bf16"]) <= FLAGS,
                       reason="the CPU has AVX-512 BF16: the kernel files run natively in the suite"),
    pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= FLAGS, reason="the emulation runs on x86 CPUs with AVX2, FMA and F16C"),
    pytest.mark.skipif(native.compiler() is None, reason="no C compiler: no native kernels to check"),
    pytest.mark.skipif(not native.enabled(), reason="EVALRUN_NATIVE=0: no native kernels to check"),
    pytest.mark.skipif(not native.simde_available(), reason="simde-py is not installed (pip install simde-py; the test extra has it)"),
]

PROBE = """
from evalrun.kernels.cpu import gemm, gemm_bf16
from evalrun.kernels.cpu.host import cpu_flags
print(gemm.width(), gemm_bf16.path(), 'avx512_bf16' in cpu_flags())
"""


def _env() -> dict[str, str]:
    return {**os.environ, EMULATE_ENV: "avx512_bf16"}


def test_the_emulated_build_takes_the_avx512_paths():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # 512: gemm.c was built with __AVX512F__ (every kernel gets the same flags); native: the vdpbf16ps tiles
    assert done.stdout.split() == ["512", "native", "True"], done.stdout + done.stderr[-3000:]


def test_the_kernel_files_pass_on_emulated_avx512():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
                           *(f"tests/{name}" for name in FILES)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=1500)
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
    # a native path skipped for want of the instructions would mean the emulation did not reach it
    assert "lacks avx512" not in done.stdout, tail


def test_the_emulation_adds_its_flags_and_an_unknown_name_is_ignored(monkeypatch, caplog):
    monkeypatch.setenv(EMULATE_ENV, "avx512_bf16")
    assert set(EMULATIONS["avx512_bf16"]) <= host.cpu_flags() and FLAGS <= host.cpu_flags()
    assert native.emulation_flags(native.FLAGS)[-1].endswith("emulate_avx512.h")
    monkeypatch.setattr(host, "_warned", set())
    monkeypatch.setenv(EMULATE_ENV, "avx1024")
    assert host.emulation() is None and host.cpu_flags() == FLAGS
    assert "EVALRUN_NATIVE_EMULATE=avx1024 ignored" in caplog.text
