"""The `evalrun` command line. Task subcommands (MMLU, HumanEval) are planned."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from evalrun import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evalrun",
        description=(
            "Offline LLM evaluation harness on its own dynamic generator "
            "(paged KV cache, continuous batching, prefix dedup, prompt caching)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; returns the exit status."""
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
