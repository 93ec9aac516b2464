"""MMLU, exactly as lm-evaluation-harness's default `mmlu` task with --num_fewshot 5.

Prompt (per subject; the preamble is shared by every question, so dedup computes it once):
    The following are multiple choice questions (with answers) about {subject}.\\n\\n
    {dev question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: {letter}\\n\\n      x num_fewshot
    {test question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:
Scored by the log-probabilities (float32 softmax over the full vocabulary) of " A",
" B", " C", " D" after the prompt; prediction = argmax, ties to the lowest letter. If a
choice is not a single token, its full log-likelihood is summed over one job per token.

With --apply-chat-template (evalrun/tasks/chat.py) the prompt is lm-eval's chat prompt: the preamble
(after any --system-instruction) is the system turn, each shot a user/assistant pair of turns, the
question a user turn, rendered with the generation prompt; the choices lose their space ("A") and
are tokenized as lm-eval's HF backend tokenizes a (context, continuation) pair (the context's trailing
whitespace, e.g. the generation prompt's newline, moves into the continuation). Every question of a
subject still shares the system and shot turns, so dedup computes them once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Optional, Sequence

import torch

from .base import (NONFINITE_COLUMN, Answer, DocPlan, PrefixGroup, Request, TaskDataError, TaskSettingError,
                   estimate_tokens, prompt_hash)
from .chat import (CHAT_CLI_ARGS, ChatOptions, ChatRenderer, chat_messages, plain_prompt, qa_turns,
                   with_chat_options)
from .lm_eval_requests import Encoder
from .mmlu_data import LETTERS, MMLUData, MMLUDoc, load_mmlu
from .mmlu_groups import GROUP_DISPLAY_NAME, GROUPS, group_of
from .spec import CliArg, RunReport, TaskSpec

PROMPT_FORMAT = "lm-eval-mmlu-default"      # in the run identity: a change of format refuses a resume
KEY_COLUMNS = ("subject", "doc_id")
UNLISTED = "unlisted"                       # the category of a subject MMLU does not have (a user's own data)


def format_question(doc: MMLUDoc) -> str:
    lines = [doc.question.strip()] + [f"{L}. {c}" for L, c in zip(LETTERS, doc.choices)]
    return "\n".join(lines) + "\nAnswer:"


def prompt_prefix(subject: str, shots: Sequence[MMLUDoc]) -> str:
    """What every question of a subject is asked after: the preamble and the shots."""
    text = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    for shot in shots:
        text += f"{format_question(shot)} {LETTERS[shot.answer]}\n\n"
    return text


def build_prompt(subject: str, shots: Sequence[MMLUDoc], doc: MMLUDoc) -> str:
    return prompt_prefix(subject, shots) + format_question(doc)


def description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def turns(subject: str, shots: Sequence[MMLUDoc], doc: MMLUDoc, system_instruction: Optional[str] = None) -> list:
    """The prompt as lm-eval's messages (plain_prompt of them is build_prompt's text)."""
    return qa_turns(description(subject), [(format_question(s), LETTERS[s.answer]) for s in shots],
                    format_question(doc), system_instruction)


class MMLUTask:
    name = "mmlu"
    key_columns = KEY_COLUMNS

    def __init__(self, data_dir: Optional[str] = None, subjects: Optional[Sequence[str]] = None,
                 limit: Optional[int] = None, num_fewshot: int = 5, data: Optional[MMLUData] = None,
                 only: Optional[Collection[tuple]] = None, chat: ChatOptions = ChatOptions()):
        if not 0 <= num_fewshot <= 5:
            raise ValueError(f"--num-fewshot must be between 0 and 5, got {num_fewshot}")
        if limit is not None and limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        self.data = data or load_mmlu(data_dir)
        known = sorted(self.data.test)
        unknown = [s for s in subjects or [] if s not in self.data.test]
        if unknown:
            raise TaskDataError(f"unknown subject(s) {', '.join(unknown)}; valid subjects: {', '.join(known)}")
        self.subjects = list(dict.fromkeys(subjects)) if subjects else known    # repeats named once
        self.limit = limit
        self.only = frozenset(only) if only is not None else None          # a shard's questions (None: all)
        if self.only is not None:
            self.subjects = [s for s in self.subjects if any(self._wanted(d) for d in self.data.test[s][:limit])]
        self.num_fewshot = num_fewshot
        self.chat = chat
        self.choice_ids: list[list[int]] = []
        self._doc_choices: dict[tuple, list[list[int]]] = {}     # chat: each question's continuations

    def fingerprint(self) -> str:
        """The data content only: the selection (--subjects, --limit) may change on resume,
        since rows are keyed by question."""
        return self.data.fingerprint

    def doc_keys(self) -> list[tuple]:
        """Keys of the selected questions (no tokenizer needed)."""
        return [(doc.subject, doc.doc_id) for doc in self.docs()]

    def docs(self) -> Iterator[MMLUDoc]:
        for subject in self.subjects:
            yield from (d for d in self.data.test[subject][: self.limit] if self._wanted(d))

    def _wanted(self, doc: MMLUDoc) -> bool:
        return self.only is None or (doc.subject, doc.doc_id) in self.only

    def restricted(self, keys: Collection[tuple]) -> "MMLUTask":
        """The same task on only these questions; its summary lists only their subjects."""
        return MMLUTask(subjects=self.subjects, limit=self.limit, num_fewshot=self.num_fewshot, data=self.data,
                        only=keys if self.only is None else self.only & frozenset(keys), chat=self.chat)

    def prefix_groups(self) -> list[PrefixGroup]:
        """One group per subject: its questions share the preamble and the shots. A subject may be
        cut into chunks (the prefix is then computed once per chunk)."""
        groups = []
        for subject in self.subjects:
            docs = [d for d in self.data.test[subject][: self.limit] if self._wanted(d)]
            shared = estimate_tokens(prompt_prefix(subject, self.data.dev[subject][: self.num_fewshot]))
            groups.append(PrefixGroup(subject, tuple((d.subject, d.doc_id) for d in docs), shared,
                                      tuple(estimate_tokens(format_question(d)) for d in docs), divisible=True))
        return groups

    def plan(self, tokenizer: Any, max_seq_len: int) -> Iterator[DocPlan]:
        self.choice_ids = [tokenizer.encode(" " + L) for L in LETTERS]
        encode = self._chat_encoder(tokenizer, max_seq_len) if self.chat.on else None
        for doc in self.docs():
            yield self._plan_doc(doc, tokenizer, max_seq_len, encode)

    def _chat_encoder(self, tokenizer: Any, max_seq_len: int) -> Any:
        """text -> (context ids, each letter's continuation ids), as lm-eval's HF backend splits them."""
        render, enc = ChatRenderer(tokenizer, self.chat), Encoder.for_model(tokenizer, max_seq_len)

        def encode(doc: MMLUDoc, k: int) -> tuple[str, list[int], list[list[int]], Optional[dict]]:
            messages = chat_messages(self._turns(doc, k), self.chat.fewshot_as_multiturn)
            text = render(messages, add_generation_prompt=True)
            ctx, conts = enc.pairs(text, list(LETTERS))
            return text, ctx, conts, render.sources.pop(text, None)
        return encode

    def _turns(self, doc: MMLUDoc, k: int) -> list:
        return turns(doc.subject, self.data.dev[doc.subject][:k], doc, self.chat.system_instruction)

    def _plan_doc(self, doc: MMLUDoc, tokenizer: Any, max_seq_len: int, chat_encode: Any = None) -> DocPlan:
        key = (doc.subject, doc.doc_id)
        base = {"question": doc.question, "target": LETTERS[doc.answer]}
        for k in range(self.num_fewshot, -1, -1):
            chat = None
            if chat_encode is not None:
                text, ids, choice_ids, chat = chat_encode(doc, k)
            else:
                plain = self.chat.system_instruction is None
                text = build_prompt(doc.subject, self.data.dev[doc.subject][:k], doc) if plain else \
                    plain_prompt(self._turns(doc, k))
                ids, choice_ids = tokenizer.encode(text), self.choice_ids
            if len(ids) + max(len(c) for c in choice_ids) <= max_seq_len:
                info = {**base, "num_fewshot_used": k, "prompt_hash": prompt_hash(ids)}
                if chat_encode is not None:
                    self._doc_choices[key] = choice_ids
                return DocPlan(key, _requests(key, ids, choice_ids, chat_encode is not None), info, prompt=text,
                               chat=chat)
        return DocPlan(key, info={**base, "num_fewshot_used": 0},
                       skip_reason=f"prompt does not fit in {max_seq_len} tokens (model context or cache) even 0-shot")

    def score(self, plan: DocPlan, answers: list[Answer]) -> dict[str, Any]:
        choice_ids = getattr(self, "_doc_choices", {}).get(plan.doc_key) or self.choice_ids
        logprobs = choice_logprobs(plan.requests[0].input_ids, choice_ids, answers)
        best = max(range(4), key=lambda i: (logprobs[i], -i))          # ties -> lowest letter
        first = min(answers, key=lambda a: a.request.part)
        broken = any(a.nonfinite_logits for a in answers)             # NaN/Inf logits: no answer at all
        return {
            **plan.info,
            "prompt_tokens": first.prompt_tokens,
            "cached_tokens": first.cached_tokens,
            "prediction": "" if broken else LETTERS[best],
            "correct": not broken and LETTERS[best] == plan.info["target"],
            "choice_logprobs": logprobs,
            NONFINITE_COLUMN: broken,
        }

    def summarize(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return summarize_subjects(rows, self.subjects)


def summarize_subjects(rows: list[dict[str, Any]], subjects: Sequence[str]) -> tuple[list[dict[str, Any]],
                                                                                   dict[str, Any]]:
    """Per subject of `subjects`, in that order (with its category group); per group and overall as
    lm-eval aggregates its mmlu groups: accuracy weighted by questions, stderr pooled over the
    subjects' stderrs; and the macro accuracy (mean over subjects). Needs the rows only."""
    scored = [r for r in rows if not r.get("skipped")]
    per_subject = []
    for subject in subjects:
        sub = [bool(r["correct"]) for r in scored if r["subject"] == subject]
        per_subject.append({"subject": subject, "group": group_of(subject), **_acc(sub)})
    overall = _pooled(per_subject)
    overall["groups"] = {g: _pooled([s for s in per_subject if s["group"] == g]) for g in GROUPS}
    overall["skipped"] = len(rows) - len(scored)
    overall[NONFINITE_COLUMN] = sum(bool(r.get(NONFINITE_COLUMN)) for r in scored)   # counted as wrong
    answered = [s["accuracy"] for s in per_subject if s["n"]]
    # no accuracy over zero questions: NaN (null in summary.json), never 0.0
    overall["macro_accuracy"] = sum(answered) / len(answered) if answered else float("nan")
    return per_subject, overall


def _shared(choice_ids: list[list[int]]) -> list[int]:
    """The tokens every choice starts with, each choice keeping at least its last token (under a chat
    template: the generation prompt's newline, which lm-eval's pair split moves into every choice)."""
    k, most = 0, min(len(c) for c in choice_ids) - 1
    while k < most and all(c[k] == choice_ids[0][k] for c in choice_ids):
        k += 1
    return choice_ids[0][:k]


def _requests(key: tuple, ids: list[int], choice_ids: list[list[int]], share: bool = False) -> list[Request]:
    """One job for the next-token logits after the prompt (with `share`, a chat prompt: and after the
    choices' shared first tokens, scored in its prefill: Request.score_from); extra jobs only for
    multi-token choice endings. Plain prompts keep their requests as they always were."""
    shared = _shared(choice_ids) if share else []
    prefixes = [tuple(ids) + tuple(shared)]
    for c in choice_ids:
        for j in range(len(shared) + 1, len(c)):
            if tuple(ids + c[:j]) not in prefixes:
                prefixes.append(tuple(ids + c[:j]))
    return [Request(key, p, 1, True, i, score_from=len(ids) if i == 0 and shared else None)
            for i, p in enumerate(prefixes)]


def choice_logprobs(base: tuple[int, ...], choice_ids: list[list[int]], answers: list[Answer]) -> list[float]:
    """Sum of float32 log-softmax log-probabilities of each choice's tokens after the prompt; `base` is
    the first request's input (the prompt and the choices' shared tokens, whose log-probabilities its
    prefill scored)."""
    logprobs = {a.request.input_ids: torch.log_softmax(a.logits[0].float(), dim=-1) for a in answers}
    first = next(a for a in answers if a.request.input_ids == base)
    n_shared = 0 if first.request.score_from is None else len(base) - first.request.score_from
    out = []
    for choice in choice_ids:
        prefix, total = base, sum(first.prompt_logprobs or [])
        for tok in choice[n_shared:]:
            total += float(logprobs[prefix][tok])
            prefix = prefix + (tok,)
        out.append(total)
    return out


def _acc(correct: list[bool]) -> dict[str, Any]:
    n = len(correct)
    acc = sum(correct) / n if n else float("nan")
    stderr = math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else float("nan")
    return {"n": n, "accuracy": acc, "stderr": stderr}


def _pooled(subjects: list[dict[str, Any]]) -> dict[str, Any]:
    """Size-weighted accuracy and lm-eval's `pooled_sample_stderr` of a group of subjects:
    sqrt(sum((n_i - 1) * n_i * se_i^2) / (N - k) / N); a subject of one question adds no variance."""
    used = [s for s in subjects if s["n"]]
    total = sum(s["n"] for s in used)
    if total == 0:
        return {"n": 0, "accuracy": float("nan"), "stderr": float("nan")}
    accuracy = sum(s["accuracy"] * s["n"] for s in used) / total
    spread = sum((s["n"] - 1) * s["n"] * s["stderr"] ** 2 for s in used if s["n"] > 1)
    dof = total - len(used)
    return {"n": total, "accuracy": accuracy, "stderr": math.sqrt(spread / dof / total) if dof > 0 else float("nan")}


# -- the registry entry ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MMLUOptions:
    data_dir: Optional[str] = None
    subjects: Optional[str] = None               # comma-separated, as given
    limit: Optional[int] = None
    num_fewshot: int = 5
    chat: ChatOptions = ChatOptions()

    def __post_init__(self) -> None:
        if not 0 <= self.num_fewshot <= 5:
            raise TaskSettingError(f"--num-fewshot must be between 0 and 5, got {self.num_fewshot}")
        if self.limit is not None and self.limit < 1:
            raise TaskSettingError(f"--limit must be >= 1, got {self.limit}")

    @property
    def subject_list(self) -> Optional[list[str]]:
        names = [s.strip() for s in (self.subjects or "").split(",") if s.strip()]
        return names or None


def _build(options: MMLUOptions, seed: int) -> MMLUTask:
    return MMLUTask(options.data_dir, options.subject_list, options.limit, options.num_fewshot, chat=options.chat)


def _identity(options: MMLUOptions, task: MMLUTask) -> dict[str, Any]:
    return {"data_fingerprint": task.fingerprint(), "num_fewshot": task.num_fewshot, "prompt_format": PROMPT_FORMAT}


def _summarize(rows: list[dict[str, Any]], groups: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return summarize_subjects(rows, groups)          # MMLU's prefix groups are its subjects, in order


def print_summary(options: MMLUOptions, r: RunReport) -> None:
    width = max([len(s["subject"]) for s in r.per_group] + [15])
    print(f"\n{'subject':<{width}}  {'n':>5}  {'acc':>6}  {'stderr':>6}")
    for s in r.per_group:
        print(_line(s["subject"], s, width))
    print()
    for group, stats in r.overall.get("groups", {}).items():
        if stats["n"]:
            print(_line(GROUP_DISPLAY_NAME[group], stats, width))
    print(_line("overall", r.overall, width))
    tp = r.throughput
    if tp and tp.get("dedup_ratio"):
        print(f"\nwall {tp['wall_seconds']:.1f}s, prompt tokens {tp['prompt_tokens']}, computed "
              f"{tp['prefill_tokens_computed']} (dedup x{tp['dedup_ratio']:.2f})")
    print(f"results: {r.out_dir}")


def _line(name: str, s: dict[str, Any], width: int) -> str:
    acc = "-" if s["n"] == 0 else f"{s['accuracy']:.4f}"
    err = "-" if s["n"] < 2 or s["stderr"] != s["stderr"] else f"{s['stderr']:.4f}"     # NaN: undefined
    return f"{name:<{width}}  {s['n']:>5}  {acc:>6}  {err:>6}"


def show_row(row: dict[str, Any]) -> str:
    head = f"{row['subject']} #{row['doc_id']}"
    if row.get("skipped"):
        return f"{head}: skipped ({row.get('skip_reason')})"
    logprobs = row.get("choice_logprobs")
    scores = "  ".join(f"{L} {v:.3f}" for L, v in zip("ABCD", logprobs)) if logprobs is not None else "-"
    verdict = "correct" if row["correct"] else "wrong"
    return (f"{head}: predicted {row['prediction']}, target {row['target']} ({verdict}); "
            f"log-probs {scores}\nquestion: {row.get('question', '(not stored)')}")


def _accuracy(n: int, c: int) -> float:
    return c / n


CLI_ARGS = (
    CliArg(("--data-dir",), "local MMLU: cais/mmlu parquet layout (dev.parquet, test.parquet) or Hendrycks CSV "
                            "layout (dev/, test/) (default: the hub's cais/mmlu)"),
    CliArg(("--subjects",), "comma-separated subjects (default: all)"),
    CliArg(("--limit",), "at most N questions per subject (default: all)", type=int),
    CliArg(("--num-fewshot", "--num_fewshot"), "few-shot examples per prompt, 0-5 (default: 5)", dest="num_fewshot",
           type=int, default=5),
)

SPEC = TaskSpec(
    name="mmlu", key_columns=KEY_COLUMNS, metric="correct", aggregate="accuracy", unit_columns=KEY_COLUMNS,
    unit_score=_accuracy,
    groupings={"subject": lambda key: str(key[0]), "category": lambda key: group_of(key[0]) or UNLISTED},
    group_order={"category": GROUPS}, default_by="category",
    help="MMLU 5-shot (57 subjects, 14,042 questions) by next-token log-probs",
    description="Evaluate a model on MMLU in lm-evaluation-harness's default format; rows land in OUTPUT_DIR as "
                "each question finishes, and a rerun resumes (a changed --limit/--subjects computes only the new "
                "questions).",
    cli_args=CLI_ARGS + CHAT_CLI_ARGS, options=with_chat_options(MMLUOptions), build=_build, identity=_identity,
    unit="questions",
    summarize=_summarize, report=print_summary, show_row=show_row)
