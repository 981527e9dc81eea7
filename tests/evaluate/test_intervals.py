"""Exact binomial intervals (issue 70): "0 of 16" is compatible with up to ~21% (two-sided
95%), and about 100 rows make a held-out 0 mean at most 3% (one-sided)."""

import math

import pytest

from gss import GSSError
from gss.evaluate.intervals import clopper_pearson


def test_zero_successes_have_the_closed_form_bound():
    assert clopper_pearson(0, 16) == pytest.approx((0.0, 1 - 0.025 ** (1 / 16)), abs=1e-9)
    _, upper = clopper_pearson(0, 100, one_sided=True)
    assert upper == pytest.approx(1 - 0.05 ** (1 / 100), abs=1e-9) and upper < 0.03


def test_the_interval_is_the_exact_binomial_one():
    """At the bounds the binomial tails equal 2.5% each (the definition)."""
    k, n = 5, 20
    lo, hi = clopper_pearson(k, n)

    def pmf(i, p):
        return math.comb(n, i) * p**i * (1 - p) ** (n - i)

    assert sum(pmf(i, lo) for i in range(k, n + 1)) == pytest.approx(0.025, abs=1e-9)
    assert sum(pmf(i, hi) for i in range(k + 1)) == pytest.approx(0.025, abs=1e-9)
    assert clopper_pearson(n, n)[1] == 1.0 and clopper_pearson(0, 0) == (0.0, 1.0)
    with pytest.raises(GSSError, match="0 <= successes <= trials"):
        clopper_pearson(3, 2)
