"""Choosing a sweep's point: the Pareto front and the deployment rule, on stated reports."""

from types import SimpleNamespace

import pytest

from gss.errors import GSSError, GSSWarning
from gss.evaluate import SweepPoint, pareto_front, select_point
from gss.evaluate.sweep import check_tolerance


def _points(*grid: tuple[float, float, float]) -> list[SweepPoint]:
    """(delta, % memorized, perplexity) each."""
    return [
        SweepPoint({"delta": d}, SimpleNamespace(memorized=m, perplexity=ppl))  # type: ignore[arg-type]
        for d, m, ppl in grid
    ]


def test_select_point_prefers_fewer_secrets_said_at_equal_memorization():
    points = _points((1, 0.0, 100.0), (4, 0.0, 103.0), (8, 0.0, 104.0), (16, 0.0, 120.0))
    said = [30.0, 5.0, 5.0, 0.0]
    assert select_point(points, 100.0, secrets_said=said) == 1  # delta 16: past +5%
    assert select_point(points, 100.0, secrets_said=said, tolerance=0.25) == 3
    assert select_point(points, 100.0) == 0  # without secrets: exact match, then perplexity
    said[0] = 5.0
    assert select_point(points, 100.0, secrets_said=said) == 0  # a tie: the lower perplexity
    points[0] = _points((1, 3.1, 100.0))[0]
    assert select_point(points, 100.0, secrets_said=said) == 1  # memorization first
    assert select_point(points, 80.0, secrets_said=said) is None  # none within +5%


def test_select_point_counts_another_prompts_secrets_after_its_own():
    points = _points((1, 0.0, 100.0), (4, 0.0, 102.0), (8, 0.0, 104.0))
    own, others = [0.0, 0.0, 3.1], [12.5, 3.1, 0.0]
    assert select_point(points, 100.0, secrets_said=own) == 0
    assert select_point(points, 100.0, secrets_said=own, others_said=others) == 1
    assert select_point(points, 100.0, others_said=others) == 2  # no own counts: others decide


def test_select_point_refuses_what_it_cannot_read():
    points = _points((1, 0.0, 100.0))
    with pytest.raises(GSSError, match="one per point"):
        select_point(points, 100.0, secrets_said=[1.0, 2.0])
    with pytest.raises(GSSError, match="1 sweep points but 0 others-said shares"):
        select_point(points, 100.0, others_said=[])
    with pytest.raises(GSSError, match="share is NaN"):
        select_point(points, 100.0, secrets_said=[float("nan")])
    with pytest.raises(GSSError, match="tolerance must be >= 0"):
        select_point(points, 100.0, tolerance=-0.1)
    with pytest.raises(GSSError, match="tolerance must be >= 0"):
        check_tolerance(float("nan"))
    with pytest.warns(GSSWarning, match="tolerance 5 lets perplexity rise by 500%"):
        check_tolerance(5)


def test_pareto_front_drops_dominated_points():
    points = _points((1, 50.0, 100.0), (2, 10.0, 101.0), (3, 10.0, 105.0), (4, 0.0, 110.0))
    assert [p.options["delta"] for p in pareto_front(points)] == [4, 2, 1]
