"""DynamicGenerator: a job queue driven through packed forwards over the paged cache."""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from .batch import build_forward_batch
from .cache import PagedCache
from .draft import NgramDrafter
from .draft_model import DraftModelRunner
from .job import DynamicJob
from .model import Model
from .output import JobOutput
from .sampler import SamplerSettings
from .scheduler import ScheduledChunk, Scheduler
from .speculation import DraftPolicy, SpecSettings, max_draft
from .tokenizer import Tokenizer
from .types import GeneratorResult, GeneratorStats
from .verify import check_rows, choose_tokens, score_prompt_rows

_COUNTERS = ("prompt_tokens", "prefill_tokens", "cached_tokens", "generated_tokens",
             "peak_batch_size", "forward_passes", "drafted_tokens", "accepted_draft_tokens")


class DynamicGenerator:
    def __init__(self, model: Model, cache: PagedCache, tokenizer: Optional[Tokenizer] = None,
                 max_batch_size: Optional[int] = None, max_chunk_size: int = 2048,
                 draft_model: Optional[Model] = None, draft_cache: Optional[PagedCache] = None,
                 num_draft_tokens: int = 4, use_ngram_draft: bool = False, max_ngram: int = 4,
                 min_ngram: int = 1, adaptive_draft: bool = True, sampling_rule: str = "coupled"):
        """Speculative decoding (evalrun/engine/speculation.py) with use_ngram_draft (drafts looked up in
        each job's own tokens) or a draft_model with its draft_cache: up to num_draft_tokens per
        job and step, as many as pay for themselves (adaptive_draft=False: every proposal).
        sampling_rule: how sampled jobs verify drafts; "coupled" keeps a seeded job's tokens those
        of plain sampling, "rejection" is the standard rule (evalrun/engine/speculation.py)."""
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be None or an integer >= 1, got {max_batch_size!r}")
        if not isinstance(max_chunk_size, int) or max_chunk_size < 1:
            raise ValueError(f"max_chunk_size must be an integer >= 1, got {max_chunk_size!r}")
        if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"tokenizer/model vocab mismatch: the tokenizer has {tokenizer.vocab_size} tokens, "
                f"the model's embedding only {model.config.vocab_size}"
            )
        self.spec = SpecSettings(num_draft_tokens, use_ngram_draft, max_ngram, min_ngram, adaptive_draft, sampling_rule)
        self.draft = self._draft_runner(model, cache, draft_model, draft_cache, max_chunk_size,
                                        sampling_rule == "coupled")
        if self.draft is not None and use_ngram_draft:
            raise ValueError("give either use_ngram_draft=True or a draft_model, not both")
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(cache.pool, max_batch_size, max_chunk_size, cache.window, cache.window_slots)
        self.policy = None
        if use_ngram_draft or self.draft is not None:
            scale = None if self.draft is None else _weights(draft_model) / _weights(model)
            self.policy = DraftPolicy(self.spec, draft_scale=scale)
        self._draft_probs: dict[int, list] = {}
        self.outputs: dict[int, JobOutput] = {}
        self.counters = dict.fromkeys(_COUNTERS, 0)

    @staticmethod
    def _draft_runner(model: Model, cache: PagedCache, draft_model: Optional[Model],
                      draft_cache: Optional[PagedCache], max_chunk_size: int, coupled: bool) -> Optional[DraftModelRunner]:
        if draft_model is None:
            if draft_cache is not None:
                raise ValueError("draft_cache was given without a draft_model")
            return None
        if not isinstance(draft_model, Model):
            raise TypeError(f"draft_model must be an engine Model, got {type(draft_model).__name__}")
        if draft_model.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) differs from "
                             f"the model's ({model.config.vocab_size}): a draft must share the tokenizer")
        if draft_cache is None:
            draft_cache = PagedCache(draft_model, max_tokens=cache.max_tokens, page_size=cache.page_size,
                                     mode=cache.format, max_jobs=cache.window_slots or None)
        if len(draft_cache.layers) != draft_model.config.num_layers:
            raise ValueError(f"draft_cache has {len(draft_cache.layers)} layers, the draft model "
                             f"{draft_model.config.num_layers}: make it with PagedCache(draft_model, ...)")
        return DraftModelRunner(draft_model, draft_cache, max_chunk_size, coupled)

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
            self.outputs[id(j)] = JobOutput(j, self.tokenizer, now)
            self.scheduler.add(j)
            self.counters["prompt_tokens"] += j.prompt_len

    def _validate(self, job: DynamicJob) -> None:
        if not isinstance(job, DynamicJob):
            raise TypeError(f"enqueue takes DynamicJob objects, got {type(job).__name__}")
        total, limit = job.max_total_tokens, self.model.max_seq_len
        if total - 1 > limit:               # (the last token sampled is never run: it needs no position)
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
        bad = [t for t in job.think_end or () if not t < vocab]
        if bad:
            raise ValueError(f"think_end token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        if job.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass tokenizer= to DynamicGenerator")
        if job.state.serial or job.state.kv is not None or job.state.new_ids:
            raise ValueError("this DynamicJob was already enqueued; create a new one")

    def num_remaining_jobs(self) -> int:
        return self.scheduler.num_queued + len(self.scheduler.active)

    # --- stepping -------------------------------------------------------------
    def iterate(self) -> list[GeneratorResult]:
        """Run one forward over the packed batch; return the results it produced."""
        sched = self.scheduler
        now = time.time()
        for job in sched.admit():
            self.outputs[id(job)].start(now)
            self.counters["cached_tokens"] += job.state.cached_tokens
            if self.spec.use_ngram_draft:
                job.state.drafter = NgramDrafter(job.prompt_ids, self.spec.max_ngram, self.spec.min_ngram)
        self.counters["peak_batch_size"] = max(self.counters["peak_batch_size"], len(sched.active))
        chunks = sched.plan()
        if not chunks:
            if sched.active or sched.queue:
                raise RuntimeError("scheduler made no progress (no runnable job) — this is a bug")
            return []
        if self.policy is not None:
            chunks = sched.with_drafts(chunks, self._drafts(chunks))
        t0 = time.perf_counter()
        jobs = [ch.job for ch in chunks]
        for copy in sched.take_copies(jobs):
            self.cache.copy_prefix(copy.src_page, copy.dst_page, copy.num_tokens)
        sched.copies_done(jobs)
        batch, sampled, scores = build_forward_batch(chunks, self.cache, self.model.device, with_scores=True)
        logits = self.model.forward(batch, self.cache)                        # [N, V] float32
        if scores is not None:                          # prompt tokens of jobs with score_from
            values, greedy = score_prompt_rows(scores.jobs, scores.targets, logits.index_select(0, scores.rows))
            for job, value, top in zip(scores.jobs, values, greedy):
                self.outputs[id(job)].scored(value, top)
            logits = logits.index_select(0, scores.sample_rows)
        self.counters["forward_passes"] += 1
        rows, drafted = sum(ch.num_rows for ch in chunks), any(ch.draft for ch in chunks)
        for ch in chunks:
            self.counters["prefill_tokens"] += max(0, min(ch.end, ch.job.prompt_len) - ch.start)
            if not ch.draft:
                sched.computed(ch)
        results = self._sample(sampled, logits)              # verifies the drafts
        if self.policy is not None and all(ch.num_tokens == 1 for ch in chunks):
            self.policy.observe_step(rows, time.perf_counter() - t0, drafted)
        if not self.num_remaining_jobs():
            self.cache.defragment()
            if self.draft is not None:
                self.draft.cache.defragment()
        return results

    def _drafts(self, chunks: list[ScheduledChunk]) -> dict[int, list[int]]:
        """Draft tokens of the step's decoding jobs that are worth verifying (by job id), within the
        scheduler's draft budget; never reaching a position a thinking budget forces (draft_horizon)."""
        sched, spec = self.scheduler, self.spec
        budget = sched.draft_budget(chunks)
        jobs = [ch.job for ch in chunks if ch.is_decode]
        if budget <= 0 or not jobs:
            return {}
        limits = {id(j): min(budget, max_draft(j.num_tokens, len(j.state.new_ids), j.draft_horizon,
                                               self.model.max_seq_len, self.cache.window, spec.num_draft_tokens))
                  for j in jobs}
        if self.draft is None:
            proposals = {id(j): d for j in jobs if limits[id(j)] and (d := j.state.drafter.propose(limits[id(j)]))}
        else:
            proposals = {id(j): [0] * limits[id(j)] for j in jobs if limits[id(j)]}   # lengths only, yet
        if not proposals:
            return {}
        remaining = None if sched.queue else {id(j): j.max_new_tokens - len(j.state.new_ids) for j in sched.active}
        draft_cost = None if self.draft is None else self.draft.cost
        chosen = self.policy.choose(proposals, {id(j): j.state.draft for j in jobs}, sched.max_chunk_size - budget,
                                    len(jobs), remaining, draft_cost)
        if self.draft is None or not chosen:
            return chosen
        made = self.draft.propose([(ch.job, len(ch.draft)) for ch in sched.with_drafts(chunks, chosen) if ch.draft])
        self._draft_probs = {k: p.probs for k, p in made.items()}
        return {k: p.tokens for k, p in made.items()}

    def _sample(self, sampled: list[ScheduledChunk], logits: torch.Tensor) -> list[GeneratorResult]:
        jobs = [ch.job for ch in sampled]
        logits_cpu = logits.cpu() if any(job.return_logits for job in jobs) else None   # as computed
        logits, top = check_rows([ch.job for ch in sampled for _ in range(1 + len(ch.draft))], logits)
        probs = [self._draft_probs.get(id(ch.job)) if ch.draft else None for ch in sampled]
        chosen = choose_tokens(jobs, [ch.draft for ch in sampled], logits, probs, self.spec.sampling_rule, top)
        self._draft_probs = {}
        results, row = [], 0
        for ch, kept in zip(sampled, chosen):
            job = ch.job
            if ch.draft:                                     # recorded first: a final result reports it
                self.policy.record(job.state.draft, len(ch.draft), len(kept) - 1)
                self.counters["drafted_tokens"] += len(ch.draft)
                self.counters["accepted_draft_tokens"] += len(kept) - 1
            elif self.policy is not None and ch.num_tokens == 1:
                self.policy.record(job.state.draft, 0, 0)
            before = len(job.state.new_ids)
            result = self.outputs[id(job)].accept(
                kept, None if logits_cpu is None else logits_cpu[row: row + len(kept)])
            row += 1 + len(ch.draft)
            added = job.state.new_ids[before:]
            self.counters["generated_tokens"] += len(added)
            if ch.draft:
                self.scheduler.computed(ch, min(len(kept) - 1, len(added)))
            if job.state.drafter is not None:
                job.state.drafter.extend(added)
            if result["eos"]:
                self.scheduler.finish(job)
                if self.draft is not None:
                    self.draft.free(job)
                del self.outputs[id(job)]
            results.append(result)
        return results

    def stats(self) -> GeneratorStats:
        pool = self.cache.pool
        draft = self.draft
        return GeneratorStats(**self.counters, pages_total=pool.num_pages,
                              pages_in_use=pool.num_in_use, pages_cached=len(pool.cached),
                              pages_evicted=pool.num_evicted,
                              draft_forward_passes=0 if draft is None else draft.forward_passes,
                              draft_cached_tokens=0 if draft is None else draft.cached_tokens)

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
                 decode_special_tokens: bool = False, completion_only: bool = False,
                 think_end: Optional[str | Sequence[int]] = None,
                 max_thinking_tokens: Optional[int] = None) -> str | list[str]:
        """Generate for one prompt (returns str) or a list (returns a list, same order).
        stop_conditions=None stops at the tokenizer's EOS ids; pass [] to disable. With a
        list of prompts, prompt i uses seed + i. think_end (the marker's text, special tokens as
        their ids, or its ids) and max_thinking_tokens: DynamicJob's thinking phase."""
        if self.tokenizer is None:
            raise ValueError("generate() needs a tokenizer; pass tokenizer= to DynamicGenerator")
        if self.num_remaining_jobs():
            raise RuntimeError("generate() needs an idle generator; drain enqueued jobs with iterate() first")
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        settings = _per_prompt(gen_settings, len(prompts))
        stops = self.tokenizer.eos_token_ids if stop_conditions is None else stop_conditions
        marker = self.tokenizer.encode(think_end, encode_special_tokens=True) if isinstance(think_end, str) \
            else think_end
        jobs = [DynamicJob(self.tokenizer.encode(p, add_bos=add_bos, encode_special_tokens=encode_special_tokens),
                           max_new_tokens, min_new_tokens, stops, settings[i],
                           None if seed is None else seed + i, identifier=i,
                           decode_special_tokens=decode_special_tokens, think_end=marker,
                           max_thinking_tokens=max_thinking_tokens)
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


def _weights(model: Model) -> int:
    """Parameters a forward streams (the layers and the LM head): the draft's cost scale."""
    c = model.config
    layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * layer + c.vocab_size * c.hidden_size
