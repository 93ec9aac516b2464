"""The set-up every Triton test file shares: without a GPU the kernels run under Triton's
interpreter on CPU tensors, so TRITON_INTERPRET=1 is set before triton is imported (triton.jit
reads it when a kernel is defined, triton.language's own helpers included); with a GPU they run
compiled on it. Import this module before anything that imports triton, and take the
`interpreter_scalars` fixture into the test module (`from triton_setup import interpreter_scalars`)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.6.0)")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def check_interpreting(interpreting: bool) -> None:
    """A kernel module's interpreting() must agree with INTERPRET: triton imported earlier without
    TRITON_INTERPRET=1 would build GPU kernels that cannot run on CPU tensors."""
    if interpreting != INTERPRET:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set: run this file in its "
                           "own process or with TRITON_INTERPRET=1 set")


@pytest.fixture(autouse=True, scope="module")
def interpreter_scalars():
    """Triton 3.6's interpreter under numpy >= 2.4 needs kernels.triton_interpreter's workaround."""
    if not INTERPRET:
        yield
        return
    from evalrun.kernels.cuda import triton_interpreter
    with triton_interpreter.interpreter_scalars():
        yield
