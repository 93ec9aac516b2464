"""The task registry: the one place that lists evalrun's tasks (evalrun/tasks/spec.py says what an
entry holds). The CLI's task commands, `show`, `merge`, `suite` and `compare` read only this.

Adding a task: a module that defines its TaskSpec, plus one line in BUILTIN. A task can also be
registered while a process runs (a test's own task): register(spec) before the CLI builds its
parser, unregister(name) after.
"""
from __future__ import annotations

from . import humaneval_spec, lm_eval_spec, mmlu
from .spec import CliArg, Grouping, RunReport, TaskContext, TaskSpec

__all__ = ["CliArg", "Grouping", "RunReport", "TaskContext", "TaskSpec", "MMLU", "HUMANEVAL", "LM_EVAL", "register",
           "unregister", "task_spec", "task_specs", "runnable_specs"]

MMLU = mmlu.SPEC
HUMANEVAL = humaneval_spec.SPEC
LM_EVAL = lm_eval_spec.SPEC                 # `evalrun task --tasks ...`: lm-eval's YAML tasks
BUILTIN = (MMLU, HUMANEVAL, LM_EVAL)        # one line per task

_TASKS: dict[str, TaskSpec] = {s.name: s for s in BUILTIN}


def register(spec: TaskSpec) -> None:
    """Add a task (ValueError when its name or an alias is taken)."""
    taken = {n for s in _TASKS.values() for n in (s.name, *s.aliases)}
    clash = sorted({spec.name, *spec.aliases} & taken)
    if clash:
        raise ValueError(f"task name {clash[0]!r} is registered already")
    _TASKS[spec.name] = spec


def unregister(name: str) -> None:
    """Remove a task registered with register() (the built-in ones stay)."""
    if any(s.name == name for s in BUILTIN):
        raise ValueError(f"{name} is a built-in task")
    _TASKS.pop(name, None)


def task_specs() -> list[TaskSpec]:
    """Every registered task, built-in ones first, in registration order."""
    return list(_TASKS.values())


def runnable_specs() -> list[TaskSpec]:
    """The tasks with an `evalrun <name>` command."""
    return [s for s in _TASKS.values() if s.runnable]


def task_spec(name: str) -> TaskSpec:
    """The spec of a run's task (manifest["task"], an alias included); ValueError naming the known tasks."""
    for spec in _TASKS.values():
        if name == spec.name or name in spec.aliases:
            return spec
    known = sorted(n for s in _TASKS.values() for n in (s.name, *s.aliases))
    raise ValueError(f"unknown task {name!r}; evalrun knows {', '.join(known)}")
