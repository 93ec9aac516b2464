"""Per-job output stream: sampled token -> text chunk, stop checks, result dicts."""
from __future__ import annotations

import time
from typing import Optional

import torch

from .job import DynamicJob
from .sampler import SampleResult, top_k_of
from .stops import StopStringMatcher
from .streaming import StreamingDecoder
from .tokenizer import Tokenizer
from .types import GeneratorResult


class JobOutput:
    """Owns a running job's text state; `accept` turns one sampled token into a result."""

    def __init__(self, job: DynamicJob, tokenizer: Optional[Tokenizer]):
        self.job = job
        self.decoder = StreamingDecoder(tokenizer, job.decode_special_tokens) if tokenizer else None
        self.matcher = StopStringMatcher(job.stop_strings) if job.stop_strings else None
        self.text: list[str] = []

    def accept(self, sample: SampleResult, logits: Optional[torch.Tensor]) -> GeneratorResult:
        job, st = self.job, self.job.state
        token = sample.token
        st.new_ids.append(token)
        if len(st.new_ids) == 1:
            st.time_first_token = time.time()
        reason, text = self._advance(token)
        self.text.append(text)
        result: GeneratorResult = {
            "job": job, "identifier": job.identifier, "stage": "streaming",
            "eos": reason is not None, "text": text, "token_ids": [token],
        }
        self._extras(result, sample, logits)
        if reason is not None:
            self._finish(result, reason)
        return result

    def _advance(self, token: int) -> tuple[Optional[str], str]:
        job = self.job
        n_new = len(job.state.new_ids)
        if token in job.stop_tokens and n_new > job.min_new_tokens:
            return "stop_token", self._flush()
        text = self.decoder.push(token) if self.decoder else ""
        if self.matcher is not None and n_new > job.min_new_tokens:
            text, stopped = self.matcher.feed(text)
            if stopped:
                return "stop_string", text
        if n_new >= job.max_new_tokens:
            return "max_new_tokens", text + self._flush()
        return None, text

    def _flush(self) -> str:
        tail = self.decoder.flush() if self.decoder else ""
        if self.matcher is not None:
            tail, _ = self.matcher.feed(tail)
            tail += self.matcher.flush()
        return tail

    def _extras(self, result: GeneratorResult, sample: SampleResult, logits: Optional[torch.Tensor]) -> None:
        job = self.job
        if job.return_logits and logits is not None:
            result["logits"] = logits[None].clone()
        if job.return_top_tokens:
            tokens, probs = top_k_of(sample.probs, job.return_top_tokens)
            result["top_k_tokens"], result["top_k_probs"] = [tokens], [probs]
        if job.return_probs:
            result["token_probs"] = [sample.prob]

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
        )
