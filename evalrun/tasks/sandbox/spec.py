"""The records at the sandbox boundary: what to run, under which limits, and the outcome."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Sequence

STATUSES = ("passed", "failed", "timeout", "error", "killed")


@dataclass(frozen=True)
class CheckSpec:
    """One check: `program` (untrusted) defines `entry_point`; `check_source` (trusted)
    defines `check(candidate)`, which is called with a proxy to that function. `names`: more of
    the program's global names the check may use; before `check` is called, each one the program
    bound is bound in the check source's globals too: a callable as a proxy that calls it in the
    worker, a standard-library module as that module (imported by the checker), a value the codec
    carries as its copy (anything else stays unbound)."""
    program: str
    check_source: str
    entry_point: str
    names: Sequence[str] = ()

    def __post_init__(self) -> None:
        for name in ("program", "check_source", "entry_point"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"CheckSpec.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if not self.entry_point.isidentifier():
            raise ValueError(f"CheckSpec.entry_point must be an identifier, got {self.entry_point!r}")
        if isinstance(self.names, (str, bytes)):
            raise TypeError("CheckSpec.names must be a sequence of names, not one string")
        object.__setattr__(self, "names", tuple(self.names))
        for name in self.names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"CheckSpec.names must hold identifiers, got {name!r}")


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 3.0          # seconds, wall clock of the whole check (worker + checker)
    memory_mb: int = 1024         # address space allowed above a fresh interpreter
    file_size_mb: int = 16        # largest file the program may write (RLIMIT_FSIZE)
    max_processes: int = 32       # RLIMIT_NPROC of the sandbox uid
    output_bytes: int = 1 << 20   # stdout + stderr of the program; beyond it the check is killed

    def __post_init__(self) -> None:
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) \
                or not math.isfinite(self.timeout) or self.timeout <= 0:
            raise ValueError(f"SandboxLimits.timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        for f in fields(self):
            if f.name == "timeout":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxLimits.{f.name} must be an int >= 1, got {value!r}")

    @property
    def cpu_seconds(self) -> int:
        """RLIMIT_CPU soft limit of the worker (SIGXCPU); the hard limit is one more."""
        return math.ceil(self.timeout) + 1


@dataclass(frozen=True)
class ExecResult:
    status: str                   # one of STATUSES
    exec_time: float              # seconds, wall clock of the check
    error: Optional[str] = None   # last line of the error; None when passed

    @property
    def passed(self) -> bool:
        return self.status == "passed"
