"""Continuous batching over a job queue with prefix dedup. Plain Python: no tensors.

One rule for every job: it computes `num_tokens - num_computed_tokens` new
tokens (a prompt chunk, or the one token sampled last step), at most
`max_chunk_size` tokens per forward across all jobs, single-token jobs first.
A job in its decode stage may carry draft tokens (speculative decoding): its chunk is then
the last token plus the drafts, each a row of the decode group with logits of its own, and
the tokens the target model rejects are rolled back (`computed`). Drafts take what the
budget leaves after the known tokens (`draft_budget`, `with_drafts`), and travel in the
chunk as a value: nothing about them is kept in the job.

The scheduler alone writes `num_computed_tokens`: a prefix hit starts it at the allocation's
cached tokens, each computed chunk advances it, a rejected draft lowers it. Admission reserves
pages for prompt + max_new_tokens (no preemption): the KVManager returns a `KVAllocation`, kept
in `JobState.kv`. The queue is kept sorted by prompt tokens, so jobs sharing a prefix are
admitted together; the first computes the shared pages, the rest reference them and wait until
the pages they need are filled. Everything about pages goes through the KVManager.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .job import DynamicJob
from .kv_manager import KVManager, PageCopy
from .page_pool import PagePool


@dataclass
class ScheduledChunk:
    job: DynamicJob
    start: int                 # first position computed
    num_tokens: int            # known tokens computed (draft tokens not included)
    draft: tuple[int, ...] = ()   # guessed tokens after them, to verify (decode chunks only)

    @property
    def end(self) -> int:
        """One past the last known position computed."""
        return self.start + self.num_tokens

    @property
    def num_rows(self) -> int:
        return self.num_tokens + len(self.draft)

    @property
    def is_decode(self) -> bool:
        """The job's one last token (the chunk that may carry a draft)."""
        return self.num_tokens == 1 and self.end == self.job.num_tokens


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
        return self.kv.pages_needed(job.max_total_tokens)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    # --- admission -----------------------------------------------------------
    def admit(self) -> list[DynamicJob]:
        admitted = []
        while self.queue and (self.max_batch_size is None or len(self.active) < self.max_batch_size):
            job = self.queue[0][2]
            if not self.start(job):
                break
            self.queue.pop(0)
            admitted.append(job)
        return admitted

    def start(self, job: DynamicJob) -> bool:
        """Make the job active if its pages fit (the queue's admission; a draft model's mirror
        jobs start here directly). Its computed count starts at the cached prefix."""
        alloc = self.kv.admit(job.prompt_ids, job.max_total_tokens, job.reuse_limit)
        if alloc is None:
            return False
        job.state.kv = alloc
        job.state.num_computed_tokens = alloc.cached_tokens
        self.active.append(job)
        return True

    # --- one step ------------------------------------------------------------
    def ready(self, job: DynamicJob) -> bool:
        return self.kv.ready(job.state.kv)

    def plan(self) -> list[ScheduledChunk]:
        """Chunks for the next forward: single tokens (decode) first, then prompt chunks; no drafts
        (`with_drafts` adds them in what budget is left)."""
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
        return chunks

    def draft_budget(self, chunks: list[ScheduledChunk]) -> int:
        """Rows the step has left for draft tokens once its chunks' known tokens are counted."""
        return self.max_chunk_size - sum(ch.num_rows for ch in chunks)

    def with_drafts(self, chunks: list[ScheduledChunk], drafts: dict[int, Sequence[int]]) -> list[ScheduledChunk]:
        """The step's chunks, each decode chunk carrying its job's draft (drafts: id(job) -> tokens)
        as far as the draft budget goes, in chunk order. Drafts come last: they only speed up,
        prompts let jobs start."""
        if not drafts:
            return chunks
        budget = self.draft_budget(chunks)
        out = []
        for ch in chunks:
            draft = drafts.get(id(ch.job))
            if draft and budget > 0 and ch.is_decode:
                ch = ScheduledChunk(ch.job, ch.start, 1, tuple(draft[:budget]))
                budget -= len(ch.draft)
            out.append(ch)
        return out

    def take_copies(self, jobs: Iterable[DynamicJob]) -> list[PageCopy]:
        """Pending page copies of the scheduled jobs (their sources are ready)."""
        copies = (self.kv.take_copy(job.state.kv) for job in jobs)
        return [c for c in copies if c is not None]

    def copies_done(self, jobs: Iterable[DynamicJob]) -> None:
        for job in jobs:
            self.kv.copy_done(job.state.kv)

    def computed(self, chunk: ScheduledChunk, num_kept: Optional[int] = None) -> None:
        """The chunk ran: its known tokens' K/V, and the first `num_kept` of its draft tokens
        (those the target accepted), are valid; the K/V of the rest are rolled back."""
        kept = chunk.end + (num_kept or 0)
        st = chunk.job.state
        st.num_computed_tokens = kept
        self.kv.on_computed(st.kv, chunk.start, kept)
        if kept < chunk.start + chunk.num_rows:
            self.kv.rollback(st.kv, kept)

    def rollback(self, job: DynamicJob, num_tokens: int) -> None:
        """Positions num_tokens and later are no longer computed (a draft mirror's stale drafts)."""
        st = job.state
        st.num_computed_tokens = min(st.num_computed_tokens, num_tokens)
        self.kv.rollback(st.kv, num_tokens)

    def finish(self, job: DynamicJob) -> None:
        """The job leaves the active set; its pages are released (its allocation stays, emptied,
        with its cached_tokens)."""
        self.active.remove(job)
        self.kv.free(job.state.kv)
