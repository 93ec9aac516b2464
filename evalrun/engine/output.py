"""Per-job output stream: sampled token -> text chunk, stop checks, result dicts.

A job with a think_end (a reasoning model's end-of-thinking marker) is thinking until its tokens
contain the marker, or until its thinking budget forced it: stop token ids end it all along, stop
strings are matched only in the text after the marker (the thinking's text passes unmatched).

NOTE: this module alone writes a job's kept tokens (`JobState.new_ids`) and its timings: a
target job's through `JobOutput`, a draft model's mirror job's through `follow` and `push_draft`.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from .job import DynamicJob
from .sampler import SampleResult, forced, top_k_of
from .stops import StopStringMatcher
from .streaming import StreamingDecoder
from .tokenizer import Tokenizer
from .types import GeneratorResult


class JobOutput:
    """Owns an enqueued job's tokens, timings and text state; `accept` turns the tokens of one
    step into a result."""

    def __init__(self, job: DynamicJob, tokenizer: Optional[Tokenizer], time_enqueued: float):
        self.job = job
        self.decoder = StreamingDecoder(tokenizer, job.decode_special_tokens) if tokenizer else None
        self.matcher = StopStringMatcher(job.stop_strings) if job.stop_strings else None
        self.text: list[str] = []
        self.prompt_logprobs: list[float] = []      # score_from jobs: per scored prompt token, in order
        self.prompt_greedy: list[bool] = []
        job.state.time_enqueued = time_enqueued

    def scored(self, logprob: float, greedy: bool) -> None:
        """The next scored prompt token's log-probability, and whether it was the argmax."""
        self.prompt_logprobs.append(logprob)
        self.prompt_greedy.append(greedy)

    def start(self, now: float) -> None:
        """The job was admitted: its prefill starts."""
        self.job.state.time_started = now

    def accept(self, samples: list[SampleResult], logits: Optional[torch.Tensor]) -> GeneratorResult:
        """The job's next tokens, in order (several when draft tokens were accepted); tokens
        after the one that ends the job are dropped. A position its thinking budget forces takes
        the marker's token in place of the sample (never drafted: DynamicJob.draft_horizon).
        logits: [len(samples), V] or None."""
        job, st = self.job, self.job.state
        reason, texts, taken = None, [], []
        for smp in samples:
            force = job.forced_token()
            if force is not None:
                if len(samples) > 1:
                    raise RuntimeError("a draft reached a position the thinking budget forces — this is a bug")
                smp = forced(smp, force)
                st.thinking_forced = True
            st.new_ids.append(smp.token)
            if len(st.new_ids) == 1:
                st.time_first_token = time.time()
            taken.append(smp)
            reason, text = self._advance(smp.token, force is not None)
            texts.append(text)
            if reason is not None:
                break
        text = "".join(texts)
        self.text.append(text)
        result: GeneratorResult = {
            "job": job, "identifier": job.identifier, "stage": "streaming",
            "eos": reason is not None, "text": text, "token_ids": [s.token for s in taken],
        }
        self._extras(result, taken, None if logits is None else logits[:len(taken)])
        if reason is not None:
            self._finish(result, reason)
        return result

    def _advance(self, token: int, was_forced: bool) -> tuple[Optional[str], str]:
        job = self.job
        n_new = len(job.state.new_ids)
        thinking = job.thinking              # before this token: its text (the marker's too) is thinking
        if thinking:
            self._end_thinking(was_forced)
        if token in job.stop_tokens and n_new > job.min_new_tokens:
            return "stop_token", self._flush()
        text = self.decoder.push(token) if self.decoder else ""
        if self.matcher is not None and not thinking and n_new > job.min_new_tokens:
            text, stopped = self.matcher.feed(text)
            if stopped:
                return "stop_string", text
        if n_new >= job.max_new_tokens:
            return "max_new_tokens", text + self._flush()
        return None, text

    def _end_thinking(self, was_forced: bool) -> None:
        """The newest token may complete the marker: the model's own (the job's last len(think_end)
        tokens), or the forced one (the last of the marker forced from max_thinking_tokens on)."""
        job, st = self.job, self.job.state
        n, marker = len(st.new_ids), job.think_end
        if was_forced:
            done = n == job.max_thinking_tokens + len(marker)
        else:
            done = tuple(st.new_ids[-len(marker):]) == marker
        if done:
            st.thinking_tokens = n

    def _flush(self) -> str:
        tail = self.decoder.flush() if self.decoder else ""
        if self.matcher is not None and not self.job.thinking:
            tail, _ = self.matcher.feed(tail)
            tail += self.matcher.flush()
        return tail

    def _extras(self, result: GeneratorResult, samples: list[SampleResult], logits: Optional[torch.Tensor]) -> None:
        job = self.job
        if job.return_logits and logits is not None:
            result["logits"] = logits.clone()
        if job.return_top_tokens:
            tops = [top_k_of(s.probs, job.return_top_tokens) for s in samples]
            result["top_k_tokens"], result["top_k_probs"] = [t for t, _ in tops], [p for _, p in tops]
        if job.return_probs:
            result["token_probs"] = [s.prob for s in samples]

    def _finish(self, result: GeneratorResult, reason: str) -> None:
        st, now = self.job.state, time.time()
        result.update(
            eos_reason=reason,
            full_completion="".join(self.text),
            new_tokens=len(st.new_ids),
            prompt_tokens=self.job.prompt_len,
            cached_tokens=st.cached_tokens,
            time_enqueued=st.time_started - st.time_enqueued,
            time_prefill=st.time_first_token - st.time_started,
            time_generate=now - st.time_first_token,
            nonfinite_logits=st.nonfinite_logits,
            drafted_tokens=st.draft.drafted,
            accepted_draft_tokens=st.draft.accepted,
        )
        if self.job.score_from is not None:
            result.update(prompt_logprobs=list(self.prompt_logprobs), prompt_greedy=list(self.prompt_greedy))
        if self.job.think_end is not None:
            thought = len(st.new_ids) if st.thinking_tokens is None else st.thinking_tokens
            result.update(thinking_tokens=thought, thinking_forced=st.thinking_forced)


# --- a draft model's mirror job (evalrun/engine/draft_model.py) -------------------------------------
def follow(mirror: DynamicJob, kept: list[int]) -> int:
    """The mirror's tokens become its target's kept ones; returns how many of the mirror's generated
    tokens agreed with them (the K/V of the rest are stale)."""
    mine = mirror.state.new_ids
    agree, n = 0, min(len(kept), len(mine))
    while agree < n and kept[agree] == mine[agree]:
        agree += 1
    mirror.state.new_ids = list(kept)
    return agree


def push_draft(mirror: DynamicJob, token: int) -> None:
    """A token the draft model proposed follows the mirror's tokens."""
    mirror.state.new_ids.append(token)
