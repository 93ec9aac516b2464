"""Hugging Face evaluate's `code_eval` metric, served by evalrun's sandbox.

lm-eval's code tasks (humaneval, humaneval_infilling, mbpp: `unsafe_code: true`) score with
`evaluate.load("code_eval")`: each candidate program is run with its test appended
(`candidate + "\\n" + test`) in a process forked from the harness, behind a `reliability_guard`
that generated code escapes (docs/sandbox.md), and only after `HF_ALLOW_CODE_EVAL=1`. While evalrun
loads task definitions (`code_eval_in_sandbox`), `evaluate.load("code_eval")` returns `SandboxedCodeEval`
instead: the same `compute(predictions, references, k, num_workers, timeout)` and the same return
value (`({"pass@k": mean}, {task index: [(completion index, {"task_id", "passed", "result",
"completion_id"})]})`), with each candidate run in evalrun's sandbox (evalrun/tasks/sandbox):
the candidate alone in the confined worker, the test in the trusted checker, every name the test
takes from the candidate (its functions, the standard-library modules it imported, plain values)
bound to the worker's. A program therefore passes only when the test's own code runs to its end
with those names; exiting early, forging output or walking frames cannot pass it. The metric no
longer needs the hub (code_eval's script) or `HF_ALLOW_CODE_EVAL`.

Where it differs from code_eval: a test that needs an object the codec cannot carry back (an
instance of a class the candidate defines, a generator kept open) fails here ("unsupported return
type"), and the candidate and test no longer share one namespace, so a test that rebinds a name
the candidate's own functions read does not reach them.
"""
from __future__ import annotations

import ast
import atexit
import builtins
import os
import threading
from collections import Counter, defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from .passk import summarize_pass_at_k
from .sandbox import CheckSpec, ExecResult, Sandbox, SandboxLimits

CODE_EVAL_PATHS = ("code_eval", "evaluate-metric/code_eval")
LOADED = "__evalrun_program_loaded__"   # appended to the candidate: the check's entry point
CHECK_SOURCE = '''\
__evalrun_test__ = {test!r}
__evalrun_names__ = {names!r}


def check(candidate):
    candidate()
    scope = {{"__name__": "__test__"}}
    for name in __evalrun_names__:
        if name in globals():
            scope[name] = globals()[name]
    exec(compile(__evalrun_test__, "<test>", "exec"), scope)
'''


def free_names(test: str) -> list[str]:
    """Names the test reads but never binds itself (nor are builtins): what it takes from the candidate."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return []
    read, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read.append((node.lineno, node.col_offset, node.id)) if isinstance(node.ctx, ast.Load)
             else bound.add(node.id))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).partition(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    names = dict.fromkeys(n for _, _, n in sorted(read)
                          if n not in bound and not hasattr(builtins, n) and not n.startswith("__evalrun"))
    return list(names)


def check_spec(candidate: str, test: str) -> CheckSpec:
    """code_eval's program `candidate + "\\n" + test` as a sandbox check: the candidate in the worker
    (with an entry point that tells the checker it loaded), the test in the checker."""
    names = free_names(test)
    program = f"{candidate}\n\n\ndef {LOADED}():\n    return None\n"
    return CheckSpec(program=program, check_source=CHECK_SOURCE.format(test=test, names=names),
                     entry_point=LOADED, names=names)


def result_text(result: ExecResult) -> str:
    """code_eval's `result` string: "passed", "timed out" or "failed: <error>"."""
    if result.passed:
        return "passed"
    if result.status == "timeout":
        return "timed out"
    return f"failed: {result.error or result.status}"


class SandboxedCodeEval:
    """`evaluate.load("code_eval")`'s interface on evalrun's sandbox (one Sandbox per timeout, kept
    until `close`)."""

    name = "code_eval"

    def __init__(self, workers: Optional[int] = None, isolation: str = "auto") -> None:
        self.workers = workers or max(1, min(8, len(os.sched_getaffinity(0))))
        self.isolation = isolation
        self._boxes: dict[float, Sandbox] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """A copy travels (a Ray replica scoring lm-eval's code tasks) without its sandboxes: it opens its own."""
        return {"workers": self.workers, "isolation": self.isolation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["workers"], state["isolation"])
        atexit.register(self.close)

    def _box(self, timeout: float) -> Sandbox:
        with self._lock:
            if timeout not in self._boxes:
                self._boxes[timeout] = Sandbox(SandboxLimits(timeout=timeout), workers=self.workers,
                                               isolation=self.isolation)
            return self._boxes[timeout]

    def isolation_info(self, timeout: float = 3.0) -> dict[str, Any]:
        return self._box(float(timeout)).isolation_info()

    def compute(self, predictions: Sequence[Sequence[str]], references: Sequence[str],
                k: Any = (1, 10, 100), num_workers: int = 4, timeout: float = 3.0) -> tuple[dict, dict]:
        """code_eval's compute: predictions[i] are task i's candidates, references[i] its test."""
        if len(predictions) != len(references):
            raise ValueError(f"code_eval: {len(predictions)} predictions for {len(references)} references")
        box = self._box(float(timeout))
        futures, completion = [], Counter()
        for task_id, (candidates, test) in enumerate(zip(predictions, references)):
            for candidate in candidates:
                futures.append((task_id, completion[task_id], box.submit(check_spec(candidate, test))))
                completion[task_id] += 1
        results: dict[int, list] = defaultdict(list)
        for task_id, completion_id, future in futures:
            text = result_text(future.result())
            results[task_id].append((completion_id, {"task_id": task_id, "passed": text == "passed",
                                                     "result": text, "completion_id": completion_id}))
        counts = {t: (len(r), sum(x[1]["passed"] for x in r)) for t, r in results.items()}
        _, overall = summarize_pass_at_k(counts, list(k) if isinstance(k, (list, tuple)) else [k])
        return {key: v for key, v in overall.items() if not key.endswith("_stderr")}, results

    def close(self) -> None:
        with self._lock:
            boxes, self._boxes = list(self._boxes.values()), {}
        for box in boxes:
            box.close()


_SHARED: Optional[SandboxedCodeEval] = None


def shared_code_eval() -> SandboxedCodeEval:
    """The process's SandboxedCodeEval (its sandboxes close when the process exits)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = SandboxedCodeEval()
        atexit.register(_SHARED.close)
    return _SHARED


@contextmanager
def code_eval_in_sandbox() -> Iterator[None]:
    """While inside, `evaluate.load("code_eval")` returns the shared SandboxedCodeEval (other metrics
    load as before); lm-eval's task modules call it when their YAML is loaded."""
    try:
        import evaluate
    except ImportError:           # lm-eval without evaluate: nothing loads code_eval
        yield
        return
    original = evaluate.load

    def load(path: str, *args: Any, **kwargs: Any) -> Any:
        if path in CODE_EVAL_PATHS:
            return shared_code_eval()
        return original(path, *args, **kwargs)

    evaluate.load = load
    try:
        yield
    finally:
        evaluate.load = original
