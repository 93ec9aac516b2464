"""KVManager: the one owner of a job's pages, between the scheduler and the page pool.

The scheduler decides who runs and what each job computes; everything about pages goes
through five calls here, so the pool's internals stay in one place:

    admit(job)               reserve pages for prompt + max_new_tokens, reusing a cached prefix
    ready(job)               the pages the job reads from other jobs are filled
    on_computed(job, a, b)   K/V of positions [a, b) are in the job's pages
    rollback(job, n)         positions n and later are discarded (rejected draft tokens)
    free(job)                release the job's pages (cached ones stay reusable)

Prefix reuse: whole prompt pages are shared by reference (their chain hash matches), and the
tokens of a partly shared page are copied from a sibling page (PageCopy, done by the cache).

    prompt:   | full page (shared) | full page (shared) | page copied from a sibling, then computed |
    computed:   ---- reused, num_computed_tokens starts here ----^ copy ^ ... the job's own chunks

NOTE: a job writes K/V only into its own pages: full pages are shared only when they hold
prompt tokens before the last one, and the page holding the last prompt token is always the
job's. Speculative rows past the accepted tokens write there too; `rollback` lowers those pages'
valid counts, so neither dedup waits nor the prompt cache ever count a rejected token's slot (the
pool's hashes and sibling tokens hold prompt tokens only, never generated ones).

Cache formats with a recent-token window (evalrun/kernels/kv_format.py) give each running job one
block of the window store, and reuse a prefix only up to a block boundary: the tokens of
a partly reused block are computed again, so their exact K/V are in the job's block.
"""
from __future__ import annotations

from typing import Optional

from .job import DynamicJob, PageCopy
from .page_pool import PagePool

MIN_TOKENS_TO_WAIT_FOR = 16   # copy from a page still being filled only if it saves this much


class KVManager:
    def __init__(self, pool: PagePool, window: int = 0, window_slots: int = 0):
        self.pool = pool
        self.window = window
        self.window_slots = window_slots
        self.free_windows = list(range(window_slots - 1, -1, -1)) if window else []

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def pages_needed(self, job: DynamicJob) -> int:
        return -(-job.max_total_tokens // self.pool.page_size)

    # --- admit ---------------------------------------------------------------
    def admit(self, job: DynamicJob) -> bool:
        """Reserve the job's pages (False, with nothing held, when they do not fit)."""
        pool, ps, st = self.pool, self.pool.page_size, job.state
        if self.window and not self.free_windows:
            return False                             # every block of the window store is in use
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

    # --- ready / copies --------------------------------------------------------
    def ready(self, job: DynamicJob) -> bool:
        pages = self.pool.pages
        return all(pages[pid].num_valid >= n for pid, n in job.state.waits)

    def take_copy(self, job: DynamicJob) -> Optional[PageCopy]:
        """The job's pending page copy, if any (its source is ready: the job was scheduled)."""
        st = job.state
        if st.copy is None:
            return None
        st.waits = []
        return st.copy

    def copy_done(self, job: DynamicJob) -> None:
        st = job.state
        if st.copy is not None:
            self.pool.mark_valid(st.copy.dst_page, st.copy.num_tokens)
            self.pool.release(st.copy.src_page)
            st.copy = None

    # --- computed / rollback ---------------------------------------------------
    def on_computed(self, job: DynamicJob, start: int, end: int) -> None:
        """K/V of positions [start, end) are written: jobs waiting on these pages can go on."""
        ps, st = self.pool.page_size, job.state
        st.num_computed_tokens = end
        st.waits = []
        for idx in range(start // ps, (end - 1) // ps + 1):
            self.pool.mark_valid(st.page_table[idx], min(ps, end - idx * ps))

    def rollback(self, job: DynamicJob, num_tokens: int) -> None:
        """Discard the K/V of positions num_tokens and later: generated positions, or the last
        prompt position at most (its page is always the job's own, never a shared one)."""
        ps, st = self.pool.page_size, job.state
        if num_tokens < job.prompt_len - 1:
            raise ValueError(f"rollback to {num_tokens} tokens would discard shared prompt tokens "
                             f"(the prompt has {job.prompt_len})")
        st.num_computed_tokens = min(st.num_computed_tokens, num_tokens)
        for idx in range(num_tokens // ps, len(st.page_table)):
            self.pool.truncate_valid(st.page_table[idx], num_tokens - idx * ps)

    # --- free --------------------------------------------------------------------
    def free(self, job: DynamicJob) -> None:
        """Release the job's pages, and the source of a page copy still pending (a job can end
        before it ever computed: a draft model's mirror whose target finished first)."""
        st = job.state
        if st.copy is not None:
            self.pool.release(st.copy.src_page)
            st.copy = None
        st.waits = []
        for pid in st.page_table:
            self.pool.release(pid)
        job.state.page_table = []
        if job.state.window_slot is not None:
            self.free_windows.append(job.state.window_slot)
            job.state.window_slot = None
