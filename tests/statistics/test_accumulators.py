import pytest
import torch

from gss import GSSError
from gss.statistics.accumulators import CovarianceAccumulator, CrossMomentAccumulator


def test_streaming_covariance_equals_direct():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(500, 8, generator=gen, dtype=torch.float64) * 3 + 100  # large mean
    acc = CovarianceAccumulator(8)
    for chunk in h.split(37):
        acc.update(chunk)
    assert acc.count == 500
    assert torch.allclose(acc.mean, h.mean(0))
    assert torch.allclose(acc.covariance, torch.cov(h.T, correction=0), atol=1e-9)
    assert torch.allclose(acc.second_moment, h.T @ h / 500, rtol=1e-10)


def test_merge_equals_one_pass():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(300, 6, generator=gen)
    g = torch.randn(300, 6, generator=gen)
    a, b, whole = CovarianceAccumulator(6), CovarianceAccumulator(6), CovarianceAccumulator(6)
    a.update(h[:100])
    b.update(h[100:])
    whole.update(h)
    a.merge(b)
    assert torch.allclose(a.covariance, whole.covariance, atol=1e-12)
    m1, m2, mw = CrossMomentAccumulator(6), CrossMomentAccumulator(6), CrossMomentAccumulator(6)
    m1.update(h[:50], g[:50])
    m2.update(h[50:], g[50:])
    mw.update(h, g)
    m1.merge(m2)
    assert torch.allclose(m1.value, mw.value, atol=1e-12)
    assert torch.allclose(mw.value, (h.double().T @ g.double()) / 300)


def test_memory_is_constant_in_corpus_size():
    acc = CrossMomentAccumulator(4)
    for _ in range(50):
        acc.update(torch.randn(64, 4), torch.randn(64, 4))
    held = [t for t in vars(acc).values() if isinstance(t, torch.Tensor)]
    assert sum(t.numel() for t in held) == 16


def test_non_finite_activations_are_refused():
    acc = CovarianceAccumulator(3)
    with pytest.raises(GSSError, match="NaN or Inf"):
        acc.update(torch.tensor([[1.0, float("nan"), 0.0]]))


def test_empty_sets_get_clear_errors():
    with pytest.raises(GSSError, match="memorized-token set is empty"):
        _ = CrossMomentAccumulator(3).value
    with pytest.raises(GSSError, match="no generalization tokens"):
        _ = CovarianceAccumulator(3).covariance
