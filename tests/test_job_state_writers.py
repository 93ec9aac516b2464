"""One writer per JobState field (issue 38): evalrun/engine/job.py names each field's writer, and an AST
scan of the engine finds every module that writes one.

What counts as a write of field F of a JobState:
- rebinding it: `E.F = ...`, `E.F += ...`, `E.F: T = ...`, `del E.F` (also inside tuple targets),
- changing a list field in place: `E.F.append(...)` (or extend, insert, pop, remove, clear, sort,
  reverse), `E.F[i] = ...`, `del E.F[i]`,
where E is a job's state: an expression `<anything>.state` (`job.state`, `self.job.state`,
`jobs[i].state`), or a name the same module binds to such an expression (`st = job.state`, also by
tuple unpacking). Creating the record (`JobState(...)` in job.py) is not a write. Calls on a field's
object that are not list mutators (the generator's draws, `rng.set_state`, `drafter.extend`) are not
writes of the field: the object stays the same. The same rule (attribute name, any receiver but
`self`) checks the records whose fields belong to one class: `KVAllocation` (the KV manager's) and
`DraftRecord` (the draft policy's).

Run as a script for the table of writers, now or at a git revision:
    python tests/test_job_state_writers.py [REV]
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "evalrun/engine"
LIST_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def _engine_sources(rev: Optional[str] = None) -> dict[str, str]:
    """file name -> source of every module of evalrun/engine (at `rev`, or in the working tree)."""
    if rev is None:
        return {p.name: p.read_text() for p in sorted((ROOT / ENGINE).glob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{ENGINE}"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{ENGINE}/{n}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout for n in names if n.endswith(".py")}


def dataclass_fields(source: str, cls: str) -> dict[str, str]:
    """Annotated fields of class `cls` in `source` -> their annotation (as written)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {s.target.id: ast.unparse(s.annotation) for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise LookupError(f"no class {cls}")


def _is_state(expr: ast.AST, aliases: set[str]) -> bool:
    return (isinstance(expr, ast.Attribute) and expr.attr == "state") or (
        isinstance(expr, ast.Name) and expr.id in aliases)


def _state_aliases(tree: ast.AST) -> set[str]:
    """Names bound to `<expr>.state` anywhere in the module (`st = job.state`, `a, st = x, job.state`)."""
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _is_state(v, set())}
    return names


def _targets(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        todo = [node.target]
    elif isinstance(node, ast.Delete):
        todo = list(node.targets)
    else:
        return
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            yield t


def state_writes(source: str, fields: dict[str, str]) -> Counter:
    """field -> number of writes of it (as defined above) in one module."""
    tree = ast.parse(source)
    aliases = _state_aliases(tree)
    lists = {f for f, ann in fields.items() if ann.startswith("list")}
    out: Counter = Counter()
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and t.attr in fields and _is_state(t.value, aliases):
                out[t.attr] += 1
            elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) \
                    and t.value.attr in lists and _is_state(t.value.value, aliases):
                out[t.value.attr] += 1
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LIST_MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in lists and _is_state(owner.value, aliases):
                out[owner.attr] += 1
    return out


def attribute_writers(sources: dict[str, str], names: set[str]) -> dict[str, set[str]]:
    """attribute name -> modules that assign it on anything but `self` (the Page-field rule)."""
    out: dict[str, set[str]] = {}
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and t.attr in names and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    out.setdefault(t.attr, set()).add(module)
    return out


def writer_table(rev: Optional[str] = None) -> dict[str, Counter]:
    """module -> Counter(field -> writes) for the JobState fields of that revision's job.py."""
    sources = _engine_sources(rev)
    fields = dataclass_fields(sources["job.py"], "JobState")
    table = {m: state_writes(src, fields) for m, src in sources.items()}
    return {m: c for m, c in table.items() if c}


def documented_writers(source: str) -> dict[str, str]:
    """field -> writer module, from job.py's WRITERS table."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["WRITERS"]:
            return ast.literal_eval(node.value)
    raise LookupError("job.py has no WRITERS table")


# --- tests -----------------------------------------------------------------------------------------
def test_each_job_state_field_has_its_documented_writer_only():
    sources = _engine_sources()
    fields = dataclass_fields(sources["job.py"], "JobState")
    documented = documented_writers(sources["job.py"])
    assert set(documented) == set(fields), "job.py's WRITERS must name every JobState field"
    found = {f: sorted(m for m, c in writer_table().items() if c[f]) for f in fields}
    wrong = {f: mods for f, mods in found.items() if set(mods) - {documented[f]}}
    assert not wrong, f"JobState fields written outside their one writer: {wrong} (job.py: WRITERS)"


def test_the_scan_sees_every_kind_of_write():
    fields = {"new_ids": "list[int]", "num_computed_tokens": "int", "kv": "Optional[KVAllocation]"}
    source = """
def f(job, jobs, n):
    job.state.num_computed_tokens = n
    jobs[0].state.num_computed_tokens += 1
    a, st = 1, job.state
    st.kv, b = None, 2
    del st.kv
    self.job.state.new_ids.append(3)
    st.new_ids[0] = 4
    print(job.state.new_ids, st.num_computed_tokens)   # reads
    job.state.rng.set_state(None)                      # not a field's rebinding
"""
    assert state_writes(source, fields) == Counter(num_computed_tokens=2, kv=2, new_ids=2)


def test_allocation_and_draft_record_fields_have_one_writer_each():
    sources = _engine_sources()
    alloc = set(dataclass_fields(sources["kv_manager.py"], "KVAllocation"))
    record = set(dataclass_fields(sources["speculation.py"], "DraftRecord"))
    assert attribute_writers(sources, alloc) and all(
        mods == {"kv_manager.py"} for mods in attribute_writers(sources, alloc).values())
    assert attribute_writers(sources, record) and all(
        mods == {"speculation.py"} for mods in attribute_writers(sources, record).values())
    assert attribute_writers(sources, {"state"}) == {}     # a job's record is made once, in job.py


def test_the_kv_manager_knows_pages_not_jobs():
    """KVManager takes token ids and its own allocations: it cannot write a job's state."""
    tree = ast.parse((ROOT / ENGINE / "kv_manager.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "job" not in imported and not any(
        isinstance(n, ast.Attribute) and n.attr == "state" for n in ast.walk(tree))


def _print(table: dict[str, Counter]) -> None:
    for module, counts in sorted(table.items()):
        print(f"{module:18s} " + ", ".join(f"{f}({n})" for f, n in sorted(counts.items())))


if __name__ == "__main__":
    _print(writer_table(sys.argv[1] if len(sys.argv) > 1 else None))
