"""Exact (Clopper-Pearson) intervals of a rate: how far "0 of 16" is from "none" (issue 70).

A leak rate measured on a few held-out rows is an estimate; its interval says which true rates it
cannot tell apart. Exact binomial tails by bisection, no scipy: the counts here are small.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gss.errors import GSSError


def _tail_at_least(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    logs = [
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(p)
        + (n - i) * math.log1p(-p)
        for i in range(k, n + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def _solve(f: Callable[[float], float], target: float) -> float:
    """The p in [0, 1] where the increasing ``f(p)`` reaches ``target`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(
    successes: int, trials: int, confidence: float = 0.95, one_sided: bool = False
) -> tuple[float, float]:
    """The exact interval (lower, upper) of a rate seen ``successes`` times in ``trials``:
    two-sided at ``confidence`` by default, or the one-sided upper bound (lower 0) with
    ``one_sided`` (what "a held-out 0 means at most 3%" reads)."""
    if not (isinstance(trials, int) and isinstance(successes, int) and 0 <= successes <= trials):
        raise GSSError(
            f"an interval needs 0 <= successes <= trials (integers), got {successes} of {trials}."
        )
    if not 0 < confidence < 1:
        raise GSSError(f"confidence must be in (0, 1), got {confidence}.")
    if trials == 0:
        return 0.0, 1.0
    alpha = 1 - confidence
    tail = alpha if one_sided else alpha / 2
    k, n = successes, trials
    upper = 1.0 if k == n else _solve(lambda p: _tail_at_least(k + 1, n, p), 1 - tail)
    if one_sided:
        return 0.0, upper
    lower = 0.0 if k == 0 else _solve(lambda p: _tail_at_least(k, n, p), tail)
    return lower, upper
