"""Work units: a task's documents cut into pieces that keep shared prompt prefixes together,
and a deterministic balanced assignment of those pieces to N shards (`--shard K/N`; a Ray
driver can hand out the same units).

    task.prefix_groups()  ──► work_units(groups, max_unit_tokens) ──► [WorkUnit ...]  (task order)
        MMLU: a subject            a group larger than max_unit_tokens that the task lets be cut
        HumanEval: a problem's     (an MMLU subject, never a HumanEval problem) becomes consecutive
        n samples                  chunks "<key>#0", "<key>#1", ... of near-equal estimates
                               ──► assign_shards(units, n) ──► n lists of units (each in task order)

The chunking rule. Every chunk repeats the group's shared prefix (`shared` tokens) and carries its
own documents (`own` tokens in all). A divisible group whose estimate shared + own exceeds the cap
is cut into the fewest chunks that each fit under it, ceil(own / (cap - shared)), but never into
more chunks than documents, nor into more than own // shared, so that a chunk always carries at
least as many tokens of its own as the prefix it repeats (with MMLU's ~650-token 5-shot prefix a
subject is cut only when it is dozens of questions). The cuts fall where the running sum of the
documents' estimates crosses i * own / chunks, so where the fit decides the count a chunk exceeds
the cap by at most one document (where a limit decides it, chunks are larger than the cap).
For shards, the cap is ceil(total / (UNITS_PER_SHARD * n)): a quarter of a shard's fair share.

Estimates come from the task without a model or tokenizer (characters / 4, a generation's
--max-new-tokens), so every machine of a job array computes the same units and assignment.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import json
from dataclasses import dataclass, replace
from typing import Collection, Optional, Sequence

from evalrun.tasks.base import PrefixGroup, Task

UNIT_RULE = "prefix-groups/lpt-v1"      # hashed into a shard's selection: a changed rule refuses a merge
UNITS_PER_SHARD = 4                     # the size cap for shards: units of at most total / (4 n) tokens


@dataclass(frozen=True)
class WorkUnit:
    key: str                            # the group's key ("philosophy", "HumanEval/3"), "<key>#i" for a chunk
    group: str                          # the prefix group it belongs to
    doc_keys: tuple[tuple, ...]         # in the task's order
    est_tokens: int                     # the group's shared prefix plus these documents' own parts


def work_units(groups: Sequence[PrefixGroup], max_unit_tokens: Optional[int] = None) -> list[WorkUnit]:
    """The units of `groups` in their order; divisible groups above max_unit_tokens are chunked
    (see the module's rule). ValueError when two groups share a key."""
    if max_unit_tokens is not None and max_unit_tokens < 1:
        raise ValueError(f"max_unit_tokens must be >= 1, got {max_unit_tokens}")
    units = [u for g in groups for u in _cut(g, max_unit_tokens)]
    keys = [u.key for u in units]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two work units share the key {next(k for k in keys if keys.count(k) > 1)!r}")
    return units


def _chunk_count(group: PrefixGroup, cap: Optional[int]) -> int:
    if not group.divisible or cap is None or group.est_tokens <= cap:
        return 1
    own, n = sum(group.doc_tokens), len(group.doc_keys)
    room = cap - group.shared_tokens                               # own tokens a chunk may carry under the cap
    fit = -(-own // room) if room > 0 else n
    return max(1, min(fit, n, own // max(1, group.shared_tokens)))


def _cut(group: PrefixGroup, max_unit_tokens: Optional[int]) -> list[WorkUnit]:
    chunks = _chunk_count(group, max_unit_tokens)
    if chunks == 1:
        return [WorkUnit(group.key, group.key, group.doc_keys, group.est_tokens)]
    running = list(itertools.accumulate(group.doc_tokens))         # running[j]: docs 0..j
    own, n = running[-1], len(group.doc_keys)
    bounds = [0]
    for i in range(1, chunks):                                     # first doc past i/chunks of the tokens,
        cut = bisect.bisect_left(running, -(-i * own // chunks)) + 1   # leaving every chunk one doc at least
        bounds.append(min(max(cut, bounds[-1] + 1), n - (chunks - i)))
    bounds.append(n)
    return [WorkUnit(f"{group.key}#{i}", group.key, group.doc_keys[a:b],
                     group.shared_tokens + sum(group.doc_tokens[a:b]))
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def assign_shards(units: Sequence[WorkUnit], n: int) -> list[list[WorkUnit]]:
    """Longest-processing-time greedy: units by estimate, largest first (ties by key), each to the
    least loaded shard (ties to the lowest index); each shard's units come back in task order.

    NOTE: the heaviest shard's estimate exceeds the lightest's by at most the largest unit's:
    when the heaviest got its last unit it was the lightest."""
    if n < 1:
        raise ValueError(f"need at least one shard, got {n}")
    order = {u.key: i for i, u in enumerate(units)}
    loads = [(0, i) for i in range(n)]                               # a heap of (estimate, shard)
    shards: list[list[WorkUnit]] = [[] for _ in range(n)]
    for unit in sorted(units, key=lambda u: (-u.est_tokens, u.key)):
        load, i = heapq.heappop(loads)
        shards[i].append(unit)
        heapq.heappush(loads, (load + unit.est_tokens, i))
    return [sorted(s, key=lambda u: order[u.key]) for s in shards]


def shard_units(task: Task, n: int) -> list[WorkUnit]:
    """The task's units for n shards (max_unit_tokens = ceil(total / (UNITS_PER_SHARD * n)))."""
    groups = task.prefix_groups()
    total = sum(g.est_tokens for g in groups)
    return work_units(groups, max(1, -(-total // (UNITS_PER_SHARD * n))))


def units_digest(units: Sequence[WorkUnit]) -> str:
    """sha256 of the rule, the units and their documents: shards agree on it only when they were
    cut from the same selection by the same rule."""
    body = {"rule": UNIT_RULE, "units": [[u.key, [list(k) for k in u.doc_keys]] for u in units]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# -- parcels: what one replica of a Ray run is handed at a time ---------------------------------

PARCELS_PER_REPLICA = 4                 # the size cap for Ray: parcels of at most total / (4 n) tokens


@dataclass(frozen=True)
class Parcel:
    """Consecutive work units handed to one replica at once (a HumanEval problem alone would make a
    batch of n jobs); a lost replica's parcel comes back with only the documents still missing."""
    key: str                            # its first unit's key, "+<k>" when it packs k more
    units: tuple[str, ...]              # the work units' keys
    doc_keys: tuple[tuple, ...]         # in the task's order
    est_tokens: int

    def without(self, received: Collection[tuple]) -> "Parcel":
        """The same parcel less the documents in `received` (a retry)."""
        return replace(self, doc_keys=tuple(k for k in self.doc_keys if k not in received))


def pack_units(units: Sequence[WorkUnit], cap: int) -> list[Parcel]:
    """Consecutive units packed into parcels of at most `cap` estimated tokens (a unit above the cap
    makes a parcel alone); no unit is split, so shared prefixes stay on one replica."""
    packs: list[list[WorkUnit]] = []
    load = 0
    for unit in units:
        if packs and load + unit.est_tokens <= cap:
            packs[-1].append(unit)
            load += unit.est_tokens
        else:
            packs.append([unit])
            load = unit.est_tokens
    return [Parcel(p[0].key + (f"+{len(p) - 1}" if len(p) > 1 else ""), tuple(u.key for u in p),
                   tuple(k for u in p for k in u.doc_keys), sum(u.est_tokens for u in p)) for p in packs]


def replica_parcels(task: Task, replicas: int) -> tuple[list[Parcel], int]:
    """The task's parcels for `replicas` replicas, largest first (ties in task order), and the cap
    (ceil(total / (PARCELS_PER_REPLICA * replicas)) tokens) that cut and packed them."""
    if replicas < 1:
        raise ValueError(f"need at least one replica, got {replicas}")
    groups = task.prefix_groups()
    cap = max(1, -(-sum(g.est_tokens for g in groups) // (PARCELS_PER_REPLICA * replicas)))
    parcels = pack_units(work_units(groups, cap), cap)
    order = {p.key: i for i, p in enumerate(parcels)}
    return sorted(parcels, key=lambda p: (-p.est_tokens, order[p.key])), cap
