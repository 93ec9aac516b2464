"""Issue 43, class 1: nothing a sample starts or creates outlives its check, at every level.

A worker that keeps the harness's uid (the `basic` level without root) could SIGKILL its own launcher,
after starting a `setsid` grandchild: the launcher's cleanup never ran, the grandchild outlived evalrun
and the sample still passed. The launcher is now out of the worker's reach there (the seccomp filter
refuses every way to signal it or its group, or to lower its limits; it is non-dumpable), and a
launcher killed from outside fails the check. And at `basic` (no IPC namespace) SysV message queues
and semaphores and POSIX message queues outlived the check, so a later sample read what an earlier
one left: the filter refuses msgget, semget and mq_open there (shmget was already refused).

Each case runs at every level this machine offers, as root (one uid per slot where it drops it) and
from a harness without root (setpriv), where the worker keeps the harness's uid."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from sandbox_helpers import (ATTACKER_UID, CORRECT_0, FAST, LEVELS, MARK, PROBLEM, REPO, he_spec, open_sandbox,
                             processes_of, proc_table, right_only_if, run_as_user, wait_no_leftovers)

from evalrun.tasks.sandbox import SandboxLimits
from evalrun.tasks.sandbox.execute import Outcome, classify

USER_LEVELS = ("userns", "basic")       # what a harness without root can have (no uid to drop)
SLEEPER = """\
    import os, signal, subprocess, time
    subprocess.Popen(["sleep", "1000.{tag}"], start_new_session=True)     # a setsid grandchild
    launcher = os.getppid()
"""
# Every way a worker of the launcher's uid could end it, or break its cleanup, found so far.
LAUNCHER_ATTACKS = {
    "kill": "os.kill(launcher, signal.SIGKILL)",
    "killpg": "os.killpg(os.getpgid(launcher), signal.SIGKILL)",
    "pidfd": "signal.pidfd_send_signal(os.pidfd_open(launcher), signal.SIGKILL)",
    "proc pidfd": "signal.pidfd_send_signal(os.open(f'/proc/{launcher}', os.O_RDONLY), signal.SIGKILL)",
    "tgkill": "import ctypes; ctypes.CDLL(None).syscall(234, launcher, launcher, 9)",
    "sigqueue": "import ctypes; ctypes.CDLL(None).syscall(129, launcher, 9, ctypes.create_string_buffer(128))",
    "SIGIO owner": ("import fcntl; r, w = os.pipe(); fcntl.fcntl(r, fcntl.F_SETOWN, launcher); "
                    "fcntl.fcntl(r, 10, 9); fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC); os.write(w, b'x')"),
    "prlimit": "import resource; resource.prlimit(launcher, resource.RLIMIT_NOFILE, (0, 0))",
}


def launcher_attack(name: str, tag: str) -> str:
    """Start a marked setsid sleeper, try `name` on the launcher, then answer right (a pass here
    is no hole by itself: the test is what is left afterwards)."""
    attack = f"    try:\n        {LAUNCHER_ATTACKS[name]}\n    except Exception:\n        pass\n    time.sleep(0.2)\n"
    return SLEEPER.format(tag=tag) + attack + right_only_if("ok = True\n")


def marked(tag: str) -> list[str]:
    return [f"{pid} {row[3][:60]}" for pid, row in proc_table().items() if tag in row[3] and row[2] != "Z"]


def kill_marked(tag: str) -> None:
    for pid, row in proc_table().items():
        if tag in row[3]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def completions(tag: str) -> list[str]:
    return [launcher_attack(name, f"{tag}{i}") for i, name in enumerate(LAUNCHER_ATTACKS)]


@pytest.mark.parametrize("level", LEVELS)
def test_killing_the_launcher_leaves_nothing_as_root(level, problems):
    tag = f"{MARK}7{LEVELS.index(level)}"
    box = open_sandbox(level, limits=FAST, workers=1)
    try:
        results = {name: box.run(he_spec(problems[PROBLEM], completion))
                   for name, completion in zip(LAUNCHER_ATTACKS, completions(tag))}
        uids = box.isolation_info()["sandbox_uids"]
    finally:
        box.close()
    try:
        assert wait_no_leftovers(uids) == [] and marked(tag) == [], results
    finally:
        kill_marked(tag)


def attacks_without_root(level: str, attacks: dict[str, str], tag: str, home) -> None:
    """Run `attacks` (name -> completion) from a harness without root; nothing of its uid, and no
    marked sleeper, may be left once it has exited, and the harness itself must survive."""
    try:
        try:
            report = run_as_user(level, list(attacks.values()), home)
        except AssertionError as exc:              # the attack ended the harness itself
            report = {"results": [], "harness": str(exc).splitlines()[0][:300]}
        left = marked(tag) + [p for p in processes_of(ATTACKER_UID) if p not in marked(tag)]
        results = dict(zip(attacks, report["results"]))
        assert left == [], f"left after evalrun exited: {left}; results: {results}; {report.get('harness', '')}"
        assert "harness" not in report, report["harness"]
        # a launcher ended from outside fails its check; none may have been ended
        assert all("launcher" not in str(error) for _, error in results.values()), results
    finally:
        kill_marked(tag)
        for pid in [int(p.split()[0]) for p in processes_of(ATTACKER_UID)]:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("level", USER_LEVELS)
def test_killing_the_launcher_leaves_nothing_without_root(level, tmp_path):
    tag = f"{MARK}8{USER_LEVELS.index(level)}"
    attacks_without_root(level, dict(zip(LAUNCHER_ATTACKS, completions(tag))), tag, tmp_path / "home")


@pytest.mark.parametrize("level", USER_LEVELS)
def test_killing_every_process_of_the_uid_is_refused_without_root(level, tmp_path):
    """kill(-1) from a worker of the harness's uid would end the harness, the launcher and the
    checker at once (and every other process of the user)."""
    tag = f"{MARK}9{USER_LEVELS.index(level)}"
    attack = SLEEPER.format(tag=tag) + "    try:\n        os.kill(-1, signal.SIGKILL)\n    except OSError:\n" \
        "        pass\n    time.sleep(0.2)\n" + right_only_if("ok = True\n")
    attacks_without_root(level, {"kill -1": attack}, tag, tmp_path / "home")


# --- IPC objects ---------------------------------------------------------------------------
IPC_COMMON = """\
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
    except OSError:
        rt = libc
    class Msg(ctypes.Structure):
        _fields_ = [("mtype", ctypes.c_long), ("text", ctypes.c_char * 64)]
    KEY, NAME = {key}, b"/evalrun-{key}"
"""
IPC_STORE = IPC_COMMON + """\
    made = []
    q = libc.msgget(KEY, 0o1000 | 0o600)                         # IPC_CREAT
    if q >= 0:
        made.append(libc.msgsnd(q, ctypes.byref(Msg(1, b"left by an earlier sample")), 64, 0o4000) == 0)
    s = libc.semget(KEY + 1, 1, 0o1000 | 0o600)
    if s >= 0:
        made.append(libc.semctl(s, 0, 16, ctypes.c_int(7)) == 0)      # SETVAL
    mq = rt.mq_open(NAME, 0o100 | 0o2, 0o600, None)               # O_CREAT | O_RDWR
    if mq >= 0:
        made.append(rt.mq_send(mq, b"left", 4, 0) == 0)
    ok = any(made)
"""
IPC_FIND = IPC_COMMON + """\
    found = []
    q = libc.msgget(KEY, 0o600)
    if q >= 0:
        m = Msg()
        found.append(libc.msgrcv(q, ctypes.byref(m), 64, 0, 0o4000) > 0)
    s = libc.semget(KEY + 1, 1, 0o600)
    if s >= 0:
        found.append(libc.semctl(s, 0, 12) == 7)                    # GETVAL
    found.append(rt.mq_open(NAME, 0o2) >= 0)
    ok = any(found)
"""


def ipc_key(salt: int) -> int:
    return (int(MARK) * 10 + salt) % (1 << 30) + 1


def host_ipc_objects(key: int) -> list[str]:
    """The SysV queues and semaphore sets with our keys, and the POSIX queue, in this IPC namespace."""
    found = []
    for kind, keys in (("msg", {key}), ("sem", {key + 1})):
        with open(f"/proc/sysvipc/{kind}") as f:
            found += [f"{kind} {line.split()[0]}" for line in f.readlines()[1:] if int(line.split()[0]) in keys]
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
    except OSError:
        rt = libc
    fd = rt.mq_open(f"/evalrun-{key}".encode(), os.O_RDONLY)
    if fd >= 0:
        os.close(fd)
        found.append(f"mq /evalrun-{key}")
    return found


def remove_ipc_objects(key: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    queue, sems = libc.msgget(key, 0), libc.semget(key + 1, 0, 0)
    if queue >= 0:
        libc.msgctl(queue, 0, None)                  # IPC_RMID
    if sems >= 0:
        libc.semctl(sems, 0, 0)                      # IPC_RMID
    try:
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
    except OSError:
        rt = libc
    rt.mq_unlink(f"/evalrun-{key}".encode())


def ipc_completions(key: int) -> list[str]:
    return [right_only_if(IPC_STORE.format(key=key)), right_only_if(IPC_FIND.format(key=key))]


@pytest.mark.parametrize("level", LEVELS)
def test_ipc_objects_do_not_outlive_the_check_as_root(level, problems):
    key = ipc_key(LEVELS.index(level))
    box = open_sandbox(level, limits=FAST, workers=1)     # one slot: both samples run as the same uid
    try:
        store, find = [box.run(he_spec(problems[PROBLEM], c)) for c in ipc_completions(key)]
    finally:
        box.close()
        left = host_ipc_objects(key)
        remove_ipc_objects(key)
    assert (find.status, left) == ("failed", []), (store, find, left)


@pytest.mark.parametrize("level", USER_LEVELS)
def test_ipc_objects_do_not_outlive_the_check_without_root(level, tmp_path):
    key = ipc_key(5 + USER_LEVELS.index(level))
    try:
        report = run_as_user(level, ipc_completions(key), tmp_path / "home")
    finally:
        left = host_ipc_objects(key)
        remove_ipc_objects(key)
    assert (report["results"][1][0], left) == ("failed", []), (report["results"], left)


def test_basic_refuses_ipc_object_creation(level_box):
    info = level_box.isolation_info()
    if info["level"] != "basic":
        pytest.skip("the namespace levels have their own IPC namespace")
    assert {"msgget", "semget", "shmget", "mq_open"} <= set(info["seccomp_denied"])


def test_a_launcher_killed_during_the_check_fails_a_passing_verdict():
    """Where no filter protects the launcher (no libseccomp), a launcher ended by a signal before the
    harness stopped it fails the check: its cleanup never ran, so what the program started may live on."""
    nonce = "0" * 32
    outcome = Outcome(verdict={"status": "passed", "nonce": nonce}, worker_code=-signal.SIGKILL, launcher_killed=True)
    result = classify(outcome, nonce, FAST, 0.1)
    assert (result.status, result.error) == ("error", "the sandbox's launcher was killed during the check (signal 9)")
    assert classify(Outcome(verdict={"status": "passed", "nonce": nonce}, worker_code=137), nonce, FAST, 0.1).passed


def test_a_launcher_killed_from_outside_fails_the_check(problems):
    """End to end, at the basic level (where the launcher is the harness's own child): the launcher is
    SIGKILLed from outside while its worker sleeps, then the worker answers right; the check is an error."""
    box = open_sandbox("basic", limits=SandboxLimits(timeout=10.0), workers=1)
    try:
        future = box.submit(he_spec(problems[PROBLEM], CORRECT_0 + "import time\ntime.sleep(1.5)\n"))   # at load
        deadline, launcher = time.monotonic() + 5, None
        while launcher is None and time.monotonic() < deadline:
            launcher = next((pid for pid, row in proc_table().items()
                             if row[0] == os.getpid() and '"mode": "run"' in row[3]), None)
            time.sleep(0.02)
        assert launcher is not None, "no launcher found"
        time.sleep(0.5)                                       # the worker is in its sleep by now
        os.kill(launcher, signal.SIGKILL)
        result = future.result()
        uids = box.isolation_info()["sandbox_uids"]
    finally:
        box.close()
    assert (result.status, result.error) == ("error", "the sandbox's launcher was killed during the check (signal 9)")
    if uids:
        assert wait_no_leftovers(uids) == []


def test_basic_names_an_mqueue_mount_it_cannot_close(tmp_path):
    """mq_open is refused, but a queue can also be made by open(2) in an mqueue mount (systemd mounts
    one on /dev/mqueue), which the basic level shares with the host: isolation_info says so."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounts an mqueue file system in a private mount namespace: needs root and unshare")
    point = tmp_path / "mqueue"
    point.mkdir()
    script = ("import json; from evalrun.tasks.sandbox import Sandbox\n"
              "with Sandbox(isolation='basic', workers=1) as box: print(json.dumps(box.isolation_info()['notes']))")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t mqueue none "$1" && exec "$2" -c "$3"', "sh",
                           str(point), sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any(f"mqueue mount {point}" in note for note in notes), notes
