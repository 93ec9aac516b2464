"""The chat-template render worker: a child process that compiles and renders untrusted Jinja.

Run as a script (`python -I template_worker.py LIMITS_JSON`, see template_renderer.py), so that it
imports the standard library and jinja2 only, never torch or the rest of evalrun. It bounds itself
before it reads any template:

- memory: RLIMIT_AS (a MemoryError inside a render is reported as "memory");
- CPU per request: an ITIMER_PROF timer raises _CpuExceeded between bytecodes, and RLIMIT_CPU,
  moved to (CPU used so far + the bound + 2 s) before each request, kills the process (SIGXCPU)
  when one C call (a huge `**`, say) never returns to the interpreter;
- output: a render is generated piece by piece and stopped once it passes max_chars.

The environment is transformers' (`_compile_jinja_template`): ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks, loopcontrols, a `{% generation %}` tag rendered as its body, the
`raise_exception` / `strftime_now` globals, a non-escaping `tojson`, and its `dict` / `namespace`.

Protocol, one JSON object a line (ASCII) each way:
  request  {"key": K, "source": S (only the first time this worker sees K), "batch": [variables, ...]}
  reply    {"ok": [text, ...]}  or  {"error": "cpu"|"output"|"memory"|"template", "index": i,
                                     "type": exception name, "message": text}
The worker ends at end of input (its parent closed the pipe or died); it ignores SIGINT.
NOTE: standard library and jinja2 only, nothing at import time: this file runs as a script.
"""
from __future__ import annotations

import json
import math
import resource
import signal
import sys
from datetime import datetime
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

KEPT_TEMPLATES = 16      # compiled templates kept (a model has a few; a test may make many)


class _CpuExceeded(BaseException):
    """Raised by the SIGPROF handler; a BaseException so no `except Exception` can swallow it."""


class _OutputExceeded(Exception):
    pass


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    # for rendering it is transparent.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    # transformers' `dict`: no attribute access to the real type from inside a template
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # transformers' `namespace`: no underscore-prefixed attributes
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses (no bounds: call it
    only inside this worker's bounded requests, or on trusted text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _render(template: jinja2.Template, variables: dict, max_chars: int) -> str:
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece)
        if size > max_chars:
            raise _OutputExceeded
        pieces.append(piece)
    return "".join(pieces)


def _on_sigprof(signum: int, frame: Any) -> None:
    raise _CpuExceeded


def _bound_cpu(cpu_seconds: float) -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(used.ru_utime + used.ru_stime + cpu_seconds) + 2
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    signal.setitimer(signal.ITIMER_PROF, cpu_seconds)


def _error(kind: str, index: int, exc: BaseException) -> dict:
    return {"error": kind, "index": index, "type": type(exc).__name__, "message": str(exc)}


def serve(request: dict, templates: dict, limits: dict) -> dict:
    """One request: compile (if new) and render each of its batch, every step bounded."""
    texts: list[str] = []
    for index, variables in enumerate(request["batch"]):
        _bound_cpu(limits["cpu_seconds"])
        try:
            template = templates.get(request["key"])
            if template is None:
                template = compile_chat_template(request["source"])
                if len(templates) >= KEPT_TEMPLATES:
                    templates.pop(next(iter(templates)))
                templates[request["key"]] = template
            texts.append(_render(template, variables, limits["max_chars"]))
        except _CpuExceeded as exc:
            return _error("cpu", index, exc)
        except _OutputExceeded as exc:
            return _error("output", index, exc)
        except MemoryError as exc:
            return _error("memory", index, exc)
        except Exception as exc:  # noqa: BLE001 - whatever the template raised is the template's error
            return _error("template", index, exc)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    return {"ok": texts}


def main(argv: list[str]) -> int:
    limits = json.loads(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGPROF, _on_sigprof)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    memory = limits["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (memory if hard == resource.RLIM_INFINITY else min(memory, hard), hard))
    templates: dict[str, jinja2.Template] = {}
    for line in sys.stdin.buffer:
        try:
            reply = serve(json.loads(line), templates, limits)
        except _CpuExceeded as exc:       # the timer fired between a render's end and its reset
            reply = _error("cpu", 0, exc)
        try:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
        except MemoryError:               # a reply too large to encode: the output bound stops it
            sys.stdout.write(json.dumps({"error": "memory", "index": 0, "type": "MemoryError", "message": ""}) + "\n")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
