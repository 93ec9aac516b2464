"""Speculative decoding (Leviathan et al., arXiv 2211.17192): which draft tokens to verify, and
the rule that accepts them. Plain Python and small pure functions; the generator runs them.

A decoding job with a draft d1..dk is one chunk of k + 1 decode rows: its last token t and the
drafts. Row i's logits give the target's distribution p_i for the token after it:

    rows:     t     d1    d2   ...  dk
    p_i:      p0    p1    p2        pk        p0 judges d1, p1 judges d2, ..., pk gives a bonus token

Greedy: accept d_{i+1} while it is the argmax of p_i; the first mismatch is replaced by the
argmax, so the output is token-identical to one-at-a-time greedy.

Sampling, two rules (SpecSettings.sampling_rule):
- "coupled" (the default): row i draws the token plain sampling would draw there (the job's next
  uniform u, inverse CDF of p_i) and d_{i+1} is kept while it equals that token. A job consumes
  one draw per kept token, as in plain sampling, so a seeded job's tokens are identical to plain
  sampling's whatever was drafted (resumed and re-batched runs reproduce). An n-gram draft is
  kept with probability p(d), as under the rejection rule. A draft model draws its token with
  the same uniform (its generator is the job's, copied), d = inverse CDF of q at u, so it is kept
  with the probability that the two inverse CDFs agree at u: high when q is close to p, below
  the rejection rule's sum of min(p, q) otherwise.
- "rejection" (Leviathan et al., arXiv 2211.17192, theorem 1): a draft token of probability q(d)
  under its proposer is kept with probability min(1, p(d) / q(d)), else the replacement is drawn
  from the residual max(0, p - q), renormalised (for an n-gram draft, a point mass: kept with
  probability p(d), else drawn from p without d). Each token has exactly the law p, but the
  draws a job consumes depend on its drafts, so a seeded job's tokens depend on them too.

Which drafts are worth verifying (`DraftPolicy`): one more row in the forward costs time b,
and a step of T rows takes t(T) = a + b T (fitted online from the generator's own decode steps,
`StepCost`). Row i of job j's draft adds the expected tokens alpha_j^i (alpha_j: the job's
recent acceptance rate). While jobs wait for a slot (throughput is what counts), tokens per
second rise with the row exactly when

    alpha_j^i * t(T) > b * E        (E: expected tokens of the step so far)

so rows are taken in order of alpha_j^i while that holds: a job's draft length follows its
acceptance, and a batch whose rows already keep the machine busy (b E large against t) drafts
little or nothing. With no job waiting, the run lasts as long as its longest jobs, so drafting
pays only when each of those keeps enough of its drafts (`DraftPolicy._for_makespan`). A margin
above 1 keeps estimation error from making a step slower.

Budget forcing (DynamicJob.max_thinking_tokens): a job's drafts and bonus token stop short of the
positions where its end-of-thinking marker is forced (`max_draft` gets the job's `draft_horizon`), so
a job drafts nothing while it is forced and a forced token is always a step's one token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

PRIOR_ROW_COST = 0.1      # b / a before any decode step of two sizes was timed (a guess; data replace it)
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0    # acceptance starts at 1/2 and follows the job's own record
HISTORY_DECAY = 0.8       # weight of a job's older verifications against its latest one
OVERALL_DECAY = 0.99      # the same for the record over all jobs (it follows the workload, slowly)
IDLE_DECAY = 0.97         # per step a job does not draft: its record fades back towards the prior, so a
                          # job (or a batch) that stopped drafting tries again after some tens of steps
COST_DECAY = 0.97         # weight of older step timings in the cost fit
MARGIN = 1.15             # a row must pay back this many times its estimated cost
SAMPLING_RULES = ("coupled", "rejection")
EXPLORE_EVERY = 8         # while jobs wait, every n-th step verifies the best draft row regardless (so
EXPLORE_MIN_GAIN = 0.3    # the cost fit sees steps of several sizes), if its acceptance is at least this


@dataclass(frozen=True)
class SpecSettings:
    """How the generator drafts: n-gram lookup in the job's own tokens (use_ngram_draft) or a
    draft model (the generator's draft_model); at most num_draft_tokens per job and step."""
    num_draft_tokens: int = 4
    use_ngram_draft: bool = False
    max_ngram: int = 4
    min_ngram: int = 1
    adaptive: bool = True            # False: always verify every proposed token (for tests)
    sampling_rule: str = "coupled"   # how sampled jobs verify drafts: COUPLED or REJECTION (see module doc)

    def __post_init__(self) -> None:
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}")
        for name in ("max_ngram", "min_ngram"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling_rule!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) exceeds max_ngram ({self.max_ngram})")


# --- acceptance rules (pure) -------------------------------------------------------------------
def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> int:
    """Draft tokens kept: targets[i] is the target's choice after row i (len(draft) + 1 of them)."""
    n = 0
    while n < len(draft) and targets[n] == draft[n]:
        n += 1
    return n


def accept_point_mass(p: torch.Tensor, token: int, u: float) -> bool:
    """Keep a proposed token of probability 1 under its proposer: with probability p(token)."""
    return u < float(p[token])


def residual_point_mass(p: torch.Tensor, token: int) -> torch.Tensor:
    """The law of the replacement after a point-mass proposal is rejected: p without token."""
    r = p.clone()
    r[token] = 0.0
    return r / r.sum()


def accept_ratio(p: torch.Tensor, q: torch.Tensor, token: int, u: float) -> bool:
    """Keep a token drawn from q: with probability min(1, p(token) / q(token))."""
    return u * float(q[token]) < float(p[token])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), renormalised: the law of the replacement after a rejected draw from q."""
    r = (p - q).clamp(min=0)
    s = float(r.sum())
    return p if s <= 0 else r / s


# --- cost and acceptance estimates ---------------------------------------------------------------
class StepCost:
    """t(T) = a + b T for a decode step of T rows, by exponentially weighted least squares."""

    def __init__(self) -> None:
        self._w = self._t = self._y = self._tt = self._ty = 0.0
        self.num_observed = 0

    def observe(self, rows: int, seconds: float) -> None:
        self.num_observed += 1
        d = COST_DECAY
        self._w, self._t, self._y = d * self._w + 1, d * self._t + rows, d * self._y + seconds
        self._tt, self._ty = d * self._tt + rows * rows, d * self._ty + rows * seconds

    def fit(self) -> tuple[float, float]:
        """(a, b) in seconds; b from the prior ratio while the timed steps are all one size."""
        if self._w == 0:
            return 1.0, PRIOR_ROW_COST
        mean_t, mean_y = self._t / self._w, self._y / self._w
        var = self._tt / self._w - mean_t ** 2
        if var > 0.25:
            b = (self._ty / self._w - mean_t * mean_y) / var
            a = mean_y - b * mean_t
            if b > 0 and a > 0:
                return a, b
        a = mean_y / (1 + PRIOR_ROW_COST * mean_t)
        return a, PRIOR_ROW_COST * a


@dataclass
class DraftRecord:
    """A job's drafting history (written by DraftPolicy only)."""
    hits: float = 0.0                # decayed counts of kept drafts ...
    trials: float = 0.0              # ... and of drafts judged (each verification: kept ones + 1 rejected)
    drafted: int = 0                 # draft tokens verified
    accepted: int = 0                # of them, kept

    @property
    def rate(self) -> float:
        return self.rate_with(PRIOR_HITS / PRIOR_TRIALS)

    def rate_with(self, prior: float) -> float:
        """The job's acceptance rate, its record shrunk towards `prior` (the rate over all jobs)."""
        return (self.hits + PRIOR_TRIALS * prior) / (self.trials + PRIOR_TRIALS)


class DraftPolicy:
    def __init__(self, settings: SpecSettings, draft_scale: Optional[float] = None):
        """draft_scale: a draft model's weights over the target's (its forwards' cost before they
        are timed); None for n-gram drafting, which costs no forward."""
        self.settings = settings
        self.cost = StepCost()
        self.draft_scale = draft_scale
        self.overall = DraftRecord()      # every job's verifications: how good these drafts are here
        self._steps = 0

    def rate(self, rec: DraftRecord) -> float:
        """A job's acceptance rate; a job with little record of its own takes the overall one where
        that is below the prior (a draft that is bad for this task is learnt once, not paid for again
        by every new job). NOTE: never above the prior: at 32 rows a good overall rate made every
        new job draft at once, which measured 0.84x plain (bench_spec, HumanEval n-gram)."""
        return rec.rate_with(min(PRIOR_HITS / PRIOR_TRIALS, self.overall.rate))

    def choose(self, proposals: dict[int, list[int]], records: dict[int, DraftRecord], base_rows: int,
               base_tokens: int, remaining: Optional[dict[int, int]] = None,
               draft_cost: Optional[StepCost] = None) -> dict[int, list[int]]:
        """The leading part of each job's proposal worth verifying in a step that already has
        base_rows rows producing base_tokens tokens; proposals and records are keyed by job id.
        remaining: with no job waiting for a slot, each decoding job's tokens still allowed
        (then only the last jobs to finish are worth speeding up: `_for_makespan`).
        draft_cost: the draft model's forwards (a_d + b_d rows each; one more per draft depth)."""
        if not self.settings.adaptive or not proposals:
            return proposals
        self._steps += 1
        explore = self._steps % EXPLORE_EVERY == 0
        a, b = self.cost.fit()
        a_d, b_d = self._draft_fit(draft_cost, a, b)
        t = a + b * base_rows
        if remaining is not None:
            rates = {j: self.rate(records[j]) for j in proposals}
            return self._for_makespan(proposals, rates, remaining, t, (b, a_d, b_d))
        rates = {j: self.rate(records[j]) for j in proposals}
        rows = [(rates[j] ** (i + 1), j, i) for j, d in proposals.items() for i in range(len(d))]
        rows.sort(key=lambda r: -r[0])
        keep = dict.fromkeys(proposals, 0)
        e, depth = float(base_tokens), 0
        for n, (gain, j, i) in enumerate(rows):
            if keep[j] != i:
                continue
            cost = b + b_d + (a_d if i + 1 > depth else 0.0)
            if not ((explore and n == 0 and gain >= EXPLORE_MIN_GAIN) or gain * t > MARGIN * cost * e):
                break
            keep[j] += 1
            depth = max(depth, i + 1)
            t, e = t + cost, e + gain
        return {j: proposals[j][:n] for j, n in keep.items() if n}

    def _draft_fit(self, draft_cost: Optional[StepCost], a: float, b: float) -> tuple[float, float]:
        """(a_d, b_d): the draft forward's fit once timed, before that the target's scaled."""
        if self.draft_scale is None:
            return 0.0, 0.0
        if draft_cost is None or draft_cost.num_observed == 0:
            return a * self.draft_scale, b * self.draft_scale
        return draft_cost.fit()

    @staticmethod
    def _for_makespan(proposals: dict[int, list[int]], rates: dict[int, float], remaining: dict[int, int],
                      t: float, costs: tuple[float, float, float]) -> dict[int, list[int]]:
        """No queue: the run ends when its longest jobs do (those within num_draft_tokens of the most
        remaining tokens), and over many steps each advances 1 + E_j(D) tokens a step, E_j(D) =
        sum of alpha_j^i for i <= D, so the run takes 1 / (1 + min_j E_j(D)) of the steps. A step
        that drafts D tokens for each of them costs t + c_D (c_D: their D rows each, b apiece, plus a
        draft model's D forwards, a_d + b_d per row). Pick the D with the largest
        (1 + min_j E_j(D)) / (1 + MARGIN c_D / t), if above 1; other jobs do not draft (they end
        sooner anyway: their kept drafts would save no step, their rejected ones cost). A longest
        job with no proposal this step (E = 0) means no drafting."""
        b, a_d, b_d = costs
        last = max(remaining.values())
        slack = max(len(d) for d in proposals.values())
        critical = [j for j, r in remaining.items() if r >= last - slack]
        if any(j not in proposals for j in critical):
            return {}
        per_depth = b * len(critical) + a_d + b_d * len(critical)
        best, best_gain = 0, 1.0
        expected = dict.fromkeys(critical, 0.0)
        for depth in range(1, min(len(proposals[j]) for j in critical) + 1):
            for j in critical:
                expected[j] += rates[j] ** depth
            gain = (1 + min(expected.values())) / (1 + MARGIN * depth * per_depth / t)
            if gain > best_gain:
                best, best_gain = depth, gain
        return {j: proposals[j][:best] for j in critical} if best else {}

    def observe_step(self, rows: int, seconds: float, drafted: bool = True) -> None:
        """A decode step's time; one that drafted nothing also fades the overall record towards
        the prior (so a run that stopped drafting tries again after a while)."""
        self.cost.observe(rows, seconds)
        if not drafted:
            _count(self.overall, 0, 0, IDLE_DECAY)

    def record(self, rec: DraftRecord, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens kept `accepted` (a run of successes, then at most
        one failure: the geometric law's counts); drafted == 0: a step without drafting."""
        _count(rec, drafted, accepted, HISTORY_DECAY if drafted else IDLE_DECAY)
        if drafted:
            _count(self.overall, drafted, accepted, OVERALL_DECAY)


def _count(rec: DraftRecord, drafted: int, accepted: int, decay: float) -> None:
    rec.hits = decay * rec.hits + accepted
    rec.trials = decay * rec.trials + accepted + (accepted < drafted)
    rec.drafted += drafted
    rec.accepted += accepted


def max_draft(num_tokens: int, new_tokens: int, max_new_tokens: int, max_seq_len: int,
              window: int, limit: int) -> int:
    """Draft tokens a job may carry: they and the bonus token must fit in max_new_tokens and the
    model, and with a recent-token window every row must lie in the last token's block (a row
    in the next block would overwrite window slots the earlier rows still read)."""
    k = min(limit, max_new_tokens - new_tokens - 1, max_seq_len - num_tokens - 1)
    if window:
        k = min(k, window - 1 - (num_tokens - 1) % window)
    return max(0, k)
