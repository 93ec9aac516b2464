"""The `evalrun` CLI run many times under time and memory bounds without paying its imports each time.

    with ForkedCli(ROOT) as cli:
        rc, stderr, seconds, peak_rss_bytes = cli.run(argv, 10.0, cwd, stderr_file, stdout_file)

One fresh interpreter imports `evalrun.commands.cli` once (as `python -m evalrun` would: evalrun's
process settings first, then torch) and never computes anything itself; each run is a fork of it
that calls `main(argv)` in a session of its own, its stderr to a file. A run reports its exit
status (SIGKILLed, the whole session, at the deadline: -9), the seconds from the fork (the deadline
bounds these: what the input makes the CLI do; the imports, paid once, are the same for every input
and would only carry the machine's load into every run), and its peak RSS (wait4's ru_maxrss,
which counts the imported interpreter it was forked from, as a fresh process's would count its
imports). No OpenMP or native thread pool exists before a fork: the parent only imported. Tests that need a fresh exec (an RLIMIT set before the interpreter starts) keep their
own subprocess.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

SERVER = r"""
import json, os, signal, sys, time, traceback
start = time.monotonic()
from evalrun.commands.cli import main
imported = time.monotonic() - start
print(json.dumps({"imported": imported}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    began = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.chdir(ask["cwd"])
            err = os.open(ask["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(err, 2)
            out = os.open(ask["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if ask["stdout"] else None
            os.dup2(os.open(os.devnull, os.O_WRONLY) if out is None else out, 1)
            code = main(ask["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    while True:
        got, status, usage = os.wait4(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() - began > ask["deadline"]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:           # killed before its setsid: it has no children yet
                os.kill(pid, signal.SIGKILL)
            got, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.01)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - began,
                      "rss": usage.ru_maxrss * 1024}), flush=True)
"""


class ForkedCli:
    """A forking server of the evalrun CLI (see the module's text); a context manager."""

    def __init__(self, cwd: Path, env: Optional[dict[str, str]] = None):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._reply()                                     # the imports are done

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the forking CLI server ended (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, argv: list[str], deadline: float, cwd: Path, stderr: Path,
            stdout: Optional[Path] = None) -> tuple[int, str, float, int]:
        """(exit status, stderr, seconds, peak RSS in bytes) of `evalrun ARGV`; its stdout into the
        file `stdout` (None: discarded)."""
        for path in (stderr, stdout):
            if path is not None:
                path.write_bytes(b"")                     # there even if the run is killed before it opens it
        self.proc.stdin.write(json.dumps({"argv": argv, "deadline": deadline, "cwd": str(cwd), "stderr": str(stderr),
                                          "stdout": None if stdout is None else str(stdout)}) + "\n")
        self.proc.stdin.flush()
        got = self._reply()
        return got["status"], stderr.read_text(errors="replace"), got["seconds"], got["rss"]

    def __enter__(self) -> "ForkedCli":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
