"""evalrun/scale/ray_watchdog.py without Ray: when the process that started it dies (SIGKILL), or closes
its pipe, the watchdog ends every process of the trees it was told to watch, orphans included."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from evalrun.scale.ray_watchdog import descendants

DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from evalrun.scale.ray_watchdog import Watchdog
    tree = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    time.sleep(0.3)
    dog = Watchdog.start()
    dog.watch([tree.pid])
    print(tree.pid, dog.pid, flush=True)
    if sys.argv[1] == "close":
        time.sleep(1.0)
        dog.close()
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _tree_of_a_driver(how: str) -> tuple[subprocess.Popen, set[int], int]:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, how], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    tree, dog = map(int, driver.stdout.readline().split())
    time.sleep(0.6)                                    # the watchdog has seen the tree
    pids = descendants([tree])
    assert len(pids) == 3 and all(map(_alive, pids))
    return driver, pids, dog


def _assert_ended(pids: set[int]) -> None:
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))


def test_a_sigkilled_driver_leaves_nothing_of_the_watched_trees():
    driver, pids, dog = _tree_of_a_driver("wait")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=10)
    _assert_ended(pids | {dog})


def test_closing_the_pipe_ends_the_watched_processes_and_the_watchdog():
    driver, pids, dog = _tree_of_a_driver("close")
    _assert_ended(pids | {dog})
    assert _alive(driver.pid)
    driver.kill()
    driver.wait(timeout=10)
