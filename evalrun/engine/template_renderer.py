"""Bounded rendering of untrusted chat templates in a persistent worker process.

    TemplateRenderer (this process)                  template_worker.py (child, jinja2 only)
      render(template, variables) ──JSON line──────►  RLIMIT_AS memory bound (set at start)
                                                      per request: ITIMER_PROF CPU bound,
                                                      RLIMIT_CPU backstop, output bound
      text or ChatTemplateError ◄──JSON line───────  {"ok": [...]} / {"error": kind, ...}

Why a process: jinja2's sandbox stops attribute escapes, not work. A template can loop (three
nested `range(100000)`), or build a string of 10**10 characters in one C call that no signal
interrupts; only a separate process can be bounded in memory and killed. The worker starts on the
first render (a fresh `python` running template_worker.py as a script: no torch, ~0.1 s), keeps
each template compiled, and is reused, so a render costs one pipe round trip (figures in
DEFAULT_* below and in the tests' docstring). A render that passes a bound ends with a one-line
ChatTemplateError naming the template's file, and the worker is killed and started afresh on the
next render. A parent-side wall-clock deadline (RenderLimits.wall_seconds) kills a worker that does
not answer. The worker ends when its stdin closes: when this renderer is closed or collected, or
when this process dies.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from evalrun.engine.chat_template import (ChatTemplate, ChatTemplateError, ChatTemplateRenderError,
                                          ChatTemplateSecurityError, one_line)

CPU_SECONDS = 5.0                   # CPU time one render may take (real templates take well under 1 ms)
MAX_OUTPUT_CHARS = 4 << 20          # characters one render may produce (a long few-shot prompt is ~0.5 M)
MEMORY_BYTES = 1 << 30              # the worker's address space
WALL_SECONDS = 30.0                 # the parent's wait for one reply, start-up included
RENDERS_PER_REQUEST = 16            # render_many sends its batch in requests of at most this many

WORKER_FILE = Path(__file__).with_name("template_worker.py")
# NOTE: run as a script, never `-m evalrun...` (that would import evalrun.engine, hence torch); -P / -I
# keep the script's own directory (engine/, which has a types.py) off sys.path.
PYTHON_FLAGS = ("-P",) if sys.version_info >= (3, 11) else ("-I",)


@dataclass(frozen=True)
class RenderLimits:
    """The bounds of one render (the memory bound is the worker's, for all its renders)."""
    cpu_seconds: float = CPU_SECONDS
    max_chars: int = MAX_OUTPUT_CHARS
    memory_bytes: int = MEMORY_BYTES
    wall_seconds: float = WALL_SECONDS

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"RenderLimits.{name} must be > 0, got {value!r}")


class _WorkerGone(Exception):
    """The worker ended or broke the protocol; the message says how."""


class TemplateRenderer:
    """Renders chat templates in one bounded worker process, started on first use. Thread-safe."""

    def __init__(self, limits: RenderLimits = RenderLimits()) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._owner_pid = 0              # the process that started _proc (a forked child starts its own)
        self._known: set[str] = set()    # template keys the current worker has compiled
        self._buffer = bytearray()
        self._finalizer: Optional[weakref.finalize] = None

    @property
    def pid(self) -> Optional[int]:
        """The worker's process id, None when none is running."""
        return self._proc.pid if self._proc is not None and self._owner_pid == os.getpid() else None

    def render(self, template: ChatTemplate, variables: dict[str, Any]) -> str:
        """`template` rendered with `variables` (JSON values; anything else becomes "<TypeName>",
        as transformers' _plain_template_data makes it)."""
        return self.render_many(template, [variables])[0]

    def render_many(self, template: ChatTemplate, batch: list[dict[str, Any]]) -> list[str]:
        """`template` rendered with each of `batch`, RENDERS_PER_REQUEST to a round trip; each render
        has its own bounds, and the first failing one raises."""
        texts: list[str] = []
        for start in range(0, len(batch), RENDERS_PER_REQUEST):
            with self._lock:
                reply = self._request(template, batch[start: start + RENDERS_PER_REQUEST])
            if "error" in reply:
                raise self._error(template, reply)
            texts += reply["ok"]
        return texts

    def close(self) -> None:
        """Stop the worker (it exits at end of input; killed if it has not within a second)."""
        with self._lock:
            self._stop(kill=False)

    # --- the worker ------------------------------------------------------------------------------
    def _request(self, template: ChatTemplate, batch: list[dict]) -> dict:
        if self._proc is not None and self._owner_pid != os.getpid():
            self._forget()
        elif self._proc is not None and self._proc.poll() is not None:
            self._stop(kill=True)           # it died between requests (killed from outside, say)
        if self._proc is None:
            self._start()
        message = {"key": template.sha256, "batch": batch}
        if template.sha256 not in self._known:
            message["source"] = template.source
        data = (json.dumps(message, default=_placeholder) + "\n").encode("ascii")
        # NOTE: each render may take cpu_seconds of CPU; the wall deadline covers the rest
        deadline = time.monotonic() + self.limits.wall_seconds + self.limits.cpu_seconds * (len(batch) - 1)
        try:
            self._send(data, deadline)
            line = self._receive(deadline)
            reply = json.loads(line)
            if not isinstance(reply, dict) or not ("ok" in reply or "error" in reply):
                raise ValueError("not a reply")
        except TimeoutError:
            self._stop(kill=True)
            return {"error": "wall"}
        except (_WorkerGone, ValueError, UnicodeDecodeError) as exc:
            return {"error": "died", "message": self._stop(kill=True) or str(exc)}
        self._known.add(template.sha256)
        if reply.get("error") in ("cpu", "output", "memory"):
            self._stop(kill=True)       # NOTE: a worker that hit a bound is not trusted with the next render
        return reply

    def _start(self) -> None:
        limits = {"cpu_seconds": self.limits.cpu_seconds, "max_chars": self.limits.max_chars,
                  "memory_bytes": self.limits.memory_bytes}
        self._proc = proc = subprocess.Popen(
            [sys.executable, *PYTHON_FLAGS, str(WORKER_FILE), json.dumps(limits)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(pipe.fileno(), False)
        self._owner_pid = os.getpid()
        self._known.clear()
        self._buffer.clear()
        self._finalizer = weakref.finalize(self, _end_process, proc, 1.0)

    def _stop(self, kill: bool) -> str:
        """Stop the worker; returns how it ended (exit status or signal and its last stderr line)."""
        proc, finalizer = self._proc, self._finalizer
        if proc is None or finalizer is None:
            return ""
        self._proc, self._finalizer = None, None
        finalizer.detach()
        how = _end_process(proc, 0.0 if kill else 1.0)
        self._known.clear()
        self._buffer.clear()
        return how

    def _forget(self) -> None:
        # a forked child: the worker belongs to the parent process, which goes on using it
        if self._finalizer is not None:
            self._finalizer.detach()
        self._proc, self._finalizer = None, None
        self._known.clear()
        self._buffer.clear()

    def _send(self, data: bytes, deadline: float) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        fd, view = self._proc.stdin.fileno(), memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                _wait(fd, select.POLLOUT, deadline)
            except (BrokenPipeError, ConnectionResetError):
                raise _WorkerGone("the render worker is gone") from None

    def _receive(self, deadline: float) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        fd, buffer = self._proc.stdout.fileno(), self._buffer
        while True:
            end = buffer.find(b"\n")
            if end >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                return line
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                _wait(fd, select.POLLIN, deadline)
                continue
            if not chunk:
                raise _WorkerGone("the render worker ended without a reply")
            buffer += chunk

    def _error(self, template: ChatTemplate, reply: dict) -> ChatTemplateError:
        kind, limits, label = reply["error"], self.limits, template.label
        if kind == "template":
            name, message = str(reply.get("type", "")), one_line(reply.get("message", ""))
            cls = ChatTemplateSecurityError if name == "SecurityError" else ChatTemplateRenderError
            return cls(f"{label}: {message}" if name == "TemplateError" else f"{label}: {name}: {message}")
        if kind == "cpu" or (kind == "died" and f"signal {signal.SIGXCPU.name}" in reply.get("message", "")):
            return ChatTemplateError(f"{label}: rendering exceeded {limits.cpu_seconds:g} s of CPU time")
        if kind == "output":
            return ChatTemplateError(f"{label}: rendering produced more than {limits.max_chars} characters")
        if kind == "memory":
            return ChatTemplateError(f"{label}: rendering ran out of its {_size(limits.memory_bytes)} memory bound")
        if kind == "wall":
            return ChatTemplateError(f"{label}: rendering did not finish within {limits.wall_seconds:g} s "
                                     "(wall clock); its worker was stopped")
        return ChatTemplateError(f"{label}: the render worker failed: {one_line(reply.get('message', kind))}")


def _placeholder(value: Any) -> str:
    return f"<{type(value).__name__}>"


def _wait(fd: int, event: int, deadline: float) -> None:
    left = deadline - time.monotonic()
    poller = select.poll()
    poller.register(fd, event)
    if left <= 0 or not poller.poll(math.ceil(left * 1000)):
        raise TimeoutError


def _end_process(proc: subprocess.Popen, grace: float) -> str:
    """Close the worker's stdin, give it `grace` seconds to exit, kill it if it has not; reap it."""
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    tail = _stderr_tail(proc)
    proc.stderr.close()
    code = proc.returncode
    how = f"killed by signal {_signal_name(-code)}" if code < 0 else f"exit status {code}"
    return f"{how}{': ' + tail if tail else ''}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _stderr_tail(proc: subprocess.Popen) -> str:
    try:
        data = proc.stderr.read(1 << 16) or b""
    except (OSError, ValueError):
        return ""
    lines = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return one_line(lines[-1]) if lines else ""


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"
