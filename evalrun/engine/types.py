"""Documented result dicts of the public generator API."""
from __future__ import annotations

from typing import Any, Literal, TypedDict

import torch


class _ResultBase(TypedDict):
    job: Any                      # the DynamicJob
    identifier: Any               # DynamicJob.identifier
    stage: Literal["streaming"]
    eos: bool                     # True on the job's last result
    text: str                     # new text since the previous result (never part of a stop string)
    token_ids: list[int]          # new token ids since the previous result


class GeneratorResult(_ResultBase, total=False):
    logits: torch.Tensor          # [n_new, vocab] float32: raw logits each new token was sampled from
    top_k_tokens: list[list[int]]   # per new token, with return_top_tokens=k
    top_k_probs: list[list[float]]
    token_probs: list[float]      # per new token, probability in the final sampling distribution
    # present when eos is True:
    eos_reason: Literal["stop_token", "stop_string", "max_new_tokens"]
    full_completion: str          # the whole completion text (stop string excluded)
    new_tokens: int               # tokens sampled
    prompt_tokens: int
    cached_tokens: int            # prompt tokens reused from the cache, not computed
    time_enqueued: float          # seconds waiting in the queue
    time_prefill: float           # seconds from start to the first sampled token
    time_generate: float          # seconds from the first to the last sampled token
    nonfinite_logits: int         # sampled positions whose logits held a NaN or Inf (the sampler got
                                  # them made finite: the tokens of such a job are not to be trusted)
    drafted_tokens: int           # speculative draft tokens the target verified for this job
    accepted_draft_tokens: int    # of them, kept (each saved one forward of the target)
    prompt_logprobs: list[float]  # with score_from: log p(prompt token | the tokens before it), float32
                                  # log-softmax, for positions score_from .. prompt_len - 1
    prompt_greedy: list[bool]     # with score_from: whether each of those tokens was the argmax
    thinking_tokens: int          # with think_end: generated tokens up to and including the marker (all of
                                  # them when it never came)
    thinking_forced: bool         # with think_end: the thinking budget forced the marker


class GeneratorStats(TypedDict):
    prompt_tokens: int            # prompt tokens submitted
    prefill_tokens: int           # prompt tokens actually computed
    cached_tokens: int            # prompt tokens reused (whole pages or copied slots)
    generated_tokens: int
    pages_total: int
    pages_in_use: int
    pages_cached: int
    pages_evicted: int            # cached pages reclaimed for new work (prompt cache evictions)
    peak_batch_size: int          # most jobs active at once
    forward_passes: int
    drafted_tokens: int           # speculative draft tokens verified (0 without drafting)
    accepted_draft_tokens: int    # of them, kept: generated_tokens / forward_passes rises with these
    draft_forward_passes: int     # forwards of the draft model (0 without one)
    draft_cached_tokens: int      # prompt tokens the draft model reused from its own cache
