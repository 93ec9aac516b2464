"""benchmarks/paired.py's check that a paused peer really is stopped (every thread of every process
in its process group), and benchmarks/common.py's --dtype auto, resolved through the engine's
choose_dtype."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks import common
from benchmarks.paired import PauseCheck, PairedPeer, alternate, median_ratio, round_pairs, thread_states
from evalrun.engine.auto import Choice

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A stand-in peer: a second process and two busy threads, all in the peer's process group
# (PairedPeer starts it in a session of its own); it speaks just enough of the protocol to start.
PEER = textwrap.dedent('''
    import subprocess, sys, threading
    subprocess.Popen([sys.executable, "-c", "while True: pass"])
    def spin():
        while True:
            pass
    for _ in range(2):
        threading.Thread(target=spin, daemon=True).start()
    print("@@evalrun ready", flush=True)
    sys.stdin.read()
''')
THREADS = 4          # the peer's main thread and its two spinners, the second process's one thread


def _wait_for(predicate, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _running(pgid: int) -> int:
    return sum(state == "R" for state in thread_states(pgid).values())


def test_paused_peer_has_no_runnable_thread_and_sigcont_restores_them(tmp_path: Path):
    peer = PairedPeer([sys.executable, "-c", PEER], dict(os.environ), tmp_path / "out.json", start_timeout_s=10)
    pgid = peer.proc.pid
    try:
        assert _wait_for(lambda: len(thread_states(pgid)) == THREADS)
        assert _wait_for(lambda: _running(pgid) >= 1)                # the spinners run (2 cores may be busy)
        assert all(s not in "Tt" for s in thread_states(pgid).values())
        with peer.paused() as pause:
            assert pause.runnable_start == []
            assert set(thread_states(pgid).values()) <= {"T", "t"}
            assert len(thread_states(pgid)) == THREADS
        assert pause.runnable_end == [] and pause.valid
        assert _wait_for(lambda: all(s not in "Tt" for s in thread_states(pgid).values()))
        assert _wait_for(lambda: _running(pgid) >= 1)
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        peer.close()


class _FakePeer:
    """alternate()'s view of a peer: rounds of 1 s; the second of our rounds finds a thread running."""

    def __init__(self) -> None:
        self.rounds = 0
        self.pauses = 0

    def round(self) -> float:
        self.rounds += 1
        return 1.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[PauseCheck]:
        self.pauses += 1
        yield PauseCheck(["42/43 R"] if self.pauses == 2 else [])


def test_a_round_with_a_runnable_peer_thread_is_kept_but_left_out_of_the_median(capsys):
    times = iter([0.5, 0.1, 0.5])
    runs, theirs = alternate(_FakePeer(), 3, lambda: {"seconds": next(times)})  # type: ignore[arg-type]
    pairs = round_pairs(runs, theirs)
    assert [p["valid"] for p in pairs] == [True, False, True]
    assert pairs[1]["peer_runnable_threads_start"] == ["42/43 R"] and pairs[1]["peer_runnable_threads_end"] == []
    assert median_ratio(pairs) == 2.0                              # 10.0 from the invalid round is left out
    assert "WARNING" in capsys.readouterr().out
    assert median_ratio([{**p, "valid": False} for p in pairs]) is None


def test_dtype_auto_resolves_through_choose_dtype(monkeypatch):
    asked = []

    def fake_choose(requested, device, facts):
        asked.append((requested, device, facts))
        return Choice(requested, "bfloat16", "the test says so") if requested == "auto" else \
            Choice(requested, requested, "as given")

    monkeypatch.setattr(common, "host_facts", lambda probe=False: probe)   # no probe timed in a test
    monkeypatch.setattr(common, "choose_dtype", fake_choose)
    args = common.base_parser("bench_x", "x").parse_args(["--dtype", "auto"])
    assert asked == [("auto", "cpu", True)]                 # auto asks for the probe, as engine_config does
    assert common.dtype_fields(args) == {"dtype_requested": "auto", "dtype": "bfloat16",
                                         "dtype_reason": "the test says so"}
    assert common.CACHE_MODE[args.dtype] == "bf16"
    default = common.base_parser("bench_x", "x").parse_args([])
    assert asked[-1] == ("float32", "cpu", False)
    assert common.dtype_fields(default) == {"dtype_requested": "float32", "dtype": "float32",
                                            "dtype_reason": "as given"}


def test_dtype_auto_that_the_benchmarks_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(common, "host_facts", lambda probe=False: None)
    monkeypatch.setattr(common, "choose_dtype", lambda r, d, f: Choice(r, "float16", "a future rule"))
    with pytest.raises(SystemExit):
        common.base_parser("bench_x", "x").parse_args(["--dtype", "auto"])
