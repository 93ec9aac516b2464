"""Bootstrap sources for `python -I -c`: the child modules' text, registered under their names.

Under -I the children cannot import this package (no script dir, no user site), so the
parent embeds the modules' text; each is exec'd into a fresh module registered in
sys.modules before the next, so their normal `from evalrun.tasks.sandbox.x import y` lines work.

NOTE: children run `python -I -S`: site-packages are appended to sys.path but their .pth
files are not run (they cost ~75 ms per interpreter here: editable finders, certifi).
NOTE: the child modules import no `typing` (7 ms per start); with postponed annotations
their hints are never evaluated, so they use builtins and collections.abc only.
"""
from __future__ import annotations

import functools
from pathlib import Path

PYTHON_FLAGS = ("-I", "-S")
_HERE = Path(__file__).resolve().parent
_LAUNCHER_MODULES = ("codec", "confine", "seccomp", "worker", "launcher")
_CHECKER_MODULES = ("codec", "confine", "checker")

_BOOT = """\
import os, site, sys, types
sys.path.extend(p for p in site.getsitepackages() if os.path.isdir(p) and p not in sys.path)
site.setquit()
for _name in ("evalrun", "evalrun.tasks", "evalrun.tasks.sandbox"):
    sys.modules[_name] = types.ModuleType(_name)
    sys.modules[_name].__path__ = []
sys.modules["evalrun"].tasks = sys.modules["evalrun.tasks"]
sys.modules["evalrun.tasks"].sandbox = sys.modules["evalrun.tasks.sandbox"]
for _name, _text in {modules!r}:
    _module = types.ModuleType(_name)
    _module.__file__ = "<" + _name + ">"
    sys.modules[_name] = _module
    setattr(sys.modules["evalrun.tasks.sandbox"], _name.rpartition(".")[2], _module)
    exec(compile(_text, _module.__file__, "exec"), _module.__dict__)
del _name, _text, _module
sys.modules[{entry!r}].main()
"""


def _source(modules: tuple[str, ...], entry: str) -> str:
    texts = tuple((f"evalrun.tasks.sandbox.{m}", (_HERE / f"{m}.py").read_text()) for m in modules)
    return _BOOT.format(modules=texts, entry=f"evalrun.tasks.sandbox.{entry}")


@functools.lru_cache(maxsize=None)
def launcher_source() -> str:
    """`python -I -c` source of the worker's launcher (read once, on first use)."""
    return _source(_LAUNCHER_MODULES, "launcher")


@functools.lru_cache(maxsize=None)
def checker_source() -> str:
    """`python -I -c` source of the checker (read once, on first use)."""
    return _source(_CHECKER_MODULES, "checker")
