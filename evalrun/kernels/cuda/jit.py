"""The Triton kernels of kernels/cuda/, compiled (or interpreted) on first use, not at import.

Each triton_*.py module defines its kernels as plain functions (the bodies are Triton) and lists
them; `jit_kernels` imports triton (an optional dependency, so only here, when a kernel is first
needed) and applies `triton.jit` to each in one shared scope: the module's globals plus `triton`,
`tl` and the jitted kernels themselves, so a kernel's call of another resolves to the jitted one.
Importing these modules therefore neither needs triton nor fixes TRITON_INTERPRET (read by
`triton.jit` when a kernel is made): the first call does.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Sequence


def jit_kernels(module_globals: dict[str, Any], functions: Sequence[Callable[..., Any]]) -> types.SimpleNamespace:
    """A namespace of the jitted `functions` by name, plus `interpreting` (True when triton.jit made
    them for Triton's interpreter, TRITON_INTERPRET=1)."""
    import triton
    import triton.language as tl

    scope = {**module_globals, "triton": triton, "tl": tl}
    jitted = {}
    for fn in functions:
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        clone.__annotations__, clone.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__
        clone.__qualname__, clone.__doc__, clone.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
        scope[fn.__name__] = jitted[fn.__name__] = triton.jit(clone)
    first = next(iter(jitted.values()))
    return types.SimpleNamespace(**jitted, interpreting=not isinstance(first, triton.runtime.JITFunction))


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
