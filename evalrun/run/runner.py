"""Run a task on the dynamic generator: every request is queued at once; each
document's row goes to the result store as soon as its last job finishes (or, for a task
whose scoring runs elsewhere, e.g. code in a sandbox, as soon as that Future completes:
generation never waits for it)."""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tqdm import tqdm

from evalrun.engine import DynamicGenerator, DynamicJob
from evalrun.errors import NonFiniteLogits
from evalrun.tasks.base import NONFINITE_COLUMN, Answer, DocPlan, Request, Task

ON_NONFINITE = ("error", "flag")


@dataclass
class RunTotals:
    docs: int = 0
    correct: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_time: float = 0.0
    metric: str = "correct"             # the row's boolean column counted in `correct`
    rows: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: int = 0                  # rows flagged for NaN/Inf logits (--on-nonfinite flag)


@dataclass
class _Pending:
    plan: DocPlan
    answers: list[Answer] = field(default_factory=list)


@dataclass
class _Emitter:
    """Rows go out through here: straight away, or when their scoring Future is done."""
    task: Task
    emit: Callable[[dict[str, Any]], None]
    row_base: dict[str, Any]
    totals: RunTotals
    bar: Any
    inflight: dict[Future, DocPlan] = field(default_factory=dict)

    def scored(self, plan: DocPlan, scored: dict[str, Any] | Future) -> None:
        if isinstance(scored, Future):
            self.inflight[scored] = plan
        else:
            self.row(plan, scored)

    def row(self, plan: DocPlan, scored: dict[str, Any]) -> None:
        _emit(self.emit, self.totals, {**self.row_base, **_key(self.task, plan), **scored, "skipped": False})
        self.bar.update(1)

    def harvest(self, block: bool = False) -> None:
        """Emit the rows of finished Futures; with `block`, wait for at least one first."""
        if not self.inflight:
            return
        done = wait(list(self.inflight), timeout=None if block else 0, return_when=FIRST_COMPLETED).done
        for fut in done:
            self.row(self.inflight.pop(fut), fut.result())


def run_task(task: Task, generator: DynamicGenerator, plans: list[DocPlan],
             emit: Callable[[dict[str, Any]], None], row_base: dict[str, Any],
             progress: bool = True, desc: Optional[str] = None, on_nonfinite: str = "error") -> RunTotals:
    """Queue every request of `plans`, drain the generator, emit one row per document.

    A document whose answers came from logits holding a NaN or an Inf (a broken model): with
    on_nonfinite="error", NonFiniteLogits naming it (the rows emitted before stay); with "flag",
    its row is emitted with the task's `nonfinite_logits` flag set (the task scores it as wrong)."""
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    totals = RunTotals(metric=getattr(task, "progress_metric", "correct"))
    pending: dict[int, _Pending] = {}
    jobs = []
    for i, plan in enumerate(plans):
        if plan.skip_reason is not None:
            _emit(emit, totals, {**row_base, **_key(task, plan), **plan.info,
                                 "skipped": True, "skip_reason": plan.skip_reason})
            continue
        pending[i] = _Pending(plan)
        jobs += [engine_job(r, (i, r)) for r in plan.requests]
    start = time.time()
    generator.enqueue(jobs)
    bar = tqdm(total=len(pending), disable=not progress, unit="doc", dynamic_ncols=True, desc=desc)
    out = _Emitter(task, emit, row_base, totals, bar)
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                _collect(task, pending, result, totals, out, on_nonfinite)
        out.harvest()
        _postfix(bar, totals, generator, start)
    while out.inflight:
        out.harvest(block=True)
        _postfix(bar, totals, generator, start)
    bar.close()
    totals.wall_time = time.time() - start
    return totals


def score_plans(task: Task, plans: list[DocPlan], emit: Callable[[dict[str, Any]], None], row_base: dict[str, Any],
                progress: bool = True, desc: Optional[str] = None) -> RunTotals:
    """Score documents that need no model (plans without requests), emitting each row as it is done."""
    totals = RunTotals(metric=getattr(task, "progress_metric", "correct"))
    start = time.time()
    with tqdm(total=len(plans), disable=not progress, unit="doc", dynamic_ncols=True, desc=desc) as bar:
        out = _Emitter(task, emit, row_base, totals, bar)
        for plan in plans:
            out.scored(plan, task.score(plan, []))
            out.harvest()
        while out.inflight:
            out.harvest(block=True)
    totals.wall_time = time.time() - start
    return totals


def engine_job(r: Request, identifier: Any) -> DynamicJob:
    """The engine job of a task's Request."""
    return DynamicJob(list(r.input_ids), max_new_tokens=r.max_new_tokens, return_logits=r.return_logits,
                      stop_conditions=list(r.stop_conditions), gen_settings=r.sampler, seed=r.seed,
                      identifier=identifier, score_from=r.score_from, think_end=r.think_end or None,
                      max_thinking_tokens=r.max_thinking_tokens)


def _collect(task: Task, pending: dict[int, _Pending], result: dict, totals: RunTotals, out: _Emitter,
             on_nonfinite: str) -> None:
    index, request = result["identifier"]
    entry = pending[index]
    entry.answers.append(answer_of(request, result))
    totals.prompt_tokens += result["prompt_tokens"]
    totals.cached_tokens += result["cached_tokens"]
    if len(entry.answers) < len(entry.plan.requests):
        return
    del pending[index]
    if any(a.nonfinite_logits for a in entry.answers) and on_nonfinite == "error":
        key = ", ".join(f"{c}={v}" for c, v in _key(task, entry.plan).items())
        raise NonFiniteLogits(f"the model's logits hold NaN or Inf at a scored position of {key}: the model or "
                              f"its dtype is broken. The rows scored before it are kept ({totals.docs} this "
                              "session); pass --on-nonfinite flag to record such rows as wrong, flagged, and go on")
    out.scored(entry.plan, task.score(entry.plan, entry.answers))


def answer_of(request: Request, result: dict) -> Answer:
    """The Answer to a Request from its job's last result."""
    return Answer(request, result["job"].state.new_ids, result["full_completion"], result.get("logits"),
                  result["prompt_tokens"], result["cached_tokens"], result.get("eos_reason"),
                  result.get("nonfinite_logits", 0), result.get("prompt_logprobs"), result.get("prompt_greedy"),
                  result.get("thinking_tokens"), result.get("thinking_forced", False))


def _emit(emit: Callable[[dict[str, Any]], None], totals: RunTotals, row: dict[str, Any]) -> None:
    row = {k: v for k, v in row.items() if not k.startswith("_")}
    emit(row)
    totals.rows.append(row)
    totals.nonfinite += bool(row.get(NONFINITE_COLUMN))
    if not row.get("skipped"):
        totals.docs += 1
        totals.correct += bool(row.get(totals.metric))


def _key(task: Task, plan: DocPlan) -> dict[str, Any]:
    return dict(zip(task.key_columns, plan.doc_key))


def _postfix(bar: tqdm, totals: RunTotals, generator: DynamicGenerator, start: float) -> None:
    if bar.disable:
        return
    stats = generator.stats()
    elapsed = max(time.time() - start, 1e-9)
    started = stats["cached_tokens"] + stats["prefill_tokens"]          # prompt tokens of admitted jobs
    hit = stats["cached_tokens"] / started if started else 0.0
    acc: Optional[float] = totals.correct / totals.docs if totals.docs else None
    label = "acc" if totals.metric == "correct" else totals.metric
    bar.set_postfix({label: "-" if acc is None else f"{acc:.3f}"},
                    tok_s=f"{(stats['prefill_tokens'] + stats['generated_tokens']) / elapsed:.0f}",
                    cache_hit=f"{hit:.0%}", refresh=False)
