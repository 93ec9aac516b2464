"""`evalrun show RUN_DIR`: a few stored rows with the prompt each was asked, for a person to read."""
from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional

import pyarrow as pa

from evalrun.errors import BadInput
from evalrun.results import inspect_run, read_prompt_messages, read_prompts, read_samples
from evalrun.tasks.registry import task_specs, task_spec

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
    show_row = _formatter(str(task))
    if show_row is None:
        known = " and ".join(s.name for s in task_specs() if s.show_row is not None)
        raise BadInput(f"{run_dir}: evalrun show knows {known} runs, not {task!r}")
    metric = task_spec(str(task)).metric
    rows = [r for r in _read_rows(run_dir) if _wanted(r, args, metric)]
    prompts = {} if args.no_prompt else read_prompts(run_dir)
    chats = {} if args.no_prompt else read_prompt_messages(run_dir)
    print(f"{run_dir}: {task}, {len(rows)} matching row(s); showing {min(len(rows), args.limit)}")
    for row in rows[: args.limit]:
        print(RULE)
        print(show_row(row))
        if not args.no_prompt:
            text, chat = prompts.get(row.get("prompt_hash")), chats.get(row.get("prompt_hash"))
            if chat is not None:
                print(f"prompt (chat, {len(chat['messages'])} messages through the model's template):")
                print(textwrap.indent(chat_transcript(chat), "  | ", lambda line: True))
                continue
            print("prompt:" if text is not None else "prompt: (not stored: a run made before prompts were kept)")
            if text is not None:
                print(textwrap.indent(text, "  | ", lambda line: True))
    return 0


def chat_transcript(chat: dict[str, Any]) -> str:
    """A chat prompt for a person: each message under its role; then where the model's answer goes
    (its own turn, or the last assistant message it continues)."""
    parts = [f"[{m.get('role')}]\n{m.get('content')}" for m in chat["messages"]]
    parts.append("[assistant] <- the model answers here" if chat.get("generation_prompt", True)
                 else "<- the model continues the last message")
    return "\n".join(parts)


def _formatter(task: str) -> Optional[Callable[[dict[str, Any]], str]]:
    try:
        return task_spec(task).show_row
    except ValueError:
        return None


def _read_rows(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return read_samples(run_dir).to_dict("records")
    except (KeyError, OSError, ValueError, pa.ArrowException) as exc:
        raise BadInput(f"{run_dir}: its sample rows cannot be read ({type(exc).__name__}: {exc})") from None


def _wanted(row: dict[str, Any], args: argparse.Namespace, metric: str) -> bool:
    if args.subject is not None and row.get("subject") != args.subject:
        return False
    if args.task_id is not None and row.get("task_id") != args.task_id:
        return False
    if args.wrong:
        return not row.get("skipped") and not row.get(metric)
    return True
