import pytest
import torch

from gss import GSSError, solve_probe_steer


def _problem(d: int = 24, n: int = 400, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64) @ a  # anisotropic activations
    sigma = torch.cov(h.T, correction=0)
    g = torch.randn(n, d, generator=gen, dtype=torch.float64)
    M = h.T @ g / n
    return M, sigma


def test_constraints_and_objective():
    M, sigma = _problem()
    delta, k = 0.7, 5
    sol = solve_probe_steer(M, sigma, k, delta, jitter=0.0)
    U, V, S = sol.probe, sol.steer, sol.singular_values
    gram = U @ sigma @ U.T
    assert torch.allclose(torch.diagonal(gram), torch.full((k,), delta, dtype=torch.float64))
    off = gram - torch.diag(torch.diagonal(gram))
    assert off.abs().max() < 1e-8  # Sigma-orthogonal
    assert torch.allclose(V.norm(dim=1), torch.ones(k, dtype=torch.float64))
    values = torch.einsum("kd,de,ke->k", U, M, V)
    assert torch.allclose(values, delta**0.5 * S)
    assert (S[:-1] >= S[1:]).all()


def test_no_random_feasible_pair_beats_the_first():
    M, sigma = _problem(seed=1)
    delta = 2.0
    sol = solve_probe_steer(M, sigma, 1, delta, jitter=0.0)
    best = float(sol.probe[0] @ M @ sol.steer[0])
    gen = torch.Generator().manual_seed(3)
    for _ in range(2000):
        u = torch.randn(M.shape[0], generator=gen, dtype=torch.float64)
        v = torch.randn(M.shape[0], generator=gen, dtype=torch.float64)
        u = u * (delta / (u @ sigma @ u)) ** 0.5  # on the budget boundary
        v = v / v.norm()
        assert float(u @ M @ v) <= best + 1e-9


def test_truncated_matches_full():
    d, k = 200, 4
    gen = torch.Generator().manual_seed(5)
    # A memorization matrix with a clear spectral gap, as M is in practice.
    left = torch.randn(d, k, generator=gen, dtype=torch.float64)
    right = torch.randn(d, k, generator=gen, dtype=torch.float64)
    M = left @ torch.diag(torch.tensor([8.0, 6.0, 4.0, 3.0], dtype=torch.float64)) @ right.T
    M += 0.01 * torch.randn(d, d, generator=gen, dtype=torch.float64)
    h = torch.randn(3 * d, d, generator=gen, dtype=torch.float64)
    sigma = torch.cov(h.T, correction=0)
    full = solve_probe_steer(M, sigma, k, 1.0, method="full")
    trunc = solve_probe_steer(M, sigma, k, 1.0, method="truncated")
    assert torch.allclose(full.singular_values, trunc.singular_values, rtol=1e-6)
    assert torch.allclose(full.steer, trunc.steer, atol=1e-6)
    assert torch.allclose(full.probe, trunc.probe, atol=1e-6)


def test_jitter_rescues_singular_covariance():
    d = 10
    h = torch.randn(5, d, dtype=torch.float64)  # rank 4 < d: singular
    sigma = torch.cov(h.T, correction=0)
    M = torch.randn(d, d, dtype=torch.float64)
    sol = solve_probe_steer(M, sigma, 2, 1.0, jitter=0.0)
    assert sol.jitter > 0 and torch.isfinite(sol.probe).all()


@pytest.mark.parametrize(
    ("M", "sigma", "rank", "message"),
    [
        (torch.zeros(4, 5), torch.eye(4), 1, "square"),
        (torch.zeros(4, 4), torch.eye(3), 1, "match M"),
        (torch.zeros(4, 4), torch.eye(4), 5, "rank"),
        (torch.full((4, 4), float("nan")), torch.eye(4), 1, "NaN"),
        (torch.zeros(4, 4), torch.diag(torch.tensor([10.0, 10.0, 10.0, -5.0])), 1, "semi-definite"),
        (torch.zeros(4, 4), torch.triu(torch.ones(4, 4)), 1, "symmetric"),
    ],
)
def test_bad_inputs_get_clear_errors(M, sigma, rank, message):
    with pytest.raises(GSSError, match=message):
        solve_probe_steer(M, sigma, rank, 1.0)
