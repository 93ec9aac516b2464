"""The package's import structure, read with `ast` (nothing is imported):

- no import cycle among evalrun's modules (imports under `if TYPE_CHECKING:` count: a cycle
  of types is still a cycle of design);
- argparse only in evalrun/commands/ (below the CLI, commands pass typed records);
- no function-level import of a project module, and function-level imports only of the optional
  packages below (everything else is imported at the top of its module, so the graph is visible).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "evalrun"
# Imported inside functions only: optional dependencies (an extra, or a GPU stack), loaded where used.
OPTIONAL = {"ray", "triton", "flash_attn", "transformers", "gguf", "simde_py",
            # the hub path only: a run from local files never pays their import
            "datasets", "huggingface_hub",
            # the HTML report only (`compare --format html`): 0.45 s of import no other command pays
            "matplotlib",
            # `evalrun task` only (the extra evalrun[lm-eval]): lm-eval's task configurations and metrics,
            # and HF evaluate (lm-eval's dependency), whose code_eval evalrun serves from its sandbox
            "lm_eval", "evaluate"}
# Files run as scripts in another interpreter (the sandbox's child): not part of the import graph.
SCRIPTS = {"evalrun/tasks/sandbox/sources.py"}
# The modules whose text runs in the sandbox's bare child interpreter for every check
# (evalrun/tasks/sandbox/sources.py): a standard-library module that only one mode needs
# (the probe's subprocess, 4 ms; importlib.util, 5 ms) loads in the function that needs it,
# so a check's start does not pay it. Project modules: never.
CHILD_MODULES = {f"evalrun.tasks.sandbox.{m}" for m in ("codec", "confine", "worker", "launcher", "checker")}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if str(rel) in SCRIPTS:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _targets(node: ast.AST, module: str, is_pkg: bool, known: Set[str]) -> List[str]:
    """Project modules an import statement names (`from a import b` names a.b if that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    out = [prefix]
    for a in node.names:
        if f"{prefix}.{a.name}" in known:
            out.append(f"{prefix}.{a.name}")
    return out


def _resolve(name: str, known: Set[str]) -> str:
    """The longest known module that `name` is or lies in ('' if none)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def _scan() -> Tuple[Dict[str, Set[str]], List[str], List[str]]:
    mods = _modules()
    known = set(mods)
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    argparse_users, late_imports = [], []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_function = {id(n) for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _targets(node, mod, _is_package(path), known)
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if any(n.split(".")[0] == "argparse" for n in names) and not mod.startswith("evalrun.commands"):
                argparse_users.append(where)
            if id(node) in in_function:
                tops = {n.split(".")[0] for n in names}
                allowed = OPTIONAL | (set(sys.stdlib_module_names) if mod in CHILD_MODULES else set())
                if not tops <= allowed:
                    late_imports.append(f"{where} imports {', '.join(sorted(names))} inside a function")
                continue
            for n in names:
                target = _resolve(n, known)
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph, argparse_users, late_imports


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_scan_sees_the_package():
    graph, _, _ = _scan()
    assert "evalrun.commands.cli" in graph and "evalrun.engine.generator" in graph
    assert "evalrun.engine.scheduler" in graph["evalrun.engine.generator"]


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph, _, _ = _scan()
    assert _cycles(graph) == []


def test_argparse_only_in_commands():
    _, argparse_users, _ = _scan()
    assert argparse_users == []


def test_function_level_imports_only_of_optional_packages():
    _, _, late = _scan()
    assert late == [], "\n".join(late)
