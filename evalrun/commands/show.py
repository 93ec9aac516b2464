"""`evalrun show RUN_DIR`: a few stored rows with the prompt each was asked, for a person to read."""
from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any, Callable

from evalrun.errors import BadInput
from evalrun.results import inspect_run, read_prompts, read_samples

RULE = "-" * 78


def run_show(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if args.limit < 1:
        raise BadInput(f"--limit must be >= 1, got {args.limit}")
    if not run_dir.is_dir():
        raise BadInput(f"run directory not found: {run_dir}")
    manifest = inspect_run(run_dir)
    if manifest is None:
        raise BadInput(f"{run_dir} holds no run (no manifest.json)")
    task = manifest.get("task")
    if task not in _FORMATS:
        raise BadInput(f"{run_dir}: evalrun show knows mmlu and humaneval runs, not {task!r}")
    rows = [r for r in _read_rows(run_dir) if _wanted(r, args)]
    prompts = {} if args.no_prompt else read_prompts(run_dir)
    print(f"{run_dir}: {task}, {len(rows)} matching row(s); showing {min(len(rows), args.limit)}")
    for row in rows[: args.limit]:
        print(RULE)
        print(_FORMATS[task](row))
        if not args.no_prompt:
            text = prompts.get(row.get("prompt_hash"))
            print("prompt:" if text is not None else "prompt: (not stored: a run made before prompts were kept)")
            if text is not None:
                print(textwrap.indent(text, "  | ", lambda line: True))
    return 0


def _read_rows(run_dir: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    try:
        return read_samples(run_dir).to_dict("records")
    except (KeyError, OSError, ValueError, pa.ArrowException) as exc:
        raise BadInput(f"{run_dir}: its sample rows cannot be read ({type(exc).__name__}: {exc})") from None


def _wanted(row: dict[str, Any], args: argparse.Namespace) -> bool:
    if args.subject is not None and row.get("subject") != args.subject:
        return False
    if args.task_id is not None and row.get("task_id") != args.task_id:
        return False
    if args.wrong:
        return not row.get("skipped") and not (row.get("correct") or row.get("passed"))
    return True


def _mmlu(row: dict[str, Any]) -> str:
    head = f"{row['subject']} #{row['doc_id']}"
    if row.get("skipped"):
        return f"{head}: skipped ({row.get('skip_reason')})"
    logprobs = row.get("choice_logprobs")
    scores = "  ".join(f"{L} {v:.3f}" for L, v in zip("ABCD", logprobs)) if logprobs is not None else "-"
    verdict = "correct" if row["correct"] else "wrong"
    return (f"{head}: predicted {row['prediction']}, target {row['target']} ({verdict}); "
            f"log-probs {scores}\nquestion: {row.get('question', '(not stored)')}")


def _humaneval(row: dict[str, Any]) -> str:
    head = f"{row['task_id']} sample {row['sample_idx']}"
    if row.get("skipped"):
        return f"{head}: skipped ({row.get('skip_reason')})"
    out = f"{head}: {row.get('exec_status')} ({row.get('stop_reason')}, {row.get('new_tokens')} new tokens)"
    if row.get("error"):
        out += f"\nerror: {row['error']}"
    return out + "\ncompletion:\n" + textwrap.indent(str(row.get("completion", "")), "  | ", lambda line: True)


_FORMATS: dict[str, Callable[[dict[str, Any]], str]] = {"mmlu": _mmlu, "humaneval": _humaneval,
                                                         "humaneval-score": _humaneval}
