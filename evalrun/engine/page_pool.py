"""Page bookkeeping for the paged KV cache: plain Python, no tensors.

Every page has a `ref_count` (jobs using it). A page at ref_count 0 is either
free (no content worth keeping) or cached (it keeps its tokens and stays
reusable until evicted, least recently used first).

Full prompt pages are keyed by a chained hash: hash(parent hash, page tokens).
A hit is verified against the stored tokens and parent hash, so a collision
can never hand out someone else's K/V. Every page that holds prompt tokens is
also listed under its parent hash as a "sibling", so a new prompt that shares
only part of a page can copy those tokens' K/V instead of recomputing them.

    prompt:  | page 0 (full) | page 1 (full) | page 2 (partial) ...
    hash:      h0=H(root,t0)   h1=H(h0,t1)     siblings[h1] -> {pages whose parent is h1}
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Optional, Sequence

ROOT_HASH = 0
MAX_SIBLINGS_SCANNED = 16
SIBLING_HEAD = 16      # siblings are also indexed by their first tokens, so that a long shared
                       # prefix is found among any number of siblings (e.g. 164 prompts at the root)


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


@dataclass
class Page:
    page_id: int
    ref_count: int = 0
    phash: Optional[int] = None          # set when registered as a full prompt page
    parent_hash: Optional[int] = None    # set when the page holds known prompt tokens
    tokens: tuple[int, ...] = ()         # prompt tokens the page holds (from slot 0)
    num_valid: int = 0                   # slots whose K/V are computed
    last_used: int = 0


@dataclass
class PrefixMatch:
    """Longest reusable prefix of a prompt: whole pages plus a partial copy."""
    full_pages: list[int] = field(default_factory=list)
    parent_hash: int = ROOT_HASH         # hash of the chain of full_pages
    copy_page: Optional[int] = None      # sibling page to copy from
    copy_tokens: int = 0                 # tokens to copy from copy_page

    @property
    def num_pages(self) -> int:
        return len(self.full_pages)


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.pages = [Page(i) for i in range(num_pages)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self.cached: OrderedDict[int, None] = OrderedDict()   # ref 0 with content, LRU first
        self.by_hash: dict[int, int] = {}
        self.siblings: dict[int, OrderedDict[int, None]] = {}
        self.sibling_heads: dict[tuple[int, tuple[int, ...]], OrderedDict[int, None]] = {}
        self.clock = 0
        self.num_evicted = 0                                  # cached pages reclaimed by allocate

    # --- capacity -------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.cached)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self.num_available

    # --- lookup -----------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """Reusable prefix of tokens[:limit] (no side effects)."""
        ps = self.page_size
        match = PrefixMatch()
        for start in range(0, limit - ps + 1, ps):
            chunk = tuple(tokens[start: start + ps])
            h = chain_hash(match.parent_hash, chunk)
            pid = self.by_hash.get(h)
            if pid is None or not self._usable(self.pages[pid], match.parent_hash, chunk):
                break
            match.full_pages.append(pid)
            match.parent_hash = h
        start = match.num_pages * ps
        want = tokens[start: min(start + ps, limit)]
        match.copy_page, match.copy_tokens = self._best_sibling(match.parent_hash, want)
        return match

    def _usable(self, page: Page, parent: int, chunk: tuple[int, ...]) -> bool:
        # NOTE: an unreferenced page never gains K/V, so only its valid slots count
        complete = page.ref_count > 0 or page.num_valid == self.page_size
        return complete and page.parent_hash == parent and page.tokens == chunk

    def _best_sibling(self, parent: int, want: Sequence[int]) -> tuple[Optional[int], int]:
        """Longest shared prefix among the oldest siblings (oldest are the likeliest to be
        computed already); on equal length a page whose slots are already valid wins."""
        best, best_key = None, (0, False)
        group = self.siblings.get(parent)
        if not group or not want:
            return None, 0
        same_head = self.sibling_heads.get((parent, tuple(want[:SIBLING_HEAD])), ()) \
            if len(want) >= SIBLING_HEAD else ()
        for pid in chain(islice(same_head, MAX_SIBLINGS_SCANNED), islice(group, MAX_SIBLINGS_SCANNED)):
            page = self.pages[pid]
            n = _common_prefix(page.tokens, want)
            if page.ref_count == 0:
                n = min(n, page.num_valid)
            key = (n, page.num_valid >= n)
            if n and key > best_key:
                best, best_key = pid, key
        return best, best_key[0]

    # --- ownership --------------------------------------------------------
    def acquire(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count == 0:
            self.cached.pop(page_id, None)
            self.free.pop(page_id, None)
        page.ref_count += 1
        page.last_used = self._tick()

    def release(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count <= 0:
            raise RuntimeError(f"page {page_id} released more often than acquired")
        page.ref_count -= 1
        page.last_used = self._tick()
        if page.ref_count == 0:
            if page.parent_hash is not None and page.num_valid > 0:
                self.cached[page_id] = None
            else:
                self._forget(page)
                self.free[page_id] = None

    def allocate(self, n: int) -> list[int]:
        """n fresh pages (ref_count 1), evicting least recently used cached pages if needed."""
        if n > self.num_available:
            raise RuntimeError(f"asked for {n} pages, only {self.num_available} available")
        out = []
        for _ in range(n):
            if self.free:
                pid, _ = self.free.popitem(last=False)
            else:
                pid, _ = self.cached.popitem(last=False)
                self._forget(self.pages[pid])
                self.num_evicted += 1
            page = self.pages[pid]
            page.ref_count, page.num_valid, page.last_used = 1, 0, self._tick()
            out.append(pid)
        return out

    # --- content registration ---------------------------------------------
    def register(self, page_id: int, parent: int, tokens: Sequence[int]) -> Optional[int]:
        """Record the prompt tokens page_id will hold; a full page also gets its chain
        hash (unless another page already owns that hash). Returns the hash or None."""
        page = self.pages[page_id]
        page.parent_hash, page.tokens = parent, tuple(tokens)
        self._index_sibling(page)
        if len(tokens) < self.page_size:
            return None
        h = chain_hash(parent, page.tokens)
        if h not in self.by_hash:
            self.by_hash[h] = page_id
            page.phash = h
        return h

    def mark_valid(self, page_id: int, num_valid: int) -> None:
        """The first `num_valid` slots of the page hold computed K/V (never lowers the count)."""
        page = self.pages[page_id]
        page.num_valid = max(page.num_valid, num_valid)

    def truncate_valid(self, page_id: int, num_valid: int) -> None:
        """Slots from `num_valid` on no longer hold valid K/V (a rollback; never raises the count)."""
        page = self.pages[page_id]
        page.num_valid = min(page.num_valid, max(0, num_valid))

    def _forget(self, page: Page) -> None:
        if page.phash is not None and self.by_hash.get(page.phash) == page.page_id:
            del self.by_hash[page.phash]
        if page.parent_hash is not None:
            _discard(self.siblings, page.parent_hash, page.page_id)
            if len(page.tokens) >= SIBLING_HEAD:
                _discard(self.sibling_heads, (page.parent_hash, page.tokens[:SIBLING_HEAD]), page.page_id)
        page.phash, page.parent_hash, page.tokens, page.num_valid = None, None, (), 0

    def _index_sibling(self, page: Page) -> None:
        self.siblings.setdefault(page.parent_hash, OrderedDict())[page.page_id] = None
        if len(page.tokens) >= SIBLING_HEAD:
            key = (page.parent_hash, page.tokens[:SIBLING_HEAD])
            self.sibling_heads.setdefault(key, OrderedDict())[page.page_id] = None

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # --- maintenance ------------------------------------------------------
    def compaction_plan(self) -> dict[int, int]:
        """When no page is referenced: old -> new ids packing the n cached pages into ids
        [0, n), in LRU order. Pages already below n stay put; only those at n or above
        move, into the holes below n (the fewest K/V copies). Apply with
        `apply_compaction` after moving the K/V."""
        if self.num_in_use:
            raise RuntimeError("compaction needs every page unreferenced")
        n = len(self.cached)
        holes = iter([i for i in range(n) if i not in self.cached])
        return {old: old if old < n else next(holes) for old in self.cached}

    def apply_compaction(self, plan: dict[int, int]) -> None:
        moved = {plan[old]: self.pages[old] for old in plan}
        n = self.num_pages
        self.pages = [moved.get(i) or Page(i) for i in range(n)]
        for new_id, page in moved.items():
            page.page_id = new_id
        self.cached = OrderedDict((new, None) for new in plan.values())
        self.free = OrderedDict((i, None) for i in range(len(plan), n))
        self.by_hash = {p.phash: p.page_id for p in moved.values() if p.phash is not None}
        self.siblings, self.sibling_heads = {}, {}
        for page in sorted(moved.values(), key=lambda p: p.last_used):
            self._index_sibling(page)


def _discard(index: dict, key: object, page_id: int) -> None:
    group = index.get(key)
    if group is not None:
        group.pop(page_id, None)
        if not group:
            del index[key]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
