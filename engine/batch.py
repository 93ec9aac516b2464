"""Turn scheduled chunks into one packed ForwardBatch (no padding)."""
from __future__ import annotations

import torch

from kernels.attention import build_metadata

from .cache import PagedCache
from .model import ForwardBatch
from .scheduler import ScheduledChunk


def build_forward_batch(chunks: list[ScheduledChunk], cache: PagedCache,
                        device: torch.device) -> tuple[ForwardBatch, list[ScheduledChunk]]:
    """Returns the batch and the chunks that produce logits (in logits row order):
    those whose chunk reaches the job's last known token."""
    ps = cache.page_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_lens, seq_lens, tables, windows = [], [], [], []
    logit_rows, sampled = [], []
    for ch in chunks:
        job, table = ch.job, ch.job.state.page_table
        ids.extend(_tokens(ch))
        span = range(ch.start, ch.end)
        positions.extend(span)
        slots.extend(table[p // ps] * ps + p % ps for p in span)
        q_lens.append(ch.num_tokens)
        seq_lens.append(ch.end)
        tables.append(table[: -(-ch.end // ps)])
        windows.append(job.state.window_slot)
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
        return job.prompt_ids[ch.start: ch.end]
    new = job.state.new_ids
    return job.prompt_ids[ch.start: n] + new[max(ch.start - n, 0): ch.end - n]
