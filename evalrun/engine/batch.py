"""Turn scheduled chunks into one packed ForwardBatch (no padding)."""
from __future__ import annotations

import torch

from evalrun.kernels.attention import build_metadata

from .cache import PagedCache
from .model import ForwardBatch
from .scheduler import ScheduledChunk


def build_forward_batch(chunks: list[ScheduledChunk], cache: PagedCache,
                        device: torch.device) -> tuple[ForwardBatch, list[ScheduledChunk]]:
    """Returns the batch and the chunks that produce logits (in logits row order):
    those whose chunk reaches the job's last known token. A chunk with draft tokens has
    1 + len(draft) logit rows (its last known token's, then each draft token's)."""
    ps = cache.page_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_lens, seq_lens, tables, windows = [], [], [], []
    logit_rows, sampled = [], []
    for ch in chunks:
        job, alloc = ch.job, ch.job.state.kv
        table = alloc.page_table
        tokens = _tokens(ch)
        ids.extend(tokens)
        span = range(ch.start, ch.start + len(tokens))
        positions.extend(span)
        slots.extend(table[p // ps] * ps + p % ps for p in span)
        if ch.draft:
            # NOTE: the last token and each draft token are rows of the decode group, each its own
            # sequence over the job's pages that ends at its position: the logits of every row are
            # bitwise those of one decode step at a time (tests/test_verify_rows.py)
            for p in span:
                q_lens.append(1)
                seq_lens.append(p + 1)
                tables.append(table[: -(-(p + 1) // ps)])
                windows.append(alloc.window_slot)
            logit_rows.extend(range(len(ids) - len(tokens), len(ids)))
            sampled.append(ch)
            continue
        q_lens.append(ch.num_tokens)
        seq_lens.append(ch.end)
        tables.append(table[: -(-ch.end // ps)])
        windows.append(alloc.window_slot)
        if ch.end == job.num_tokens:
            logit_rows.append(len(ids) - 1)
            sampled.append(ch)
    attn = build_metadata(q_lens, seq_lens, tables, ps, cache.null_page, device,
                          window=cache.window, window_slots=windows if cache.window else None)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        attn=attn,
        logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=device),
    )
    return batch, sampled


def _tokens(ch: ScheduledChunk) -> list[int]:
    job = ch.job
    n = job.prompt_len
    if ch.end <= n:
        tokens = job.prompt_ids[ch.start: ch.end]
    else:
        tokens = job.prompt_ids[ch.start: n] + job.state.new_ids[max(ch.start - n, 0): ch.end - n]
    if ch.draft:
        tokens.extend(ch.draft)     # (a new list: slices copy)
    return tokens
