"""Prompt sets for speculative decoding (issue 14), shared by benchmarks/bench_spec.py and the tests:

- humaneval:  the HumanEval prompts (code completion, the harness's generative workload);
- mmlu:       zero-shot MMLU-style questions ending in "Answer:" (cais/mmlu schema parquet);
- repetitive: prompts whose continuation copies text the prompt already holds (a function to
              restate verbatim, a counting pattern, a table to continue), where n-gram lookup pays.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from benchmarks.decode_curve import humaneval_texts

WORKLOADS = ("humaneval", "mmlu", "repetitive")
DEFAULT_MMLU_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "mmlu"


def mmlu_texts(n: int, data_dir: Optional[Path] = None) -> list[str]:
    import pandas as pd
    test = pd.read_parquet(Path(data_dir or DEFAULT_MMLU_DIR) / "test.parquet")
    if n > len(test):
        raise ValueError(f"the MMLU test split at {data_dir or DEFAULT_MMLU_DIR} has {len(test)} questions, {n} requested")
    out = []
    for r in test.head(n).itertuples():
        choices = "\n".join(f"{letter}. {c}" for letter, c in zip("ABCD", r.choices))
        out.append(f"Question about {r.subject.replace('_', ' ')}: {r.question.strip()}\n{choices}\n"
                   f"Explain the answer, then give it.\nAnswer:")
    return out


def repetitive_texts(n: int) -> list[str]:
    code = humaneval_texts()
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            src = code[i % len(code)].strip()
            out.append(f"{src}\n\n# The same function again, copied exactly:\n{src.splitlines()[0]}\n")
        elif kind == 1:
            start = 3 + i
            out.append(", ".join(str(start + j % 7) for j in range(40)) + ",")
        else:
            rows = "\n".join(f"| {j} | item_{j} | {j * j} |" for j in range(1 + i, 9 + i))
            out.append(f"| n | name | square |\n|---|---|---|\n{rows}\n")
    return out


def workload_texts(kind: str, n: int, mmlu_dir: Optional[Path] = None) -> list[str]:
    if kind == "humaneval":
        texts = humaneval_texts()
        if n > len(texts):
            raise ValueError(f"HumanEval has {len(texts)} problems, {n} requested")
        return texts[:n]
    if kind == "mmlu":
        return mmlu_texts(n, mmlu_dir)
    if kind == "repetitive":
        return repetitive_texts(n)
    raise ValueError(f"unknown workload {kind!r}: one of {', '.join(WORKLOADS)}")
