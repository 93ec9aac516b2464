"""The narrow interface between task adapters and the runner.

A task turns documents into `Request`s (token ids plus what to ask the engine),
and turns the engine's answers back into one scored row per document. The
runner owns the generator and the result store; a task knows nothing of pages.

    documents -> task.requests() -> [Request ...] -> runner -> engine jobs
    engine results -> task.score(doc_requests, answers) -> row
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import Any, Collection, Iterator, Optional, Protocol, Sequence, Union

import torch

from evalrun.engine import SamplerSettings


class TaskDataError(ValueError):
    """Malformed task data: names the file and row."""


class TaskSettingError(ValueError):
    """A task option out of range, or one this host cannot honor (the message names the flag)."""


NONFINITE_COLUMN = "nonfinite_logits"   # a row's flag: its answer came from NaN/Inf logits
CHARS_PER_TOKEN = 4                     # work-unit estimates: no tokenizer, the same on every machine


def estimate_tokens(text: str) -> int:
    """A model-free token estimate: ceil(characters / CHARS_PER_TOKEN)."""
    return -(-len(text) // CHARS_PER_TOKEN)


@dataclass(frozen=True)
class Request:
    """One engine job. `doc_key` groups the requests of one document."""
    doc_key: tuple
    input_ids: tuple[int, ...]
    max_new_tokens: int = 1
    return_logits: bool = False
    part: int = 0                       # index of this request within its document
    stop_conditions: tuple[int | str, ...] = ()     # stop token ids and stop strings
    sampler: Optional[SamplerSettings] = None       # None: greedy
    seed: Optional[int] = None
    score_from: Optional[int] = None                # also score the prompt from here (DynamicJob.score_from)
    think_end: tuple[int, ...] = ()                 # end-of-thinking marker's ids (DynamicJob.think_end); (): none
    max_thinking_tokens: Optional[int] = None       # thinking budget (DynamicJob.max_thinking_tokens)


@dataclass
class Answer:
    """What the engine returned for one Request."""
    request: Request
    token_ids: list[int]
    text: str
    logits: Optional[torch.Tensor]      # [n_new, vocab] float32 when requested
    prompt_tokens: int
    cached_tokens: int
    stop_reason: Optional[str] = None   # "stop_token" | "stop_string" | "max_new_tokens"
    nonfinite_logits: int = 0           # positions whose logits held a NaN or Inf (a broken model)
    prompt_logprobs: Optional[list[float]] = None   # with Request.score_from
    prompt_greedy: Optional[list[bool]] = None
    thinking_tokens: Optional[int] = None           # with Request.think_end: tokens up to and including the marker
    thinking_forced: bool = False                   # the thinking budget forced the marker


@dataclass
class DocPlan:
    """All requests of one document, or the reason it is skipped."""
    doc_key: tuple
    requests: list[Request] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)   # carried into the row
    skip_reason: Optional[str] = None
    prompt: Optional[str] = None        # the prompt's text, stored once per info["prompt_hash"]
    chat: Optional[dict] = None         # a chat prompt's source: {"messages", "generation_prompt"} (for `show`)


@dataclass(frozen=True)
class PrefixGroup:
    """Documents whose prompts share a prefix (an MMLU subject's preamble and shots, the n samples
    of one HumanEval problem): kept in one work unit, the engine computes the prefix once.
    Token figures are model-free estimates (estimate_tokens), identical on every machine."""
    key: str
    doc_keys: tuple[tuple, ...]             # in the task's order
    shared_tokens: int                      # the shared prefix, counted once per unit
    doc_tokens: tuple[int, ...]             # each document's own part (its question, its generation budget)
    divisible: bool = False                 # may be cut into consecutive chunks, each repeating the prefix

    def __post_init__(self) -> None:
        if not self.doc_keys or len(self.doc_keys) != len(self.doc_tokens):
            raise ValueError(f"prefix group {self.key!r}: needs one token estimate per document, at least one")

    @property
    def est_tokens(self) -> int:
        return self.shared_tokens + sum(self.doc_tokens)


class Task(Protocol):
    name: str
    key_columns: tuple[str, ...]

    def doc_keys(self) -> list[tuple]:
        """Keys of the selected documents' rows, without a tokenizer (to see what a resume has left)."""

    def prefix_groups(self) -> list[PrefixGroup]:
        """The selected documents grouped by shared prompt prefix, in the task's order (work units)."""

    def restricted(self, keys: Collection[tuple]) -> "Task":
        """The same task on only the selected documents among `keys` (a shard's); summaries cover them."""

    def plan(self, tokenizer: Any, max_seq_len: int) -> Iterator[DocPlan]: ...

    def score(self, plan: DocPlan, answers: list[Answer]) -> Union[dict[str, Any], Future]:
        """The document's row, or a Future of it (e.g. code still executing in a sandbox)."""

    def summarize(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def fingerprint(self) -> str: ...


def load_hub_dataset(name: str, *args: Any, hint: str, **kwargs: Any) -> Any:
    """`datasets.load_dataset(name, ...)`; any failure (offline, unknown name, auth) becomes a
    TaskDataError naming the dataset and the local alternative `hint`."""
    import datasets
    try:
        return datasets.load_dataset(name, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - network, auth and cache errors all mean the same to the user
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TaskDataError(f"could not load {name} from the Hugging Face hub ({type(exc).__name__}: {first}); "
                            f"{hint}") from None


def prompt_hash(ids: Sequence[int]) -> str:
    """A prompt's key in the run's prompts table: a hash of its token ids."""
    return hashlib.sha256(repr(list(ids)).encode()).hexdigest()[:16]

