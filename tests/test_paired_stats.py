"""evalrun/results/paired_stats.py against independent references: scipy's exact binomial test and
Clopper–Pearson interval, statsmodels' McNemar test and Holm correction, and a plain numpy
bootstrap written here (other code, other generator, other seed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from evalrun.results.paired_stats import (
    PairedComparison,
    clopper_pearson,
    compare_binary,
    compare_units,
    holm,
    mcnemar_exact,
    paired_bootstrap,
    paired_exact_interval,
)

GRID = [(0, 0), (0, 1), (1, 0), (5, 5), (3, 17), (17, 3), (0, 12), (100, 130), (2000, 2100), (9900, 10100)]


def _ref_pvalue(b: int, c: int) -> float:
    return 1.0 if b + c == 0 else binomtest(min(b, c), b + c, 0.5).pvalue


def _ref_interval(b: int, c: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """scipy's exact (Clopper–Pearson) interval on c / (b + c), mapped to (c - b) / n."""
    if b + c == 0:
        return 0.0, 0.0
    ci = binomtest(c, b + c).proportion_ci(confidence_level=level, method="exact")
    scale = (b + c) / n
    return scale * (2 * ci.low - 1), scale * (2 * ci.high - 1)


def _flipped(seed: int, n: int, to_wrong: int, to_correct: int) -> tuple[np.ndarray, np.ndarray]:
    """A base run and a copy with `to_wrong` right answers and `to_correct` wrong answers flipped."""
    rng = np.random.default_rng(seed)
    base = rng.random(n) < 0.6
    cand = base.copy()
    cand[rng.choice(np.flatnonzero(base), to_wrong, replace=False)] = False
    cand[rng.choice(np.flatnonzero(~base), to_correct, replace=False)] = True
    return base, cand


# ---------------------------------------------------------------- McNemar and the exact interval

@pytest.mark.parametrize("b,c", GRID)
def test_mcnemar_matches_scipy_binomtest(b, c):
    assert mcnemar_exact(b, c) == pytest.approx(_ref_pvalue(b, c), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("b,c", GRID)
def test_mcnemar_matches_statsmodels(b, c):
    mcnemar = pytest.importorskip("statsmodels.stats.contingency_tables").mcnemar
    ref = mcnemar([[7, b], [c, 4]], exact=True).pvalue
    assert mcnemar_exact(b, c) == pytest.approx(ref, rel=1e-9, abs=1e-300)


def test_mcnemar_tiny_pvalues_stay_accurate_for_large_n():
    """Log-space sums: no overflow and full relative accuracy far in the tail at n = 20,000."""
    b, c = 9500, 10500
    p = mcnemar_exact(b, c)
    assert 0 < p < 1e-10
    assert p == pytest.approx(binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


@pytest.mark.parametrize("b,c", GRID)
@pytest.mark.parametrize("level", [0.95, 0.9])
def test_exact_interval_matches_scipy_clopper_pearson(b, c, level):
    n = b + c + 1000
    low, high = paired_exact_interval(b, c, n, level)
    ref_low, ref_high = _ref_interval(b, c, n, level)
    assert abs(low - ref_low) < 1e-9 and abs(high - ref_high) < 1e-9
    assert low <= (c - b) / n <= high


@pytest.mark.parametrize("x,n", [(0, 1), (1, 1), (0, 40), (40, 40), (1, 3), (13, 40), (2100, 4100)])
def test_clopper_pearson_matches_scipy(x, n):
    ci = binomtest(x, n).proportion_ci(method="exact")
    low, high = clopper_pearson(x, n)
    assert abs(low - ci.low) < 1e-9 and abs(high - ci.high) < 1e-9


def test_interval_excludes_zero_exactly_when_mcnemar_rejects():
    """The doubled exact binomial test and the Clopper–Pearson interval are duals at theta = 1/2."""
    for b in range(0, 40, 3):
        for c in range(0, 40, 4):
            p = _ref_pvalue(b, c)
            low, high = paired_exact_interval(b, c, 100)
            assert abs(p - 0.05) < 1e-9 or (low > 0 or high < 0) == (p < 0.05), (b, c)


# ---------------------------------------------------------------- compare_binary

def test_run_against_itself():
    base, _ = _flipped(0, 500, 0, 0)
    r = compare_binary(base, base)
    assert (r.delta, r.p_value, r.ci_low, r.ci_high, r.to_correct, r.to_wrong) == (0.0, 1.0, 0.0, 0.0, 0, 0)
    assert r.base_metric == r.cand_metric and r.method == "mcnemar-exact" and r.n == 500


@pytest.mark.parametrize("to_wrong,to_correct", [(30, 12), (1, 0), (0, 7), (9, 9)])
def test_flipped_copy_matches_independent_computation(to_wrong, to_correct):
    base, cand = _flipped(1, 800, to_wrong, to_correct)
    r = compare_binary(base.tolist(), cand.tolist())
    assert (r.to_wrong, r.to_correct, r.n) == (to_wrong, to_correct, 800)
    assert r.delta == pytest.approx(cand.mean() - base.mean(), abs=1e-15)
    assert r.p_value == pytest.approx(_ref_pvalue(to_wrong, to_correct), rel=1e-9)
    ref_low, ref_high = _ref_interval(to_wrong, to_correct, 800)
    assert abs(r.ci_low - ref_low) < 1e-9 and abs(r.ci_high - ref_high) < 1e-9
    # Each run's stderr is lm-eval's mean_stderr (sample std / sqrt(n)), as evalrun/tasks/mmlu.py reports it.
    assert r.base_stderr == pytest.approx(np.std(base, ddof=1) / math.sqrt(800), rel=1e-12)
    assert r.cand_stderr == pytest.approx(np.std(cand, ddof=1) / math.sqrt(800), rel=1e-12)


def test_planted_five_point_drop_is_significant_one_question_is_not():
    base, cand = _flipped(2, 1000, 80, 30)                  # -5 points on 1,000 questions
    drop = compare_binary(base, cand)
    assert drop.delta == pytest.approx(-0.05) and drop.p_value < 0.05 and drop.ci_high < 0
    base, cand = _flipped(3, 1000, 1, 0)                    # one question
    one = compare_binary(base, cand)
    assert one.delta == pytest.approx(-0.001) and one.p_value >= 0.05 and one.ci_low < 0 < one.ci_high


def test_compare_binary_accepts_zero_one_and_rejects_bad_input():
    assert compare_binary([1, 0, 1], [1, 1, 1]).to_correct == 1
    with pytest.raises(ValueError, match="aligned"):
        compare_binary([True, False], [True])
    with pytest.raises(ValueError, match="empty"):
        compare_binary([], [])
    with pytest.raises(ValueError, match="0/1"):
        compare_binary([True, 0.5], [True, False])
    with pytest.raises(ValueError, match="0/1"):
        compare_binary([True, None], [True, False])
    with pytest.raises(ValueError, match="level"):
        compare_binary([True], [False], level=1.0)
    with pytest.raises(ValueError, match="level"):
        compare_binary([True], [False], level=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 3)


def test_single_question_has_no_stderr():
    r = compare_binary([True], [False])
    assert math.isnan(r.base_stderr) and math.isnan(r.cand_stderr) and r.to_wrong == 1


def test_record_validates_method():
    with pytest.raises(ValueError, match="method"):
        PairedComparison(1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.95, 1.0, 0, 0, "z-test")


# ---------------------------------------------------------------- bootstrap

def _units(seed: int, n: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """pass@k-like per-problem scores in [0, 1] and a correlated candidate moved by about `shift`."""
    rng = np.random.default_rng(seed)
    base = rng.beta(0.6, 0.6, n)
    cand = np.clip(base + shift + 0.15 * rng.standard_normal(n), 0, 1)
    return base, cand


def _reference_bootstrap(base: np.ndarray, cand: np.ndarray, n_boot: int, seed: int, level: float):
    """Mean of resampled per-unit differences (equal to the difference of means), legacy generator."""
    rng = np.random.RandomState(seed)
    diff = cand - base
    means = np.array([diff[rng.randint(0, len(diff), len(diff))].mean() for _ in range(n_boot)])
    alpha = 1 - level
    p = min(1.0, 2 * min(np.mean(means <= 0), np.mean(means >= 0)))
    return np.percentile(means, 100 * alpha / 2), np.percentile(means, 100 * (1 - alpha / 2)), p


@pytest.mark.parametrize("shift", [-0.01, -0.003])
def test_bootstrap_matches_independent_bootstrap(shift):
    """Tolerances: with 10,000 resamples the Monte-Carlo standard error of a 2.5% percentile is
    0.027 sd of the delta, 0.038 sd for the difference of two bootstraps; 5% of the 95% interval's
    width (0.196 sd, here ~0.0009) is 5 standard errors, and a 90% interval in place of 95% (0.315 sd)
    fails. A p-value near 0.37 has a standard error of ~0.007: 0.03 is > 4, a one-sided p fails."""
    base, cand = _units(4, 1000, shift)
    r = paired_bootstrap(base, cand, n_boot=10000, seed=0)
    ref_low, ref_high, ref_p = _reference_bootstrap(base, cand, 10000, 12345, 0.95)
    assert r.delta == pytest.approx(cand.mean() - base.mean(), abs=1e-12)
    tol = 0.05 * (ref_high - ref_low)
    assert abs(r.ci_low - ref_low) < tol and abs(r.ci_high - ref_high) < tol
    assert abs(r.p_value - ref_p) < 0.03


def test_bootstrap_same_seed_same_result_other_seed_differs():
    base, cand = _units(5, 300, 0.0)
    first = paired_bootstrap(base, cand, n_boot=2000, seed=7)
    assert paired_bootstrap(base.tolist(), cand.tolist(), n_boot=2000, seed=7) == first
    assert paired_bootstrap(base, cand, n_boot=2000, seed=8) != first


def test_bootstrap_other_statistic_and_level():
    base, cand = _units(6, 400, 0.05)
    r = paired_bootstrap(base, cand, statistic=np.median, n_boot=2000, level=0.8)
    assert r.delta == pytest.approx(np.median(cand) - np.median(base))
    assert r.ci_low <= r.delta <= r.ci_high


def test_compare_units_self_planted_drop_and_bad_input():
    base, cand = _units(7, 1000, -0.05)
    same = compare_units(base, base)
    assert (same.delta, same.p_value, same.ci_low, same.ci_high, same.to_correct, same.to_wrong) == (0, 1, 0, 0, 0, 0)
    drop = compare_units(base, cand)
    assert drop.method == "bootstrap" and drop.p_value < 0.05 and drop.ci_high < 0
    assert (drop.to_correct, drop.to_wrong) == (int(np.sum(cand > base)), int(np.sum(cand < base)))
    assert drop.base_stderr == pytest.approx(np.std(base, ddof=1) / math.sqrt(1000))
    one = base.copy()
    one[0] = 1 - one[0]                                    # one problem changes
    assert compare_units(base, one).p_value >= 0.05
    with pytest.raises(ValueError, match="aligned"):
        compare_units([0.1, 0.2], [0.3])
    with pytest.raises(ValueError, match="finite"):
        compare_units([0.1, float("nan")], [0.3, 0.4])
    with pytest.raises(ValueError, match="level"):
        compare_units([0.1], [0.3], level=95)


# ---------------------------------------------------------------- Holm

def test_holm_hand_worked():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([]) == []
    with pytest.raises(ValueError, match="p-values"):
        holm([0.1, 1.5])


def test_holm_matches_statsmodels():
    multipletests = pytest.importorskip("statsmodels.stats.multitest").multipletests
    rng = np.random.default_rng(8)
    p = np.concatenate([rng.random(50), rng.random(7) * 1e-3, [0.02, 0.02]])   # 57 subjects, with ties
    assert holm(p.tolist()) == pytest.approx(multipletests(p, method="holm")[1].tolist(), rel=1e-12)
