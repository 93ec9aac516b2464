"""lm-eval's standard errors (lm-eval 0.4.13, lm_eval/api/metrics.py stderr_for_metric), with its bootstrap
computed in this process.

lm-eval bootstraps the stderr of `median`, `matthews_corrcoef`, `f1_score`, `perplexity`, `bleu`, `chrf`,
`chrfpp`, `ter` and `nanmean`: chunks of min(1000, iters) resamples (iters // chunk chunks), chunk i drawn
with `random.Random(i).choices(xs, k=len(xs))`, then the sample standard deviation of the statistic over all
resamples. It runs the chunks in a `multiprocessing` pool forked from the calling process; forked from a
process holding the engine's threads, a worker can hang at the pool's end (seen in this suite), so here the
chunks run in this process instead, with the draws vectorized: numpy's MT19937 set to `Random(i)`'s state
yields the same 32-bit words, and Python's `random()` is (a >> 5, b >> 6) of two of them, so the indices
are the ones `choices` picks. `perplexity` of numbers is then computed on whole chunks (Python's
left-to-right sum, as lm-eval's `mean`, is a cumulative sum); the other statistics on each resample
as lm-eval computes them. Metrics with a closed form (mean, acc_all) keep lm-eval's own.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional, Sequence

import numpy as np

CHUNK = 1000                   # lm-eval's resamples per seeded chunk


def _bootstrappable() -> tuple[Callable, ...]:
    from lm_eval.api import metrics as m
    return (m.median, m.matthews_corrcoef, m.f1_score, m.perplexity, m.bleu, m.chrf, m.chrfpp, m.ter, m.nanmean)


def stderr_for_metric(metric: Callable, bootstrap_iters: int) -> Optional[Callable[[Sequence[Any]], float]]:
    """lm-eval's stderr_for_metric: None without iterations; the bootstrap for its bootstrappable
    statistics; else its closed form (or None)."""
    from lm_eval.api import metrics as m
    if bootstrap_iters <= 0:
        return None
    if metric in _bootstrappable():
        return lambda xs: bootstrap_stderr(metric, xs, bootstrap_iters)
    return m.stderr_for_metric(metric=metric, bootstrap_iters=bootstrap_iters)


def resample_indices(seed: int, n: int, k: int) -> np.ndarray:
    """[k, n] int64: the indices `random.Random(seed).choices(range(n), k=n)` picks, k times in a row."""
    state = random.Random(seed).getstate()[1]
    words = np.random.MT19937()
    words.state = {"bit_generator": "MT19937", "state": {"key": np.array(state[:624], dtype=np.uint32),
                                                         "pos": int(state[624])}}
    raw = words.random_raw(2 * n * k).reshape(-1, 2)
    a, b = (raw[:, 0] >> 5).astype(np.float64), (raw[:, 1] >> 6).astype(np.float64)
    u = (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)
    return np.floor(u * float(n)).astype(np.int64).reshape(k, n)


def bootstrap_stderr(metric: Callable, xs: Sequence[Any], iters: int) -> float:
    """lm-eval's bootstrap_stderr(metric, xs, iters), without its worker pool (module docstring)."""
    from lm_eval.api import metrics as m
    size = min(CHUNK, iters)
    items = list(xs)
    whole = _whole_chunk(metric, items)
    values: list[float] = []
    for i in range(iters // size):
        picks = resample_indices(i, len(items), size)
        if whole is not None:
            values.extend(whole(picks))
        else:
            values.extend(metric([items[j] for j in row]) for row in picks.tolist())
    return m.sample_stddev(values)


def _whole_chunk(metric: Callable, items: list) -> Optional[Callable[[np.ndarray], list[float]]]:
    """The statistic over a chunk of resamples at once, where it is exact: perplexity, nanmean."""
    from lm_eval.api import metrics as m
    if metric is m.perplexity and all(isinstance(x, (int, float)) for x in items):
        table = np.asarray(items, dtype=np.float64)

        def perplexity(picks: np.ndarray) -> list[float]:
            sums = np.cumsum(table[picks], axis=1)[:, -1]       # left to right, as Python's sum
            return [math.exp(-(s / picks.shape[1])) for s in sums.tolist()]
        return perplexity
    return None
