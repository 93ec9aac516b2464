"""In-process stand-ins for the replicas of a `--ray` run (evalrun/scale/dispatch.py's Backend), for the
dispatcher's tests and the driver-only benchmark: every poll moves each busy replica one batch
forward on a clock of its own, and `Faults` makes chosen replica instances die, fail, hang,
repeat themselves or never start.

    backend = FakeBackend(make_row, batch_rows=4, faults=Faults(die_after={(0, 0): 3}))
    Dispatcher(backend, parcels, 2, key_of, intake, clock=backend.clock).run()

A replica instance is (slot, instance): instance 0 first, one more per restart. FakeSpec is a
ReplicaSpec without a model, for real Ray actors that stream mmlu_like_row()s at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from evalrun.scale.dispatch import Done, Event, Failed, Lost, Ready, Rows, StartFailed

Instance = tuple[int, int]


@dataclass
class Faults:
    die_after: dict[Instance, int] = field(default_factory=dict)   # sends this many rows, then its process dies
    fail_docs: frozenset = frozenset()      # a parcel reaching one of these documents raises, on every replica
    silent: set[Instance] = field(default_factory=set)             # takes a parcel, then is never heard from
    no_start: set[Instance] = field(default_factory=set)           # never becomes ready
    start_error: dict[int, str] = field(default_factory=dict)      # slot -> the error every start of it raises
    repeat: set[Instance] = field(default_factory=set)             # sends every batch twice
    slow: dict[int, int] = field(default_factory=dict)             # slot -> moves on only every k-th poll


class FakeBackend:
    def __init__(self, make_row: Callable[[tuple], dict[str, Any]], batch_rows: int = 4,
                 faults: Optional[Faults] = None, step: float = 0.01):
        self.make_row, self.batch_rows, self.faults, self.step = make_row, batch_rows, faults or Faults(), step
        self.now = 0.0
        self.instances: dict[int, int] = {}
        self.submitted: list[tuple[int, int, tuple]] = []   # (slot, instance, doc keys) in order
        self.killed: list[Instance] = []
        self._starting: list[int] = []
        self._busy: dict[int, tuple[int, list[tuple]]] = {}  # slot -> (token, documents left)
        self._sent: dict[Instance, int] = {}
        self._polls = 0

    def clock(self) -> float:
        return self.now

    def start(self, slot: int) -> None:
        self.instances[slot] = self.instances.get(slot, -1) + 1
        self._busy.pop(slot, None)
        self._starting.append(slot)

    def submit(self, slot: int, token: int, doc_keys: tuple[tuple, ...]) -> None:
        self._busy[slot] = (token, list(doc_keys))
        self.submitted.append((slot, self.instances[slot], tuple(doc_keys)))

    def kill(self, slot: int) -> None:
        self._busy.pop(slot, None)
        if slot in self._starting:
            self._starting.remove(slot)
        self.killed.append((slot, self.instances[slot]))

    def poll(self, timeout: float) -> list[Event]:
        self._polls += 1
        events = self._starts()
        for slot in sorted(self._busy):
            events += self._advance(slot)
        self.now += self.step if events else max(timeout, self.step)
        return events

    def _starts(self) -> list[Event]:
        events: list[Event] = []
        for slot in list(self._starting):
            if (slot, self.instances[slot]) in self.faults.no_start:
                continue
            self._starting.remove(slot)
            if slot in self.faults.start_error:
                events.append(StartFailed(slot, self.faults.start_error[slot]))
            else:
                events.append(Ready(slot, {"pid": 1000 + 10 * slot + self.instances[slot], "node": "fake"}))
        return events

    def _advance(self, slot: int) -> list[Event]:
        me = (slot, self.instances[slot])
        every = self.faults.slow.get(slot, 1)
        if me in self.faults.silent or self._polls % every:
            return []
        token, left = self._busy[slot]
        batch = left[: self.batch_rows]
        failing = next((i for i, k in enumerate(batch) if k in self.faults.fail_docs), None)
        budget = self.faults.die_after.get(me)
        sent = self._sent.get(me, 0)
        if failing is not None:
            batch = batch[:failing]
        if budget is not None and sent + len(batch) >= budget:
            batch = batch[: budget - sent]
        events: list[Event] = []
        if batch:
            rows = [self.make_row(k) for k in batch]
            events += [Rows(slot, token, rows)] * (2 if me in self.faults.repeat else 1)
            del left[: len(batch)]
            self._sent[me] = sent + len(batch)
        if budget is not None and self._sent.get(me, 0) >= budget:
            del self._busy[slot]
            return events + [Lost(slot, "SIGKILL (fake)")]
        if failing is not None:
            del self._busy[slot]
            return events + [Failed(slot, token, "ValueError: a document that fails everywhere")]
        if not left:
            del self._busy[slot]
            events.append(Done(slot, token, {"prompt_tokens": self._sent[me], "generated_tokens": 0}))
        return events


def mmlu_like_row(key: tuple) -> dict[str, Any]:
    """A row of an MMLU run's shape and size (less the driver's row_base)."""
    return {"subject": key[0], "doc_id": key[1], "question": "Which of the following best describes " + "x" * 200,
            "target": "B", "num_fewshot_used": 5, "prompt_hash": f"{hash(key) & (2**64 - 1):016x}",
            "prompt_tokens": 760, "cached_tokens": 640, "prediction": "B", "correct": True,
            "choice_logprobs": [-1.5, -0.4, -2.25, -3.0], "nonfinite_logits": False, "skipped": False}


@dataclass(frozen=True)
class FakeSpec:
    """evalrun/scale/ray_actor.py's Replica runs this like a ReplicaSpec: no model, rows at once."""
    batch_rows: int = 32
    batch_seconds: float = 1.0
    heartbeat_seconds: float = 5.0

    def open(self) -> "FakeWorker":
        return FakeWorker()


class FakeWorker:
    def info(self) -> dict[str, Any]:
        return {}

    def run(self, doc_keys: tuple[tuple, ...], put: Callable[[tuple[str, Any]], None]) -> dict[str, Any]:
        for key in doc_keys:
            put(("row", mmlu_like_row(key)))
        return {"prompt_tokens": 0}

    def close(self) -> None:
        pass
