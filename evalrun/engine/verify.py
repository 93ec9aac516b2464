"""The tokens each job keeps from one forward: plain sampling, or the verification of its draft.

A job with no draft has one logits row and keeps one token. A job with draft d1..dk has k + 1
rows (evalrun/engine/speculation.py draws the picture) and keeps 1 to k + 1 tokens: the accepted drafts
and one more, chosen by the target (the replacement of the first rejected draft, or the bonus
token after the last).

NOTE: a job's randomness comes only from its own generator, one draw per decision (sampling a
token, or accepting a draft token), so what it keeps never depends on the other jobs of the batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from evalrun.kernels.cpu import fused

from .job import DynamicJob
from .sampler import SampleResult, draw, greedy_tokens, inverse_cdf, sample, target_distribution
from .speculation import accept_greedy, accept_point_mass, accept_ratio, residual, residual_point_mass


def mark_nonfinite(jobs: list[DynamicJob], logits: torch.Tensor,
                   finite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Count, per job, the sampled positions whose logits hold a NaN or an Inf (a broken model or
    an overflow; results carry the count as "nonfinite_logits" so a task can refuse or flag the
    row), and give the sampler finite rows in their place: NaN as -inf, +inf as the largest float,
    a row with nothing left above -inf as all zeros. Rows that are finite are returned untouched.
    jobs: the job of each row (a job with a draft has several).
    The check is one pass over the logits (kernels.cpu.fused.finite_rows: natively for float32 CPU
    rows, on the kernels' own threads; a torch reduction here left torch's threads spinning into
    the next kernels, ~3 ms a step at 32 rows on 2 cores); `finite`: that check's result, where
    the caller already has it (check_rows)."""
    bad = (~(fused.finite_rows(logits) if finite is None else finite)).nonzero().flatten().tolist()
    if not bad:
        return logits
    logits = logits.clone()
    big = torch.finfo(logits.dtype).max
    for i in bad:
        jobs[i].state.nonfinite_logits += 1
        row = torch.nan_to_num(logits[i], nan=float("-inf"), posinf=big, neginf=float("-inf"))
        logits[i] = row if bool((row > float("-inf")).any()) else torch.zeros_like(row)
    return logits


def score_prompt_rows(jobs: list[DynamicJob], targets: list[int], logits: torch.Tensor,
                      block: int = 256) -> tuple[list[float], list[bool]]:
    """Each row's float32 log-softmax log-probability of its target token, and whether the target
    is the row's argmax (lm-eval's `is_greedy`: the first maximum of the log-probabilities); a row
    whose logits hold a NaN or an Inf counts in its job's nonfinite_logits (its value stays NaN or
    -inf: the score of a broken model is not made finite). In blocks of rows (a long prompt's rows
    at once would double the logits' memory)."""
    values: list[float] = []
    greedy: list[bool] = []
    for b in range(0, len(targets), block):
        rows = logits[b: b + block].float()
        lp = torch.log_softmax(rows, dim=-1)
        t = torch.tensor(targets[b: b + block], dtype=torch.long, device=rows.device)
        values += lp.gather(1, t[:, None])[:, 0].tolist()
        greedy += (lp.argmax(dim=-1) == t).tolist()
        for i in (~torch.isfinite(rows).all(dim=-1)).nonzero().flatten().tolist():
            jobs[b + i].state.nonfinite_logits += 1
    return values, greedy


def check_rows(row_jobs: list[DynamicJob], logits: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """mark_nonfinite(row_jobs, logits), and where some row's job is plain greedy, every row's
    argmax from the same visit of the rows (kernels.cpu.fused.argmax_finite_rows: one pass over the
    logits instead of two): (the sampler's logits, their row argmax or None). The argmax is None
    when a row was replaced (then it is not that row's argmax) or no job is plain greedy."""
    if not any(plain_greedy(j) for j in row_jobs):
        return mark_nonfinite(row_jobs, logits), None
    top, finite = fused.argmax_finite_rows(logits)
    checked = mark_nonfinite(row_jobs, logits, finite)
    return checked, top if checked is logits else None


def choose_tokens(jobs: list[DynamicJob], drafts: Sequence[Sequence[int]], logits: torch.Tensor,
                  draft_probs: Optional[Sequence[Optional[Sequence[Optional[torch.Tensor]]]]] = None,
                  rule: str = "coupled", top: Optional[torch.Tensor] = None) -> list[list[SampleResult]]:
    """Per job, the tokens it keeps; logits [sum(1 + len(d)), V], each job's rows in order.
    draft_probs: per job, the proposer's distribution q of each draft token (a draft model's), or
    None where the draft is a point mass (n-gram lookup, or a greedy draft); they are used by the
    "rejection" rule only (evalrun/engine/speculation.py describes both rules).
    Plain greedy jobs (no penalties or extras) share one argmax over all their rows (stop tokens
    banned before min_new_tokens at -inf for it, as `sample` bans them); the rest go row by row.
    top: every row's argmax of these logits (check_rows), or None: where no row's argmax is one of
    its banned tokens it is the banned argmax (banning other tokens moves neither the maximum nor
    its first index), so the greedy rows take it without another pass."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + 1 + len(d))
    out: list[Optional[list[SampleResult]]] = [None] * len(jobs)
    fast = [i for i, j in enumerate(jobs) if plain_greedy(j)]
    if fast:
        rows = [r for i in fast for r in range(starts[i], starts[i + 1])]
        bans = [(n, t) for n, (i, r) in enumerate((i, r) for i in fast for r in range(starts[i], starts[i + 1]))
                for t in banned(jobs[i], r - starts[i])]
        tokens = None if top is None else top[rows].tolist()
        if tokens is None or any(tokens[n] == t for n, t in bans):
            tokens = _argmax_with_bans(logits if len(rows) == logits.shape[0] else logits[rows], bans)
        at = 0
        for i in fast:
            targets = tokens[at: at + 1 + len(drafts[i])]
            at += len(targets)
            kept = targets[: accept_greedy(targets, drafts[i]) + 1]
            out[i] = [SampleResult(token=t, prob=float("nan"), probs=None) for t in kept]
    for i, job in enumerate(jobs):
        if out[i] is None:
            qs = None if draft_probs is None else draft_probs[i]
            out[i] = _verify_rows(job, list(drafts[i]), logits[starts[i]: starts[i + 1]], qs, rule == "rejection")
    return out


def sample_rows(jobs: list[DynamicJob], logits: torch.Tensor) -> list[SampleResult]:
    """One token per job from one row each (no drafts)."""
    return [kept[0] for kept in choose_tokens(jobs, [()] * len(jobs), logits)]


def _argmax_with_bans(rows: torch.Tensor, bans: list[tuple[int, int]]) -> list[int]:
    """Row argmax with (row, token) pairs at -inf; in place, then the caller's values back (no copy)."""
    if not bans:
        return greedy_tokens(rows).tolist()
    where = tuple(torch.tensor(list(ix)) for ix in zip(*bans))
    with torch.inference_mode(rows.is_inference()):      # the model's logits are inference tensors
        saved = rows[where].clone()
        rows[where] = float("-inf")
        try:
            return greedy_tokens(rows).tolist()
        finally:
            rows[where] = saved


def _verify_rows(job: DynamicJob, draft: list[int], rows: torch.Tensor,
                 draft_probs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 rejection: bool = False) -> list[SampleResult]:
    """Row by row: each row gives the target's law for the next token, under the job's settings
    with the history so far (accepted drafts included). Coupled (and greedy): the row's token is
    the one plain sampling draws, and the draft is kept if it is that token. Rejection: the draft
    is kept if the rule accepts it. The first token not a kept draft ends the step."""
    s, rng = job.gen_settings, job.state.rng
    history = job.prompt_ids + job.state.new_ids if s.needs_history else None
    kept: list[SampleResult] = []
    for i, row in enumerate(rows):
        hist = None if history is None else torch.tensor(history, dtype=torch.long)
        proposal = draft[i] if i < len(draft) else None
        if proposal is None or s.is_greedy or not rejection:
            smp = sample(row, s, hist, rng, banned(job, i))
        else:
            _, probs = target_distribution(row, s, hist, banned(job, i))
            q = None if draft_probs is None else draft_probs[i]
            token = proposal
            if q is None and not accept_point_mass(probs, proposal, draw(rng)):
                token = inverse_cdf(residual_point_mass(probs, proposal), draw(rng))
            elif q is not None and not accept_ratio(probs, q, proposal, draw(rng)):
                token = inverse_cdf(residual(probs, q), draw(rng))
            smp = SampleResult(token=token, prob=float(probs[token]), probs=probs)
        kept.append(smp)
        if smp.token != proposal:
            break
        if history is not None:
            history.append(smp.token)
    return kept


def plain_greedy(job: DynamicJob) -> bool:
    s = job.gen_settings
    return s.is_greedy and not s.needs_history and not job.return_probs and not job.return_top_tokens


def banned(job: DynamicJob, ahead: int = 0) -> list[int]:
    """Stop tokens banned for the job's token `ahead` places after its next one (min_new_tokens)."""
    return sorted(job.stop_tokens) if len(job.state.new_ids) + ahead < job.min_new_tokens else []
