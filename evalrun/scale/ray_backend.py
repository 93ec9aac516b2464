"""Ray under the dispatcher (evalrun/scale/dispatch.py's Backend): one actor per slot, one streaming call
per parcel; and the Ray instance: a local one started for the run and stopped after it, or a
running cluster joined at --ray-address (left running; our actors end with our connection).

    ray_instance(opts) ──► ray.init(...) ... ray.shutdown()
    RayBackend(spec, opts): start(slot) = a Replica actor + its start() call; submit = its run()
        poll(t) = ray.wait over every start ref and parcel stream, at most t seconds
        ActorDiedError & co (killed, OOM, node gone) ──► Lost; start() raising ──► StartFailed

NOTE: a local instance shares the driver's fate: Ray gives its head processes PR_SET_PDEATHSIG and
the workers end with their raylet, but its agents outlive a SIGKILLed driver by a minute or more,
so evalrun/scale/ray_watchdog.py ends them (tests/test_ray_run.py SIGKILLs the driver to check).
SIGTERM keeps the CLI's handler (SystemExit): actors killed, rows flushed, then Ray stopped.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from evalrun.errors import BadInput
from evalrun.run.config import RayOptions
from evalrun.scale.dispatch import Done, Event, Failed, Lost, Ready, Rows, StartFailed
from evalrun.scale.ray_actor import Replica, ReplicaHooks
from evalrun.scale.ray_watchdog import Watchdog, children_of

INSTALL_HINT = ("--ray needs Ray, an optional extra: pip install 'evalrun[ray]' (or pip install 'ray[default]'), "
                "on the driver and on every node of the cluster")
OBJECT_STORE_BYTES = 256 * 2**20         # a local instance's object store: row batches are small


def require_ray() -> Any:
    """The ray module, or BadInput saying how to install it."""
    try:
        import ray
    except ImportError:
        raise BadInput(INSTALL_HINT) from None
    return ray


@contextlib.contextmanager
def ray_instance(opts: RayOptions) -> Iterator[dict[str, Any]]:
    """Connected to Ray for the block: yields {"address", "resources"} (BadInput when it cannot be
    reached, or cannot hold one replica)."""
    ray = require_ray()
    ours = signal.getsignal(signal.SIGTERM)
    watchdog = None
    try:
        if opts.address is not None:
            _check_reachable(opts.address)
            ray.init(address=opts.address, logging_level=logging.WARNING)
        else:
            watchdog, before = Watchdog.start(), children_of(os.getpid())
            ray.init(num_cpus=math.ceil(opts.replicas * opts.cpus_per_replica),
                     num_gpus=None if opts.gpus_per_replica else 0, include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING)
            watchdog.watch(children_of(os.getpid()) - before - {watchdog.pid})
        if threading.current_thread() is threading.main_thread() and ours is not None:
            signal.signal(signal.SIGTERM, ours)     # ray.init's handler would exit before our `with` blocks unwind
        resources = ray.cluster_resources()
        _check_resources(opts, resources)
        yield {"address": opts.address or "local", "resources": {k: resources[k] for k in ("CPU", "GPU")
                                                                  if k in resources}}
    finally:
        ray.shutdown()
        if watchdog is not None:
            watchdog.close()


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A `host:port` address must answer a TCP connection (ray.init would retry for a minute)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise BadInput(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); start the cluster "
                       "(`ray start --head` on its head node) or give its address") from None


def _check_resources(opts: RayOptions, resources: dict[str, float]) -> None:
    for name, each in (("CPU", opts.cpus_per_replica), ("GPU", opts.gpus_per_replica)):
        have = resources.get(name, 0)
        if each > have and opts.address is None:
            flag = "--cpus-per-replica" if name == "CPU" else "--gpus-per-replica"
            raise BadInput(f"{flag} {each:g}: the local Ray instance has {have:g} {name}s, so no replica could "
                           "start; ask for fewer, or give --ray-address of a cluster that has them")


def _modules_by_value(spec: Any) -> list[Any]:
    """Modules the spec's task asks to travel by value in the replicas' pickle (its `modules_by_value()`)."""
    task = getattr(spec, "task", None)
    task = getattr(task, "task", task)             # GenerateOnly wraps the run's task
    return list(task.modules_by_value()) if hasattr(task, "modules_by_value") else []


@dataclass
class _Waiting:
    slot: int
    kind: str                                # "start" | "parcel"
    token: int
    waitable: Any                            # an ObjectRef, or the parcel's ObjectRefGenerator


class RayBackend:
    def __init__(self, spec: Any, opts: RayOptions, hooks: Optional[ReplicaHooks] = None):
        ray = require_ray()
        self._ray = ray
        self._actor_class = ray.remote(Replica).options(
            num_cpus=opts.cpus_per_replica, num_gpus=opts.gpus_per_replica, max_restarts=0, max_task_retries=0)
        for module in _modules_by_value(spec):     # e.g. lm-eval's `!function` hook files (LmEvalTask)
            ray.cloudpickle.register_pickle_by_value(module)
        self._spec = ray.put(spec)
        self._hooks = hooks
        self._actors: dict[int, Any] = {}
        self._instances: dict[int, int] = {}
        self._waiting: list[_Waiting] = []

    def __enter__(self) -> "RayBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, slot: int) -> None:
        if slot in self._actors:
            self.kill(slot)
        self._instances[slot] = self._instances.get(slot, -1) + 1
        actor = self._actor_class.remote(self._spec, slot, self._instances[slot], self._hooks)
        self._actors[slot] = actor
        self._waiting.append(_Waiting(slot, "start", 0, actor.start.remote()))

    def submit(self, slot: int, token: int, doc_keys: tuple[tuple, ...]) -> None:
        stream = self._actors[slot].run.options(num_returns="streaming").remote(doc_keys)
        self._waiting.append(_Waiting(slot, "parcel", token, stream))

    def poll(self, timeout: float) -> list[Event]:
        if not self._waiting:
            time.sleep(min(timeout, 0.05))
            return []
        waitables = [w.waitable for w in self._waiting]
        ready, _ = self._ray.wait(waitables, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self._ray.wait(waitables, num_returns=len(waitables), timeout=0)
        done = set(ready)                            # ObjectRefs hash by id; generators by identity
        events: list[Event] = []
        for entry in [w for w in self._waiting if w.waitable in done]:
            events += self._take(entry)
        return events

    def kill(self, slot: int) -> None:
        self._waiting = [w for w in self._waiting if w.slot != slot]
        actor = self._actors.pop(slot, None)
        if actor is not None:
            self._ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for slot in list(self._actors):
            self.kill(slot)

    def _take(self, entry: _Waiting) -> list[Event]:
        exc = self._ray.exceptions
        try:
            if entry.kind == "start":
                self._waiting.remove(entry)
                return [Ready(entry.slot, self._ray.get(entry.waitable))]
            message = self._ray.get(next(entry.waitable))
        except StopIteration:
            self._waiting.remove(entry)
            return []
        except exc.RayTaskError as err:             # start() raised, or the stream itself did
            self._drop(entry)
            cause = err.cause if err.cause is not None else err
            text = f"{type(cause).__name__}: {cause}".splitlines()[0]
            return [StartFailed(entry.slot, text) if entry.kind == "start" else Failed(entry.slot, entry.token, text)]
        except exc.RayError as err:                 # the actor is gone: killed, out of memory, node lost
            self._drop(entry)
            return [Lost(entry.slot, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")]
        events: list[Event] = [Rows(entry.slot, entry.token, message["rows"], message.get("prompts", {}))]
        if "done" in message:
            events.append(Done(entry.slot, entry.token, message["done"]))
        if "error" in message:
            events.append(Failed(entry.slot, entry.token, message["error"]))
        if len(events) > 1:
            self._waiting.remove(entry)
        return events

    def _drop(self, entry: _Waiting) -> None:
        if entry in self._waiting:
            self._waiting.remove(entry)
