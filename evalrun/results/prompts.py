"""The prompts table of a run: each distinct prompt's full text once, keyed by `prompt_hash`
(rows carry only the hash).

    <run_dir>/prompts/part-000000-1a2b3c4d.parquet    prompt_hash, prompt (one part per session)
                                                      [, messages: a chat prompt's turns, JSON]

A prompt rendered with a chat template also keeps the messages it was rendered from
([{"role", "content"}, ...] and whether the model's turn was opened for it), so `evalrun show`
prints roles instead of the template's special tokens.

Parts are written atomically before the rows that reference them, so every stored row's
prompt is on disk; a hash stored twice keeps its first text.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

import pyarrow as pa

from evalrun.results.atomic import atomic_write_parquet, fsync_dir
from evalrun.results.parts import list_parts, next_seq, read_part
from evalrun.results.schema import PROMPTS_DIR, part_name


def write_prompts(run_dir: str | Path, prompts: Mapping[str, str],
                  messages: Optional[Mapping[str, Any]] = None) -> int:
    """Store the prompts whose hash is not stored yet (with their chat messages where given, any
    JSON value); returns how many were new."""
    folder = Path(run_dir) / PROMPTS_DIR
    known = set(read_prompts(run_dir))
    new = {h: text for h, text in prompts.items() if h not in known}
    if not new:
        return 0
    folder.mkdir(exist_ok=True)
    columns = {"prompt_hash": list(new), "prompt": list(new.values())}
    if messages:
        columns["messages"] = [json.dumps(messages[h]) if h in messages else None for h in new]
    table = pa.table(columns)
    atomic_write_parquet(folder / part_name(next_seq(folder), uuid.uuid4().hex[:8]), table)
    fsync_dir(folder.parent)
    return len(new)


def read_prompts(run_dir: str | Path) -> dict[str, str]:
    """prompt_hash -> prompt text, over every readable part (first text per hash wins)."""
    out: dict[str, str] = {}
    for path in list_parts(Path(run_dir) / PROMPTS_DIR):
        table = read_part(path)
        if table is None:
            continue
        for h, text in zip(table.column("prompt_hash").to_pylist(), table.column("prompt").to_pylist()):
            out.setdefault(h, text)
    return out


def read_prompt_messages(run_dir: str | Path) -> dict[str, Any]:
    """prompt_hash -> the chat messages its prompt was rendered from (prompts without any left out)."""
    out: dict[str, Any] = {}
    for path in list_parts(Path(run_dir) / PROMPTS_DIR):
        table = read_part(path)
        if table is None or "messages" not in table.column_names:
            continue
        for h, text in zip(table.column("prompt_hash").to_pylist(), table.column("messages").to_pylist()):
            if text is not None:
                out.setdefault(h, json.loads(text))
    return out
