"""CheckSpec.names: the checker binds only the names it asked for, from the worker's untrusted report (callables
as proxies, standard-library modules it imports itself, codec values), and a name the program lacks stays
unbound; in a real check, the test reaches the program's functions, modules and values through them."""
from __future__ import annotations

import pytest

from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
from evalrun.tasks.sandbox.checker import NamedCall, bind_names
from evalrun.tasks.sandbox.codec import encode_value


class _Link:
    def named(self, name):
        return NamedCall(self, name)


def test_only_asked_names_are_bound_from_the_report():
    report = {"callables": ["f", "unasked", ["not", "a", "name"]],
              "modules": {"m": "math", "w": "webbrowser", "np": "numpy", "os2": ["os"]},
              "values": {"LIMIT": encode_value(10), "EVIL": encode_value(1), "bad": ["nope"]}}
    namespace: dict = {}
    bind_names(namespace, report, ["f", "m", "w", "np", "os2", "LIMIT", "bad"], _Link())
    import math
    assert set(namespace) == {"f", "m", "LIMIT"}
    assert isinstance(namespace["f"], NamedCall) and namespace["m"] is math and namespace["LIMIT"] == 10
    bind_names(namespace, True, ["x"], _Link())                     # a plain "ready": nothing more
    assert set(namespace) == {"f", "m", "LIMIT"}


def test_a_check_reaches_the_program_s_names():
    program = "import math as mm\nK = 3\ndef area(r):\n    return mm.pi * r * r\ndef entry():\n    return 1\n"
    source = ("def check(candidate):\n    assert candidate() == 1\n    assert mm.isclose(area(1.0), mm.pi) and K == 3\n"
              "    assert 'missing' not in globals()\n")
    bad = source.replace("K == 3", "K == 4")
    with Sandbox(SandboxLimits(timeout=10.0), workers=2) as box:
        specs = [CheckSpec(program, source, "entry", names=("area", "mm", "K", "missing")),
                 CheckSpec(program, bad, "entry", names=("area", "mm", "K")),
                 CheckSpec(program, source, "entry", names=("mm", "K"))]      # area not asked: NameError
        results = [box.submit(s).result() for s in specs]
    assert [r.status for r in results] == ["passed", "failed", "failed"], results


def test_names_must_be_identifiers():
    with pytest.raises(ValueError, match="identifiers"):
        CheckSpec("x = 1", "def check(c): pass", "x", names=("a b",))
    with pytest.raises(TypeError, match="not one string"):
        CheckSpec("x = 1", "def check(c): pass", "x", names="abc")
