"""Continuous batching over a job queue with prefix dedup. Plain Python: no tensors.

One rule for every job: it computes `num_tokens - num_computed_tokens` new
tokens (a prompt chunk, or the one token sampled last step), at most
`max_chunk_size` tokens per forward across all jobs, single-token jobs first.

Admission reserves pages for prompt + max_new_tokens (no preemption). The queue
is kept sorted by prompt tokens, so jobs sharing a prefix are admitted together;
the first computes the shared pages, the rest reference them and wait until the
pages they need are filled.

Cache formats with a recent-token window (kernels/kv_format.py) give each running job one
block of the window store, and reuse a prefix only up to a block boundary: the tokens of
a partly reused block are computed again, so their exact K/V are in the job's block.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

from .job import DynamicJob, PageCopy
from .page_pool import PagePool

MIN_TOKENS_TO_WAIT_FOR = 16   # copy from a page still being filled only if it saves this much


@dataclass
class ScheduledChunk:
    job: DynamicJob
    start: int                 # first position computed
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    def __init__(self, pool: PagePool, max_batch_size: Optional[int], max_chunk_size: int,
                 window: int = 0, window_slots: int = 0):
        self.pool = pool
        self.window = window
        if window:
            max_batch_size = window_slots if max_batch_size is None else min(max_batch_size, window_slots)
        self.free_windows = list(range(window_slots - 1, -1, -1)) if window else []
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        self.queue: list[tuple[tuple[int, ...], int, DynamicJob]] = []
        self.active: list[DynamicJob] = []
        self._serial = 0

    def add(self, job: DynamicJob) -> None:
        self._serial += 1
        job.state.serial = self._serial
        bisect.insort(self.queue, (tuple(job.prompt_ids), self._serial, job), key=lambda e: e[:2])

    def pages_needed(self, job: DynamicJob) -> int:
        return -(-job.max_total_tokens // self.pool.page_size)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    # --- admission -----------------------------------------------------------
    def admit(self) -> list[DynamicJob]:
        admitted = []
        while self.queue and (self.max_batch_size is None or len(self.active) < self.max_batch_size):
            job = self.queue[0][2]
            if not self._try_start(job):
                break
            self.queue.pop(0)
            self.active.append(job)
            admitted.append(job)
        return admitted

    def _try_start(self, job: DynamicJob) -> bool:
        pool, ps, st = self.pool, self.pool.page_size, job.state
        match = pool.match_prefix(job.prompt_ids, job.prompt_len - 1)
        copy_tokens = match.copy_tokens - match.copy_tokens % self.window if self.window else match.copy_tokens
        copy = match.copy_page if copy_tokens else None
        # NOTE: every page the job reads is held before allocating, so that the allocation
        # cannot evict it (an evicted copy source forgets its tokens: the copy would never come)
        for pid in match.full_pages + ([copy] if copy is not None else []):
            pool.acquire(pid)
        new_needed = self.pages_needed(job) - match.num_pages
        if copy is not None and new_needed > pool.num_available:
            pool.release(copy)                       # the copy only saves work: drop it, not the job
            copy = None
        if new_needed > pool.num_available:
            for pid in match.full_pages:
                pool.release(pid)
            return False
        st.page_table = match.full_pages + pool.allocate(new_needed)
        st.num_computed_tokens = match.num_pages * ps
        st.waits = [(pid, ps) for pid in match.full_pages if pool.pages[pid].num_valid < ps]
        self._plan_copy(job, copy, copy_tokens)
        st.cached_tokens = st.num_computed_tokens
        if self.window:
            st.window_slot = self.free_windows.pop()
        self._register_prompt_pages(job, match.num_pages, match.parent_hash)
        return True

    def _plan_copy(self, job: DynamicJob, src: Optional[int], n: int) -> None:
        """src (held by the caller; kept while the copy is pending, else released)."""
        st = job.state
        if src is None:
            return
        ready = self.pool.pages[src].num_valid >= n
        if not ready and not st.waits and n < MIN_TOKENS_TO_WAIT_FOR:
            self.pool.release(src)
            return      # not worth waiting for, unless the job waits for its full pages anyway
        st.copy = PageCopy(src, st.page_table[st.num_computed_tokens // self.pool.page_size], n)
        st.waits.append((src, n))
        st.num_computed_tokens += n

    def _register_prompt_pages(self, job: DynamicJob, first: int, parent: int) -> None:
        ps = self.pool.page_size
        for i in range(first, -(-job.prompt_len // ps)):
            tokens = job.prompt_ids[i * ps: (i + 1) * ps]
            parent = self.pool.register(job.state.page_table[i], parent, tokens)
            if parent is None:
                break

    # --- one step ------------------------------------------------------------
    def ready(self, job: DynamicJob) -> bool:
        pages = self.pool.pages
        return all(pages[pid].num_valid >= n for pid, n in job.state.waits)

    def plan(self) -> list[ScheduledChunk]:
        """Chunks for the next forward: single tokens (decode) first, then prompt chunks."""
        budget = self.max_chunk_size
        decode, prefill = [], []
        for job in self.active:
            todo = job.num_tokens - job.state.num_computed_tokens
            if todo > 0:
                (decode if todo == 1 else prefill).append(job)
        chunks = []
        for job in decode + prefill:
            if budget == 0:
                break
            if not self.ready(job):
                continue
            start = job.state.num_computed_tokens
            n = min(job.num_tokens - start, budget)
            chunks.append(ScheduledChunk(job, start, n))
            budget -= n
        return chunks

    def take_copies(self, chunks: list[ScheduledChunk]) -> list[PageCopy]:
        """Pending page copies of the scheduled jobs (their sources are ready)."""
        copies = []
        for chunk in chunks:
            st = chunk.job.state
            if st.copy is not None:
                copies.append(st.copy)
                st.waits = []
        return copies

    def copies_done(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            st = chunk.job.state
            if st.copy is not None:
                self.pool.mark_valid(st.copy.dst_page, st.copy.num_tokens)
                self.pool.release(st.copy.src_page)
                st.copy = None

    def computed(self, chunk: ScheduledChunk) -> None:
        """Mark the chunk's slots valid so jobs waiting on these pages can go on."""
        ps, st = self.pool.page_size, chunk.job.state
        st.num_computed_tokens = chunk.end
        st.waits = []
        for idx in range(chunk.start // ps, (chunk.end - 1) // ps + 1):
            self.pool.mark_valid(st.page_table[idx], min(ps, chunk.end - idx * ps))

    def finish(self, job: DynamicJob) -> None:
        self.active.remove(job)
        for pid in job.state.page_table:
            self.pool.release(pid)
        job.state.page_table = []
        if job.state.window_slot is not None:
            self.free_windows.append(job.state.window_slot)
            job.state.window_slot = None
