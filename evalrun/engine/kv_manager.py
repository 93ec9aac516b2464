"""KVManager: the one owner of a job's pages, between the scheduler and the page pool.

The scheduler decides who runs and what each job computes; everything about pages goes
through these calls, so the pool's internals stay in one place. The manager knows token ids and
its own allocations, never jobs: it returns a typed `KVAllocation` (as vLLM v1's `allocate_slots`
returns its blocks) that the scheduler keeps in the job's state, and only the manager writes it.

    admit(prompt_ids, max_tokens)  reserve pages for prompt + max_new_tokens, reusing a cached prefix
    ready(alloc)                   the pages the job reads from other jobs are filled
    take_copy / copy_done(alloc)   the pending copy of a sibling's slots, then its end
    on_computed(alloc, a, b)       K/V of positions [a, b) are in the job's pages
    rollback(alloc, n)             positions n and later are discarded (rejected draft tokens)
    free(alloc)                    release the job's pages (cached ones stay reusable)

The job's computed count is the scheduler's: it starts at `alloc.cached_tokens` and the scheduler
advances it (and lowers it on a rollback) beside these calls.

Prefix reuse: whole prompt pages are shared by reference (their chain hash matches), and the
tokens of a partly shared page are copied from a sibling page (PageCopy, done by the cache).

    prompt:   | full page (shared) | full page (shared) | page copied from a sibling, then computed |
    computed:   ---- reused -------------------------------^ copy ^ cached_tokens: the job's chunks go on here

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

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .page_pool import PagePool

MIN_TOKENS_TO_WAIT_FOR = 16   # copy from a page still being filled only if it saves this much


@dataclass
class PageCopy:
    """Copy `num_tokens` prompt slots from a sibling page into the job's own page."""
    src_page: int
    dst_page: int
    num_tokens: int


@dataclass
class KVAllocation:
    """What `KVManager.admit` reserved for one job. NOTE: only kv_manager.py writes these fields
    (tests/test_job_state_writers.py); the scheduler keeps the record in `JobState.kv`."""
    page_table: list[int]               # page of positions [i * page_size, (i + 1) * page_size), i = index
    cached_tokens: int                  # prompt tokens reused (whole pages + copied slots): K/V already there
    prompt_len: int                     # a rollback never goes below prompt_len - 1 (shared prompt pages)
    waits: list[tuple[int, int]] = field(default_factory=list)   # (page id, slots that must be valid)
    copy: Optional[PageCopy] = None     # sibling slots to copy before the job's first chunk
    window_slot: Optional[int] = None   # block of the cache's recent-token window store


class KVManager:
    def __init__(self, pool: PagePool, window: int = 0, window_slots: int = 0):
        self.pool = pool
        self.window = window
        self.window_slots = window_slots
        self.free_windows = list(range(window_slots - 1, -1, -1)) if window else []

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def pages_needed(self, max_tokens: int) -> int:
        return -(-max_tokens // self.pool.page_size)

    # --- admit ---------------------------------------------------------------
    def admit(self, prompt_ids: Sequence[int], max_tokens: int,
              reuse_limit: Optional[int] = None) -> Optional[KVAllocation]:
        """Reserve pages for max_tokens positions of a job with this prompt (None, with nothing
        held, when they do not fit); at most its first reuse_limit positions (default: all but the
        last prompt token) come from the cache."""
        pool, ps = self.pool, self.pool.page_size
        if self.window and not self.free_windows:
            return None                              # every block of the window store is in use
        prompt_len = len(prompt_ids)
        limit = prompt_len - 1 if reuse_limit is None else min(reuse_limit, prompt_len - 1)
        match = pool.match_prefix(prompt_ids, limit)
        copy_tokens = match.copy_tokens - match.copy_tokens % self.window if self.window else match.copy_tokens
        copy = match.copy_page if copy_tokens else None
        # NOTE: every page the job reads is held before allocating, so that the allocation
        # cannot evict it (an evicted copy source forgets its tokens: the copy would never come)
        for pid in match.full_pages + ([copy] if copy is not None else []):
            pool.acquire(pid)
        new_needed = self.pages_needed(max_tokens) - match.num_pages
        if copy is not None and new_needed > pool.num_available:
            pool.release(copy)                       # the copy only saves work: drop it, not the job
            copy = None
        if new_needed > pool.num_available:
            for pid in match.full_pages:
                pool.release(pid)
            return None
        alloc = KVAllocation(match.full_pages + pool.allocate(new_needed), match.num_pages * ps, prompt_len,
                             [(pid, ps) for pid in match.full_pages if pool.pages[pid].num_valid < ps])
        self._plan_copy(alloc, copy, copy_tokens)
        if self.window:
            alloc.window_slot = self.free_windows.pop()
        self._register_prompt_pages(alloc, prompt_ids, match.num_pages, match.parent_hash)
        return alloc

    def _plan_copy(self, alloc: KVAllocation, src: Optional[int], n: int) -> None:
        """src (held by the caller; kept while the copy is pending, else released)."""
        if src is None:
            return
        ready = self.pool.pages[src].num_valid >= n
        if not ready and not alloc.waits and n < MIN_TOKENS_TO_WAIT_FOR:
            self.pool.release(src)
            return      # not worth waiting for, unless the job waits for its full pages anyway
        alloc.copy = PageCopy(src, alloc.page_table[alloc.cached_tokens // self.pool.page_size], n)
        alloc.waits.append((src, n))
        alloc.cached_tokens += n

    def _register_prompt_pages(self, alloc: KVAllocation, prompt_ids: Sequence[int], first: int,
                               parent: int) -> None:
        ps = self.pool.page_size
        for i in range(first, -(-len(prompt_ids) // ps)):
            parent = self.pool.register(alloc.page_table[i], parent, prompt_ids[i * ps: (i + 1) * ps])
            if parent is None:
                break

    # --- ready / copies --------------------------------------------------------
    def ready(self, alloc: KVAllocation) -> bool:
        pages = self.pool.pages
        return all(pages[pid].num_valid >= n for pid, n in alloc.waits)

    def take_copy(self, alloc: KVAllocation) -> Optional[PageCopy]:
        """The job's pending page copy, if any (its source is ready: the job was scheduled)."""
        if alloc.copy is None:
            return None
        alloc.waits = []
        return alloc.copy

    def copy_done(self, alloc: KVAllocation) -> None:
        if alloc.copy is not None:
            self.pool.mark_valid(alloc.copy.dst_page, alloc.copy.num_tokens)
            self.pool.release(alloc.copy.src_page)
            alloc.copy = None

    # --- computed / rollback ---------------------------------------------------
    def on_computed(self, alloc: KVAllocation, start: int, end: int) -> None:
        """K/V of positions [start, end) are written: jobs waiting on these pages can go on."""
        ps, table = self.pool.page_size, alloc.page_table
        if alloc.waits:
            alloc.waits = []
        for idx in range(start // ps, (end - 1) // ps + 1):
            self.pool.mark_valid(table[idx], min(ps, end - idx * ps))

    def rollback(self, alloc: KVAllocation, num_tokens: int) -> None:
        """Discard the K/V of positions num_tokens and later: generated positions, or the last
        prompt position at most (its page is always the job's own, never a shared one)."""
        ps = self.pool.page_size
        if num_tokens < alloc.prompt_len - 1:
            raise ValueError(f"rollback to {num_tokens} tokens would discard shared prompt tokens "
                             f"(the prompt has {alloc.prompt_len})")
        for idx in range(num_tokens // ps, len(alloc.page_table)):
            self.pool.truncate_valid(alloc.page_table[idx], num_tokens - idx * ps)

    # --- free --------------------------------------------------------------------
    def free(self, alloc: KVAllocation) -> None:
        """Release the job's pages, and the source of a page copy still pending (a job can end
        before it ever computed: a draft model's mirror whose target finished first)."""
        if alloc.copy is not None:
            self.pool.release(alloc.copy.src_page)
            alloc.copy = None
        alloc.waits = []
        for pid in alloc.page_table:
            self.pool.release(pid)
        alloc.page_table = []
        if alloc.window_slot is not None:
            self.free_windows.append(alloc.window_slot)
            alloc.window_slot = None
