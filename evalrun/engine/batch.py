"""Turn scheduled chunks into one packed ForwardBatch (no padding)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from evalrun.kernels.attention import build_metadata

from .cache import PagedCache
from .model import ForwardBatch
from .scheduler import ScheduledChunk


@dataclass
class PromptScoreRows:
    """Logits rows of a step that score prompt tokens (jobs with `score_from`), beside the sampled ones."""
    sample_rows: torch.Tensor                        # rows of the logits that the sampled chunks use, in order
    jobs: list                                       # per scored row: its job
    targets: list[int]                               # per scored row: the prompt token it predicts
    rows: torch.Tensor                               # per scored row: its row of the logits


def build_forward_batch(chunks: list[ScheduledChunk], cache: PagedCache, device: torch.device,
                        with_scores: bool = False):
    """Returns the batch and the chunks that produce logits (in logits row order):
    those whose chunk reaches the job's last known token. A chunk with draft tokens has
    1 + len(draft) logit rows (its last known token's, then each draft token's).
    with_scores: a third value, the PromptScoreRows of the step's prompt chunks of jobs with
    `score_from` (None when there are none): their rows are in the logits too, in position order
    (so a batch without them is unchanged)."""
    ps = cache.page_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_lens, seq_lens, tables, windows = [], [], [], []
    logit_rows, sampled = [], []
    sample_at: list[int] = []
    scored_jobs, targets, score_at = [], [], []
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
            sample_at.extend(range(len(logit_rows), len(logit_rows) + len(tokens)))
            logit_rows.extend(range(len(ids) - len(tokens), len(ids)))
            sampled.append(ch)
            continue
        q_lens.append(ch.num_tokens)
        seq_lens.append(ch.end)
        tables.append(table[: -(-ch.end // ps)])
        windows.append(alloc.window_slot)
        if job.score_from is not None:
            # position p's logits score prompt token p + 1 (the last prompt position's are sampled)
            first = len(ids) - len(tokens)
            for p in range(max(ch.start, job.score_from - 1), min(ch.end, job.prompt_len - 1)):
                score_at.append(len(logit_rows))
                logit_rows.append(first + p - ch.start)
                scored_jobs.append(job)
                targets.append(job.prompt_ids[p + 1])
        if ch.end == job.num_tokens:
            sample_at.append(len(logit_rows))
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
    if not with_scores:
        return batch, sampled
    scores: Optional[PromptScoreRows] = None
    if scored_jobs:
        scores = PromptScoreRows(torch.tensor(sample_at, dtype=torch.long, device=device), scored_jobs, targets,
                                 torch.tensor(score_at, dtype=torch.long, device=device))
    return batch, sampled, scores


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
