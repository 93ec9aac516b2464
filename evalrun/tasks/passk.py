"""pass@k: the unbiased estimator of Chen et al. (2021), per problem and averaged.

    pass@k = 1 - C(n - c, k) / C(n, k)          n samples of a problem, c of them correct

computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the huge
binomials. A k is reported only when every problem has n >= k samples.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

DEFAULT_KS = (1, 10, 100)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def summarize_pass_at_k(counts: Mapping[str, tuple[int, int]],
                        ks: Sequence[int] = DEFAULT_KS) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """`counts`: task_id -> (n, c). Returns per-problem {"pass@k": ...} and the overall means
    with their standard errors ("pass@k_stderr": sample std / sqrt(problems))."""
    usable = [k for k in ks if counts and all(n >= k for n, _ in counts.values())]
    per_problem = {tid: {f"pass@{k}": pass_at_k(n, c, k) for k in usable} for tid, (n, c) in counts.items()}
    overall: dict[str, float] = {}
    for k in usable:
        values = [p[f"pass@{k}"] for p in per_problem.values()]
        mean = sum(values) / len(values)
        overall[f"pass@{k}"] = mean
        overall[f"pass@{k}_stderr"] = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)
                                                 / len(values)) if len(values) > 1 else float("nan"))
    return per_problem, overall
