"""The prompts table of a run: each distinct prompt's full text once, keyed by `prompt_hash`
(rows carry only the hash).

    <run_dir>/prompts/part-000000-1a2b3c4d.parquet    prompt_hash, prompt (one part per session)

Parts are written atomically before the rows that reference them, so every stored row's
prompt is on disk; a hash stored twice keeps its first text.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Mapping

import pyarrow as pa

from evalrun.results.atomic import atomic_write_parquet, fsync_dir
from evalrun.results.parts import list_parts, next_seq, read_part
from evalrun.results.schema import PROMPTS_DIR, part_name


def write_prompts(run_dir: str | Path, prompts: Mapping[str, str]) -> int:
    """Store the prompts whose hash is not stored yet; returns how many were new."""
    folder = Path(run_dir) / PROMPTS_DIR
    known = set(read_prompts(run_dir))
    new = {h: text for h, text in prompts.items() if h not in known}
    if not new:
        return 0
    folder.mkdir(exist_ok=True)
    table = pa.table({"prompt_hash": list(new), "prompt": list(new.values())})
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
