"""A draft model for speculative decoding: a smaller model (same vocabulary) that proposes each
job's next tokens, one packed forward per draft position over all drafting jobs.

Every target job that drafts has a mirror job in the draft model's own paged cache, admitted the
first time it drafts (so dedup and the prompt cache work there as in the target's) and freed
with the job. Before each proposal the mirror takes the target job's kept tokens and rolls its
K/V back to where they still agree:

    target kept:   prompt t1 .. tL                 (tL not yet computed by the target)
    mirror before: prompt t1 .. tj d(j+1) .. dk    (its last drafts, partly rejected)
    rollback to:   prompt t1 .. tj  (agreeing positions), then the forward computes the rest

The first draft forward catches the mirror up (a whole prompt on a job's first draft, else one
or two tokens); each one after it feeds the token just drafted. A draft token is chosen under the
job's own sampler settings (greedy: the argmax), with the mirror's own generator; its distribution
q is kept for the target's acceptance rule (evalrun/engine/speculation.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .batch import build_forward_batch
from .cache import PagedCache
from .job import DynamicJob
from .model import Model
from .output import follow, push_draft
from .sampler import sample
from .scheduler import ScheduledChunk, Scheduler
from .speculation import StepCost
from .verify import banned, plain_greedy



def truncated_model(model: Model, num_layers: int) -> Model:
    """The model's first num_layers layers with its own final norm and LM head (shared tensors, no
    copy): a self-speculative draft that needs no second checkpoint."""
    if not isinstance(num_layers, int) or not 1 <= num_layers <= model.config.num_layers:
        raise ValueError(f"a truncated draft keeps 1 to {model.config.num_layers} layers, got {num_layers!r}")
    cfg = dataclasses.replace(model.config, num_layers=num_layers, layer_windows=model.config.layer_windows[:num_layers])
    return Model(cfg, model.embed, model.layers[:num_layers], model.final_norm, model.lm_head, model.dtype,
                 model.device, model.kernels, model.deterministic)


@dataclass
class Proposal:
    tokens: list[int]
    probs: list[Optional[torch.Tensor]]     # q of each token ([V]; None for greedy jobs)


class DraftModelRunner:
    def __init__(self, model: Model, cache: PagedCache, max_chunk_size: int, coupled: bool = True):
        """coupled: each mirror draws with a copy of its job's generator (the "coupled" rule of
        evalrun/engine/speculation.py); else with a generator of its own."""
        self.model, self.cache = model, cache
        self.coupled = coupled
        self.sched = Scheduler(cache.pool, None, max_chunk_size, cache.window, cache.window_slots)
        self.max_chunk_size = max_chunk_size
        self.mirrors: dict[int, DynamicJob] = {}          # id(target job) -> its mirror
        self.cost = StepCost()
        self.forward_passes = 0
        self.cached_tokens = 0

    def propose(self, wants: list[tuple[DynamicJob, int]]) -> dict[int, Proposal]:
        """Up to n draft tokens for each (job, n); jobs whose mirror does not fit or waits for
        pages another mirror is filling get none this step. Keyed by id(job)."""
        active = [(job, m, n) for job, n in wants if (m := self._mirror(job)) is not None]
        out = {id(job): Proposal([], []) for job, _, _ in active}
        for depth in range(max((n for _, _, n in active), default=0)):
            chunks, budget = [], self.max_chunk_size
            for job, m, n in active:
                todo = m.num_tokens - m.state.num_computed_tokens
                if len(out[id(job)].tokens) == depth < n and budget:
                    chunks.append(ScheduledChunk(m, m.state.num_computed_tokens, min(todo, budget)))
                    budget -= chunks[-1].num_tokens            # a long prompt catches up over several steps
            if not chunks:
                break
            self._forward(chunks, out, {id(m): job for job, m, _ in active})
        return {k: p for k, p in out.items() if p.tokens}

    def free(self, job: DynamicJob) -> None:
        m = self.mirrors.pop(id(job), None)
        if m is not None:
            self.sched.finish(m)

    def _mirror(self, job: DynamicJob) -> Optional[DynamicJob]:
        """The job's mirror, synced and ready to compute; None if it cannot draft this step."""
        m = self.mirrors.get(id(job))
        if m is None:
            if job.max_total_tokens > self.model.max_seq_len:
                return None
            m = DynamicJob(job.prompt_ids, job.max_new_tokens, gen_settings=job.gen_settings, seed=_mirror_seed(job.seed))
            if self.sched.pages_needed(m) > self.cache.num_pages or not self.sched.start(m):
                return None
            self.mirrors[id(job)] = m
            self.cached_tokens += m.state.cached_tokens
        sched = self.sched
        if m.state.kv.copy is not None and sched.ready(m):
            for c in sched.take_copies([m]):
                self.cache.copy_prefix(c.src_page, c.dst_page, c.num_tokens)
            sched.copies_done([m])
        self._sync(m, job)
        if self.coupled:
            m.state.rng.set_state(job.state.rng.get_state())     # the uniforms the job will draw next
        return m if m.state.kv.copy is None and sched.ready(m) else None

    def _sync(self, m: DynamicJob, job: DynamicJob) -> None:
        """The mirror's tokens become the job's kept ones; K/V past the agreeing prefix are dropped."""
        agree = follow(m, job.state.new_ids)
        valid = min(m.prompt_len + agree, m.num_tokens - 1)   # the last kept token is fed again: its logits draft
        if m.state.num_computed_tokens > valid:
            self.sched.rollback(m, valid)

    def _forward(self, chunks: list[ScheduledChunk], out: dict[int, Proposal], target_of: dict[int, DynamicJob]) -> None:
        t0 = time.perf_counter()
        batch, sampled = build_forward_batch(chunks, self.cache, self.model.device)
        logits = self.model.forward(batch, self.cache)                    # [len(chunks), V]
        self.forward_passes += 1
        for ch in chunks:
            self.sched.computed(ch)
        for row, ch in enumerate(sampled):
            m, job = ch.job, target_of[id(ch.job)]
            prop = out[id(job)]
            bans = banned(job, len(prop.tokens))
            if plain_greedy(job):
                scores = logits[row]
                if bans:
                    scores = scores.clone()
                    scores[bans] = float("-inf")
                token, q = int(torch.argmax(scores)), None
            else:
                history = torch.tensor(m.prompt_ids + m.state.new_ids) if job.gen_settings.needs_history else None
                smp = sample(logits[row], job.gen_settings, history, m.state.rng, bans)
                token, q = smp.token, (None if job.gen_settings.is_greedy else smp.probs)
            prop.tokens.append(token)
            prop.probs.append(q)
            push_draft(m, token)
        self.cost.observe(sum(ch.num_tokens for ch in chunks), time.perf_counter() - t0)


def _mirror_seed(seed: Optional[int]) -> Optional[int]:
    """The seed of a mirror's own generator (the rejection rule), apart from every job's seed."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"evalrun draft mirror {seed}".encode()).digest()[:8], "little") >> 1
