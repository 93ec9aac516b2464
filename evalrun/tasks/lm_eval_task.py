"""lm-evaluation-harness's YAML tasks on evalrun's engine (`evalrun task --tasks NAME[,NAME...]`).

lm-eval (the optional extra `evalrun[lm-eval]`, 0.4.13) loads the task configurations: names and
groups/tags resolved by its TaskManager over its packaged tasks (their index cached:
evalrun/tasks/lm_eval_index.py) and `--include-path` directories,
datasets through `datasets` (hub or local `data_files`), `process_docs`, the Jinja/column/list/
`!function` doc_to_* fields, descriptions, delimiters and its few-shot sampler. Its task objects
build each document's requests (`build_all_requests`, in document order, so the seeded sampler
gives every document the few-shot examples an lm-eval run gives it, whatever the shard, resume
or --limit), apply its filters and compute its metrics and aggregations; the engine answers the
requests (evalrun/tasks/lm_eval_requests.py). lm-eval's evaluator is never called.

Rows: one per document, keyed (task_name, doc_id): the responses, the filtered responses per
filter, each metric (lm-eval's `metric,filter` names) as JSON, and `correct` (the first 0/1 metric)
for progress and `compare`; with an end-of-thinking marker, the raw generations too (`raw_resps`).

Chat templates (--apply-chat-template, evalrun/tasks/chat.py): lm-eval builds the chat prompts itself
(fewshot_context with the template as its `chat_template` callable, our renderer); they need the
model's tokenizer, so the requests are built once more when the tokenizer is known (plan), the
few-shot sampler re-seeded first, so every document keeps the examples a plain build gives it.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Collection, Iterator, Optional, Sequence

from .base import Answer, DocPlan, PrefixGroup, Request, TaskDataError, TaskSettingError, estimate_tokens, prompt_hash
from .chat import ChatOptions, ChatRenderer, ThinkEnd, resolve_think_end
from .lm_eval_code import code_eval_in_sandbox
from .lm_eval_index import task_manager
from .lm_eval_requests import (Ask, Encoder, check_gen_kwargs, cut_at_stops, generation_request, loglikelihood,
                               score_request)
from .lm_eval_stderr import stderr_for_metric

OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until")
UNSUPPORTED = {                # config fields this runner refuses (the line names the field)
    "use_prompt": "promptsource prompts",
    "doc_to_image": "multimodal documents",
    "doc_to_audio": "multimodal documents",
}
FEWSHOT_SEED = 1234            # lm-eval's default --fewshot_random_seed


def _lm_eval() -> Any:
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise TaskSettingError(f"evalrun task needs lm-evaluation-harness (pip install 'evalrun[lm-eval]'): "
                               f"{exc}") from None
    return TaskManager


def load_tasks(names: Sequence[str], include_path: Optional[str], num_fewshot: Optional[int]) -> dict[str, Any]:
    """{task name: lm-eval task object} for the names (groups and tags expanded): load_suite's tasks."""
    return load_suite(names, include_path, num_fewshot)[0]


def load_suite(names: Sequence[str], include_path: Optional[str], num_fewshot: Optional[int],
               gen_kwargs: Optional[dict] = None, unsafe_code: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """({task name: lm-eval task object}, {group name: lm-eval Group}) for the names (groups and tags
    expanded), configured as lm-eval's simple_evaluate configures them (`gen_kwargs`, its --gen_kwargs:
    laid over each generate_until task's generation_kwargs); TaskSettingError/TaskDataError in one line.
    A task marked `unsafe_code` (it runs generated code) is refused unless `unsafe_code` (lm-eval's
    --confirm_run_unsafe_code); HF evaluate's code_eval, which such tasks load, runs in evalrun's
    sandbox (evalrun/tasks/lm_eval_code.py)."""
    _lm_eval()
    if not names:
        raise TaskSettingError("--tasks names no task")
    manager = task_manager(include_path, packaged=False) if include_path else None
    if manager is None or not set(names) <= set(manager.all_tasks):
        manager = task_manager(include_path)         # with lm-eval's packaged tasks, their index cached
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise TaskSettingError(f"unknown task {unknown[0]!r}: neither lm-eval's tasks nor "
                               f"{include_path or 'an --include-path'} define it")
    tasks: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for name in names:                  # one at a time: an error names its task
        try:
            with code_eval_in_sandbox():
                loaded = manager.load([name])
            tasks.update(loaded["tasks"])
            groups.update(loaded.get("groups") or {})
        except FileNotFoundError as exc:
            raise TaskDataError(f"task {name}: its data is missing: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - datasets and YAML errors all reach the user as one line
            first = (str(exc).splitlines() or [""])[0]
            raise TaskDataError(f"task {name}: could not load it: {type(exc).__name__}: {first}") from None
    for name, task in tasks.items():
        if gen_kwargs and task.get_config("output_type") == "generate_until":
            task.set_config(key="generation_kwargs", value=dict(gen_kwargs), update=True)
        _check_supported(name, task)
        if getattr(task, "UNSAFE_CODE", False) and not unsafe_code:
            raise TaskSettingError(f"task {name} runs the code the model generates (unsafe_code: true); pass "
                                   f"--confirm-run-unsafe-code to run it (its code_eval checks run in evalrun's "
                                   f"sandbox)")
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return tasks, groups


def _check_supported(name: str, task: Any) -> None:
    output_type = task.get_config("output_type")
    if output_type not in OUTPUT_TYPES:
        raise TaskSettingError(f"task {name}: output_type {output_type!r} is not supported (evalrun runs "
                               f"{', '.join(OUTPUT_TYPES)})")
    for field, what in UNSUPPORTED.items():
        if task.get_config(field):
            raise TaskSettingError(f"task {name}: {field} ({what}) is not supported")
    if output_type == "generate_until":
        check_gen_kwargs(task.get_config("generation_kwargs"), f"task {name}: ")


class LmEvalTask:
    name = "task"
    key_columns = ("task_name", "doc_id")
    progress_metric = "correct"

    def __init__(self, tasks: dict[str, Any], limit: Optional[float] = None, only: Optional[Collection[tuple]] = None,
                 groups: Optional[dict[str, Any]] = None, chat: ChatOptions = ChatOptions(),
                 bootstrap_iters: int = 100000):
        self.tasks, self.limit, self.groups, self.chat = tasks, limit, groups or {}, chat
        self.bootstrap_iters = bootstrap_iters         # lm-eval's --bootstrap_iters, for the summary's stderrs
        self.only = frozenset(only) if only is not None else None
        self.instances = self._build_requests(None, rebuild=False)
        self.encoder: Optional[Encoder] = None
        self.think: Optional[ThinkEnd] = None
        self.render: Optional[ChatRenderer] = None

    def _build_requests(self, render: Optional[ChatRenderer], rebuild: bool) -> dict[tuple, list]:
        """{(task, doc_id): its instances}, built by lm-eval (again, from a re-seeded sampler, when `rebuild`)."""
        from lm_eval.evaluator_utils import get_sample_size
        instances: dict[tuple, list] = {}
        for name, task in self.tasks.items():
            if rebuild or not getattr(task, "_instances", None):
                task.set_fewshot_seed(seed=FEWSHOT_SEED)
                task.build_all_requests(limit=get_sample_size(task, self.limit), rank=0, world_size=1,
                                        system_instruction=self.chat.system_instruction,
                                        apply_chat_template=render is not None,
                                        fewshot_as_multiturn=self.chat.fewshot_as_multiturn and render is not None,
                                        chat_template=render)
            for inst in task.instances:
                instances.setdefault((name, inst.doc_id), []).append(inst)
        for group in instances.values():
            group.sort(key=lambda inst: inst.idx)
        return instances

    def fingerprint(self) -> str:
        """Each task's configuration (its YAML as lm-eval dumps it, with the source of its `!function`
        hooks: trusted code, part of the identity) and its documents' content; not the selection
        (--limit may grow on resume: every document keeps its few-shot examples)."""
        h = hashlib.sha256()
        for name, task in sorted(self.tasks.items()):
            h.update(json.dumps(task.dump_config(), sort_keys=True, default=str).encode())
            for path in sorted(_hook_files(task.config)):     # a hook's helpers are in its file too
                h.update(Path(path).read_bytes())
            dataset = getattr(task, "dataset", None)
            for split in sorted(dataset or {}):
                h.update(f"{split}:{getattr(dataset[split], '_fingerprint', '')}".encode())
        return h.hexdigest()[:16]

    def doc_keys(self) -> list[tuple]:
        return [k for k in self.instances if self.only is None or k in self.only]

    def modules_by_value(self) -> list[Any]:
        """The modules of the tasks' `!function` hooks, for a pickle that travels to another process (a
        Ray replica) to carry by value: lm-eval registers a hook file outside its package under its path
        (not importable there), and a packaged one would import again there, loading HF evaluate's
        code_eval outside evalrun's sandbox (evalrun/tasks/lm_eval_code.py)."""
        found: dict[str, Any] = {}
        for task in self.tasks.values():
            for fn in _callables([vars(task.config), getattr(task, "_metric_fn_list", {})]):
                module = sys.modules.get(getattr(fn, "__module__", None) or "")
                name = getattr(module, "__name__", "")
                if module is not None and (name.startswith("lm_eval.tasks.") or os.sep in name):
                    found[name] = module
        return [found[n] for n in sorted(found)]

    def restricted(self, keys: Collection[tuple]) -> "LmEvalTask":
        only = keys if self.only is None else self.only & frozenset(keys)
        return LmEvalTask(self.tasks, self.limit, only, self.groups, self.chat, self.bootstrap_iters)

    def prefix_groups(self) -> list[PrefixGroup]:
        groups = []
        for name in self.tasks:
            keys = tuple(k for k in self.doc_keys() if k[0] == name)
            if keys:
                sizes = tuple(sum(estimate_tokens(str(a)) for inst in self.instances[k] for a in inst.args)
                              for k in keys)
                groups.append(PrefixGroup(name, keys, 0, sizes, divisible=True))
        return groups

    def plan(self, tokenizer: Any, max_seq_len: int) -> Iterator[DocPlan]:
        self.encoder = enc = Encoder.for_model(tokenizer, max_seq_len)
        self.think = resolve_think_end(tokenizer, self.chat)
        self.render = ChatRenderer(tokenizer, self.chat) if self.chat.on else None
        if self.render is not None:
            self.instances = self._build_requests(self.render, rebuild=True)
        for key in self.doc_keys():
            try:
                yield self._plan_doc(key, self.instances[key], enc)
            except TaskSettingError:
                raise
            except ValueError as exc:           # a request that cannot fit the model's context: a skipped row
                yield DocPlan(key, skip_reason=f"{exc} (context {max_seq_len} tokens)")

    def _plan_doc(self, key: tuple, instances: list, enc: Encoder) -> DocPlan:
        requests: list[Request] = []
        index: dict[tuple, int] = {}
        asks: list[list[Ask]] = []

        def ask(r: Request) -> int:
            sig = replace(r, doc_key=key, part=0)
            if sig not in index:
                index[sig] = len(requests)
                requests.append(replace(sig, part=len(requests)))
            return index[sig]

        for inst in instances:
            mine: list[Ask] = []
            for repeat in range(inst.repeats):
                if inst.request_type == "loglikelihood":
                    req, last = score_request(key, 0, *enc.pair(*inst.args), enc.max_length)
                    mine.append(Ask(ask(req), last))
                elif inst.request_type == "loglikelihood_rolling":
                    for ctx, cont in enc.rolling(inst.args[0]):
                        req, last = score_request(key, 0, ctx, cont, enc.max_length)
                        mine.append(Ask(ask(req), last))
                else:
                    seed = hash((key, inst.idx, repeat)) & 0x7FFFFFFF
                    mine.append(Ask(ask(generation_request(key, 0, enc, inst.args[0], inst.args[1], seed, self.think,
                                                           self.chat.max_thinking_tokens))))
            asks.append(mine)
        first = instances[0].args[0]
        info = {"_asks": asks, "prompt_hash": prompt_hash(requests[0].input_ids) if requests else ""}
        chat = self.render.sources.get(first) if self.render is not None and isinstance(first, str) else None
        return DocPlan(key, requests, info, prompt=first if isinstance(first, str) else None, chat=chat)

    def score(self, plan: DocPlan, answers: list[Answer]) -> dict[str, Any]:
        name, doc_id = plan.doc_key
        task, instances = self.tasks[name], self.instances[plan.doc_key]
        by_part = {a.request.part: a for a in answers}
        for inst, asks in zip(instances, plan.info["_asks"]):
            inst.resps = self._responses(inst, asks, by_part)
            inst.filtered_resps = {}
        for ensemble in task._filters:
            ensemble.apply(instances)
        metrics: dict[str, Any] = {}
        filtered: dict[str, Any] = {}
        for filter_key in instances[0].filtered_resps:
            values = task.process_results(instances[0].doc, [inst.filtered_resps[filter_key] for inst in instances])
            filtered[filter_key] = [inst.filtered_resps[filter_key] for inst in instances]
            metrics.update({f"{m},{filter_key}": v for m, v in values.items()})
        first01 = next((v for v in metrics.values() if isinstance(v, (bool, int, float)) and v in (0, 1)), None)
        raw = {}
        if self.think is not None and any(i.request_type == "generate_until" for i in instances):
            raw = {"raw_resps": json.dumps([by_part[a.request].text for asks in plan.info["_asks"] for a in asks]),
                   "thinking_tokens": json.dumps([by_part[a.request].thinking_tokens
                                                  for asks in plan.info["_asks"] for a in asks])}
        return {
            "prompt_hash": plan.info["prompt_hash"],
            "prompt_tokens": sum(a.prompt_tokens for a in answers),
            "cached_tokens": sum(a.cached_tokens for a in answers),
            "resps": json.dumps([inst.resps for inst in instances], default=_plain),
            "filtered_resps": json.dumps(filtered, default=_plain),
            "metrics": json.dumps(metrics, default=_plain),
            "target": str(task.doc_to_target(instances[0].doc)),
            "correct": bool(first01) if first01 is not None else None,
            "nonfinite_logits": any(a.nonfinite_logits for a in answers),
            **raw,
        }

    def _responses(self, inst: Any, asks: list[Ask], by_part: dict[int, Answer]) -> list:
        if inst.request_type == "loglikelihood":
            return [loglikelihood(by_part[a.request], a.last) for a in asks]
        if inst.request_type == "loglikelihood_rolling":
            return [sum(loglikelihood(by_part[a.request], a.last)[0] for a in asks)]
        eos = self.encoder.eos_text if self.encoder else ""
        think = self.think.text if self.think else None
        return [cut_at_stops(by_part[a.request].text, inst.args[1], eos, think) for a in asks]

    def summarize(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return summarize_suite(rows, self.tasks, self.groups, self.bootstrap_iters)


def summarize_suite(rows: list[dict[str, Any]], tasks: dict[str, Any], groups: dict[str, Any],
                    bootstrap_iters: int = 100000) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """summarize_rows with each task's own aggregations, and lm-eval's aggregate of each group that has
    an aggregate_metric_list (under `groups`)."""
    per_task, overall = summarize_rows(rows, list(tasks), {n: t.aggregation() for n, t in tasks.items()},
                                       bootstrap_iters)
    metrics = {t["task_name"]: {**t, "sample_len": t["n"]} for t in per_task}
    overall["groups"] = {name: {k: v for k, v in group.aggregate(metrics).items() if k not in ("alias", "name")}
                         for name, group in groups.items() if group.has_aggregation}
    return per_task, overall


def summarize_rows(rows: list[dict[str, Any]], names: Sequence[str], aggregations: Optional[dict] = None,
                   bootstrap_iters: int = 100000) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per task: each `metric,filter` aggregated as lm-eval aggregates it (the task's aggregation, or
    the metric's registered default) with lm-eval's stderr (`metric_stderr,filter`; its bootstrap run in
    this process, evalrun/tasks/lm_eval_stderr.py)."""
    from lm_eval.api.metrics import mean
    from lm_eval.api.registry import get_metric_aggregation
    per_task = []
    for name in names:
        mine = [r for r in rows if r.get("task_name") == name and not r.get("skipped")]
        values: dict[str, list] = {}
        for r in mine:
            for key, v in json.loads(r["metrics"]).items():
                values.setdefault(key, []).append(tuple(v) if isinstance(v, list) else v)
        own = _expanded(dict((aggregations or {}).get(name, {})), {k.rsplit(",", 1)[0] for k in values})
        out: dict[str, Any] = {"task_name": name, "n": len(mine)}
        for key, items in values.items():
            metric, filter_key = key.rsplit(",", 1)
            fn = own.get(metric) or get_metric_aggregation(metric) or mean     # lm-eval's evaluator: else mean
            out[key] = fn(items)
            iters = min(bootstrap_iters, 100) if metric in ("bleu", "chrf", "chrf++", "ter") else bootstrap_iters
            stderr = stderr_for_metric(metric=fn, bootstrap_iters=iters) if bootstrap_iters > 0 else None
            out[f"{metric}_stderr,{filter_key}"] = stderr(items) if stderr and len(items) > 1 else "N/A"
        per_task.append(out)
    overall = {"n": sum(t["n"] for t in per_task), "skipped": sum(bool(r.get("skipped")) for r in rows),
               "tasks": {t["task_name"]: {k: v for k, v in t.items() if k != "task_name"} for t in per_task}}
    return per_task, overall


def _expanded(aggregations: dict, metrics: set) -> dict:
    """The task's aggregations with those of a metric that returned a dict (HF evaluate's, e.g. code_eval's
    pass_at_k -> pass@1) given to its keys, as lm-eval's process_results propagates them when it runs; a
    resumed run's rows never went through it in this process. Only where the owner is unambiguous: the one
    aggregated metric that no row carries."""
    owners = [m for m in aggregations if m not in metrics]
    if len(owners) == 1:
        for m in metrics - set(aggregations):
            aggregations[m] = aggregations[owners[0]]
    return aggregations


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _callables(value: Any, depth: int = 0) -> Iterator[Any]:
    """The functions inside a task's configuration and its metric table (dicts and lists of them, as
    the YAML's `!function` fields, metric_list and filter_list hold them)."""
    if inspect.isfunction(value) or inspect.ismethod(value):
        yield value
    elif depth < 6 and isinstance(value, (dict, list, tuple)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _callables(item, depth + 1)


def _hook_files(config: Any) -> set[str]:
    """The source files of a task config's `!function` hooks (its callables)."""
    files = set()
    for value in vars(config).values():
        if callable(value):
            try:
                path = inspect.getsourcefile(value)
            except TypeError:
                continue
            if path and Path(path).is_file():
                files.add(path)
    return files
