"""What a task declares, once, so that every command can run, store, show, merge and compare it
without knowing its code. evalrun/tasks/registry.py lists the entries.

    TaskSpec ── running it       cli_args (data; evalrun/commands/cli.py makes them argparse
                                 arguments) -> options(**values) -> build(options, seed) -> Task
             ── its runs         identity / manifest_extra (resume identity, manifest), unit, run_name,
                                 context (what must be open while scoring: HumanEval's sandbox pool)
             ── its rows         key_columns, metric, summarize (merge), report (printed), show_row
             ── comparing them   unit_columns, aggregate via unit_score(n, c), groupings, default_by

A spec without `build` only reads runs (an alias's rows, e.g. humaneval-score: same rows, same metric).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from concurrent.futures import Future
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol, Sequence, runtime_checkable

from .base import Answer, DocPlan, Task

Grouping = Callable[[tuple], str]          # a unit's key -> its group's name
Summary = tuple[list[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class CliArg:
    """One command-line argument of a task, as data (argparse's add_argument words)."""
    flags: tuple[str, ...]
    help: str                                # states the default, as every --help line does
    dest: Optional[str] = None               # default: the first flag, without dashes, '-' -> '_'
    type: Optional[Callable[[str], Any]] = None
    default: Any = None
    choices: Optional[tuple[str, ...]] = None
    switch: bool = False                     # a flag without a value (store_true)
    nargs: Optional[str] = None
    const: Any = None
    metavar: Optional[str] = None

    @property
    def name(self) -> str:
        return self.dest or self.flags[0].lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class RunReport:
    """What a finished run (or a resume with nothing left) hands its task to print."""
    rows: list[dict[str, Any]]               # the selection's rows
    per_group: list[dict[str, Any]]
    overall: dict[str, Any]
    throughput: Optional[dict[str, Any]]     # this session's, None when nothing ran
    out_dir: Path
    manifest: dict[str, Any]                 # the stored manifest updated by this session's


class TaskContext(Protocol):
    """What must be open while a task's documents are scored (HumanEval: the sandbox pool); travels
    pickled to Ray replicas when the scoring runs there."""
    manifest_key: str                        # the manifest entry that records what open() yields
    execute_on: Optional[str]                # --ray: "driver" (replicas only generate) or "replica"

    def open(self, task: Task) -> ContextManager[dict[str, Any]]: ...


@runtime_checkable
class ScoredElsewhere(Protocol):
    """A task with a context whose rows may be generated on one machine and scored on another
    (--ray: replicas generate, the driver's sandbox executes)."""

    def generated(self, plan: DocPlan, answers: list[Answer]) -> dict[str, Any]:
        """The document's row before scoring."""

    def check_row(self, row: dict[str, Any]) -> Future:
        """Future of a generated row (with its key columns) once scored."""


def _no_options(**values: Any) -> dict[str, Any]:
    return values


def _data_identity(options: Any, task: Task) -> dict[str, Any]:
    return {"data_fingerprint": task.fingerprint()}


def _nothing(options: Any, task: Task) -> dict[str, Any]:
    return {}


def _same_options(options: Any, tag: str) -> Any:
    return options


def _never_model_free(options: Any) -> Optional[str]:
    return None


def _run_name(options: Any, model: str) -> Optional[str]:
    return None


@dataclass(frozen=True)
class TaskSpec:
    name: str
    key_columns: tuple[str, ...]
    metric: str                                      # the per-row pass/fail column ("correct", "passed")
    aggregate: str                                   # how units combine ("accuracy", "pass@1")
    unit_columns: tuple[str, ...]                    # rows sharing these are samples of one unit
    unit_score: Callable[[int, int], float]          # (rows of the unit, rows passing) -> its score
    groupings: Mapping[str, Grouping] = field(default_factory=dict)
    group_order: Mapping[str, tuple[str, ...]] = field(default_factory=dict)   # listed groups first, in order
    default_by: str = "none"
    aliases: tuple[str, ...] = ()                    # other manifest["task"] names with these rows
    # -- running it (`evalrun <name>`) -----------------------------------------------------------
    help: str = ""                                   # one line in `evalrun --help`
    description: str = ""
    cli_args: tuple[CliArg, ...] = ()
    options: Callable[..., Any] = _no_options        # the options record from {arg name: value}
    build: Optional[Callable[[Any, int], Task]] = None   # (options, --seed) -> the task
    identity: Callable[[Any, Task], dict[str, Any]] = _data_identity   # the task's part of the resume identity
    manifest_extra: Callable[[Any, Task], dict[str, Any]] = _nothing    # more manifest fields
    unit: str = "questions"                          # what its documents are called in messages
    run_name: Callable[[Any, str], Optional[str]] = _run_name   # (options, model name) -> a default dir name
    context: Optional[Callable[[Any], Optional[TaskContext]]] = None
    per_run: Callable[[Any, str], Any] = _same_options   # one run's options in a sweep or suite (a tag each)
    model_free: Callable[[Any], Optional[str]] = _never_model_free   # the flag that asks to score without a model
    # -- its rows --------------------------------------------------------------------------------
    summarize: Optional[Callable[[list[dict[str, Any]], Sequence[str]], Summary]] = None   # rows, groups
    # a merged run's summary where the rows alone do not make it (rows, the run's manifest; default: summarize)
    summarize_merged: Optional[Callable[[list[dict[str, Any]], dict[str, Any]], Summary]] = None
    report: Optional[Callable[[Any, RunReport], None]] = None     # (options, report): the printed summary
    show_row: Optional[Callable[[dict[str, Any]], str]] = None    # one row for `evalrun show`

    def __post_init__(self) -> None:
        if not set(self.unit_columns) <= set(self.key_columns):
            raise ValueError(f"{self.name}: unit columns {self.unit_columns} must be key columns")
        if self.default_by != "none" and self.default_by not in self.groupings:
            raise ValueError(f"{self.name}: default grouping {self.default_by!r} is not one of its groupings")
        if self.build is not None and (self.summarize is None or self.report is None):
            raise ValueError(f"{self.name}: a task that runs needs summarize and report")

    @property
    def by_choices(self) -> tuple[str, ...]:
        return (*self.groupings, "none")

    @property
    def runnable(self) -> bool:
        """`evalrun <name>` exists."""
        return self.build is not None
