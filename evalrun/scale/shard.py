"""`--shard K/N`: one deterministic shard of a task's work units, run into its own run directory
(a Slurm or Kubernetes job array), later combined by `evalrun merge`.

    parse_shard("1/3") ──► ShardSpec(1, 3)
    take_shard(task, spec) ──► TaskShard: the task restricted to shard 1's units (its summary covers
                               them), manifest["shard"], and the identity entries that make a shard
                               directory resumable only as that shard of that selection

A shard's identity is the whole run's plus SHARD_IDENTITY_KEYS; a merged run drops them again.
"""
from __future__ import annotations

import json

import re
from dataclasses import dataclass
from typing import Any, Optional

from evalrun.errors import BadInput
from evalrun.scale.units import WorkUnit, assign_shards, shard_units, units_digest
from evalrun.tasks.base import Task

SHARD_IDENTITY_KEYS = ("shard", "shard_selection")       # in a shard's identity only
_SPEC = re.compile(r"(\d+)/(\d+)")


@dataclass(frozen=True)
class ShardSpec:
    index: int                          # K, 0-based
    count: int                          # N

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise BadInput(f"--shard K/N needs N >= 1 and 0 <= K < N (shards are numbered from 0), "
                           f"got {self.index}/{self.count}")

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def dir_suffix(self) -> str:
        """The default run directory's suffix, e.g. "-shard-1-of-3"."""
        return f"-shard-{self.index}-of-{self.count}"


def parse_shard(text: Optional[str]) -> Optional[ShardSpec]:
    """'1/3' -> ShardSpec(1, 3); None -> None; anything else is a BadInput naming --shard."""
    if text is None:
        return None
    m = _SPEC.fullmatch(text)
    if not m:
        raise BadInput(f"--shard must be K/N, two whole numbers with 0 <= K < N (e.g. 0/3), got {text!r}")
    return ShardSpec(int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True)
class TaskShard:
    spec: ShardSpec
    task: Task                          # restricted to this shard's documents
    units: list[WorkUnit]               # this shard's, in task order
    selection: dict[str, Any]           # the whole selection: sha256, docs, units, groups (in task order)

    def identity(self) -> dict[str, str]:
        return {"shard": self.spec.label, "shard_selection": self.selection["sha256"][:16]}

    def record(self) -> dict[str, Any]:
        """manifest["shard"]; "keys" are its documents' row keys, which `evalrun merge` holds its rows to (one
        compact JSON string: a full MMLU shard's 14,042 keys stay one line of the manifest)."""
        keys = [list(k) for u in self.units for k in u.doc_keys]
        return {"index": self.spec.index, "count": self.spec.count, "units": [u.key for u in self.units],
                "docs": sum(len(u.doc_keys) for u in self.units), "selection": self.selection,
                "keys": json.dumps(keys, separators=(",", ":"))}


def take_shard(task: Task, spec: ShardSpec) -> TaskShard:
    """Shard spec.index of the task's units for spec.count shards. BadInput when that shard would
    be empty (fewer units than shards)."""
    units = shard_units(task, spec.count)
    mine = assign_shards(units, spec.count)[spec.index]
    if not mine:
        raise BadInput(f"--shard {spec.label}: this selection makes only {len(units)} work unit(s), so shard "
                       f"{spec.index} would be empty; use at most {len(units)} shards")
    selection = {"sha256": units_digest(units), "docs": sum(len(u.doc_keys) for u in units), "units": len(units),
                 "groups": list(dict.fromkeys(u.group for u in units))}
    keys = [k for u in mine for k in u.doc_keys]
    return TaskShard(spec, task.restricted(keys), mine, selection)


def shard_suffix(text: Optional[str]) -> str:
    """The default run directory's suffix for --shard `text` ("" without one)."""
    spec = parse_shard(text)
    return spec.dir_suffix if spec else ""
