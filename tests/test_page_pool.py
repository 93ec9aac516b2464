"""PagePool and Scheduler bookkeeping on tiny configs: exact page ids, LRU order, dedup plans."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import evalrun.engine as engine
from evalrun.engine.job import DynamicJob
from evalrun.engine.kv_manager import KVAllocation, KVManager, PageCopy
from evalrun.engine.page_pool import ROOT_HASH, PagePool, chain_hash
from evalrun.engine.scheduler import Scheduler


def test_allocate_release_free_and_cached_lru_order():
    pool = PagePool(num_pages=4, page_size=4)
    a, b = pool.allocate(2)
    assert (a, b) == (0, 1)
    pool.register(a, ROOT_HASH, [1, 2, 3, 4])          # full page: hashed, content kept
    pool.mark_valid(a, 4)
    pool.release(a)
    pool.release(b)                                    # no content: back to the free list
    assert list(pool.cached) == [0]
    assert list(pool.free) == [2, 3, 1]
    assert pool.allocate(3) == [2, 3, 1]               # free pages go first
    assert pool.allocate(1) == [0]                     # then the LRU cached page is evicted
    assert pool.by_hash == {} and pool.siblings == {}


def test_release_more_than_acquired_raises():
    pool = PagePool(2, 4)
    (p,) = pool.allocate(1)
    pool.release(p)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(p)


def test_match_prefix_full_pages_and_partial_sibling():
    pool = PagePool(8, 4)
    prompt = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32]
    pages = pool.allocate(3)
    parent = ROOT_HASH
    for i, pid in enumerate(pages):
        parent = pool.register(pid, parent, prompt[i * 4:(i + 1) * 4])
        pool.mark_valid(pid, len(prompt[i * 4:(i + 1) * 4]))
    other = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 99, 98, 97]
    m = pool.match_prefix(other, len(other) - 1)
    assert m.full_pages == pages[:2]
    assert m.parent_hash == chain_hash(chain_hash(ROOT_HASH, prompt[:4]), prompt[4:8])
    assert (m.copy_page, m.copy_tokens) == (pages[2], 2)


def test_hash_hit_is_verified_against_tokens():
    pool = PagePool(4, 2)
    (p,) = pool.allocate(1)
    pool.register(p, ROOT_HASH, [1, 2])
    pool.mark_valid(p, 2)
    # Forge a collision: another chunk's hash points at page p.
    pool.by_hash[chain_hash(ROOT_HASH, (7, 8))] = p
    m = pool.match_prefix([7, 8, 9], 2)
    assert m.full_pages == []


def test_unreferenced_page_counts_only_valid_slots():
    pool = PagePool(4, 4)
    (p,) = pool.allocate(1)
    pool.register(p, ROOT_HASH, [1, 2, 3])
    pool.mark_valid(p, 2)
    pool.release(p)                                    # cached with 2 of 3 tokens valid
    m = pool.match_prefix([1, 2, 3, 4, 5], 4)
    assert (m.copy_page, m.copy_tokens) == (p, 2)


def test_partial_sibling_found_among_many_siblings():
    """40 different partial prompts under the root: the 35th is still found (by its first
    SIBLING_HEAD tokens), not only the oldest MAX_SIBLINGS_SCANNED; and forgetting it unindexes it."""
    pool = PagePool(64, 64)
    prompts = [[1, 2, 3] + [100 + i] * 30 for i in range(40)]        # share 3 tokens, then differ
    pages = pool.allocate(40)
    for pid, prompt in zip(pages, prompts):
        pool.register(pid, ROOT_HASH, prompt)
    want = prompts[34] + [7, 7]
    m = pool.match_prefix(want, len(want) - 1)
    assert (m.copy_page, m.copy_tokens) == (pages[34], 33)
    short = pool.match_prefix([1, 2, 3, 5, 6], 4)                     # short shares: oldest siblings
    assert (short.copy_page, short.copy_tokens) == (pages[0], 3)
    pool.release(pages[34])                                            # unreferenced, nothing valid
    assert pool.match_prefix(want, len(want) - 1).copy_tokens == 3
    pool.allocate(64 - 39)                                             # evicts and forgets page 34
    assert all(pages[34] not in group for group in pool.sibling_heads.values())


def _job(ids, n=1):
    return DynamicJob(ids, max_new_tokens=n)


def test_scheduler_dedups_jobs_admitted_together_and_waits():
    pool = PagePool(16, 4)
    sched = Scheduler(pool, max_batch_size=None, max_chunk_size=64)
    shared = list(range(100, 110))                     # 10 tokens: 2 full pages + 2 tokens
    a, b = _job(shared + [1, 2, 3]), _job(shared + [4, 5, 6])
    sched.add(b)
    sched.add(a)
    assert [j for _, _, j in sched.queue] == [a, b]    # queue sorted by prompt tokens
    assert sched.admit() == [a, b]
    sa, sb = a.state.kv, b.state.kv
    assert sb.page_table[:2] == sa.page_table[:2]      # b references a's pages
    assert sb.copy is not None and sb.copy.src_page == sa.page_table[2] and sb.copy.num_tokens == 2
    assert b.state.num_computed_tokens == 10 and sb.cached_tokens == b.state.cached_tokens == 10
    assert not sched.ready(b)
    chunks = sched.plan()
    assert [(c.job, c.start, c.num_tokens) for c in chunks] == [(a, 0, 13)]
    for c in chunks:
        sched.computed(c)
    assert sched.ready(b)
    assert [(c.job, c.start, c.num_tokens) for c in sched.plan()] == [(b, 10, 3)]


def test_scheduler_reserves_pages_and_queues_when_full():
    pool = PagePool(4, 4)
    sched = Scheduler(pool, max_batch_size=None, max_chunk_size=64)
    jobs = [_job([i] * 5, n=3) for i in range(1, 4)]   # 8 tokens -> 2 pages each
    for j in jobs:
        sched.add(j)
    assert sched.admit() == jobs[:2]
    assert pool.num_available == 0 and sched.num_queued == 1
    sched.finish(jobs[0])
    assert sched.admit() == [jobs[2]]


def test_max_batch_size_limits_active_jobs():
    pool = PagePool(64, 4)
    sched = Scheduler(pool, max_batch_size=2, max_chunk_size=64)
    for i in range(5):
        sched.add(_job([i + 1, 7, 7]))
    assert len(sched.admit()) == 2 and len(sched.active) == 2


def _prompt_chunks(prompt_len: int, max_chunk_size: int) -> list[tuple[int, int]]:
    """(start, tokens) of each chunk one job's prompt is computed in, alone."""
    sched = Scheduler(PagePool(64, 4), max_batch_size=None, max_chunk_size=max_chunk_size)
    job = _job(list(range(1, prompt_len + 1)))
    sched.add(job)
    sched.admit()
    starts = []
    while job.state.num_computed_tokens < job.prompt_len:
        (c,) = sched.plan()
        starts.append((c.start, c.num_tokens))
        sched.computed(c)
    return starts


def test_chunk_budget_splits_long_prompts():
    assert _prompt_chunks(20, 8) == [(0, 8), (8, 8), (16, 4)]


def test_compaction_packs_cached_pages_to_the_front():
    pool = PagePool(6, 2)
    pages = pool.allocate(6)
    for pid, toks in zip(pages[3:], ([1, 2], [3, 4], [5, 6])):
        pool.register(pid, ROOT_HASH, toks)
        pool.mark_valid(pid, 2)
    for pid in pages:
        pool.release(pid)
    plan = pool.compaction_plan()
    assert plan == {3: 0, 4: 1, 5: 2}
    pool.apply_compaction(plan)
    assert list(pool.cached) == [0, 1, 2] and list(pool.free) == [3, 4, 5]
    m = pool.match_prefix([3, 4, 9], 2)
    assert m.full_pages == [1]


def test_compaction_moves_only_pages_above_the_cached_count():
    """Pages already inside [0, n) keep their ids; only pages at n or above fill the holes."""
    pool = PagePool(8, 2)
    pages = pool.allocate(8)
    kept = {0: [1, 2], 2: [3, 4], 5: [5, 6], 7: [7, 8]}
    for pid, toks in kept.items():
        pool.register(pages[pid], ROOT_HASH, toks)
        pool.mark_valid(pages[pid], 2)
    for pid in pages:
        pool.release(pid)
    lru = list(pool.cached)
    plan = pool.compaction_plan()
    assert plan[0] == 0 and plan[2] == 2
    assert sorted([plan[5], plan[7]]) == [1, 3]
    pool.apply_compaction(plan)
    assert sorted(pool.cached) == [0, 1, 2, 3] and list(pool.free) == [4, 5, 6, 7]
    assert list(pool.cached) == [plan[old] for old in lru]          # LRU order kept
    for old, toks in kept.items():
        assert pool.pages[plan[old]].tokens == tuple(toks)


def test_copy_source_is_not_evicted_by_the_allocation_of_its_own_job():
    """Under cache pressure the allocation for a new job evicts cached pages, least recently
    used first. The partial sibling the job copies from is such a page: it must be held
    before allocating, else it is evicted (its tokens forgotten) and the job waits for a
    copy that never comes — the scheduler stalls. With no room for it, the copy is dropped."""
    pool = PagePool(4, 32)
    sched = Scheduler(pool, max_batch_size=None, max_chunk_size=256)
    full, partial = list(range(100, 132)), list(range(200, 220))
    x = _job(full + partial, n=1)                           # 52 + 1 tokens: 2 pages
    sched.add(x)
    assert sched.admit() == [x]
    for c in sched.plan():
        sched.computed(c)
    sched.finish(x)
    assert sorted(pool.cached) == [0, 1] and len(pool.free) == 2
    y = _job(full + partial[:18] + list(range(300, 340)), n=30)   # 90 + 30 tokens: 4 pages, 1 matched
    sched.add(y)
    assert sched.admit() == [y]                             # room only without the copy: no copy
    assert y.state.kv.copy is None and y.state.kv.page_table[0] == 0 and sched.ready(y)
    assert [(c.job, c.start) for c in sched.plan()] == [(y, 32)]
    sched.finish(y)
    z = _job(full + partial[:18] + [7] * 10, n=1)           # 61 tokens: 2 pages, room for the copy too
    pool2_before = sorted(pool.cached)
    sched.add(z)
    assert sched.admit() == [z]
    if z.state.kv.copy is not None:                         # copying: the source holds its tokens
        src = pool.pages[z.state.kv.copy.src_page]
        assert src.ref_count >= 1 and src.num_valid >= z.state.kv.copy.num_tokens
    assert sched.plan(), pool2_before                       # and the scheduler makes progress


def test_a_prompt_token_is_never_computed_alone():
    """A prompt chunk never leaves exactly one token for later, nor is one token (the decode
    kernel would compute it, which agrees with the prefill kernel only to rounding)."""
    assert _prompt_chunks(21, 10) == [(0, 10), (10, 9), (19, 2)]
    for size in (1, 2):                                     # the only way with so small a budget
        small = Scheduler(PagePool(64, 4), max_batch_size=None, max_chunk_size=size)
        j = _job([1, 2, 3])
        small.add(j)
        small.admit()
        assert [(c.start, c.num_tokens) for c in small.plan()] == [(0, size)]


def test_freeing_a_job_with_a_pending_copy_releases_its_source():
    """A job that waits for a sibling's page (a pending copy) and ends before computing anything
    (a draft mirror whose target finished) gives back every reference it took."""
    pool = PagePool(16, 4)
    kv = KVManager(pool)
    shared = list(range(100, 106))                      # 1 full page + 2 tokens
    a = kv.admit(shared + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], 25)
    b = kv.admit(shared + [7, 8], 9)
    assert a is not None and b is not None
    assert b.copy is not None and b.copy.src_page == a.page_table[1] and not kv.ready(b)
    kv.free(b)
    assert b.copy is None and pool.pages[a.page_table[1]].ref_count == 1
    kv.free(a)
    assert pool.num_in_use == 0


def test_valid_counts_only_rise_by_mark_and_only_fall_by_truncate():
    pool = PagePool(num_pages=2, page_size=4)
    (p,) = pool.allocate(1)
    pool.mark_valid(p, 3)
    pool.mark_valid(p, 2)                              # a later, shorter write does not lower it
    assert pool.pages[p].num_valid == 3
    pool.truncate_valid(p, 4)                          # a rollback past the valid slots changes nothing
    assert pool.pages[p].num_valid == 3
    pool.truncate_valid(p, 1)
    assert pool.pages[p].num_valid == 1
    pool.truncate_valid(p, -3)                         # positions before the page: none of it is valid
    assert pool.pages[p].num_valid == 0


def test_only_the_pool_writes_its_pages_fields():
    """KVManager and the rest of the engine go through PagePool's methods (one writer per field)."""
    fields = {"num_valid", "ref_count", "phash", "parent_hash", "tokens", "last_used"}
    writers = set()
    for path in Path(engine.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and t.attr in fields and not (
                            isinstance(t.value, ast.Name) and t.value.id == "self"):
                        writers.add(path.name)
    assert writers == {"page_pool.py"}


def test_kv_manager_returns_a_typed_allocation():
    """admit hands back what it reserved (exact pages, waits, copy, cached tokens); nothing of the
    job is written: the scheduler starts the job's computed count at cached_tokens."""
    pool = PagePool(8, 4)
    kv = KVManager(pool)
    shared = list(range(100, 110))                     # 2 full pages + 2 tokens
    a = kv.admit(shared + [1, 2, 3], 15)
    assert a == KVAllocation(page_table=[0, 1, 2, 3], cached_tokens=0, prompt_len=13)
    b = kv.admit(shared + [4, 5, 6], 15)                # a's pages 0, 1 by reference, 2 slots of page 2 copied
    assert b == KVAllocation(page_table=[0, 1, 4, 5], cached_tokens=10, prompt_len=13,
                             waits=[(0, 4), (1, 4), (2, 2)], copy=PageCopy(src_page=2, dst_page=4, num_tokens=2))
    assert kv.admit(shared + [7], 20) is None and pool.num_available == 2   # does not fit: nothing held
    kv.on_computed(a, 0, 13)
    assert kv.ready(b) and kv.take_copy(b) == b.copy and b.waits == []
    kv.copy_done(b)
    assert b.copy is None and pool.pages[4].num_valid == 2 and pool.pages[2].ref_count == 1


def test_drafts_are_the_same_arithmetic_within_the_chunk_budget():
    """A decode chunk carries its draft as a value, in what the budget leaves after the known tokens
    (prompt chunks first); computed() advances num_computed_tokens past the kept drafts and rolls
    the rejected ones' slots back."""
    pool = PagePool(16, 4)
    sched = Scheduler(pool, max_batch_size=None, max_chunk_size=8)
    job = _job(list(range(1, 7)), n=8)
    sched.add(job)
    sched.admit()
    (c,) = sched.plan()
    sched.computed(c)
    job.state.new_ids.append(9)                         # (JobOutput.accept's part)
    (c,) = sched.plan()
    assert (c.start, c.num_tokens, c.draft, c.is_decode) == (6, 1, (), True)
    assert sched.draft_budget([c]) == 7
    (d,) = sched.with_drafts([c], {id(job): list(range(20, 30))})
    assert d.draft == tuple(range(20, 27)) and d.num_rows == 8 and c.draft == ()   # cut to the budget
    sched.computed(d, num_kept=2)                        # rows at positions 6..13 ran, 2 drafts kept
    assert job.state.num_computed_tokens == 9
    table = job.state.kv.page_table
    assert [pool.pages[p].num_valid for p in table[:4]] == [4, 4, 1, 0]
    other = _job([50, 51, 52, 53, 54])
    sched.add(other)
    sched.admit()
    job.state.new_ids.extend([20, 21, 5])                # the 2 kept drafts and the token after them
    chunks = sched.plan()
    assert [(ch.job, ch.start, ch.num_tokens) for ch in chunks] == [(job, 9, 1), (other, 0, 5)]
    drafted = sched.with_drafts(chunks, {id(job): [1, 2, 3, 4], id(other): [7]})
    assert [ch.draft for ch in drafted] == [(1, 2), ()]   # prompts first; a prompt chunk never drafts
