"""DynamicJob: the engine's one record per request, from queue to last token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .draft import NgramDrafter
from .kv_manager import KVAllocation
from .sampler import SamplerSettings, make_generator
from .speculation import DraftRecord
from .stops import split_stop_conditions


class DynamicJob:
    """A generation request: what was asked (set here, never changed) and its `JobState`.

    Scheduling needs only two counters: `num_computed_tokens` (K/V in the cache)
    and `num_tokens` (prompt + sampled). A job computes the difference, in chunks.
    """

    def __init__(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, min_new_tokens: int = 0,
                 stop_conditions: Optional[Sequence[int | str]] = None,
                 gen_settings: Optional[SamplerSettings] = None, seed: Optional[int] = None,
                 identifier: Any = None, return_logits: bool = False, return_top_tokens: int = 0,
                 return_probs: bool = False, decode_special_tokens: bool = False,
                 score_from: Optional[int] = None, think_end: Optional[Sequence[int]] = None,
                 max_thinking_tokens: Optional[int] = None):
        """score_from: also score the prompt from this position on: the final result carries
        `prompt_logprobs` (each prompt token's float32 log-softmax log-probability given the tokens
        before it, positions score_from .. prompt_len - 1) and `prompt_greedy` (whether it was the
        argmax), as a log-likelihood request needs. Those positions are always computed by this
        job (a cached prefix is reused only before position score_from - 1).
        think_end: the token ids of a reasoning model's end-of-thinking marker (e.g. `</think>`). Until
        the generated ids contain it the job is thinking: stop token ids still end it, stop strings are
        matched only in the text generated after the marker.
        max_thinking_tokens=N (budget forcing, needs think_end): if the first N generated tokens do not
        contain the marker, tokens N .. N + len(think_end) - 1 are the marker, whatever the sampler
        picks (a marker the model began at the boundary is forced whole all the same); then the
        answer follows. max_new_tokens stays the budget of thinking and answer together. A forced
        position is sampled as any other (a sampling job spends its one draw there, a greedy one none)
        and the pick replaced by the marker's token, so a seeded job's draws are those of an unforced
        run, alone or batched. Nothing is drafted at forced positions (`draft_horizon`).
        The final result carries `thinking_tokens` (generated tokens up to and including the marker;
        all of them if it never came) and `thinking_forced`."""
        self.prompt_ids = _as_id_list(input_ids)
        if not self.prompt_ids:
            raise ValueError("empty prompt: a job needs at least one input token")
        if score_from is not None:
            _check_int("score_from", score_from, 1)
            if score_from > len(self.prompt_ids):
                raise ValueError(f"score_from ({score_from}) is past the prompt's {len(self.prompt_ids)} tokens")
        self.score_from = score_from
        _check_int("max_new_tokens", max_new_tokens, 1)
        _check_int("min_new_tokens", min_new_tokens, 0)
        _check_int("return_top_tokens", return_top_tokens, 0)
        if min_new_tokens > max_new_tokens:
            raise ValueError(f"min_new_tokens ({min_new_tokens}) exceeds max_new_tokens ({max_new_tokens})")
        if gen_settings is not None and not isinstance(gen_settings, SamplerSettings):
            raise TypeError(f"gen_settings must be a SamplerSettings, got {type(gen_settings).__name__}")
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.stop_tokens, self.stop_strings = split_stop_conditions(stop_conditions or [])
        self.gen_settings = gen_settings or SamplerSettings()
        self.seed = seed
        self.identifier = identifier
        self.return_logits = return_logits
        self.return_top_tokens = return_top_tokens
        self.return_probs = return_probs
        self.decode_special_tokens = decode_special_tokens
        self.think_end, self.max_thinking_tokens = _check_thinking(think_end, max_thinking_tokens, max_new_tokens)
        self.state = JobState(rng=make_generator(seed))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.state.new_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def reuse_limit(self) -> int:
        """Prompt positions before this one may come from the cache (the rest are computed here)."""
        last = len(self.prompt_ids) - 1
        return last if self.score_from is None else min(last, self.score_from - 1)

    @property
    def thinking(self) -> bool:
        """The job has a think_end and its marker has not come yet."""
        return self.think_end is not None and self.state.thinking_tokens is None

    def forced_token(self) -> Optional[int]:
        """The token the job's next position must be (budget forcing), None where the sampler picks.

        NOTE: the marker goes in whole at new tokens N .. N + L - 1 (N = max_thinking_tokens,
        L = len(think_end)); JobOutput ends the thinking at N + L exactly, so n - N < L here.
        """
        n, budget = len(self.state.new_ids), self.max_thinking_tokens
        if budget is None or n < budget or not self.thinking:
            return None
        return self.think_end[n - budget]

    @property
    def draft_horizon(self) -> int:
        """New tokens a speculative step may reach (drafts and the bonus token): max_new_tokens, but
        never a forced position: while a thinking budget runs, the budget (so nothing is drafted
        while the marker is forced)."""
        if self.max_thinking_tokens is not None and self.thinking:
            return self.max_thinking_tokens
        return self.max_new_tokens

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.state.new_ids[pos - n]

    def __repr__(self) -> str:
        return (f"DynamicJob(identifier={self.identifier!r}, prompt_tokens={self.prompt_len}, "
                f"max_new_tokens={self.max_new_tokens})")


# NOTE: one writer per field: only the module named here assigns the field (or changes a list field
# in place); every other module reads it. tests/test_job_state_writers.py fails on any other writer.
WRITERS = {
    "rng": "job.py",                     # made here; draws advance it, a draft mirror copies its target's
    "num_computed_tokens": "scheduler.py",
    "kv": "scheduler.py",
    "serial": "scheduler.py",
    "new_ids": "output.py",
    "time_enqueued": "output.py",
    "time_started": "output.py",
    "time_first_token": "output.py",
    "nonfinite_logits": "verify.py",
    "drafter": "generator.py",
    "draft": "job.py",                   # made here; DraftPolicy (speculation.py) alone writes its fields
    "thinking_tokens": "output.py",
    "thinking_forced": "output.py",
}


@dataclass
class JobState:
    """What changes while a job runs; each field has one writer (WRITERS)."""
    rng: torch.Generator                  # the job's own randomness (a seeded job reproduces)
    new_ids: list[int] = field(default_factory=list)    # tokens kept: JobOutput.accept (a draft mirror:
                                                        # its target's kept ones, then its drafts)
    num_computed_tokens: int = 0          # positions whose K/V are in the job's pages: the scheduler sets it
                                          # to kv.cached_tokens at admission, advances it per chunk and
                                          # lowers it when draft tokens are rejected
    kv: Optional[KVAllocation] = None     # the job's pages, waits, copy and window slot (KVManager.admit's;
                                          # only the KV manager writes inside it)
    serial: int = 0                       # order of enqueueing (the queue's tie-break)
    time_enqueued: float = 0.0
    time_started: float = 0.0
    time_first_token: float = 0.0
    nonfinite_logits: int = 0             # sampled positions whose logits held a NaN or an Inf
    drafter: Optional[NgramDrafter] = None    # n-gram drafting over the job's kept tokens
    draft: DraftRecord = field(default_factory=DraftRecord)   # speculative drafting history
    thinking_tokens: Optional[int] = None    # with think_end: new tokens up to and including the marker,
                                             # once it came (None: still thinking)
    thinking_forced: bool = False            # the marker was forced (max_thinking_tokens)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from the cache (whole pages and copied slots), not computed."""
        return 0 if self.kv is None else self.kv.cached_tokens


def _check_thinking(think_end: Optional[Sequence[int]], budget: Optional[int],
                    max_new_tokens: int) -> tuple[Optional[tuple[int, ...]], Optional[int]]:
    if think_end is not None:
        if isinstance(think_end, (str, bytes)):
            raise ValueError(f"think_end must be token ids, not the text {think_end!r}: encode it first")
        think_end = tuple(think_end.tolist() if isinstance(think_end, torch.Tensor) else think_end)
        if not think_end:
            raise ValueError("think_end is empty: give the end-of-thinking marker's token ids, or None")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in think_end):
            raise ValueError(f"think_end must be token ids (integers >= 0), got {think_end!r}")
    if budget is not None:
        if think_end is None:
            raise ValueError("max_thinking_tokens needs think_end (the marker to force)")
        _check_int("max_thinking_tokens", budget, 0)
        if budget >= max_new_tokens:
            raise ValueError(f"max_thinking_tokens ({budget}) must be below max_new_tokens ({max_new_tokens}), "
                             "which counts thinking and answer together")
    return think_end, budget


def _as_id_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"input_ids tensor must be [n] or [1, n], got shape {tuple(ids.shape)}")
        return [int(t) for t in ids.tolist()]
    out = list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
        raise TypeError("input_ids must be a sequence of int token ids")
    return out


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
