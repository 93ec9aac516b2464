"""`evalrun merge RUN_DIR... --output-dir DIR`: the N directories of a `--shard K/N` job array
combined into one ordinary run directory, as if one process had run the whole selection.

    each RUN_DIR: a finished shard run (finalized, manifest["shard"]) holding all its units' rows
      ──► one task, key columns, shard count and identity but for SHARD_IDENTITY_KEYS (else exit 2
          naming the first difference and both values); shards 0..N-1 each once; every row's key
          one of its shard's own (manifest["shard"]["keys"]); no key twice
      ──► DIR: manifest.json (the whole run's identity, "merged_from"), one sample part per shard,
          samples.parquet, the prompts, summary.json/summary.parquet from the task's summary, and
          only then the manifest says finalized (a merge killed before that is redone by the same
          command, without --overwrite)

`evalrun show`, `compare`, `regress` and a resume of the whole run (the same command without
--shard, into DIR) treat DIR as a run made in one process. Rows are copied as stored: the
columns in PER_RUN_COLUMNS are the ones that may differ from a single-process run's.
"""
from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import pyarrow as pa

from evalrun.errors import BadInput
from evalrun.results import (NotARunDirError, RunDirBusyError, RunStore, environment_info, inspect_run,
                             read_prompt_messages, read_prompts, write_prompts, write_summary)
from evalrun.results.errors import RunReadError
from evalrun.results.manifest import utc_now
from evalrun.results.run_reader import finished_manifest, read_finished_rows
from evalrun.run.common import clean
from evalrun.scale.shard import SHARD_IDENTITY_KEYS
from evalrun.tasks.registry import runnable_specs, task_spec
from evalrun.tasks.spec import TaskSpec

# Row columns that legitimately differ from a single-process run's: the run that stored the row (a
# shard's run_id, listed in merged_from), prompt tokens found in the cache (what else was cached
# depends on the batch), and a program's execution time.
PER_RUN_COLUMNS = ("run_id", "cached_tokens", "exec_time")
# summary.json figures made of those, or of one session (a merged run has no session of its own)
PER_RUN_SUMMARY_KEYS = ("this_session", "mean_exec_time")
# Manifest fields of a shard's own store and sessions: not carried into the merged run.
SESSION_FIELDS = ("run_id", "cli_args", "environment", "start_time", "shard", "schema_version", "key_columns",
                  "status", "resumes", "finalized_at", "num_samples", "samples_sha256", "end_time", "throughput",
                  "wall_seconds")
_NEVER = float("inf")                    # flush_seconds: one part per shard, flushed by hand
_MISSING = "<missing>"



@dataclass(frozen=True)
class ShardRun:
    path: Path
    manifest: dict[str, Any]
    rows: pa.Table

    @property
    def index(self) -> int:
        return int(self.manifest["shard"]["index"])

    @property
    def count(self) -> int:
        return int(self.manifest["shard"]["count"])

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def run_merge(args: argparse.Namespace, argv: Sequence[str]) -> int:
    shards = [load_shard(Path(p)) for p in args.run_dirs]
    check_shards(shards)
    out = Path(args.output_dir)
    overwrite = args.overwrite or _unfinished_merge(out)
    _check_output_dir(out, shards, overwrite)
    rows, overall = write_merged(out, sorted(shards, key=lambda s: s.index), argv, overwrite)
    metric = task_spec(shards[0].manifest["task"]).aggregate
    value = overall.get(metric)
    shown = "-" if value is None or value != value else f"{value:.4f}"
    print(f"merged {len(shards)} shards ({len(rows)} rows) into {out}: {metric} {shown}; "
          f"see `evalrun show {out}`")
    return 0


def load_shard(path: Path) -> ShardRun:
    """A finished shard run, or BadInput naming the directory and what it is not."""
    try:
        manifest = finished_manifest(path)
        rows = read_finished_rows(path, manifest)
    except RunReadError as exc:
        raise BadInput(str(exc)) from None
    if not isinstance(manifest.get("shard"), dict):
        raise BadInput(f"{path}: not a shard run (made without --shard); merge combines the run directories of "
                       "`evalrun mmlu|humaneval --shard K/N`")
    if _spec(manifest) is None:
        known = " and ".join(s.name for s in runnable_specs())
        raise BadInput(f"{path}: evalrun merge knows {known} runs, not {manifest.get('task')!r}")
    return ShardRun(path, manifest, rows)


def _spec(manifest: dict[str, Any]) -> Optional[TaskSpec]:
    """The registry's entry of a shard run's task (a task that runs, so it has a summary)."""
    try:
        spec = task_spec(str(manifest.get("task")))
    except ValueError:
        return None
    return spec if spec.summarize is not None and manifest.get("task") == spec.name else None


def check_shards(shards: Sequence[ShardRun]) -> None:
    """BadInput unless the shards are exactly the N shards of one run, each complete, disjoint."""
    first = shards[0]
    for other in shards[1:]:
        _check_same_run(first, other)
    _check_shard_set(shards)
    for shard in shards:
        _check_own_keys(shard)
        docs = shard.manifest["shard"]["docs"]
        if shard.rows.num_rows != docs:
            raise BadInput(f"{shard.path} (shard {shard.label}) holds {shard.rows.num_rows} rows, but its units have "
                           f"{docs} documents: rerun its command to finish it")
    _check_disjoint(shards)


def _compared(shard: ShardRun) -> dict[str, Any]:
    """What must be equal between the shards of one run, in the order differences are named."""
    m = shard.manifest
    identity = {k: v for k, v in m.get("identity", {}).items() if k != "shard"}
    return {"task": m.get("task"), "key_columns": m.get("key_columns"), "shard count": shard.count, **identity}


def _check_same_run(a: ShardRun, b: ShardRun) -> None:
    mine, theirs = _compared(a), _compared(b)
    for name in list(mine) + [k for k in theirs if k not in mine]:
        x, y = mine.get(name, _MISSING), theirs.get(name, _MISSING)
        if x != y:
            hint = " (another --subjects, --limit or --n-samples)" if name == "shard_selection" else ""
            raise BadInput(f"shards differ in {name}{hint}: {_show(x)} ({a.path}) vs {_show(y)} ({b.path}); "
                           "merge only the shards of one run")


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f"{value[:12]}..." if len(value) > 24 else value
    return json.dumps(value)


def _check_shard_set(shards: Sequence[ShardRun]) -> None:
    seen: dict[int, ShardRun] = {}
    for shard in shards:
        if shard.index in seen:
            raise BadInput(f"shard {shard.label} is given twice: {seen[shard.index].path} and {shard.path}")
        seen[shard.index] = shard
    count = shards[0].count
    missing = [f"{i}/{count}" for i in range(count) if i not in seen]
    if missing:
        given = ", ".join(s.label for s in sorted(shards, key=lambda s: s.index))
        raise BadInput(f"shard(s) {', '.join(missing)} missing (given {given}): merge needs all {count} shards "
                       "of the run")


def _check_own_keys(shard: ShardRun) -> None:
    """BadInput naming the first row whose key is not one of the shard's own documents'."""
    declared = shard.manifest["shard"].get("keys")
    if declared is None:
        print(f"warning: {shard.path} (shard {shard.label}) was made before shards recorded their keys: its rows "
              "are checked by count and overlap only", file=sys.stderr)
        return
    try:
        own = {tuple(k) for k in (json.loads(declared) if isinstance(declared, str) else declared)}
    except (TypeError, ValueError):
        raise BadInput(f"{shard.path} (shard {shard.label}): its manifest's shard keys are unreadable") from None
    columns = shard.manifest["key_columns"]
    for key in zip(*(shard.rows.column(c).to_pylist() for c in columns)):
        if key not in own:
            raise BadInput(f"{shard.path} (shard {shard.label}) holds the row {dict(zip(columns, key))}, outside its "
                           "selection: remake that shard (its command with --overwrite)")


def _check_disjoint(shards: Sequence[ShardRun]) -> None:
    owner: dict[tuple, ShardRun] = {}
    for shard in shards:
        columns = shard.manifest["key_columns"]
        for key in zip(*(shard.rows.column(c).to_pylist() for c in columns)):
            if key in owner:
                raise BadInput(f"row {dict(zip(columns, key))} is stored in two shards: {owner[key].path} "
                               f"and {shard.path}")
            owner[key] = shard


def _unfinished_merge(out: Path) -> bool:
    """`out` holds a merge stopped before its manifest said finalized (killed): the merge is redone."""
    try:
        manifest = inspect_run(out)
    except (NotARunDirError, RunDirBusyError):
        return False                        # RunStore.open says why (a link, busy); not a run: "not empty"
    return (manifest is not None and manifest.get("status") != "finalized" and "merged_from" in manifest
            and not manifest.get("resumes"))


def _check_output_dir(out: Path, shards: Sequence[ShardRun], overwrite: bool) -> None:
    if any(out.resolve() == s.path.resolve() for s in shards):
        raise BadInput(f"--output-dir {out} is one of the shards being merged; merge into another directory")
    if out.exists() and not out.is_dir():
        raise BadInput(f"--output-dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise BadInput(f"--output-dir {out} is not empty; choose another directory, or pass --overwrite to "
                       "replace the run in it")


def merged_manifest(shards: Sequence[ShardRun], argv: Sequence[str]) -> dict[str, Any]:
    """The first shard's manifest less its sessions' fields, with the whole run's identity."""
    first = shards[0].manifest
    manifest = {k: v for k, v in first.items() if k not in SESSION_FIELDS}
    manifest["identity"] = {k: v for k, v in first["identity"].items() if k not in SHARD_IDENTITY_KEYS}
    sources = [{"path": str(s.path.resolve()), "run_id": s.manifest.get("run_id"),
                "shard": {k: s.manifest["shard"][k] for k in ("index", "count", "units")},
                "start_time": s.manifest.get("start_time"), "end_time": s.manifest.get("end_time"),
                "throughput": s.manifest.get("throughput")} for s in shards]
    return {**manifest, "run_id": uuid.uuid4().hex[:12], "cli_args": list(argv), "environment": environment_info(),
            "start_time": utc_now(), "merged_from": sources}


def write_merged(out: Path, shards: Sequence[ShardRun], argv: Sequence[str],
                 overwrite: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Write the merged run into `out` (shards in index order); returns its rows and overall summary."""
    first = shards[0].manifest
    with RunStore.open(out, merged_manifest(shards, argv), first["key_columns"], overwrite=overwrite,
                       flush_rows=sys.maxsize, flush_seconds=_NEVER) as store:
        prompts: dict[str, str] = {}
        messages: dict[str, Any] = {}
        for shard in shards:
            for digest, text in read_prompts(shard.path).items():
                prompts.setdefault(digest, text)
            for digest, chat in read_prompt_messages(shard.path).items():
                messages.setdefault(digest, chat)
        write_prompts(out, prompts, messages)            # before the rows that reference them
        for shard in shards:
            for row in shard.rows.to_pylist():
                store.add(row)
            store.flush()
        rows = store.merge_samples().to_dict("records")
        spec = task_spec(first["task"])
        assert spec.summarize is not None                # load_shard checked it
        if spec.summarize_merged is not None:
            per, overall = spec.summarize_merged(rows, first)
        else:
            per, overall = spec.summarize(rows, first["shard"]["selection"]["groups"])
        write_summary(out, clean(per), clean(overall))
        store.mark_finalized()                           # NOTE: after the summary (see RunStore)
        store.record_session(end_time=utc_now())
    return rows, overall
