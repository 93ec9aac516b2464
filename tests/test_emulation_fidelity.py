"""The AVX-512 emulation (EVALRUN_NATIVE_EMULATE=avx512_bf16: csrc/emulate_avx512.h over SIMDe) against
the instructions themselves: on a CPU with AVX-512 BF16, every native kernel's outputs on fixed
inputs (tests/emulation_outputs.py: GEMMs, fused ops, decode and prefill attention over every page
kind) come out bitwise the same from the emulated build as from the native one. This is what lets
tests/test_emulated_avx512.py judge the AVX-512 code on CPUs without it; it can only run where the
instructions exist (on other CPUs that file runs instead).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evalrun.kernels.cpu import native
from evalrun.kernels.cpu.host import EMULATE_ENV, EMULATIONS, cpu_flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = cpu_flags() or frozenset()


pytestmark = [
    pytest.mark.skipif(not set(EMULATIONS["avx512_bf16"]) <= FLAGS,
                       reason="needs a CPU with AVX-512 BF16 to compare the emulation with (elsewhere "
                              "tests/test_emulated_avx512.py runs the kernel files under the emulation)"),
    pytest.mark.skipif(native.compiler() is None, reason="no C compiler: no native kernels to compare"),
    pytest.mark.skipif(not native.enabled(), reason="EVALRUN_NATIVE=0: no native kernels to compare"),
    pytest.mark.skipif(not native.simde_available(), reason="simde-py is not installed (pip install simde-py; the test extra has it)"),
]


def _outputs(tmp_path: Path, emulate: bool) -> tuple[str, dict[str, torch.Tensor]]:
    env = {k: v for k, v in os.environ.items() if k != EMULATE_ENV}
    if emulate:
        env[EMULATE_ENV] = "avx512_bf16"
    path = tmp_path / ("emulated.pt" if emulate else "native.pt")
    done = subprocess.run([sys.executable, "-m", "tests.emulation_outputs", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()[0], torch.load(path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8, 8: torch.int64}[t.element_size()]) \
        if t.is_floating_point() else t


def test_the_emulated_build_gives_the_native_bits(tmp_path):
    paths, native_out = _outputs(tmp_path, emulate=False)
    emulated_paths, emulated_out = _outputs(tmp_path, emulate=True)
    assert paths == emulated_paths == "512 native True"      # both builds took the AVX-512 and vdpbf16ps paths
    assert native_out.keys() == emulated_out.keys() and len(native_out) > 60
    differ = [k for k in native_out if not torch.equal(_bits(native_out[k]), _bits(emulated_out[k]))]
    assert not differ, f"{len(differ)} of {len(native_out)} outputs differ: {differ[:8]}"
