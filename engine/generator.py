"""DynamicGenerator: a job queue driven through packed forwards over the paged cache."""
from __future__ import annotations

import math
import time
from typing import Any, Optional, Sequence

import torch

from .batch import build_forward_batch
from .cache import PagedCache
from .job import DynamicJob
from .model import Model
from .output import JobOutput
from .sampler import SampleResult, SamplerSettings, greedy_tokens, sample
from .scheduler import ScheduledChunk, Scheduler
from .tokenizer import Tokenizer
from .types import GeneratorResult, GeneratorStats

_COUNTERS = ("prompt_tokens", "prefill_tokens", "cached_tokens", "generated_tokens",
             "peak_batch_size", "forward_passes")


class DynamicGenerator:
    def __init__(self, model: Model, cache: PagedCache, tokenizer: Optional[Tokenizer] = None,
                 max_batch_size: Optional[int] = None, max_chunk_size: int = 2048):
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be None or an integer >= 1, got {max_batch_size!r}")
        if not isinstance(max_chunk_size, int) or max_chunk_size < 1:
            raise ValueError(f"max_chunk_size must be an integer >= 1, got {max_chunk_size!r}")
        if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"tokenizer/model vocab mismatch: the tokenizer has {tokenizer.vocab_size} tokens, "
                f"the model's embedding only {model.config.vocab_size}"
            )
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(cache.pool, max_batch_size, max_chunk_size, cache.window, cache.window_slots)
        self.outputs: dict[int, JobOutput] = {}
        self.counters = dict.fromkeys(_COUNTERS, 0)

    # --- queue ---------------------------------------------------------------
    def enqueue(self, job: DynamicJob | Sequence[DynamicJob]) -> None:
        """Queue one job or a list; a job that can never run raises ValueError here."""
        jobs = [job] if isinstance(job, DynamicJob) else list(job)
        for j in jobs:
            self._validate(j)
        if len({id(j) for j in jobs}) != len(jobs):
            raise ValueError("a DynamicJob is listed twice: already enqueued in this list; create one job per request")
        now = time.time()
        for j in jobs:
            j.state.time_enqueued = now
            self.scheduler.add(j)
            self.counters["prompt_tokens"] += j.prompt_len

    def _validate(self, job: DynamicJob) -> None:
        if not isinstance(job, DynamicJob):
            raise TypeError(f"enqueue takes DynamicJob objects, got {type(job).__name__}")
        total, limit = job.max_total_tokens, self.model.max_seq_len
        if total > limit:
            raise ValueError(f"prompt too long: {job.prompt_len} prompt tokens + {job.max_new_tokens} "
                             f"max_new_tokens = {total} tokens exceeds the model's max_seq_len of {limit}")
        if self.scheduler.pages_needed(job) > self.cache.num_pages:
            raise ValueError(f"prompt too long: {job.prompt_len} prompt tokens + {job.max_new_tokens} "
                             f"max_new_tokens = {total} tokens exceeds the cache's {self.cache.max_tokens} tokens")
        vocab = self.model.config.vocab_size
        bad = [t for t in job.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        bad = sorted(t for t in job.stop_tokens if not 0 <= t < vocab)
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        if job.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass tokenizer= to DynamicGenerator")
        if job.state.serial or job.state.page_table or job.state.new_ids:
            raise ValueError("this DynamicJob was already enqueued; create a new one")

    def num_remaining_jobs(self) -> int:
        return self.scheduler.num_queued + len(self.scheduler.active)

    # --- stepping -------------------------------------------------------------
    def iterate(self) -> list[GeneratorResult]:
        """Run one forward over the packed batch; return the results it produced."""
        sched = self.scheduler
        now = time.time()
        for job in sched.admit():
            job.state.time_started = now
            self.outputs[id(job)] = JobOutput(job, self.tokenizer)
            self.counters["cached_tokens"] += job.state.cached_tokens
        self.counters["peak_batch_size"] = max(self.counters["peak_batch_size"], len(sched.active))
        chunks = sched.plan()
        if not chunks:
            if sched.active or sched.queue:
                raise RuntimeError("scheduler made no progress (no runnable job) — this is a bug")
            return []
        for copy in sched.take_copies(chunks):
            self.cache.copy_prefix(copy.src_page, copy.dst_page, copy.num_tokens)
        sched.copies_done(chunks)
        batch, sampled = build_forward_batch(chunks, self.cache, self.model.device)
        logits = self.model.forward(batch, self.cache)                        # [N, V] float32
        self.counters["forward_passes"] += 1
        for ch in chunks:
            self.counters["prefill_tokens"] += max(0, min(ch.end, ch.job.prompt_len) - ch.start)
            sched.computed(ch)
        results = self._sample(sampled, logits)
        if not self.num_remaining_jobs():
            self.cache.defragment()
        return results

    def _sample(self, sampled: list[ScheduledChunk], logits: torch.Tensor) -> list[GeneratorResult]:
        jobs = [ch.job for ch in sampled]
        logits_cpu = logits.cpu() if any(job.return_logits for job in jobs) else None   # as computed
        logits = _mark_nonfinite(jobs, logits)
        samples = _sample_rows(jobs, logits)
        results = []
        for row, (ch, smp) in enumerate(zip(sampled, samples)):
            job = ch.job
            result = self.outputs[id(job)].accept(smp, None if logits_cpu is None else logits_cpu[row])
            self.counters["generated_tokens"] += 1
            if result["eos"]:
                self.scheduler.finish(job)
                del self.outputs[id(job)]
            results.append(result)
        return results

    def stats(self) -> GeneratorStats:
        pool = self.cache.pool
        return GeneratorStats(**self.counters, pages_total=pool.num_pages,
                              pages_in_use=pool.num_in_use, pages_cached=len(pool.cached),
                              pages_evicted=pool.num_evicted)

    def defragment(self) -> None:
        """Pack cached pages to the lowest page ids; runs automatically when idle."""
        if self.scheduler.active:
            raise RuntimeError("defragment needs an idle generator")
        self.cache.defragment()

    # --- convenience -----------------------------------------------------------
    def generate(self, prompt: str | Sequence[str], max_new_tokens: int, min_new_tokens: int = 0,
                 stop_conditions: Optional[Sequence[int | str]] = None,
                 gen_settings: Optional[SamplerSettings | Sequence[SamplerSettings]] = None,
                 seed: Optional[int] = None, add_bos: bool = False, encode_special_tokens: bool = False,
                 decode_special_tokens: bool = False, completion_only: bool = False) -> str | list[str]:
        """Generate for one prompt (returns str) or a list (returns a list, same order).
        stop_conditions=None stops at the tokenizer's EOS ids; pass [] to disable. With a
        list of prompts, prompt i uses seed + i."""
        if self.tokenizer is None:
            raise ValueError("generate() needs a tokenizer; pass tokenizer= to DynamicGenerator")
        if self.num_remaining_jobs():
            raise RuntimeError("generate() needs an idle generator; drain enqueued jobs with iterate() first")
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        settings = _per_prompt(gen_settings, len(prompts))
        stops = self.tokenizer.eos_token_ids if stop_conditions is None else stop_conditions
        jobs = [DynamicJob(self.tokenizer.encode(p, add_bos=add_bos, encode_special_tokens=encode_special_tokens),
                           max_new_tokens, min_new_tokens, stops, settings[i],
                           None if seed is None else seed + i, identifier=i,
                           decode_special_tokens=decode_special_tokens)
                   for i, p in enumerate(prompts)]
        self.enqueue(jobs)
        completions = [""] * len(jobs)
        while self.num_remaining_jobs():
            for r in self.iterate():
                if r["eos"]:
                    completions[r["identifier"]] = r["full_completion"]
        texts = completions if completion_only else [p + c for p, c in zip(prompts, completions)]
        return texts[0] if single else texts


def _per_prompt(settings: Any, n: int) -> list[Optional[SamplerSettings]]:
    if settings is None or isinstance(settings, SamplerSettings):
        return [settings] * n
    settings = list(settings)
    if len(settings) != n:
        raise ValueError(f"gen_settings has {len(settings)} entries for {n} prompts")
    return settings


def _mark_nonfinite(jobs: list[DynamicJob], logits: torch.Tensor) -> torch.Tensor:
    """Count, per job, the sampled positions whose logits hold a NaN or an Inf (a broken model or
    an overflow; results carry the count as "nonfinite_logits" so a task can refuse or flag the
    row), and give the sampler finite rows in their place: NaN as -inf, +inf as the largest float,
    a row with nothing left above -inf as all zeros. Rows that are finite are returned untouched.
    The common case costs one sum over the logits (NaN and Inf carry into it; 0.13 ms for 32 x 49,152
    here, where torch.isfinite(...).all() took 3.3 ms); a non-finite sum is checked row by row."""
    if math.isfinite(float(logits.sum())):
        return logits
    bad = (~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist()
    if not bad:                                 # finite rows whose sum overflowed
        return logits
    logits = logits.clone()
    big = torch.finfo(logits.dtype).max
    for i in bad:
        jobs[i].state.nonfinite_logits += 1
        row = torch.nan_to_num(logits[i], nan=float("-inf"), posinf=big, neginf=float("-inf"))
        logits[i] = row if bool((row > float("-inf")).any()) else torch.zeros_like(row)
    return logits


def _sample_rows(jobs: list[DynamicJob], logits: torch.Tensor) -> list[SampleResult]:
    """Greedy jobs without penalties or extras share one argmax (stop tokens banned before
    min_new_tokens at -inf for it, as `sample` bans them); the rest sample alone."""
    out: list[Optional[SampleResult]] = [None] * len(jobs)
    fast = [i for i, j in enumerate(jobs) if _plain_greedy(j)]
    if fast:
        rows = logits if len(fast) == len(jobs) else logits[fast]
        bans = [(r, t) for r, i in enumerate(fast) for t in _banned(jobs[i])]     # ids checked at enqueue
        if bans:                  # -inf in place for the argmax, then the caller's values back (no copy)
            where = tuple(torch.tensor(list(ix)) for ix in zip(*bans))
            with torch.inference_mode(rows.is_inference()):      # the model's logits are inference tensors
                saved = rows[where].clone()
                rows[where] = float("-inf")
                try:
                    tokens = greedy_tokens(rows).tolist()
                finally:
                    rows[where] = saved
        else:
            tokens = greedy_tokens(rows).tolist()
        for i, t in zip(fast, tokens):
            out[i] = SampleResult(token=t, prob=float("nan"), probs=None)
    for i, job in enumerate(jobs):
        if out[i] is None:
            out[i] = sample(logits[i], job.gen_settings, _history(job), job.state.rng, _banned(job))
    return out


def _plain_greedy(job: DynamicJob) -> bool:
    s = job.gen_settings
    return s.is_greedy and not s.needs_history and not job.return_probs and not job.return_top_tokens


def _banned(job: DynamicJob) -> list[int]:
    return sorted(job.stop_tokens) if len(job.state.new_ids) < job.min_new_tokens else []


def _history(job: DynamicJob) -> Optional[torch.Tensor]:
    if not job.gen_settings.needs_history:
        return None
    return torch.tensor(job.prompt_ids + job.state.new_ids, dtype=torch.long)
