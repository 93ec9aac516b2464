"""A replica of a `--ray` run: one process that loads the model once, keeps its own DynamicGenerator
(and prompt cache) across parcels, and streams each parcel's rows back in small batches.

    Replica(spec, slot, instance).start()  ──► {"pid", "node", "fits", "max_seq_len", "setup"}
    Replica.run(doc_keys)  (a Ray streaming generator)
        a thread: task.restricted(doc_keys).plan() ──► run_task ──► queue: ("prompts", ..), ("row", ..) ...
        stream(queue) ──► {"rows": [...], "prompts": {...}} every batch_rows rows or batch_seconds,
                          {"rows": []} as a heartbeat when nothing happened for heartbeat_seconds,
                          last {"rows": [...], "done": generator counters} or {..., "error": "Type: message"}

Nothing here imports Ray at module level: EvalWorker and stream() run and are tested in-process.
Rows leave without the run's row_base (run_id, task, cache_mode): the driver adds it.
"""
from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from evalrun.run.common import load_model, make_generator
from evalrun.run.engine_config import EngineConfig
from evalrun.run.runner import run_task
from evalrun.tasks.base import Answer, DocPlan, Task
from evalrun.tasks.spec import TaskContext

Put = Callable[[tuple[str, Any]], None]
EVALRUN_TEST_FAIL = "test hook: this document fails on every replica:"
# What must be open on a replica while it runs (HumanEval --execute-on replica: its sandbox): the task's
# context, travelling pickled, opened after the model has loaded; it yields what to report (the isolation).
ReplicaSetup = TaskContext


class Worker(Protocol):
    def info(self) -> dict[str, Any]: ...

    def run(self, doc_keys: tuple[tuple, ...], put: Put) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs, sent once (pickled) to every replica."""
    cfg: EngineConfig
    model_dir: str
    task: Task                              # the run's selection; a parcel restricts it to its documents
    threads: int = 1                        # torch threads (--cpus-per-replica)
    generate_only: bool = False             # rows leave before execution: the driver executes them
    setup: Optional[ReplicaSetup] = None
    on_nonfinite: str = "error"
    batch_rows: int = 32
    batch_seconds: float = 1.0
    heartbeat_seconds: float = 5.0

    def open(self) -> Worker:
        return EvalWorker(self)


@dataclass(frozen=True)
class ReplicaHooks:
    """Tests only, from the driver's environment (evalrun/scale/ray_run.py replica_hooks()):
    EVALRUN_TEST_PAUSE_REPLICA=ROWS:PIDFILE: the first replica to have sent `pause_rows` rows of one
    parcel creates `pidfile`, writes its pid there and stops streaming (it sleeps), so a test can
    SIGKILL it mid-parcel; the others, and it after a restart, find the file and go on.
    EVALRUN_TEST_REPLICA_DELAY=SECONDS: every replica sleeps that long after each message it sends
    (a tiny model is done before the second replica has started).
    EVALRUN_TEST_FAIL_DOC=JSON key: a parcel holding that document raises on every replica."""
    pause_rows: Optional[int] = None
    pidfile: str = ""
    delay: float = 0.0
    fail_doc: Optional[tuple] = None


class GenerateOnly:
    """A task whose rows leave before their execution (HumanEval --execute-on driver)."""

    def __init__(self, task: Any):
        self.task = task
        self.name, self.key_columns = task.name, task.key_columns
        self.progress_metric = getattr(task, "progress_metric", "correct")

    def score(self, plan: DocPlan, answers: list[Answer]) -> dict[str, Any]:
        return self.task.generated(plan, answers)


class EvalWorker:
    """The model, its generator and the task, loaded once per replica process."""

    def __init__(self, spec: ReplicaSpec):
        torch.set_num_threads(max(1, spec.threads))
        self.spec = spec
        model, self.tokenizer = load_model(spec.cfg, Path(spec.model_dir))
        self.generator = make_generator(spec.cfg, model, self.tokenizer)
        self.max_seq_len = model.max_seq_len
        self.fits = min(model.max_seq_len, self.generator.cache.max_tokens)
        self._open = contextlib.ExitStack()
        self.setup_info = self._open.enter_context(spec.setup.open(spec.task)) if spec.setup else None

    def info(self) -> dict[str, Any]:
        return {"fits": self.fits, "max_seq_len": self.max_seq_len, "setup": self.setup_info}

    def run(self, doc_keys: tuple[tuple, ...], put: Put) -> dict[str, Any]:
        task = self.spec.task.restricted(doc_keys)
        plans = list(task.plan(self.tokenizer, self.fits))
        put(("prompts", {p.info["prompt_hash"]: p.prompt for p in plans if p.prompt is not None}))
        scoring = GenerateOnly(task) if self.spec.generate_only else task
        run_task(scoring, self.generator, plans, lambda row: put(("row", row)), {}, progress=False,
                 on_nonfinite=self.spec.on_nonfinite)
        return dict(self.generator.stats())

    def close(self) -> None:
        self._open.close()


def stream(items: "queue.Queue[tuple[str, Any]]", batch_rows: int, batch_seconds: float,
           heartbeat_seconds: float) -> Iterator[dict[str, Any]]:
    """The messages of one parcel from its worker's queue (see the module's diagram)."""
    rows: list[dict[str, Any]] = []
    prompts: dict[str, str] = {}
    first: Optional[float] = None                 # when the oldest waiting row arrived
    last_sent = time.monotonic()
    while True:
        now = time.monotonic()
        wait = heartbeat_seconds - (now - last_sent) if first is None else batch_seconds - (now - first)
        try:
            kind, value = items.get(timeout=max(0.0, wait))
        except queue.Empty:
            kind, value = "flush", None
        if kind == "prompts":
            prompts.update(value)
            continue
        if kind == "row":
            rows.append(value)
            first = first if first is not None else time.monotonic()
            if len(rows) < batch_rows:
                continue
        message: dict[str, Any] = {"rows": rows, "prompts": prompts}
        if kind in ("done", "error"):
            yield {**message, kind: value}
            return
        yield message
        rows, prompts, first, last_sent = [], {}, None, time.monotonic()


class Replica:
    """The Ray actor (made with ray.remote by evalrun/scale/ray_backend.py)."""

    def __init__(self, spec: Any, slot: int, instance: int, hooks: Optional[ReplicaHooks] = None):
        self.spec, self.slot, self.instance, self.hooks = spec, slot, instance, hooks
        self.worker: Optional[Worker] = None

    def start(self) -> dict[str, Any]:
        import ray
        self.worker = self.spec.open()
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), **self.worker.info()}

    def run(self, doc_keys: tuple[tuple, ...]) -> Iterator[dict[str, Any]]:
        items: queue.Queue[tuple[str, Any]] = queue.Queue()
        threading.Thread(target=self._work, args=(doc_keys, items.put), daemon=True).start()
        sent = 0
        for message in stream(items, self.spec.batch_rows, self.spec.batch_seconds, self.spec.heartbeat_seconds):
            yield message
            sent += len(message["rows"])
            if self.hooks is not None and "done" not in message and "error" not in message:
                time.sleep(self.hooks.delay)
                self._maybe_pause(self.hooks, sent)

    def _work(self, doc_keys: tuple[tuple, ...], put: Put) -> None:
        assert self.worker is not None
        try:
            if self.hooks is not None and self.hooks.fail_doc in doc_keys:
                raise RuntimeError(f"{EVALRUN_TEST_FAIL} {self.hooks.fail_doc}")
            put(("done", self.worker.run(doc_keys, put)))
        except BaseException as exc:  # noqa: BLE001 - sent to the driver, which retries the parcel elsewhere
            traceback.print_exc(file=sys.stderr)
            put(("error", f"{type(exc).__name__}: {exc}"))

    def _maybe_pause(self, hooks: ReplicaHooks, sent: int) -> None:
        if hooks.pause_rows is None or sent < hooks.pause_rows:
            return
        try:
            fd = os.open(hooks.pidfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return                                # another replica paused first
        time.sleep(0.5)                           # let the rows sent reach the driver
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        while True:
            time.sleep(3600)
