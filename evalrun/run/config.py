"""`RunConfig`: one `evalrun <task>` run as the command line asked for it, checked, frozen. The CLI
(evalrun/commands/cli.py) makes it from argv once; nothing below the CLI sees argparse. Sweeps and
suites derive each run's config with dataclasses.replace; Ray replicas receive the resolved records.

    RunConfig ── task, options      the registry's task and its options record (TaskSpec.options)
              ── model, engine      the model directory; EngineRequest: the engine flags, `auto` unresolved
              ── cache_modes        one mode, or several: a sweep (engine.cache_mode is the first)
              ── run directory      output_dir, overwrite, flush_rows/flush_seconds, shard, on_nonfinite
              ── ray                RayRequest: the --ray flags as given (ray_options() checks and resolves)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from evalrun.errors import BadInput
from evalrun.run.engine_config import EngineRequest

ON_NONFINITE = ("error", "flag")


@dataclass(frozen=True)
class RayRequest:
    """The --ray flags as given (None: not given)."""
    enabled: bool = False
    replicas: Optional[int] = None
    address: Optional[str] = None
    gpus_per_replica: Optional[float] = None
    cpus_per_replica: Optional[float] = None
    timeout: Optional[float] = None
    batch_rows: Optional[int] = None

    def given(self) -> list[str]:
        """The flags given besides --ray itself, by their command-line names."""
        flags = {"address": "--ray-address", "replicas": "--replicas", "gpus_per_replica": "--gpus-per-replica",
                 "cpus_per_replica": "--cpus-per-replica", "timeout": "--ray-timeout",
                 "batch_rows": "--ray-batch-rows"}
        return [flag for name, flag in flags.items() if getattr(self, name) is not None]


@dataclass(frozen=True)
class RayOptions:
    """The --ray settings, checked and resolved (evalrun/scale/ray_run.py ray_options)."""
    replicas: int
    address: Optional[str] = None           # None: a local instance for this run
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    timeout: float = 600.0
    batch_rows: int = 32
    execute_on: Optional[str] = None        # a task with a context (HumanEval): "driver" | "replica"

    def record(self) -> dict[str, Any]:
        out = {"address": self.address or "local", "replicas": self.replicas,
               "gpus_per_replica": self.gpus_per_replica, "cpus_per_replica": self.cpus_per_replica,
               "timeout": self.timeout, "batch_rows": self.batch_rows}
        return {**out, "execute_on": self.execute_on} if self.execute_on else out


@dataclass(frozen=True)
class RunConfig:
    task: str                                        # a registered task's name
    options: Any                                     # its options record
    model: Optional[str] = None                      # None: the embedded demo model
    engine: EngineRequest = field(default_factory=EngineRequest)
    cache_modes: tuple[str, ...] = ("auto",)         # more than one: a sweep, each mode a run of its own
    seed: int = 0
    output_dir: Optional[str] = None                 # None: runs/<task>-<model name>
    overwrite: bool = False
    flush_rows: int = 256
    flush_seconds: float = 30.0
    progress: bool = True
    shard: Optional[str] = None                      # "K/N"
    on_nonfinite: str = "error"
    ray: RayRequest = field(default_factory=RayRequest)
    argv: tuple[str, ...] = ()                       # the command line, for the manifest

    def __post_init__(self) -> None:
        if self.flush_rows < 1 or self.flush_seconds <= 0:
            raise BadInput("--flush-rows must be >= 1 and --flush-seconds > 0")
        if self.on_nonfinite not in ON_NONFINITE:
            raise BadInput(f"--on-nonfinite must be one of {', '.join(ON_NONFINITE)}, got {self.on_nonfinite!r}")
        if not self.cache_modes or self.engine.cache_mode != self.cache_modes[0]:
            raise BadInput("a run's cache mode must be the first of its cache modes")

    @property
    def sweep(self) -> bool:
        return len(self.cache_modes) > 1

    def one_mode(self, mode: str, output_dir: str) -> "RunConfig":
        """The run of one cache mode of a sweep or suite, into `output_dir`."""
        return replace(self, cache_modes=(mode,), engine=self.engine.for_mode(mode), output_dir=output_dir)
