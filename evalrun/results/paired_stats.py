"""Paired statistics for comparing two runs on the same questions (numpy only).

Two runs answer the same n questions; only the discordant pairs carry information about the
difference:

                     candidate right   candidate wrong
    base right              a            b = to_wrong
    base wrong        c = to_correct           d

    delta = cand accuracy - base accuracy = (c - b) / n

- Per-question pass/fail (MMLU `correct`, HumanEval with one sample): `compare_binary`, the exact
  McNemar test and the exact conditional interval, which agree (the interval excludes 0 exactly
  when p <= 1 - level).
- Per-unit scores (HumanEval pass@k per problem): `compare_units`, a paired bootstrap over units.
- Many groups (subjects): `holm` adjusts their p-values for multiplicity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

Method = Literal["mcnemar-exact", "bootstrap"]


@dataclass(frozen=True)
class PairedComparison:
    """Candidate against base on `n` shared questions (or units); delta = cand_metric - base_metric.

    Standard errors are those each run reports on its own (NaN when n < 2, as in evalrun/tasks/mmlu.py);
    the interval and p-value are paired. to_correct / to_wrong count the questions that went
    wrong→right / right→wrong (for units: units whose score rose / fell).
    """
    n: int
    base_metric: float
    cand_metric: float
    base_stderr: float
    cand_stderr: float
    delta: float
    ci_low: float
    ci_high: float
    level: float
    p_value: float
    to_correct: int
    to_wrong: int
    method: Method

    def __post_init__(self) -> None:
        _check_level(self.level)
        if self.method not in ("mcnemar-exact", "bootstrap"):
            raise ValueError(f"method must be 'mcnemar-exact' or 'bootstrap', got {self.method!r}")


@dataclass(frozen=True)
class BootstrapResult:
    """Percentile interval and two-sided bootstrap p-value of statistic(cand) - statistic(base)."""
    delta: float
    ci_low: float
    ci_high: float
    p_value: float


# ---------------------------------------------------------------- exact binomial pieces

def _log_choose(n: int) -> np.ndarray:
    """log C(n, i) for i = 0..n, from lgamma (no cumulative rounding)."""
    lg = np.array([math.lgamma(i + 1) for i in range(n + 1)])    # [n+1] log i!
    return lg[n] - lg - lg[::-1]


def _logsumexp(a: np.ndarray) -> float:
    m = float(np.max(a))
    return m + math.log(float(np.sum(np.exp(a - m))))


def _tail(log_choose: np.ndarray, p: float, lo: int, hi: int) -> float:
    """P(lo <= X <= hi) for X ~ Binomial(n, p), 0 < p < 1, summed in log space."""
    n = len(log_choose) - 1
    i = np.arange(lo, hi + 1)
    return math.exp(_logsumexp(log_choose[lo:hi + 1] + i * math.log(p) + (n - i) * math.log1p(-p)))


def _bisect(f: Callable[[float], float], tol: float = 1e-15) -> float:
    """Root in (0, 1) of an increasing f with f(0+) < 0 < f(1-)."""
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts b (right→wrong), c (wrong→right):
    min(1, 2 P(X <= min(b, c))) with X ~ Binomial(b + c, 1/2); 1.0 when b = c = 0."""
    _check_count("b", b)
    _check_count("c", c)
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    log_p = _logsumexp(_log_choose(n)[:k + 1]) - n * math.log(2.0)
    return min(1.0, 2.0 * math.exp(log_p))


def clopper_pearson(x: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper–Pearson) interval for a binomial proportion, x successes in n trials (n >= 1):
    lower bound solves P(X >= x | p) = alpha/2, upper bound P(X <= x | p) = alpha/2."""
    _check_level(level)
    _check_count("x", x)
    if n < 1 or x > n:
        raise ValueError(f"need 1 <= n and x <= n, got x={x}, n={n}")
    half = (1.0 - level) / 2
    log_choose = _log_choose(n)
    lo = 0.0 if x == 0 else _bisect(lambda p: _tail(log_choose, p, x, n) - half)
    hi = 1.0 if x == n else _bisect(lambda p: half - _tail(log_choose, p, 0, x))
    return lo, hi


def paired_exact_interval(b: int, c: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact interval for delta = (c - b) / n, the accuracy difference on n shared questions.

    NOTE: conditional on the number of discordant pairs b + c: Clopper–Pearson on
    theta = c / (b + c), mapped to delta = (b + c) / n * (2 theta - 1). [0, 0] when b + c = 0.
    """
    _check_count("b", b)
    _check_count("c", c)
    if n < b + c or n < 1:
        raise ValueError(f"n must be >= 1 and >= b + c, got b={b}, c={c}, n={n}")
    _check_level(level)
    if b + c == 0:
        return 0.0, 0.0
    theta_lo, theta_hi = clopper_pearson(c, b + c, level)
    scale = (b + c) / n
    return scale * (2 * theta_lo - 1), scale * (2 * theta_hi - 1)


# ---------------------------------------------------------------- bootstrap and multiplicity

def paired_bootstrap(base: Sequence[float], cand: Sequence[float], statistic: Callable[..., np.ndarray] = np.mean,
                     n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> BootstrapResult:
    """Paired bootstrap of statistic(cand) - statistic(base): units are resampled jointly with
    replacement, n_boot times, from np.random.default_rng(seed) (same inputs and seed, same result).

    `statistic(x, axis=-1)` must reduce the last axis (numpy reductions do). Interval: percentiles
    (1 - level)/2 and (1 + level)/2 of the resampled deltas. p-value: the percentile interval
    inverted, p = min(1, 2 (1 + min(#{delta* <= 0}, #{delta* >= 0})) / (n_boot + 1)), never 0.
    """
    x, y = _as_units(base, cand)
    _check_level(level)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    n = len(x)
    rng = np.random.default_rng(seed)
    # NOTE: the chunk size depends only on n, so a seed always gives the same draws for the same data.
    chunk = max(1, (1 << 22) // n)
    deltas = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        rows = min(chunk, n_boot - start)
        idx = rng.integers(0, n, size=(rows, n))                              # [rows, n]
        deltas[start:start + rows] = statistic(y[idx], axis=-1) - statistic(x[idx], axis=-1)
    low, high = np.quantile(deltas, [(1 - level) / 2, (1 + level) / 2])
    extreme = min(int(np.sum(deltas <= 0)), int(np.sum(deltas >= 0)))
    p_value = min(1.0, 2.0 * (1 + extreme) / (n_boot + 1))
    delta = float(statistic(y, axis=-1) - statistic(x, axis=-1))
    return BootstrapResult(delta, float(low), float(high), p_value)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values, in the input order: the i-th smallest (1-based) of m
    becomes max over j <= i of min(1, (m - j + 1) p_(j))."""
    p = np.asarray(pvalues, dtype=float)
    if p.ndim != 1 or np.any(np.isnan(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must be a flat sequence of numbers in [0, 1], got {list(pvalues)!r}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    stepped = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(stepped)
    return adjusted.tolist()


# ---------------------------------------------------------------- entry points

def compare_binary(base: Sequence[bool], cand: Sequence[bool], level: float = 0.95) -> PairedComparison:
    """Pass/fail per question, aligned (base[i] and cand[i] are the same question): accuracies with
    the sample standard error sqrt(p (1 - p) / (n - 1)) (as evalrun/tasks/mmlu.py), the exact McNemar
    p-value and the exact interval of `paired_exact_interval` (conditional on b + c)."""
    x = _as_binary("base", base)
    y = _as_binary("cand", cand)
    _check_pair(x, y)
    _check_level(level)
    n = len(x)
    b = int(np.sum(x & ~y))
    c = int(np.sum(~x & y))
    ci_low, ci_high = paired_exact_interval(b, c, n, level)
    base_acc, cand_acc = float(np.mean(x)), float(np.mean(y))
    return PairedComparison(n=n, base_metric=base_acc, cand_metric=cand_acc,
                            base_stderr=_binary_stderr(base_acc, n), cand_stderr=_binary_stderr(cand_acc, n),
                            delta=(c - b) / n, ci_low=ci_low, ci_high=ci_high, level=level,
                            p_value=mcnemar_exact(b, c), to_correct=c, to_wrong=b, method="mcnemar-exact")


def compare_units(base: Sequence[float], cand: Sequence[float], level: float = 0.95, n_boot: int = 10000,
                  seed: int = 0) -> PairedComparison:
    """Per-unit scores, aligned (e.g. pass@k per HumanEval problem): means with the standard error
    sample std / sqrt(n) (as evalrun/tasks/passk.py), and `paired_bootstrap` of the mean difference."""
    x, y = _as_units(base, cand)
    boot = paired_bootstrap(x, y, np.mean, n_boot=n_boot, seed=seed, level=level)
    n = len(x)
    return PairedComparison(n=n, base_metric=float(np.mean(x)), cand_metric=float(np.mean(y)),
                            base_stderr=_unit_stderr(x), cand_stderr=_unit_stderr(y),
                            delta=boot.delta, ci_low=boot.ci_low, ci_high=boot.ci_high, level=level,
                            p_value=boot.p_value, to_correct=int(np.sum(y > x)), to_wrong=int(np.sum(y < x)),
                            method="bootstrap")


# ---------------------------------------------------------------- helpers

def _binary_stderr(acc: float, n: int) -> float:
    return math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else float("nan")


def _unit_stderr(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer count, got {value!r}")


def _check_pair(x: np.ndarray, y: np.ndarray) -> None:
    if len(x) != len(y):
        raise ValueError(f"base and cand must be aligned on the same questions: {len(x)} vs {len(y)} values")
    if len(x) == 0:
        raise ValueError("base and cand are empty: no shared questions to compare")


def _as_binary(name: str, values: Sequence[bool]) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of booleans, got shape {arr.shape}")
    if arr.dtype.kind == "b":
        return arr
    ok = arr.dtype.kind in "iuf" and bool(np.all((arr == 0) | (arr == 1)))
    if not ok:
        bad = next((v for v in values if not (isinstance(v, (bool, int, float, np.number, np.bool_)) and v in (0, 1))),
                   None)
        raise ValueError(f"{name} must hold only booleans or 0/1 (pass/fail per question), got {bad!r}")
    return arr.astype(bool)


def _as_units(base: Sequence[float], cand: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(base, dtype=float), np.asarray(cand, dtype=float)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"base and cand must be flat sequences of per-unit scores, got shapes {x.shape}, {y.shape}")
    _check_pair(x, y)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("base and cand must hold finite numbers (no NaN/inf per-unit scores)")
    return x, y
