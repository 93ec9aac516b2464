"""The task registry: what every task declares so that runs of it can be stored, resumed and
compared without knowing the task's code.

    TaskSpec ── key_columns     which rows are the same question (or sample)
             ── metric          the per-row pass/fail column ("correct", "passed")
             ── unit_columns    rows that share these are samples of one unit (a HumanEval problem)
             ── aggregate       how units combine ("accuracy", "pass@1"), via unit_score(n, c)
             ── groupings       --by names -> the group of a unit (MMLU subject, category)

`evalrun compare`/`regress`/`suite` read only this registry and run directories.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from .mmlu_groups import GROUPS, group_of
from .passk import pass_at_k

Grouping = Callable[[tuple], str]          # a unit's key -> its group's name
UNLISTED = "unlisted"                      # MMLU category of a subject MMLU does not have (a user's own data)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    key_columns: tuple[str, ...]
    metric: str
    aggregate: str
    unit_columns: tuple[str, ...]
    unit_score: Callable[[int, int], float]          # (rows of the unit, rows passing) -> its score
    groupings: Mapping[str, Grouping] = field(default_factory=dict)
    group_order: Mapping[str, tuple[str, ...]] = field(default_factory=dict)   # listed groups first, in order
    default_by: str = "none"
    commands: tuple[str, ...] = ()                   # the CLI commands that run it

    def __post_init__(self) -> None:
        if not set(self.unit_columns) <= set(self.key_columns):
            raise ValueError(f"{self.name}: unit columns {self.unit_columns} must be key columns")
        if self.default_by != "none" and self.default_by not in self.groupings:
            raise ValueError(f"{self.name}: default grouping {self.default_by!r} is not one of its groupings")

    @property
    def by_choices(self) -> tuple[str, ...]:
        return (*self.groupings, "none")


def _accuracy(n: int, c: int) -> float:
    return c / n


def _pass_at_1(n: int, c: int) -> float:
    return pass_at_k(n, c, 1)


MMLU = TaskSpec(
    name="mmlu", key_columns=("subject", "doc_id"), metric="correct", aggregate="accuracy",
    unit_columns=("subject", "doc_id"), unit_score=_accuracy,
    groupings={"subject": lambda key: str(key[0]), "category": lambda key: group_of(key[0]) or UNLISTED},
    group_order={"category": GROUPS}, default_by="category", commands=("mmlu",))

HUMANEVAL = TaskSpec(
    name="humaneval", key_columns=("task_id", "sample_idx"), metric="passed", aggregate="pass@1",
    unit_columns=("task_id",), unit_score=_pass_at_1, commands=("humaneval",))

TASK_SPECS: dict[str, TaskSpec] = {
    "mmlu": MMLU,
    "humaneval": HUMANEVAL,
    "humaneval-score": HUMANEVAL,          # `evalrun humaneval --score-samples`: same rows, same metric
}


def task_spec(name: str) -> TaskSpec:
    """The spec of a run's task (manifest["task"]); ValueError naming the known tasks otherwise."""
    try:
        return TASK_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; evalrun knows {', '.join(sorted(TASK_SPECS))}") from None
