"""The registry entry of `evalrun task`: lm-evaluation-harness's YAML tasks (evalrun/tasks/lm_eval_task.py)."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .base import TaskDataError, TaskSettingError
from .chat import CHAT_CLI_ARGS, ChatOptions, with_chat_options
from .lm_eval_code import shared_code_eval
from .lm_eval_task import LmEvalTask, load_suite, summarize_rows, summarize_suite
from .spec import CliArg, RunReport, TaskSpec

KEY_COLUMNS = ("task_name", "doc_id")


@dataclass(frozen=True)
class LmEvalOptions:
    tasks: Optional[str] = None                  # comma-separated, as given
    include_path: Optional[str] = None
    num_fewshot: Optional[int] = None
    limit: Optional[float] = None
    bootstrap_iters: int = 100000
    gen_kwargs: Optional[Sequence[str]] = None   # lm-eval's --gen_kwargs words, as given
    confirm_run_unsafe_code: bool = False        # lm-eval's flag: tasks marked unsafe_code may run
    chat: ChatOptions = ChatOptions()

    def __post_init__(self) -> None:
        if not self.names:
            raise TaskSettingError("--tasks is required: lm-eval task, group or tag names, comma-separated")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise TaskSettingError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and (self.limit <= 0 or (self.limit >= 1 and self.limit != int(self.limit))):
            raise TaskSettingError(f"--limit must be a count >= 1 or a fraction in (0, 1), got {self.limit}")
        if self.bootstrap_iters < 0:
            raise TaskSettingError(f"--bootstrap-iters must be >= 0, got {self.bootstrap_iters}")
        if self.gen_kwargs is not None:
            object.__setattr__(self, "gen_kwargs", tuple(self.gen_kwargs))
            self.generation_overrides            # parsed now: a bad word is refused before anything loads

    @property
    def names(self) -> list[str]:
        return [n.strip() for n in (self.tasks or "").split(",") if n.strip()]

    @property
    def generation_overrides(self) -> dict[str, Any]:
        """--gen-kwargs as lm-eval's CLI parses its --gen_kwargs: one JSON object, or `key=value` words
        (comma-separated or not; values as Python literals, else strings), later keys winning."""
        return parse_gen_kwargs(self.gen_kwargs or ())


def parse_gen_kwargs(words: Sequence[str]) -> dict[str, Any]:
    try:
        from lm_eval._cli.utils import key_val_to_dict, try_parse_json
    except ImportError as exc:
        raise TaskSettingError(f"--gen-kwargs needs lm-evaluation-harness (pip install 'evalrun[lm-eval]'): "
                               f"{exc}") from None
    out: dict[str, Any] = {}
    try:
        first = try_parse_json(words[0]) if words else None
        if isinstance(first, dict):
            return first
        for word in words:
            out.update(key_val_to_dict(word))
    except ValueError as exc:
        raise TaskSettingError(f"--gen-kwargs: {exc}") from None
    return out


def _build(options: LmEvalOptions, seed: int) -> LmEvalTask:
    tasks, groups = load_suite(options.names, options.include_path, options.num_fewshot,
                               options.generation_overrides or None, unsafe_code=options.confirm_run_unsafe_code)
    return LmEvalTask(tasks, options.limit, groups=groups, chat=options.chat, bootstrap_iters=options.bootstrap_iters)


def _identity(options: LmEvalOptions, task: LmEvalTask) -> dict[str, Any]:
    return {"data_fingerprint": task.fingerprint(), "lm_eval_tasks": sorted(task.tasks),
            "num_fewshot": {n: t.get_config("num_fewshot") for n, t in sorted(task.tasks.items())},
            "prompt_format": "lm-eval-0.4-hf"}


def _manifest_extra(options: LmEvalOptions, task: LmEvalTask) -> dict[str, Any]:
    import lm_eval
    extra = {"lm_eval": {"version": getattr(lm_eval, "__version__", "?"), "tasks": options.names,
                         "include_path": options.include_path, "bootstrap_iters": options.bootstrap_iters,
                         "gen_kwargs": options.generation_overrides}}
    unsafe = sorted(n for n, t in task.tasks.items() if getattr(t, "UNSAFE_CODE", False))
    if unsafe:                  # what isolates their code_eval checks on this machine (docs/sandbox.md)
        extra["lm_eval"]["unsafe_code_tasks"] = unsafe
        extra["sandbox"] = shared_code_eval().isolation_info()
    return extra


def _summarize(rows: list[dict[str, Any]], groups: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return summarize_rows(rows, groups)          # prefix groups are the tasks, in order


def _summarize_merged(rows: list[dict[str, Any]], manifest: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A merged run's summary as its unsharded run writes it: the task definitions are loaded again
    (their aggregations and groups; lm-eval loads their data too) from the names, --include-path and
    --bootstrap-iters the manifest records. Where they cannot be loaded, each metric's registered
    aggregation and no groups, with a warning."""
    info = manifest.get("lm_eval") or {}
    iters = int(info.get("bootstrap_iters", 100000))
    try:
        tasks, groups = load_suite(list(info["tasks"]), info.get("include_path"), None, unsafe_code=True)
    except (KeyError, TypeError, TaskSettingError, TaskDataError) as exc:
        names = (manifest.get("shard") or {}).get("selection", {}).get("groups") or \
            sorted({str(r.get("task_name")) for r in rows})
        warnings.warn(f"the summary uses each metric's registered aggregation and no group aggregates: the task "
                      f"definitions could not be loaded again ({exc})")
        return summarize_rows(rows, names, None, iters)
    return summarize_suite(rows, tasks, groups, iters)


def print_summary(options: LmEvalOptions, r: RunReport) -> None:
    print(f"\n{'task':<28} {'metric':<28} {'value':>10} {'stderr':>10}  n")
    for t in r.per_group:
        for key, value in t.items():
            if key in ("task_name", "n") or "_stderr," in key:
                continue
            metric, flt = key.rsplit(",", 1)
            err = t.get(f"{metric}_stderr,{flt}")
            print(f"{t['task_name']:<28} {key:<28} {_num(value):>10} {_num(err):>10}  {t['n']}")
    for name, g in r.overall.get("groups", {}).items():
        for key, value in g.items():
            if "," in key and "_stderr," not in key:
                metric, flt = key.rsplit(",", 1)
                print(f"{name:<28} {key:<28} {_num(value):>10} {_num(g.get(f'{metric}_stderr,{flt}')):>10}  "
                      f"{g.get('sample_len', '')}")
    print(f"results: {r.out_dir}")


def _num(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else str(v)


def show_row(row: dict[str, Any]) -> str:
    head = f"{row['task_name']} #{row['doc_id']}"
    if row.get("skipped"):
        return f"{head}: skipped ({row.get('skip_reason')})"
    return (f"{head}: target {row.get('target')!r}; metrics {row.get('metrics')}\n"
            f"filtered: {json.loads(row.get('filtered_resps') or '{}')}")


def _score(n: int, c: int) -> float:
    return c / n


CLI_ARGS = (
    CliArg(("--tasks",), "lm-eval task, group or tag names, comma-separated (default: none; required)"),
    CliArg(("--include-path", "--include_path"), "a directory of lm-eval task YAML files, searched before lm-eval's "
           "own tasks (default: lm-eval's tasks only)", dest="include_path"),
    CliArg(("--num-fewshot", "--num_fewshot"), "few-shot examples per prompt (default: each task's own, else 0)",
           dest="num_fewshot", type=int),
    CliArg(("--limit",), "the first N documents of each task, or a fraction of them when below 1 (default: all)",
           type=float),
    CliArg(("--bootstrap-iters", "--bootstrap_iters"), "bootstrap iterations of lm-eval's stderr for metrics "
           "without a closed form (default: 100000, lm-eval's)", dest="bootstrap_iters", type=int, default=100000),
    CliArg(("--gen-kwargs", "--gen_kwargs"), "generation arguments laid over each generate_until task's "
           "generation_kwargs, as lm-eval's --gen_kwargs: KEY=VALUE words or one JSON object, e.g. max_gen_toks=1024 "
           "or temperature=0.6 do_sample=True top_p=0.95 (default: the tasks' own)", dest="gen_kwargs", nargs="+",
           metavar="KEY=VALUE"),
    CliArg(("--confirm-run-unsafe-code", "--confirm_run_unsafe_code"), "run tasks marked unsafe_code, which execute "
           "the code the model generates (lm-eval's humaneval, mbpp, ...); their code_eval checks run in evalrun's "
           "sandbox (default: off: such tasks are refused)", dest="confirm_run_unsafe_code", switch=True),
)

SPEC = TaskSpec(
    name="task", key_columns=KEY_COLUMNS, metric="correct", aggregate="accuracy", unit_columns=KEY_COLUMNS,
    unit_score=_score, groupings={"task": lambda key: str(key[0])}, default_by="task",
    help="any lm-evaluation-harness task (its YAML definitions) on evalrun's engine",
    description="Run lm-evaluation-harness tasks, groups or tags (its YAML definitions, packaged or under "
                "--include-path) with lm-eval's prompts, filters and metrics, on evalrun's engine; rows land in "
                "OUTPUT_DIR as each document finishes, and a rerun resumes.",
    cli_args=CLI_ARGS + CHAT_CLI_ARGS, options=with_chat_options(LmEvalOptions), build=_build, identity=_identity, manifest_extra=_manifest_extra,
    unit="documents", summarize=_summarize, summarize_merged=_summarize_merged, report=print_summary,
    show_row=show_row)
