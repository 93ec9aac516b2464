"""The `evalrun` command line: parse argv (evalrun/commands/parser.py), turn a task command's
arguments into a RunConfig once, and run the command; a user's mistake is one line and exit 2.
Error and warning lines name paths and data: they are printed through `terminal_safe`."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import warnings
from typing import Iterator, Optional, Sequence

from evalrun.commands.compare import run_compare, run_regress
from evalrun.commands.merge import run_merge
from evalrun.commands.parser import CACHE_MODE_CHOICES, build_parser, run_config
from evalrun.commands.show import run_show
from evalrun.commands.suite import run_suite
from evalrun.commands.sweep import run_sweep
from evalrun.commands.task import prepare
from evalrun.errors import BadInput, RunFailed, as_bad_input, as_out_of_memory
from evalrun.results.text import terminal_safe
from evalrun.run.config import RunConfig
from evalrun.scale.execute import execute
from evalrun.tasks.registry import runnable_specs, task_spec

__all__ = ["CACHE_MODE_CHOICES", "EXIT_BAD_INPUT", "EXIT_RUN_FAILED", "build_parser", "main"]

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1            # the run stopped on a fault found while running (errors.RunFailed)


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM (a scheduler's stop, `timeout`, `kill`) unwinds like Ctrl-C: the run's context
    managers flush buffered rows and end the sandbox processes before the process exits. The
    caller's handler is back when main() returns (main() may run inside a caller's process, whose
    later forks, multiprocessing's workers among them, must not inherit ours)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


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
        return f"evalrun {command}: warning: {terminal_safe(message, one_line=True)}\n"
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
    with _exit_on_sigterm(), _one_line_warnings(args.command):
        try:
            return _run(parser, args, list(argv) if argv is not None else sys.argv[1:])
        except SystemExit:
            if _signalled:                          # ray.wait re-raises a handler's exit as SystemExit(1)
                raise SystemExit(128 + _signalled[-1]) from None
            raise


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    try:
        return _command(parser, args, argv)
    except RunFailed as exc:
        print(f"evalrun {args.command}: error: {terminal_safe(exc, one_line=True)}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except Exception as exc:  # noqa: BLE001 - bad input becomes a message, the rest re-raises
        bad = exc if isinstance(exc, BadInput) else as_bad_input(exc)
        if bad is None:
            oom = as_out_of_memory(exc)
            if oom is None:
                raise
            print(f"evalrun {args.command}: error: {terminal_safe(oom, one_line=True)}", file=sys.stderr)
            return EXIT_RUN_FAILED
        print(f"evalrun {args.command}: error: {terminal_safe(bad, one_line=True)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    if args.command in {s.name for s in runnable_specs()}:
        return run_task(run_config(args, argv))
    if args.command == "show":
        return run_show(args)
    if args.command == "compare":
        return run_compare(args)
    if args.command == "regress":
        return run_regress(args)
    if args.command == "suite":
        return run_suite(args)
    if args.command == "merge":
        return run_merge(args, argv)
    parser.error(f"unknown command {args.command}")
    return EXIT_BAD_INPUT


def run_task(cfg: RunConfig) -> int:
    """`evalrun <task>`: one run, or (several cache modes) a sweep."""
    if cfg.sweep and task_spec(cfg.task).model_free(cfg.options) is None:
        return run_sweep(cfg)
    return execute(prepare(cfg))


if __name__ == "__main__":
    raise SystemExit(main())
