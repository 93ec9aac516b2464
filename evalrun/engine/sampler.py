"""Token sampling: penalties, filtered distributions and reproducible draws.

Every function here is pure: it neither mutates its inputs nor touches the
global RNG. Logits are float32 tensors of one job, shape [V], except the
batched greedy fast path, [B, V].

Order of operations for one token (see `sample`):

    logits --banned=-inf--> --penalties--> greedy? argmax
                                           else  /T -> top_k -> top_p -> min_p -> renormalise
                                                 -> one uniform u from the job's generator
                                                 -> inverse CDF

NOTE: a non-greedy job consumes exactly one draw from its own generator per
token and a greedy job consumes none, so a job's samples do not depend on
which other jobs share its batch or in which order they are sampled. A token
forced on a job (its thinking budget) is sampled all the same and then replaced
(`forced`): it spends the same draw.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Optional, Sequence

import torch
from torch import Tensor

from evalrun.kernels.cpu import fused


@dataclass(frozen=True)
class SamplerSettings:
    """How one job picks its next token. The defaults are greedy with no penalties."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    token_repetition_penalty: float = 1.0
    token_frequency_penalty: float = 0.0
    token_presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature, lambda v: v >= 0, "a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check_real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)")
        _check_real("min_p", self.min_p, lambda v: 0 <= v < 1, "a number in [0, 1) (0 = off)")
        _check_real("token_repetition_penalty", self.token_repetition_penalty, lambda v: v > 0,
                    "a finite number > 0 (1 = off)")
        _check_real("token_frequency_penalty", self.token_frequency_penalty, lambda v: True,
                    "a finite number (0 = off)")
        _check_real("token_presence_penalty", self.token_presence_penalty, lambda v: True,
                    "a finite number (0 = off)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        return (self.token_repetition_penalty != 1.0 or self.token_frequency_penalty != 0.0
                or self.token_presence_penalty != 0.0)


def _check_real(name: str, value: object, ok, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SampleResult:
    token: int
    prob: float    # probability of `token` in `probs`
    probs: Tensor  # [V] the distribution the token was drawn from (softmax at T=1 when greedy)


def make_generator(seed: Optional[int]) -> torch.Generator:
    """A CPU generator for one job; `seed=None` seeds it from os.urandom."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def greedy_tokens(logits: Tensor) -> Tensor:
    """Batched greedy fast path: [B, V] -> [B] int64 argmax (ties go to the lowest id; torch.argmax's
    contract, natively for float32 CPU rows: evalrun/kernels/cpu/fused.py)."""
    return fused.argmax_rows(logits)


def apply_penalties(logits: Tensor, history: Tensor, s: SamplerSettings) -> Tensor:
    """Penalise tokens seen in `history` (1-D int64 ids, prompt + generated) in logits [V].

    Repetition (CTRL): a seen token's logit is divided by the penalty if > 0,
    multiplied if < 0. Then frequency: minus penalty * count; presence: minus
    penalty if seen. Returns a new tensor (or `logits` itself if no penalty is on).
    """
    if not s.needs_history:
        return logits
    vocab = logits.shape[-1]
    if history.numel() and (int(history.min()) < 0 or int(history.max()) >= vocab):
        raise ValueError(f"history holds token ids outside [0, {vocab})")
    counts = torch.bincount(history.to(device=logits.device, dtype=torch.int64), minlength=vocab)  # [V]
    seen = counts > 0  # [V]
    out = logits
    r = s.token_repetition_penalty
    if r != 1.0:
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if s.token_frequency_penalty != 0.0:
        out = out - s.token_frequency_penalty * counts.to(out.dtype)
    if s.token_presence_penalty != 0.0:
        out = out - s.token_presence_penalty * seen.to(out.dtype)
    return out


def sampling_probs(logits: Tensor, s: SamplerSettings) -> Tensor:
    """The final distribution [V] a token is drawn from, given (penalised) logits [V].

    Greedy: softmax at temperature 1 (only used to report probabilities).
    Otherwise: temperature -> top_k -> top_p -> min_p, renormalised.
    NOTE: every filter keeps ties at its cut-off, so the result never depends on sort order.
    """
    if s.is_greedy:
        return torch.softmax(logits, dim=-1)
    # Shift by the max first so a tiny temperature cannot overflow to inf - inf = NaN.
    scaled = (logits - logits.max()) / s.temperature  # [V]
    if s.top_k:
        scaled = _mask_top_k(scaled, s.top_k)
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if s.top_p < 1.0:
        probs = _mask_top_p(probs, s.top_p)
    if s.min_p > 0.0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def _mask_top_k(logits: Tensor, k: int) -> Tensor:
    if k >= logits.shape[-1]:
        return logits
    pivot = torch.topk(logits, k).values[-1]
    return torch.where(logits < pivot, float("-inf"), logits)


def _mask_top_p(probs: Tensor, top_p: float) -> Tensor:
    # Keep the smallest high-probability set whose mass reaches top_p:
    # a token is kept while the mass strictly before it is < top_p.
    # Sorting all V is slow on CPU, so look at the k most probable, k = 64, 512, ... V,
    # until the cut-off falls inside them (mass_before only grows further down).
    vocab = probs.shape[-1]
    k = min(64, vocab)
    while True:
        top = torch.topk(probs, k).values  # [k] descending
        mass_before = torch.cumsum(top, dim=-1) - top
        num_kept = int((mass_before < top_p).sum())  # >= 1 since mass_before[0] == 0
        if num_kept < k or k == vocab:
            break
        k = min(k * 8, vocab)
    cutoff = top[num_kept - 1]
    return torch.where(probs >= cutoff, probs, 0.0)


def inverse_cdf(probs: Tensor, u: float) -> int:
    """The token whose CDF bucket holds u * sum(probs); u in [0, 1).

    Never returns a zero-probability token: if rounding puts the point past the
    last bucket, the last token with nonzero probability is returned.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [V]
    # right=True: first index with cdf > point, so empty buckets (cdf equal to the previous one) are skipped.
    token = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
    if token >= probs.shape[-1]:
        token = int(torch.nonzero(probs > 0)[-1, 0])
    return token


def sample(
    logits: Tensor,
    s: SamplerSettings,
    history: Optional[Tensor],
    generator: Optional[torch.Generator],
    banned_tokens: Sequence[int] = (),
) -> SampleResult:
    """Pick one token from logits [V] under settings `s`.

    `banned_tokens` get -inf before anything else (e.g. EOS before
    min_new_tokens). `history` (1-D int64 ids) is required when a penalty is on;
    `generator` is required unless greedy. Greedy takes the argmax of the
    penalised logits (lowest id on ties) and draws nothing; otherwise exactly
    one float64 `torch.rand(1, generator=generator)` draw is used, by inverse CDF.
    """
    logits, probs = target_distribution(logits, s, history, banned_tokens)
    if s.is_greedy:
        token = int(torch.argmax(logits))
    else:
        if generator is None:
            raise ValueError(f"temperature={s.temperature} samples at random, so sample() needs a generator")
        token = inverse_cdf(probs, draw(generator))
    return SampleResult(token=token, prob=float(probs[token]), probs=probs)


def forced(smp: SampleResult, token: int) -> SampleResult:
    """smp with its token replaced by `token` (budget forcing: DynamicJob.max_thinking_tokens); its
    distribution stays (probs None: the greedy fast path's), and the draw that made smp stays spent."""
    prob = float("nan") if smp.probs is None else float(smp.probs[token])
    return SampleResult(token=token, prob=prob, probs=smp.probs)


def target_distribution(logits: Tensor, s: SamplerSettings, history: Optional[Tensor],
                        banned_tokens: Sequence[int] = ()) -> tuple[Tensor, Tensor]:
    """(banned and penalised logits [V], the final distribution [V]) that `sample` draws from."""
    logits = _ban(logits, banned_tokens)
    if s.needs_history:
        if history is None:
            raise ValueError("these sampler settings use penalties, so sample() needs the token history")
        logits = apply_penalties(logits, history, s)
    return logits, sampling_probs(logits, s)


def draw(generator: torch.Generator) -> float:
    """One uniform in [0, 1) from the job's generator (float64): a job's only source of randomness."""
    return float(torch.rand(1, generator=generator, dtype=torch.float64)[0])


def _ban(logits: Tensor, banned_tokens: Sequence[int]) -> Tensor:
    if len(banned_tokens) == 0:
        return logits
    vocab = logits.shape[-1]
    ids = list(banned_tokens)
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"banned token ids must be in [0, {vocab}), got {ids}")
    out = logits.clone()
    out[ids] = float("-inf")
    if torch.isneginf(out).all():
        raise ValueError("every token is banned; nothing can be sampled")
    return out


def top_k_of(probs: Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k most probable tokens of probs [V] and their probabilities, most probable first.

    Ties are ordered by lowest token id; k larger than V returns all V.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    k = min(k, probs.shape[-1])
    values, ids = torch.sort(probs, descending=True, stable=True)
    return ids[:k].tolist(), values[:k].tolist()
