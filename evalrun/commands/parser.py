"""The `evalrun` command line's parser, and the records made of what it parsed: each task command's
arguments come from the task registry (evalrun/tasks/spec.py CliArg), then the model, engine, run
and --ray arguments every task command shares; run_config() turns a task command's namespace into
a frozen RunConfig, the only form in which the rest of evalrun sees it."""
from __future__ import annotations

import argparse
import re
from typing import Any, Optional, Sequence

from evalrun.results.compare_format import FORMATS
from evalrun.run.config import RayRequest, RunConfig
from evalrun.run.engine_config import EngineRequest
from evalrun.tasks.registry import runnable_specs, task_spec
from evalrun.tasks.spec import CliArg, TaskSpec
from evalrun.version import version_line


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser of every command; the task commands are the registry's tasks at the time of the call."""
    parser = parser_class(
        prog="evalrun",
        description=("Offline LLM evaluation harness on its own dynamic generator "
                     "(paged KV cache, continuous batching, prefix dedup, prompt caching)."),
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for spec in runnable_specs():
        _task_parser(sub, spec)
    _show_parser(sub)
    add_compare_parser(sub)
    add_regress_parser(sub)
    add_suite_parser(sub)
    add_merge_parser(sub)
    return parser


def _task_parser(sub: argparse._SubParsersAction, spec: TaskSpec) -> None:
    p = sub.add_parser(spec.name, help=spec.help, description=spec.description)
    _model_args(p)
    for arg in spec.cli_args:
        _add(p, arg)
    _run_args(p)


def _add(p: argparse.ArgumentParser, arg: CliArg) -> None:
    """A task's CliArg as an argparse argument."""
    kwargs: dict[str, Any] = {"dest": arg.name, "help": arg.help}
    if arg.switch:
        kwargs["action"] = "store_true"
    else:
        kwargs.update({k: v for k, v in (("type", arg.type), ("choices", arg.choices), ("nargs", arg.nargs),
                                         ("const", arg.const), ("metavar", arg.metavar)) if v is not None})
        kwargs["default"] = arg.default
    p.add_argument(*arg.flags, **kwargs)


def run_config(ns: argparse.Namespace, argv: Sequence[str]) -> RunConfig:
    """A task command's namespace as a RunConfig (BadInput, or the task's TaskSettingError, when a
    value is out of range)."""
    spec = task_spec(ns.command)
    values = vars(ns)
    options = spec.options(**{arg.name: values[arg.name] for arg in spec.cli_args})
    engine = EngineRequest(
        device=ns.device, dtype=ns.dtype, cache_mode=ns.cache_modes[0], cache_tokens=ns.cache_tokens,
        cache_memory=ns.cache_memory, cache_window=ns.cache_window, deterministic=ns.deterministic, eager=ns.eager,
        page_size=ns.page_size, max_batch_size=ns.max_batch_size, max_chunk_size=ns.max_chunk_size,
        draft_model=ns.draft_model, ngram_draft=ns.ngram_draft, num_draft_tokens=ns.num_draft_tokens)
    return RunConfig(spec.name, options, ns.model, engine, tuple(ns.cache_modes), ns.seed, ns.output_dir,
                     ns.overwrite, ns.flush_rows, ns.flush_seconds, not ns.no_progress, ns.shard, ns.on_nonfinite,
                     ray_request(ns), tuple(argv))


def ray_request(ns: argparse.Namespace) -> RayRequest:
    """The --ray flags of a task command or a suite."""
    return RayRequest(ns.ray, ns.replicas, ns.ray_address, ns.gpus_per_replica, ns.cpus_per_replica, ns.ray_timeout,
                      ns.ray_batch_rows)


def _show_parser(sub: argparse._SubParsersAction) -> None:
    show = sub.add_parser("show", help="print a few stored rows of a run with their prompts",
                          description="Print rows of a run directory (MMLU or HumanEval) with the full prompt "
                                      "each was asked, like lm-evaluation-harness's --log_samples.")
    show.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (the --output-dir of a run)")
    show.add_argument("--subject", help="MMLU: only this subject (default: all)")
    show.add_argument("--task-id", help="HumanEval: only this problem, e.g. HumanEval/0 (default: all)")
    show.add_argument("--wrong", action="store_true",
                      help="only rows that are wrong (MMLU) or did not pass (HumanEval) (default: all rows)")
    show.add_argument("--limit", "-n", type=int, default=3, help="rows to print (default: 3)")
    show.add_argument("--no-prompt", action="store_true", help="leave the prompts out (default: print them)")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory, or a llama.cpp .gguf file (llama, qwen2, qwen3; "
                                   "de-quantized once at load to --dtype) (default: the embedded "
                                   "SmolLM2-135M-Instruct demo)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="compute dtype (default: auto: bfloat16 on CUDA or on a CPU with AVX512-BF16/AMX, "
                        "else float32; a resumed run keeps its stored dtype)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu or cuda[:N] (default: auto, which means cpu until the CUDA path is verified "
                        "on a GPU; a resumed run keeps its stored device)")
    p.add_argument("--cache-mode", dest="cache_modes", default=["auto"], type=_cache_modes, metavar="MODE[,MODE...]",
                   help="KV cache storage: fp32/bf16/fp16 floats, or q8 (8-bit K and V), q6 (8-bit K, "
                        "4-bit V), q4 (4-bit K and V), quantized in groups of 32 after a Hadamard rotation. "
                        "A comma-separated list is a sweep: the model loads once, each mode runs into "
                        "OUTPUT_DIR/<mode>/ (each resumable), then the modes are compared with the first "
                        "(default: auto, the float storage of the compute dtype)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--cache-tokens", type=int, help="KV cache size in tokens (default: 65536)")
    size.add_argument("--cache-memory", type=_memory_size,
                      help="KV cache size in bytes instead, e.g. 2GiB, 512MiB, 1.5GB: a smaller cache mode "
                           "then holds more tokens (default: --cache-tokens)")
    p.add_argument("--cache-window", type=int, default=None,
                   help="q8/q6/q4: attend each token's current block of this many recent tokens exactly "
                        "(fp16, one block per running job) and only older ones through the codes; 0 turns it "
                        "off (the plain ExLlamaV2 scheme). Must divide --page-size (default: 128, or its greatest "
                        "common divisor with the page size; a resumed run keeps its stored window)")
    p.add_argument("--deterministic", default="auto", choices=["auto", "on", "off"],
                   help="batch-invariant linears, so a question's log-probabilities are bitwise the same whatever "
                        "else is in its batch (--max-batch-size, a resumed run, another shard); part of the run's "
                        "identity (default: auto: on where it costs nothing or saves time: float32, bf16 on a CPU without "
                        "native bf16; off where native bf16 matmuls are much faster, AVX512-BF16/AMX CPUs, on CUDA "
                        "until its cost is measured, or where it cannot run; a resumed run keeps its stored setting)")
    p.add_argument("--eager", action="store_true",
                   help="CUDA: run every decode step eagerly instead of replaying CUDA graphs (default: graphs for "
                        "pure decode steps, one per batch-size bucket)")
    p.add_argument("--page-size", type=int, default=256, help="tokens per cache page (default: 256)")
    p.add_argument("--max-batch-size", "--batch-size", "--batch_size", dest="max_batch_size", type=_batch_size,
                   help="most jobs running at once; lm-eval's --batch_size is accepted, 'auto' included "
                        "(default: auto, as many as the cache holds; with a q8/q6/q4 window at most the window "
                        "store's jobs: 64, or fewer when --cache-memory is small)")
    p.add_argument("--max-chunk-size", type=int, default=2048, help="tokens per forward pass (default: 2048)")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--draft-model", metavar="DIR",
                      help="speculative decoding with this draft model (a Hugging Face directory sharing the "
                           "model's tokenizer): its guesses are verified in the batch, so greedy output is "
                           "unchanged and sampled output keeps its law (default: no drafting)")
    spec.add_argument("--ngram-draft", action="store_true",
                      help="speculative decoding with n-gram lookup: guess each job's next tokens from what "
                           "followed its current suffix earlier in its prompt and output, no draft model (default: off)")
    p.add_argument("--num-draft-tokens", type=int, default=4,
                   help="most draft tokens per job and step; fewer are verified where they do not pay (default: 4)")


CACHE_MODE_CHOICES = ("auto", "fp32", "bf16", "fp16", "q8", "q6", "q4")    # engine.cache.CACHE_MODES + auto
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _memory_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or 1.5GB, got {text!r}")
    try:
        size = int(float(m.group(1)) * _UNITS[unit])
    except OverflowError:
        raise argparse.ArgumentTypeError(f"cache size {text!r} is out of range") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"a cache size must be at least one byte, got {text!r}")
    return size


def _cache_modes(text: str) -> list[str]:
    """'q4' -> ['q4']; 'fp32,q8,q4' -> a sweep over those modes, in that order."""
    modes = [m.strip() for m in text.split(",")]
    bad = [m for m in modes if m not in CACHE_MODE_CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown cache mode {bad[0]!r}; choose from {', '.join(CACHE_MODE_CHOICES)} "
                                         "(a sweep: a comma-separated list such as fp32,q8,q6,q4)")
    if len(modes) > 1 and "auto" in modes:
        raise argparse.ArgumentTypeError("a sweep names its cache modes; 'auto' cannot be one of them")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a cache mode is named twice in {text!r}")
    return modes


def _batch_size(text: str) -> Optional[int]:
    if text == "auto" or text.startswith("auto:"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="base seed (default: 0)")
    p.add_argument("--output-dir", "--output_path", dest="output_dir",
                   help="run directory (default: runs/<task>-<model name>)")
    p.add_argument("--overwrite", action="store_true",
                   help="discard an existing run in --output-dir (default: off, resume it)")
    p.add_argument("--flush-rows", type=int, default=256, help="write a result part every N rows (default: 256)")
    p.add_argument("--flush-seconds", type=float, default=30.0,
                   help="... or every T seconds, whichever comes first (default: 30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: show it)")
    p.add_argument("--shard", metavar="K/N",
                   help="run only shard K of N (0-based): the selection's work units (an MMLU subject or a chunk "
                        "of one, all samples of a HumanEval problem), balanced by estimated tokens, the same on "
                        "every machine; into its own run directory (default OUTPUT_DIR: the usual one with "
                        "-shard-K-of-N appended). Combine the N directories with `evalrun merge` (default: "
                        "the whole selection)")
    p.add_argument("--on-nonfinite", choices=("error", "flag"), default="error",
                   help="when the model's logits at a scored position hold NaN or Inf: 'error' stops the run "
                        "naming the first such question or sample (exit 1, the rows before it kept); 'flag' "
                        "records it as wrong with nonfinite_logits=true and goes on (default: error)")
    add_ray_args(p)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true",
                   help="compute the run on Ray replicas, each loading the model once and pulling work units "
                        "(prefix groups kept together) as it finishes; this process alone writes the run "
                        "directory, which resumes like any other. Needs `pip install evalrun[ray]` (default: off)")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="join this running Ray cluster (host:port, ray://host:port or auto) instead of starting "
                        "a local Ray instance for the run (default: a local instance, stopped at the end)")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="model replicas (Ray actors) to run; required with --ray (no default)")
    p.add_argument("--gpus-per-replica", type=float, metavar="G",
                   help="GPUs each replica asks Ray for (default: 1 with --device cuda, else 0)")
    p.add_argument("--cpus-per-replica", type=float, metavar="C",
                   help="CPUs each replica asks Ray for; also its torch threads (default: 1)")
    p.add_argument("--ray-timeout", type=float, metavar="SECONDS",
                   help="the longest a replica may take to start, or stay silent while running a parcel, "
                        "before it is killed and its work re-queued (default: 600)")
    p.add_argument("--ray-batch-rows", type=int, metavar="N",
                   help="rows a replica sends back at once, or what it has after a second (default: 32)")



def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare finished runs question by question, with paired statistics",
                       description="Align runs of one task by question and report, per group and overall, each "
                                   "run's metric with its standard error and, against the baseline, the paired "
                                   "delta with its confidence interval, the exact McNemar p-value (paired "
                                   "bootstrap for HumanEval with several samples) and the questions that flipped "
                                   "each way. Questions not in every run are counted and left out.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories of one task")
    p.add_argument("--baseline", metavar="RUN_DIR",
                   help="the run the others are compared with (default: the first RUN_DIR; added when not listed)")
    p.add_argument("--by", help="groups: subject, category (MMLU) or none (default: category for MMLU, "
                                "none for HumanEval)")
    p.add_argument("--format", default="table", choices=FORMATS,
                   help="table, markdown, csv, json, or html (one self-contained file) (default: table)")
    p.add_argument("--output", metavar="FILE", help="write there instead of standard output (default: stdout)")
    _stats_args(p)


def add_regress_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("regress", help="nightly gate: exit 1 when the candidate's metric dropped significantly",
                       description="Exit 1 only when the candidate's overall metric is at least --max-drop points "
                                   "below the baseline's AND the paired test finds the drop significant at "
                                   "--alpha; else 0; 2 on bad input. Every group's change is printed with "
                                   "Holm-adjusted p-values (reported, not gating).")
    p.add_argument("--baseline", required=True, metavar="RUN",
                   help="last known good run directory (required, no default)")
    p.add_argument("--candidate", required=True, metavar="RUN", help="run directory to check (required, no default)")
    p.add_argument("--max-drop", type=float, default=1.0,
                   help="points (percent of questions) the overall metric may drop before it can fail (default: 1.0)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the drop (default: 0.05)")
    p.add_argument("--by", help="groups to print: subject, category (MMLU) or none (default: subject for MMLU, "
                                "none for HumanEval)")
    _stats_args(p, "1 - alpha")


def _stats_args(p: argparse.ArgumentParser, level_help: str = "0.95") -> None:
    p.add_argument("--level", type=float, default=None,
                   help=f"confidence level of the intervals (default: {level_help})")
    p.add_argument("--allow-different-data", action="store_true",
                   help="compare runs whose data fingerprints differ (default: refuse: the same key may be "
                        "another question)")
    p.add_argument("--n-boot", type=int, default=10000,
                   help="bootstrap resamples, for HumanEval with several samples per problem (default: 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")


def add_merge_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="combine the run directories of `--shard K/N` runs into one run",
                       description="Combine the N shard directories of one `evalrun mmlu|humaneval --shard K/N` "
                                   "job array into one ordinary run directory, the same as a single-process run "
                                   "of the whole selection: `evalrun show`, `compare` and a resume treat it so. "
                                   "Refused (exit 2) when the shards differ in task, settings, model or data "
                                   "(the message names the difference), when a shard is missing, given twice "
                                   "or unfinished, or when a row is stored in two shards.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="the shard run directories, in any order")
    p.add_argument("--output-dir", "--output_path", dest="output_dir", required=True,
                   help="the merged run directory (required, no default)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in a non-empty --output-dir (default: off, refuse it)")


def add_suite_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("suite", help="run the tasks x models x cache modes of a TOML file, compare, gate",
                       description="Run every task x model x cache mode that FILE.toml lists, each into "
                                   "<output_dir>/<task>/<model>/<cache mode>/ (resumable: a rerun computes only "
                                   "what is missing), then print and write one combined table "
                                   "(comparison.md/.csv/.json in output_dir); with a [baseline] section, gate "
                                   "like `evalrun regress` (exit 1 on a significant drop). Schema: docs/compare-and-regress.md. "
                                   "Suites run whole tasks: --shard is for evalrun mmlu/humaneval.")
    p.add_argument("file", metavar="FILE.toml", help="the suite")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: show them)")
    add_ray_args(p)


class VersionAction(argparse.Action):
    """argparse's "version" action, but the line (a git call) is made only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help=kwargs.get("help", "print the version (and the git commit of a checkout) and exit"))

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        print(version_line())                       # stdout, as argparse's own version action
        parser.exit()
