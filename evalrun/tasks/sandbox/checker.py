"""The trusted side: run `check(candidate)` with a proxy to the worker, then write the verdict.

The checker is a plain `python -I` child outside the sandbox. It makes itself
non-dumpable first (no ptrace, no /proc/<pid>/mem or /fd for same-uid processes), then
reads {nonce, check_source, entry_point} from stdin. Only when `check` returns normally
and no call to the worker failed at the protocol level does it write
{"status": "passed", "nonce": ...} to the verdict pipe; the worker never sees the nonce
or that pipe, so nothing it does (exit early, forge output, walk frames) can pass.
NOTE: runs as text inside the checker child (see sources.py): standard library and
tasks.sandbox modules only, nothing at import time.
"""
from __future__ import annotations

import builtins
import importlib
import json
import os
import signal
import sys

from evalrun.tasks.sandbox import confine
from evalrun.tasks.sandbox.codec import (MESSAGE_CHARS, READY, CodecError, decode_value, encode_value, error_line,
                                 read_frame, write_frame)

# NOTE: re-raising these from a call could end a loop early (map() stops on StopIteration).
_NOT_REBUILT = (StopIteration, StopAsyncIteration)
# Standard-library modules the checker never imports for a program's name (they act on import).
_NOT_IMPORTED = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser"})


class WorkerFault(BaseException):
    """The worker broke the protocol or went away. A BaseException, so that `except
    Exception` in test code cannot swallow it; WorkerLink also remembers it."""


def rebuild_exception(name: object, message: object) -> Exception:
    """The builtin exception type called `name`, else RuntimeError('name: message')."""
    name, message = str(name)[:100], str(message)[:MESSAGE_CHARS]
    cls = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _NOT_REBUILT):
        try:
            return cls(message)
        except Exception:
            pass
    return RuntimeError(f"{name}: {message}")


class WorkerLink:
    """The candidate as seen by `check`: each call is one request/reply over the pipes."""

    def __init__(self, fd_requests: int, fd_replies: int) -> None:
        self.fd_requests, self.fd_replies = fd_requests, fd_replies
        self.fault: dict | None = None

    def _fail(self, message: str, worker_gone: bool = False) -> WorkerFault:
        if self.fault is None:
            self.fault = {"status": "error", "error": message[:MESSAGE_CHARS], "worker_gone": worker_gone}
        return WorkerFault(self.fault["error"])

    def _receive(self) -> dict:
        try:
            reply = read_frame(self.fd_replies)
        except EOFError:
            raise self._fail("worker closed the connection", worker_gone=True) from None
        except (CodecError, OSError) as exc:
            raise self._fail(f"bad reply from the worker: {exc}") from None
        if type(reply) is not dict or len(reply) != 1:
            raise self._fail("bad reply from the worker")
        return reply

    def handshake(self) -> object:
        """Wait until the program is loaded (its "ready" reply: True, or what it bound to the names
        asked); raises WorkerFault if it could not be."""
        reply = self._receive()
        ready = reply.get("ready")
        if ready is True or type(ready) is dict:
            return ready
        error = reply.get("load_error")
        raise self._fail(error if type(error) is str else "bad reply from the worker")

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.call(None, args, kwargs)

    def named(self, name: str) -> "NamedCall":
        return NamedCall(self, name)

    def call(self, name: str | None, args: tuple, kwargs: dict) -> object:
        """Call the entry point (name None) or the program's callable `name` in the worker."""
        if self.fault is not None:
            raise WorkerFault(self.fault["error"])
        try:
            request = {"args": [encode_value(a) for a in args],
                       "kwargs": [[k, encode_value(v)] for k, v in kwargs.items()]}
            if name is not None:
                request["name"] = name
            write_frame(self.fd_requests, request)
        except CodecError as exc:
            raise self._fail(f"cannot send the arguments: {exc}") from None
        except OSError:
            raise self._fail("worker closed the connection", worker_gone=True) from None
        return self._unpack(self._receive())

    def _unpack(self, reply: dict) -> object:
        if "ok" in reply:
            try:
                return decode_value(reply["ok"])
            except CodecError as exc:
                raise self._fail(f"bad return value from the worker: {exc}") from None
        if "raise" in reply and type(reply["raise"]) is list and len(reply["raise"]) == 2:
            raise rebuild_exception(*reply["raise"])
        unsupported = reply.get("unsupported")
        raise self._fail(unsupported if type(unsupported) is str else "bad reply from the worker")


class NamedCall:
    """Another callable of the program, as seen by the check (one of the spec's names)."""

    def __init__(self, link: WorkerLink, name: str) -> None:
        self._link, self._name = link, name

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._link.call(self._name, args, kwargs)


def bind_names(namespace: dict, ready: object, names: list, link: WorkerLink) -> None:
    """Bind the asked names the program bound (its untrusted report, checked against the names asked)."""
    if type(ready) is not dict:
        return
    asked = {n for n in names if type(n) is str}
    callables = ready.get("callables")
    for name in callables if type(callables) is list else ():
        if type(name) is str and name in asked:
            namespace[name] = link.named(name)
    modules = ready.get("modules")
    for name, module in (modules.items() if type(modules) is dict else ()):
        top = module.partition(".")[0] if type(module) is str else ""
        if name in asked and top in sys.stdlib_module_names and top not in _NOT_IMPORTED:
            try:
                namespace[name] = importlib.import_module(module)
            except ImportError:
                pass
    values = ready.get("values")
    for name, value in (values.items() if type(values) is dict else ()):
        if name in asked:
            try:
                namespace[name] = decode_value(value)
            except CodecError:
                pass


def run_check(message: dict, link: WorkerLink) -> dict:
    """Exec the check source, wait for the program, call check(proxy); return the verdict."""
    namespace: dict[str, object] = {"__name__": "__checker__"}
    try:
        exec(compile(message["check_source"], "<check>", "exec"), namespace)
        check = namespace["check"]
    except BaseException as exc:
        return {"status": "error", "error": f"check source failed: {error_line(exc)}"}
    try:
        ready = link.handshake()
        bind_names(namespace, ready, list(message.get("names") or ()), link)
        namespace[message["entry_point"]] = link   # NOTE: after exec: the prompt defines a stub
        check(link)
    except BaseException as exc:
        return link.fault or {"status": "failed", "error": error_line(exc)}
    return link.fault or {"status": "passed", "nonce": message["nonce"]}


def main() -> None:
    """Entry point of the checker child: argv[1] = {"fd_requests", "fd_replies",
    "fd_verdict", "parent_pid"}; stdin = {"nonce", "check_source", "entry_point", "names"}."""
    confine.prctl(confine.PR_SET_DUMPABLE, 0)
    confine.prctl(confine.PR_SET_PDEATHSIG, signal.SIGKILL)
    cfg = json.loads(sys.argv[1])
    if os.getppid() != cfg["parent_pid"]:
        os._exit(1)
    # Non-dumpable now: a process of the same uid can no longer open /proc/<this>/fd or mem. Only
    # after this byte does the parent hand the worker its program (execute.py: READY).
    os.write(cfg["fd_verdict"], READY)
    message = json.loads(sys.stdin.buffer.read())
    link = WorkerLink(cfg["fd_requests"], cfg["fd_replies"])
    try:
        verdict = run_check(message, link)
    except BaseException as exc:
        verdict = {"status": "error", "error": f"checker failed: {error_line(exc)}"}
    os.close(cfg["fd_requests"])         # the worker reads EOF and exits
    data = json.dumps(verdict).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(cfg["fd_verdict"], view):]
    os._exit(0)
