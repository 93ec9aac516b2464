"""One run pipeline for every task: check the run directory, then (only if there is work)
load the model, queue every remaining request, store rows as they finish, summarize.

    prepare(RunConfig) (evalrun/commands/task.py) ──► PreparedRun: TaskRun (decided without a model) + pending(run)
    execute(prepared, loader) (evalrun/scale/execute.py) ──► nothing left: report_stored(...)
        ├──► generate(run, ...): model (loaded once per ModelLoader), store, rows, summary
        ├──► score_without_model(run, ...): a task that needs no model (humaneval --score-samples)
        └──► --ray: evalrun/scale/ray_run.py, rows from Ray replicas, the same store and summary
             (all end in finish_session)

Sweeps (evalrun/commands/sweep.py) and suites (evalrun/commands/suite.py) prepare every run first, so a bad
setting or a mismatched run directory is refused before anything is computed, then execute
them one after another with one ModelLoader.

The summary always covers the current selection (--subjects/--limit/--n-samples); rows
outside it stay stored. A resume that has nothing to do writes nothing, unless its run was stopped
before it was finalized or lost its summary: then it finalizes it, without a model (report_stored).
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from concurrent.futures import Future
from typing import Any, Callable, ContextManager, Optional

from evalrun.results import (RunStore, check_resumable, read_samples, samples_file_intact, stored_keys, write_prompts,
                             write_summary)
from evalrun.results.manifest import utc_now
from evalrun.results.text import terminal_safe
from evalrun.results.summary import summary_intact
from evalrun.run.common import clean, generator_throughput, load_model, make_generator
from evalrun.run.config import RayOptions
from evalrun.run.engine_config import EngineConfig
from evalrun.run.runner import run_task, score_plans
from evalrun.tasks.base import Task
from evalrun.tasks.spec import TaskContext

# report(rows of the selection, summary rows, overall, this session's throughput or None, run dir)
Report = Callable[[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], Optional[dict], Path], None]


@dataclass
class TaskRun:
    """One command's run, everything decided before a model is loaded."""
    task: Task
    out_dir: Path
    manifest: dict[str, Any]                 # for a new run; its "identity" is compared on resume
    stored: Optional[dict[str, Any]]         # the manifest already in out_dir (None: new run or --overwrite)
    unit: str                                # "questions", "samples"
    overwrite: bool = False
    flush_rows: int = 256
    flush_seconds: float = 30.0
    progress: bool = True
    progress_desc: Optional[str] = None      # the progress bar's label (a sweep's "[2/4 q8]")
    on_nonfinite: str = "error"              # a document scored from NaN/Inf logits: stop, or flag its row
    verb: str = "done"                       # "... already done"; "scored" for a run without a model


@dataclass
class Pending:
    keys: list[tuple]                        # the current selection
    done: set[tuple]                         # of those, stored already

    @property
    def todo(self) -> int:
        return len(self.keys) - len(self.done)

    @property
    def nothing_left(self) -> bool:
        """A stored run holds every row of the selection."""
        return bool(self.done) and self.todo == 0


def pending(run: TaskRun) -> Pending:
    """What the run directory already holds of the selection; raises ResumeMismatchError (in
    words) when it holds another run — before anything is loaded or written."""
    keys = run.task.doc_keys()
    if run.stored is None:
        return Pending(keys, set())
    check_resumable(run.out_dir, run.stored, run.manifest["identity"], run.task.key_columns)
    stored = stored_keys(run.out_dir, run.task.key_columns)
    return Pending(keys, {k for k in keys if k in stored})


@dataclass
class PreparedRun:
    """A command's run, checked and ready: execute() computes what is left (or reports the stored rows)."""
    command: str                             # "mmlu", "humaneval"
    run: TaskRun
    todo: Pending
    cfg: Optional[EngineConfig]              # None (and model_dir None): a task that needs no model
    model_dir: Optional[Path]
    report: Report
    # what must be open while generating (HumanEval: the sandbox pool that scores the completions)
    context: Callable[[], ContextManager[Any]] = field(default=contextlib.nullcontext)
    ray: Optional[RayOptions] = None                         # --ray: computed by Ray replicas
    replica_setup: Optional[TaskContext] = None              # --ray: what each replica opens (its sandbox)
    # --ray: a generated row's execution on this machine (HumanEval --execute-on driver), None: done on replicas
    finish_row: Optional[Callable[[dict[str, Any]], Future]] = None


class ModelLoader:
    """Loads a model once and hands it to every run that uses the same directory and settings."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._loaded: Optional[tuple[Any, Any]] = None
        self.loads = 0

    def get(self, cfg: EngineConfig, model_dir: Path) -> tuple[Any, Any]:
        key = (str(Path(model_dir).resolve()), *sorted(cfg.load_settings().items()))
        if key != self._key:
            self._loaded = None                  # free the previous model before loading the next
            self._loaded = load_model(cfg, model_dir)
            self._key = key
            self.loads += 1
        assert self._loaded is not None
        return self._loaded


def report_stored(run: TaskRun, todo: Pending, report: Report) -> int:
    """Nothing to run: say so and print the stored results of the selection. A finalized run whose
    samples.parquet and summary are intact is left exactly as it is; one stopped before finalizing
    (killed after its last flush, or before its summary was written) is finalized now, without a
    model."""
    print(f"{len(todo.keys)} of {len(todo.keys)} {run.unit} already {run.verb} in {run.out_dir}; nothing to run",
          file=sys.stderr)
    if ((run.stored or {}).get("status") == "finalized" and samples_file_intact(run.out_dir)
            and summary_intact(run.out_dir)):
        rows = _selected(read_samples(run.out_dir).to_dict("records"), run.task, todo.keys)
        per, overall = run.task.summarize(rows)
    else:
        with open_store(run) as store:
            rows, per, overall = finalize_with_summary(run, todo, store)
    report(rows, per, overall, None, run.out_dir)
    return all_skipped_status(run, rows)


def all_skipped_status(run: TaskRun, rows: list[dict[str, Any]]) -> int:
    """2, with the cause on the console, where every row of the selection was skipped (the summary
    then shows no accuracy: there is none over zero questions); else 0."""
    if not rows or not all(r.get("skipped") for r in rows):
        return 0
    reasons = Counter(str(r.get("skip_reason") or "no reason recorded") for r in rows)
    reason, n = reasons.most_common(1)[0]
    more = f" (and {len(reasons) - 1} other causes)" if len(reasons) > 1 else ""
    print(f"error: all {len(rows)} {run.unit} were skipped, so there is no score: {terminal_safe(reason, True)}"
          f"{'' if n == len(rows) else f' ({n} of them)'}{more}", file=sys.stderr)
    return 2


def open_store(run: TaskRun) -> RunStore:
    return RunStore.open(run.out_dir, run.manifest, key_columns=run.task.key_columns, overwrite=run.overwrite,
                         flush_rows=run.flush_rows, flush_seconds=run.flush_seconds)


@dataclass
class Session:
    """What this session computed, for the summary and its manifest entry."""
    rows: int                                # rows scored (skipped ones not counted)
    nonfinite: int                           # rows flagged for NaN/Inf logits
    generator: dict[str, Any]                # the generator's counters (--ray: summed over the replicas)
    throughput: dict[str, Any]
    skipped: int = 0                         # rows stored as skipped
    cache_fits: Optional[int] = None         # the cache's prompt limit, where shorter than the model's context
    record: dict[str, Any] = field(default_factory=dict)    # more fields of the session's entry (--ray: "ray")


def say_resuming(run: TaskRun, todo: Pending) -> None:
    if todo.done:
        print(f"resuming {run.out_dir}: {len(todo.done)} of {len(todo.keys)} {run.unit} already done, "
              f"{todo.todo} to run", file=sys.stderr)


def generate(run: TaskRun, todo: Pending, cfg: EngineConfig, model_dir: Path, report: Report,
             loader: ModelLoader) -> int:
    say_resuming(run, todo)
    model, tokenizer = loader.get(cfg, model_dir)
    with open_store(run) as store:
        generator = make_generator(cfg, model, tokenizer)
        fits = min(model.max_seq_len, generator.cache.max_tokens)     # longer prompts are skipped rows
        done = store.completed_keys()
        plans = [p for p in run.task.plan(tokenizer, fits) if p.doc_key not in done]
        write_prompts(run.out_dir, {p.info["prompt_hash"]: p.prompt for p in plans if p.prompt is not None},
                      {p.info["prompt_hash"]: p.chat for p in plans if p.prompt is not None and p.chat is not None})
        row_base = {"run_id": store.manifest["run_id"], "task": run.task.name, "cache_mode": cfg.cache_mode}
        t0 = time.time()
        totals = run_task(run.task, generator, plans, store.add, row_base, progress=run.progress,
                          desc=run.progress_desc, on_nonfinite=run.on_nonfinite)
        session = Session(totals.docs, totals.nonfinite, dict(generator.stats()), generator_throughput(generator, t0),
                          sum(p.skip_reason is not None for p in plans), fits if fits < model.max_seq_len else None)
        rows, per, overall = finish_session(run, todo, store, session)
    report(rows, per, overall, session.throughput, run.out_dir)
    return all_skipped_status(run, rows)


def score_without_model(run: TaskRun, todo: Pending, report: Report) -> int:
    """A task whose documents need no model (their plans hold no requests): score each, store its row."""
    say_resuming(run, todo)
    with open_store(run) as store:
        done = store.completed_keys()
        plans = [p for p in run.task.plan(None, None) if p.doc_key not in done]
        t0 = time.time()
        score_plans(run.task, plans, store.add, {}, progress=run.progress, desc=run.progress_desc)
        rows, per, overall = finalize_with_summary(run, todo, store)
        store.record_session(end_time=utc_now(), wall_seconds=time.time() - t0)
    report(rows, per, overall, None, run.out_dir)
    return 0


def finish_session(run: TaskRun, todo: Pending, store: RunStore,
                   session: Session) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Warn, finalize the store, write the summary and this session's manifest entry; returns the
    selection's rows, the per-group summary and the overall one."""
    if session.nonfinite:
        print(f"warning: {session.nonfinite} {run.unit} were scored from logits holding NaN or Inf (a broken "
              f"model or dtype); they count as wrong and are flagged in the nonfinite_logits column", file=sys.stderr)
    _warn_cache_skips(run, session.skipped, session.cache_fits)
    this_session = {"rows": session.rows, "generator": session.generator}
    rows, per, overall = finalize_with_summary(run, todo, store, {"this_session": this_session})
    store.record_session(end_time=utc_now(), throughput=session.throughput, **session.record)
    return rows, per, overall


def finalize_with_summary(run: TaskRun, todo: Pending, store: RunStore, extra: Optional[dict[str, Any]] = None,
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """samples.parquet, the selection's summary (overall plus `extra` in summary.json), then the
    manifest says finalized; returns the selection's rows, the per-group summary and the overall one.
    NOTE: in this order, so that a finalized run always has its summary: a run killed before the
    last step is not finalized, and its rerun finalizes it without a model (report_stored)."""
    rows = _selected(store.merge_samples().to_dict("records"), run.task, todo.keys)
    per, overall = run.task.summarize(rows)
    write_summary(run.out_dir, clean(per), clean({**overall, **(extra or {})}))
    store.mark_finalized()
    return rows, per, overall


def _warn_cache_skips(run: TaskRun, skipped: int, fits: Optional[int]) -> None:
    """Rows skipped because their prompt is longer than the KV cache are stored as done: say so."""
    if skipped and fits is not None:
        print(f"warning: {skipped} {run.unit} skipped because their prompt does not fit in the KV cache's "
              f"{fits} tokens; they are stored as skipped and a resume will not retry them: run them with a "
              "larger --cache-tokens or --cache-memory into another --output-dir", file=sys.stderr)


def _selected(rows: list[dict[str, Any]], task: Task, keys: list[tuple]) -> list[dict[str, Any]]:
    wanted = set(keys)
    return [r for r in rows if tuple(r[c] for c in task.key_columns) in wanted]
