"""Shared fixtures and helpers of the sandbox tests (test_sandbox.py, test_sandbox_attacks.py)."""
from __future__ import annotations

import os
import secrets
import textwrap
import time
from pathlib import Path

import pytest

from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
from evalrun.tasks.sandbox.isolation import IsolationUnavailable

REPO = Path(__file__).resolve().parents[1]
LEVELS = ("namespaces", "userns", "basic")
FAST = SandboxLimits(timeout=2.0)
MARK = str(10 ** 7 + secrets.randbelow(9 * 10 ** 7))   # tags the sleepers (digits: `sleep 1000.MARK` must parse)
PROBLEM = "HumanEval/0"                # has_close_elements(numbers, threshold) -> bool


# The body of HumanEval/0's function, right; attack completions return it only when the attack
# worked, so a "passed" verdict reveals a hole.
CORRECT_0 = """\
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return False
"""


# --- helpers ----------------------------------------------------------------------
def right_only_if(attack: str) -> str:
    """A HumanEval/0 completion: `attack` (indented code) sets `ok`; the right answer only if ok."""
    body = textwrap.indent(textwrap.dedent(attack), "    ")
    return body + "    if not ok:\n        return None\n" + CORRECT_0


def he_spec(problem: dict, completion: str) -> CheckSpec:
    return CheckSpec(program=problem["prompt"] + completion,
                     check_source=problem["prompt"] + "\n" + problem["test"], entry_point=problem["entry_point"])


def open_sandbox(level: str, **kwargs) -> Sandbox:
    try:
        return Sandbox(isolation=level, **kwargs)
    except IsolationUnavailable as exc:
        pytest.skip(f"isolation level {level!r} is not available here: {exc}")


def proc_table() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (ppid, real uid, state, cmdline) of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        table[int(name)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]), fields["State"][0], cmdline)
    return table


def leftovers(uids: list[int]) -> list[str]:
    """Live processes a check could have left: our descendants, the sandbox uids, the marked sleepers."""
    table = proc_table()
    mine, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, row in table.items() if row[0] in frontier} - mine
        mine |= frontier
    return [f"{pid} uid={row[1]} {row[3][:80]}" for pid, row in table.items() if row[2] != "Z" and
            (pid in mine or row[1] in uids or MARK in row[3])]


def wait_no_leftovers(uids: list[int], timeout: float = 2.0) -> list[str]:
    end = time.monotonic() + timeout
    while (found := leftovers(uids)) and time.monotonic() < end:
        time.sleep(0.05)
    return found


