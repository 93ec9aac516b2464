"""`evalrun show RUN_DIR`: a few stored rows with the prompt each was asked, for a person to read.

What a row holds came from a model or a dataset: everything is printed through `terminal_safe`
(evalrun/results/text.py), so a completion cannot drive the terminal."""
from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa

from evalrun.commands.compare import run_spec
from evalrun.errors import BadInput
from evalrun.results import inspect_run, read_prompt_messages, read_prompts, read_samples
from evalrun.results.text import terminal_safe
from evalrun.tasks.registry import task_specs
from evalrun.tasks.spec import TaskSpec

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
    spec = run_spec(run_dir, manifest)              # the checks compare makes: a task name, its keys
    if spec.show_row is None:
        known = " and ".join(s.name for s in task_specs() if s.show_row is not None)
        raise BadInput(f"{run_dir}: evalrun show knows {known} runs, not {spec.name}")
    rows = [r for r in _read_rows(run_dir, spec) if _wanted(r, args, spec.metric)]
    shown = [_show_row(run_dir, spec, row) for row in rows[: args.limit]]     # every row checked before printing
    prompts = {} if args.no_prompt else read_prompts(run_dir)
    chats = {} if args.no_prompt else read_prompt_messages(run_dir)
    _print(f"{run_dir}: {manifest['task']}, {len(rows)} matching row(s); showing {len(shown)}")
    for row, text in zip(rows, shown):
        _print(RULE)
        _print(text)
        if not args.no_prompt:
            _print(_prompt(prompts.get(row.get("prompt_hash")), chats.get(row.get("prompt_hash"))))
    return 0


def _print(text: str) -> None:
    print(terminal_safe(text))


def _prompt(text: Any, chat: Any) -> str:
    if isinstance(chat, dict) and isinstance(chat.get("messages"), list):
        return (f"prompt (chat, {len(chat['messages'])} messages through the model's template):\n"
                + _quoted(chat_transcript(chat)))
    if text is None:
        return "prompt: (not stored: a run made before prompts were kept)"
    return "prompt:\n" + _quoted(text)


def _quoted(text: Any) -> str:
    return textwrap.indent(str(text), "  | ", lambda line: True)


def chat_transcript(chat: dict[str, Any]) -> str:
    """A chat prompt for a person: each message under its role; then where the model's answer goes
    (its own turn, or the last assistant message it continues). Raw text: print it through
    `terminal_safe`."""
    parts = [f"[{m.get('role')}]\n{m.get('content')}" if isinstance(m, dict) else f"[?]\n{m}"
             for m in chat["messages"]]
    parts.append("[assistant] <- the model answers here" if chat.get("generation_prompt", True)
                 else "<- the model continues the last message")
    return "\n".join(parts)


def _read_rows(run_dir: Path, spec: TaskSpec) -> list[dict[str, Any]]:
    try:
        frame = read_samples(run_dir)
    except (KeyError, OSError, ValueError, pa.ArrowException) as exc:
        raise BadInput(f"{run_dir}: its sample rows cannot be read ({type(exc).__name__}: {exc})") from None
    scored = frame[~frame["skipped"].fillna(False).astype(bool)] if "skipped" in frame.columns else frame
    if len(scored) and spec.metric not in frame.columns:
        raise BadInput(f"{run_dir}: rows lack the {spec.name} metric column {spec.metric!r}")
    return frame.to_dict("records")


def _show_row(run_dir: Path, spec: TaskSpec, row: dict[str, Any]) -> str:
    assert spec.show_row is not None
    try:
        return spec.show_row(row)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        key = ", ".join(f"{k} {row.get(k)!r}" for k in spec.key_columns)
        raise BadInput(f"{run_dir}: the row at {key} cannot be shown as a {spec.name} row "
                       f"({type(exc).__name__}: {exc})") from None


def _wanted(row: dict[str, Any], args: argparse.Namespace, metric: str) -> bool:
    if args.subject is not None and row.get("subject") != args.subject:
        return False
    if args.task_id is not None and row.get("task_id") != args.task_id:
        return False
    if args.wrong:
        return not row.get("skipped") and not row.get(metric)
    return True
