"""evalrun/tasks/lm_eval_stderr.py: lm-eval 0.4.13's stderrs computed in-process give lm-eval's own numbers
bitwise (its bootstrap run by lm-eval itself, in-process: DISABLE_MULTIPROC=1, the same draws as its pool)."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's metrics import sacrebleu: install evalrun[lm-eval]")

from lm_eval.api import metrics as m  # noqa: E402

from evalrun.tasks.lm_eval_stderr import bootstrap_stderr, resample_indices, stderr_for_metric  # noqa: E402


@pytest.fixture(autouse=True)
def _lm_eval_in_process(monkeypatch):
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
@pytest.mark.parametrize("seed", [0, 3, 99])
def test_resample_indices_are_the_ones_random_choices_picks(n, seed):
    population, rnd = list(range(n)), random.Random(seed)
    assert resample_indices(seed, n, 4).tolist() == [rnd.choices(population, k=n) for _ in range(4)]


def _data(kind: str, n: int, rnd: random.Random) -> list:
    if kind == "floats":
        return [-rnd.random() * 6 for _ in range(n)]
    if kind == "pairs":
        return [(rnd.randint(0, 1), rnd.randint(0, 1)) for _ in range(n)]
    words = ["the cat sat", "on the mat", "a dog ran", "far away now"]
    return [([rnd.choice(words)], rnd.choice(words)) for _ in range(n)]


@pytest.mark.parametrize("name,kind,iters", [
    ("perplexity", "floats", 1000), ("perplexity", "floats", 2500), ("perplexity", "floats", 20000),
    ("median", "floats", 2000), ("nanmean", "floats", 1000), ("f1_score", "pairs", 1000),
    ("matthews_corrcoef", "pairs", 1000), ("bleu", "texts", 100), ("chrf", "texts", 100),
])
def test_bootstrap_equals_lm_eval(name, kind, iters):
    metric = getattr(m, name)
    xs = _data(kind, 37, random.Random(len(name)))
    assert bootstrap_stderr(metric, xs, iters) == m.bootstrap_stderr(metric, xs, iters)


def test_stderr_for_metric_follows_lm_eval():
    xs = _data("floats", 25, random.Random(1))
    assert stderr_for_metric(m.perplexity, 0) is None and stderr_for_metric(m.mean, 0) is None
    assert stderr_for_metric(m.mean, 1000)(xs) == m.stderr_for_metric(m.mean, 1000)(xs)          # closed form
    assert stderr_for_metric(m.perplexity, 1000)(xs) == m.stderr_for_metric(m.perplexity, 1000)(xs)
    assert stderr_for_metric(m.weighted_perplexity, 1000) is None is m.stderr_for_metric(m.weighted_perplexity, 1000)
