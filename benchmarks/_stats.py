"""Statistics the timing benchmarks share: an interval for a median that assumes no distribution."""

from __future__ import annotations

import math


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics k and
    n + 1 - k, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (the whole range
    where n is too small for the level)."""
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n  # P(X = k) added: P(X < k + 1)
        if below > (1 - level) / 2:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])
