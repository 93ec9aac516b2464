"""Running the Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors):
a workaround the tests and benchmarks/gpu_check.py --dry-run enter explicitly.

Triton 3.6's interpreter turns a scalar tensor into a Python int with int(array of shape
(1,)), which numpy >= 2.4 refuses, so every loop bounded by a runtime value (a sequence
length, a split count) fails. `interpreter_scalars()` makes it take .item() instead while
the context is open, and restores Triton's own code after. Compiled kernels never use it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def interpreter_scalars() -> Iterator[None]:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original
