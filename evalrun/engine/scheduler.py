"""Continuous batching over a job queue with prefix dedup. Plain Python: no tensors.

One rule for every job: it computes `num_tokens - num_computed_tokens` new
tokens (a prompt chunk, or the one token sampled last step), at most
`max_chunk_size` tokens per forward across all jobs, single-token jobs first.
A job in its decode stage may carry draft tokens (speculative decoding): its chunk is then
the last token plus the drafts, each a row of the decode group with logits of its own, and
the tokens the target model rejects are rolled back (`computed`).

Admission reserves pages for prompt + max_new_tokens (no preemption). The queue
is kept sorted by prompt tokens, so jobs sharing a prefix are admitted together;
the first computes the shared pages, the rest reference them and wait until the
pages they need are filled. Everything about pages goes through the KVManager.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

from .job import DynamicJob, PageCopy
from .kv_manager import KVManager
from .page_pool import PagePool


@dataclass
class ScheduledChunk:
    job: DynamicJob
    start: int                 # first position computed
    num_tokens: int            # known tokens computed (draft tokens not included)

    @property
    def draft(self) -> list[int]:
        """Guessed tokens after them: the job's draft being verified (JobState.draft_ids, decode
        chunks only; set by Scheduler.plan, cleared by Scheduler.computed)."""
        return self.job.state.draft_ids

    @property
    def end(self) -> int:
        """One past the last known position computed."""
        return self.start + self.num_tokens

    @property
    def num_rows(self) -> int:
        return self.num_tokens + len(self.draft)


class Scheduler:
    def __init__(self, pool: PagePool, max_batch_size: Optional[int], max_chunk_size: int,
                 window: int = 0, window_slots: int = 0):
        self.kv = KVManager(pool, window, window_slots)
        if window:
            max_batch_size = window_slots if max_batch_size is None else min(max_batch_size, window_slots)
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        self.queue: list[tuple[tuple[int, ...], int, DynamicJob]] = []
        self.active: list[DynamicJob] = []
        self._serial = 0

    @property
    def pool(self) -> PagePool:
        return self.kv.pool

    @property
    def window(self) -> int:
        return self.kv.window

    @property
    def free_windows(self) -> list[int]:
        return self.kv.free_windows

    def add(self, job: DynamicJob) -> None:
        self._serial += 1
        job.state.serial = self._serial
        bisect.insort(self.queue, (tuple(job.prompt_ids), self._serial, job), key=lambda e: e[:2])

    def pages_needed(self, job: DynamicJob) -> int:
        return self.kv.pages_needed(job)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    # --- admission -----------------------------------------------------------
    def admit(self) -> list[DynamicJob]:
        admitted = []
        while self.queue and (self.max_batch_size is None or len(self.active) < self.max_batch_size):
            job = self.queue[0][2]
            if not self.kv.admit(job):
                break
            self.queue.pop(0)
            self.active.append(job)
            admitted.append(job)
        return admitted

    # --- one step ------------------------------------------------------------
    def ready(self, job: DynamicJob) -> bool:
        return self.kv.ready(job)

    def decoding(self) -> list[DynamicJob]:
        """Active jobs whose next chunk is their one last token (the jobs that may draft)."""
        return [j for j in self.active if j.num_tokens - j.state.num_computed_tokens == 1]

    def plan(self, drafts: Optional[dict[int, list[int]]] = None) -> list[ScheduledChunk]:
        """Chunks for the next forward: single tokens (decode) first, then prompt chunks.
        drafts: id(job) -> draft tokens for decode jobs, given what budget the prompt chunks leave."""
        drafts = drafts or {}
        budget = self.max_chunk_size
        decode, prefill = [], []
        for job in self.active:
            todo = job.num_tokens - job.state.num_computed_tokens
            if todo > 0:
                (decode if todo == 1 else prefill).append(job)
        chunks = []
        for job in decode:
            if budget == 0:
                break
            if not self.ready(job):
                continue
            chunks.append(ScheduledChunk(job, job.state.num_computed_tokens, 1))
            budget -= 1
        decoded = list(chunks)
        for job in prefill:
            if budget == 0:
                break
            if not self.ready(job):
                continue
            start = job.state.num_computed_tokens
            n = min(job.num_tokens - start, budget)
            if self.max_chunk_size > 2:          # (with 2 or fewer it could never finish a prompt)
                # NOTE: never leave one prompt token alone, nor compute one alone: the decode kernel
                # would take it, which agrees with the prefill kernel only to rounding, and a job's
                # logits would then depend on how the batch around it cut its prompt
                if job.num_tokens - (start + n) == 1:
                    n -= 1
                if n < 2:
                    continue
            chunks.append(ScheduledChunk(job, start, n))
            budget -= n
        for ch in decoded:                   # drafts last: they only speed up, prompts let jobs start
            ch.job.state.draft_ids = list(drafts.get(id(ch.job), ()))[:budget]
            budget -= len(ch.draft)
        return chunks

    def take_copies(self, chunks: list[ScheduledChunk]) -> list[PageCopy]:
        """Pending page copies of the scheduled jobs (their sources are ready)."""
        copies = (self.kv.take_copy(ch.job) for ch in chunks)
        return [c for c in copies if c is not None]

    def copies_done(self, chunks: list[ScheduledChunk]) -> None:
        for ch in chunks:
            self.kv.copy_done(ch.job)

    def computed(self, chunk: ScheduledChunk, num_kept: Optional[int] = None) -> None:
        """The chunk ran: its known tokens' K/V, and the first `num_kept` of its draft tokens
        (those the target accepted), are valid; the K/V of the rest are rolled back."""
        kept = chunk.end + (num_kept or 0)
        self.kv.on_computed(chunk.job, chunk.start, kept)
        if kept < chunk.start + chunk.num_rows:
            self.kv.rollback(chunk.job, kept)
        chunk.job.state.draft_ids = []

    def finish(self, job: DynamicJob) -> None:
        self.active.remove(job)
        self.kv.free(job)
