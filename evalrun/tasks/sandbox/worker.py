"""The untrusted side: run the program, then answer the checker's calls to its entry point.

    checker --request frame--> worker:  {"args": [value...], "kwargs": [[name, value]...]}
                                        (+ "name": another of the spec's names to call)
    worker --reply frame-->  checker:   {"ready": true} | {"load_error": "NameError: ..."}   (once)
                                        | {"ready": {"callables": [...], "modules": {name: module},
                                                     "values": {name: value}}}  (with names asked)
                                        {"ok": value} | {"raise": [type name, message]}
                                        | {"unsupported": "unsupported return type X"}  (per call)

Everything here runs inside the sandbox; nothing it sends is trusted (see checker.py).
NOTE: runs as text inside the sandbox child (see sources.py): standard library and
tasks.sandbox.codec only, nothing at import time.
"""
from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any
import os
import sys

from evalrun.tasks.sandbox.codec import (MESSAGE_CHARS, CodecError, decode_value, encode_value, error_line,
                                 read_frame, write_frame)

def load_program(program: str, entry_point: str) -> tuple[Callable[..., object], dict]:
    """Exec the program at top level in a fresh namespace; return its entry point and the namespace."""
    # NOTE: not "__main__", so `if __name__ == "__main__":` blocks (doctest runs) are skipped.
    namespace: dict[str, object] = {"__name__": "__candidate__", "__builtins__": builtins}
    exec(compile(program, "<program>", "exec"), namespace)
    func = namespace.get(entry_point)
    if func is None:
        raise NameError(f"name {entry_point!r} is not defined")
    if not callable(func):
        raise TypeError(f"{entry_point!r} is not callable")
    return func, namespace


def describe_names(namespace: dict, names: list) -> dict:
    """What the program bound to each asked name: a callable, a module (by its name), or a value
    the codec carries; names it left unbound, or bound to anything else, are not listed."""
    out: dict = {"callables": [], "modules": {}, "values": {}}
    for name in names:
        if type(name) is not str or name not in namespace:
            continue
        value = namespace[name]
        if isinstance(value, type(os)):
            out["modules"][name] = str(getattr(value, "__name__", ""))[:200]
        elif callable(value):
            out["callables"].append(name)
        else:
            try:
                out["values"][name] = encode_value(value)
            except (CodecError, RecursionError, ValueError):
                pass
    return out


def call_once(func: Callable[..., object], request: Any) -> dict:
    """Answer one request frame (never raises an Exception)."""
    try:
        args = [decode_value(a) for a in request["args"]]
        kwargs = {str(k): decode_value(v) for k, v in request["kwargs"]}
    except (CodecError, KeyError, TypeError, ValueError) as exc:
        return {"raise": ["RuntimeError", f"bad request: {exc}"[:MESSAGE_CHARS]]}
    try:
        result = func(*args, **kwargs)
    except Exception as exc:
        return {"raise": [type(exc).__name__, error_line(exc).partition(": ")[2]]}
    try:
        return {"ok": encode_value(result)}
    except CodecError as exc:
        return {"unsupported": str(exc)[:MESSAGE_CHARS]}
    except (RecursionError, ValueError) as exc:   # self-referencing or absurd values
        return {"unsupported": f"return value cannot be encoded: {error_line(exc)}"}


def pick(func: Callable[..., object], namespace: dict, request: Any) -> Callable[..., object]:
    """The function a request calls: the entry point, or the program's callable of its "name"."""
    name = request.get("name") if type(request) is dict else None
    if name is None:
        return func
    target = namespace.get(name) if type(name) is str else None
    if target is None or not callable(target):
        def missing(*args: object, **kwargs: object) -> object:
            raise NameError(f"name {str(name)[:100]!r} is not a callable of the program")
        return missing
    return target


def serve(program: str, entry_point: str, fd_requests: int, fd_replies: int, names: list = ()) -> None:
    """Load the program, then serve calls until the checker closes the request pipe."""
    try:
        func, namespace = load_program(program, entry_point)
        ready = describe_names(namespace, list(names)) if names else True
    except Exception as exc:
        write_frame(fd_replies, {"load_error": error_line(exc)})
        return
    write_frame(fd_replies, {"ready": ready})
    while True:
        try:
            request = read_frame(fd_requests)
        except EOFError:
            return
        reply = call_once(pick(func, namespace, request), request)
        try:
            write_frame(fd_replies, reply)
        except CodecError as exc:
            write_frame(fd_replies, {"unsupported": str(exc)[:MESSAGE_CHARS]})


def worker_main(program: str, entry_point: str, fd_requests: int, fd_replies: int, names: list = ()) -> None:
    """Run `serve` and leave the process without running the program's exit hooks."""
    code = 0
    try:
        serve(program, entry_point, fd_requests, fd_replies, names)
    except SystemExit as exc:       # sys.exit() in the program: exit as asked
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)
