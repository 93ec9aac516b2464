"""The scheduler of a `--ray` run, without Ray: parcels handed to N replicas as each frees up (fast
replicas take more), rows taken in as they stream back, lost replicas restarted and their
unfinished documents re-queued, every wait bounded by `Limits.timeout`.

    Dispatcher(backend, parcels, ...).run()
      each slot: backend.start(slot) ──► Ready | StartFailed | Lost | silence (killed after timeout)
      an idle slot ◄── the next parcel it may take: backend.submit(slot, token, doc_keys)
      Rows ──► rows of keys not seen before go to intake.add (the rest count as duplicates)
      Done ──► the slot is idle again (documents it sent no row for count as a failure)
      Failed (the parcel raised) | Lost (the process died or was killed, or said nothing for timeout)
           ──► the rows received stay; the missing documents are re-queued (a retry), or after
               max_attempts failures reported as failed; a lost slot restarts up to max_restarts
               times, then retires
      ──► DispatchReport: actors, retries, failed parcels, duplicates (the manifest's "ray" record)

The retry rule. A parcel goes to a replica it has not failed on while such a replica is alive; back
to one it failed on only when every live replica has. It fails for good after max_attempts
failures (default max(2, replicas): with one replica, its restarted actor gets a second try).
NOTE: events carry the token of their submission; those of an earlier submission are ignored.
"""
from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Protocol, Union

from evalrun.scale.units import Parcel


@dataclass(frozen=True)
class Ready:
    slot: int
    info: dict[str, Any]                    # what the replica says of itself: pid, node, ...


@dataclass(frozen=True)
class StartFailed:
    slot: int
    error: str                              # its start raised: a setting that cannot work there


@dataclass(frozen=True)
class Rows:
    slot: int
    token: int
    rows: list[dict[str, Any]]              # empty: a heartbeat
    prompts: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Done:
    slot: int
    token: int
    stats: dict[str, Any]                   # the replica's generator counters so far


@dataclass(frozen=True)
class Failed:
    slot: int
    token: int
    error: str                              # the parcel raised; the replica lives on


@dataclass(frozen=True)
class Lost:
    slot: int
    error: str                              # the replica's process is gone


Event = Union[Ready, StartFailed, Rows, Done, Failed, Lost]


class Backend(Protocol):
    def start(self, slot: int) -> None:
        """(Re)start the replica of `slot`; Ready, StartFailed or Lost follows."""

    def submit(self, slot: int, token: int, doc_keys: tuple[tuple, ...]) -> None:
        """Run these documents there; Rows follow, then Done, Failed or Lost."""

    def poll(self, timeout: float) -> list[Event]:
        """What has arrived, waiting at most `timeout` seconds for something."""

    def kill(self, slot: int) -> None:
        """End the replica of `slot`; nothing more arrives from it."""


class Intake(Protocol):
    def add(self, rows: list[dict[str, Any]], prompts: Mapping[str, str]) -> None: ...

    def tick(self) -> None:
        """Called on every turn of the loop (rows executed on the driver are stored here)."""


@dataclass(frozen=True)
class Limits:
    timeout: float = 600.0                  # a start, or a busy replica's silence, longer than this: killed
    max_restarts: int = 3                   # per slot, then it retires
    max_attempts: Optional[int] = None      # failures of one parcel before it is given up (max(2, replicas))
    tick: float = 1.0                       # the longest single poll


@dataclass
class _Slot:
    index: int
    state: str = "starting"                 # starting | idle | busy | retired
    instance: int = 0                       # 0, then one more per restart
    heard: float = 0.0                      # last heard from (or started, or handed a parcel)
    parcel: Optional[Parcel] = None
    token: int = 0
    record: dict[str, Any] = field(default_factory=dict)    # this instance's entry in DispatchReport.actors


@dataclass
class DispatchReport:
    parcels: int
    rows: int = 0                           # taken in (new keys)
    duplicates: int = 0                     # rows of keys already taken in, dropped
    actors: list[dict[str, Any]] = field(default_factory=list)     # one per replica instance
    retries: list[dict[str, Any]] = field(default_factory=list)    # one per parcel failure
    failed: list[dict[str, Any]] = field(default_factory=list)     # parcels given up
    stats: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)   # (slot, instance) -> counters

    def generator_totals(self) -> dict[str, int]:
        """Every instance's last counters, added up."""
        out: dict[str, int] = {}
        for stats in self.stats.values():
            for name, value in stats.items():
                if isinstance(value, (int, float)):
                    out[name] = out.get(name, 0) + value
        return out

    def record(self) -> dict[str, Any]:
        return {"parcels": self.parcels, "rows": self.rows, "duplicates_dropped": self.duplicates,
                "actors": self.actors, "retries": self.retries, "failed": self.failed}


def _stderr(line: str) -> None:
    print(f"ray: {line}", file=sys.stderr, flush=True)


class Dispatcher:
    def __init__(self, backend: Backend, parcels: list[Parcel], replicas: int, key_of: Callable[[dict], tuple],
                 intake: Intake, seen: Collection[tuple] = (), limits: Limits = Limits(),
                 clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] = _stderr):
        if replicas < 1:
            raise ValueError(f"need at least one replica, got {replicas}")
        self.backend, self.key_of, self.intake, self.limits = backend, key_of, intake, limits
        self.clock, self.log = clock, log
        self.queue: deque[Parcel] = deque(parcels)
        self.seen = set(seen)
        self.slots = [_Slot(i) for i in range(replicas)]
        self.max_attempts = limits.max_attempts or max(2, replicas)
        self.failed_on: dict[str, set[int]] = {}          # parcel key -> the slots it failed on
        self.failures: dict[str, int] = {}                 # parcel key -> its failures so far
        self.report = DispatchReport(len(parcels))
        self._tokens = itertools.count(1)
        self._last_loss = ""

    def run(self) -> DispatchReport:
        """Until every parcel is stored or given up; KeyboardInterrupt/SystemExit pass through (the
        caller ends the replicas)."""
        for slot in self.slots:
            self._start(slot)
        while self.queue or any(s.state == "busy" for s in self.slots):
            if all(s.state == "retired" for s in self.slots):
                self._abandon(f"no replica is left ({self._last_loss})")
                break
            for event in self.backend.poll(self._wait_time()):
                self._handle(event)
            self._check_silence()
            self._assign()
            self.intake.tick()
        return self.report

    # -- events ----------------------------------------------------------------------------

    def _handle(self, event: Event) -> None:
        slot = self.slots[event.slot]
        if isinstance(event, (Rows, Done, Failed)) and (slot.state != "busy" or slot.token != event.token):
            return                                          # from a submission given up already
        if isinstance(event, Ready):
            self._ready(slot, event.info)
        elif isinstance(event, StartFailed):
            self._retire(slot, f"could not start: {event.error}")
        elif isinstance(event, Rows):
            self._rows(slot, event)
        elif isinstance(event, Done):
            self._done(slot, event.stats)
        elif isinstance(event, Failed):
            self._parcel_failed(slot, event.error)
        elif isinstance(event, Lost):
            self._lost(slot, event.error)

    def _ready(self, slot: _Slot, info: dict[str, Any]) -> None:
        if slot.state != "starting":
            return
        took = self.clock() - slot.heard
        slot.record.update({**info, "start_seconds": round(took, 3)})
        slot.state, slot.heard = "idle", self.clock()
        where = ", ".join(f"{k} {info[k]}" for k in ("pid", "node") if k in info)
        self.log(f"replica {slot.index} ready ({where}) in {took:.1f} s")

    def _rows(self, slot: _Slot, event: Rows) -> None:
        slot.heard = self.clock()
        new = []
        for row in event.rows:
            key = self.key_of(row)
            if key not in self.seen:
                self.seen.add(key)
                new.append(row)
        self.report.duplicates += len(event.rows) - len(new)
        if new or event.prompts:
            self.intake.add(new, event.prompts)
        self.report.rows += len(new)
        slot.record["rows"] = slot.record.get("rows", 0) + len(new)

    def _done(self, slot: _Slot, stats: dict[str, Any]) -> None:
        assert slot.parcel is not None
        self.report.stats[(slot.index, slot.instance)] = stats
        missing = slot.parcel.without(self.seen).doc_keys
        if missing:
            self._parcel_failed(slot, f"finished without rows for {len(missing)} of its documents")
            return
        slot.record["parcels"] = slot.record.get("parcels", 0) + 1
        slot.state, slot.parcel = "idle", None

    def _lost(self, slot: _Slot, error: str) -> None:
        if slot.state == "retired":
            return
        if slot.state == "busy":
            self._parcel_failed(slot, error)
        slot.record["end"] = f"lost: {error}"
        self._last_loss = f"replica {slot.index}: {error}"
        if slot.instance >= self.limits.max_restarts:
            self._retire(slot, f"lost {slot.instance + 1} times, the last: {error}")
            return
        self.log(f"replica {slot.index} lost ({error}); restarting it ({slot.instance + 1} of "
                 f"{self.limits.max_restarts} restarts)")
        slot.instance += 1
        self._start(slot)

    def _parcel_failed(self, slot: _Slot, error: str) -> None:
        parcel = slot.parcel
        assert parcel is not None
        slot.state, slot.parcel = "idle", None
        rest = parcel.without(self.seen)
        tried = self.failed_on.setdefault(parcel.key, set())
        tried.add(slot.index)
        attempt = self.failures[parcel.key] = self.failures.get(parcel.key, 0) + 1
        outcome = ("nothing left to redo" if not rest.doc_keys else
                   "given up" if attempt >= self.max_attempts else "re-queued")
        self.report.retries.append({"parcel": parcel.key, "units": list(parcel.units), "slot": slot.index,
                                    "instance": slot.instance, "attempt": attempt, "error": error,
                                    "rows_kept": len(parcel.doc_keys) - len(rest.doc_keys),
                                    "docs_left": len(rest.doc_keys), "outcome": outcome})
        self.log(f"parcel {parcel.key} failed on replica {slot.index} (attempt {attempt} of {self.max_attempts}): "
                 f"{error}; {len(parcel.doc_keys) - len(rest.doc_keys)} rows kept, {len(rest.doc_keys)} {outcome}")
        if outcome == "given up":
            self.report.failed.append({"parcel": parcel.key, "units": list(parcel.units), "docs": len(rest.doc_keys),
                                       "attempts": attempt, "error": error})
        elif outcome == "re-queued":
            self.queue.appendleft(rest)

    # -- slots -----------------------------------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        slot.state, slot.heard, slot.parcel = "starting", self.clock(), None
        slot.record = {"slot": slot.index, "instance": slot.instance, "parcels": 0, "rows": 0}
        self.report.actors.append(slot.record)
        self.backend.start(slot.index)

    def _retire(self, slot: _Slot, why: str) -> None:
        slot.state = "retired"
        slot.record["end"] = why
        self._last_loss = f"replica {slot.index} {why}"
        self.log(f"replica {slot.index} retired: {why}")

    def _check_silence(self) -> None:
        now = self.clock()
        for slot in self.slots:
            if slot.state not in ("starting", "busy") or now - slot.heard < self.limits.timeout:
                continue
            self.backend.kill(slot.index)
            if slot.state == "starting":
                why = (f"did not start within {self.limits.timeout:g} s (the cluster may lack the resources a replica "
                       "asks for, or the model loads slowly: see --ray-timeout); killed")
            else:
                assert slot.parcel is not None
                why = (f"sent nothing for {self.limits.timeout:g} s while running parcel {slot.parcel.key}; "
                       "killed as hung")
            self._lost(slot, why)

    def _wait_time(self) -> float:
        now = self.clock()
        ends = [s.heard + self.limits.timeout - now for s in self.slots if s.state in ("starting", "busy")]
        return max(0.0, min([self.limits.tick, *ends]))

    def _assign(self) -> None:
        for slot in self.slots:
            if slot.state != "idle" or not self.queue:
                continue
            parcel = self._pick(slot)
            if parcel is None:
                continue
            slot.state, slot.parcel, slot.token, slot.heard = "busy", parcel, next(self._tokens), self.clock()
            self.backend.submit(slot.index, slot.token, parcel.doc_keys)

    def _pick(self, slot: _Slot) -> Optional[Parcel]:
        live = {s.index for s in self.slots if s.state != "retired"}
        for parcel in list(self.queue):
            tried = self.failed_on.get(parcel.key, set())
            if slot.index not in tried or live <= tried:
                self.queue.remove(parcel)
                rest = parcel.without(self.seen)
                if rest.doc_keys:
                    return rest
        return None

    def _abandon(self, why: str) -> None:
        for parcel in self.queue:
            self.report.failed.append({"parcel": parcel.key, "units": list(parcel.units),
                                       "docs": len(parcel.without(self.seen).doc_keys), "attempts": 0, "error": why})
        self.queue.clear()
