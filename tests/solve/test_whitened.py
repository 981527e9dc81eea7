import warnings

import pytest
import torch

from gss import GSSError, GSSWarning, solve_probe_steer
from gss.solve.whitened import MAX_POWER_ITERS
from gss_bench.perf.scaling import accuracy


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


def _flat_past_the_window(d: int = 200, k: int = 8, seed: int = 3):
    """M whose 32 singular values fall evenly from 1.0 to 0.8: a window of K + 16 vectors
    ends inside them, where a few subspace iterations leave the directions off."""
    gen = torch.Generator().manual_seed(seed)
    left, _ = torch.linalg.qr(torch.randn(d, 32, generator=gen, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(d, 32, generator=gen, dtype=torch.float64))
    M = left @ torch.diag(torch.linspace(1.0, 0.8, 32, dtype=torch.float64)) @ right.T
    h = torch.randn(4 * d, d, generator=gen, dtype=torch.float64)
    return M, torch.cov(h.T, correction=0), k


def test_truncated_iterates_until_the_directions_settle():
    """Four fixed iterations (the old default) leave a direction ~14 degrees off on this
    spectrum; iterating to the tolerance matches the full SVD's directions."""
    M, sigma, k = _flat_past_the_window()
    full = solve_probe_steer(M, sigma, k, method="full")
    fixed = solve_probe_steer(M, sigma, k, method="truncated", power_iters=4)
    settled = solve_probe_steer(M, sigma, k, method="truncated")
    assert fixed.power_iters == 4 and not fixed.converged
    assert accuracy(full, fixed)["steer_min_cos"] < 0.99  # the case is a hard one
    assert settled.converged and 4 < settled.power_iters < MAX_POWER_ITERS
    close = accuracy(full, settled)
    assert close["steer_min_cos"] > 0.9999 and close["probe_min_cos"] > 0.9999
    assert torch.allclose(full.singular_values, settled.singular_values, rtol=1e-4)
    assert full.power_iters == 0 and full.converged and full.method == "full"


def test_a_window_as_wide_as_the_space_needs_no_iteration():
    M, sigma = _problem(d=24)
    full = solve_probe_steer(M, sigma, 10, method="full")
    sol = solve_probe_steer(M, sigma, 10, method="truncated")  # 10 + 16 vectors >= d
    assert sol.power_iters == 0 and sol.converged
    assert torch.allclose(full.singular_values, sol.singular_values, rtol=1e-10)
    assert accuracy(full, sol)["steer_min_cos"] > 1 - 1e-10


def test_truncated_warns_when_it_does_not_settle():
    M, sigma, k = _flat_past_the_window()
    with pytest.warns(GSSWarning, match=r"did not settle .* in 64 iterations.*smaller rank"):
        sol = solve_probe_steer(M, sigma, k, method="truncated", tol=1e-12)  # below float32
    assert sol.power_iters == MAX_POWER_ITERS and not sol.converged
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fixed count is the caller's choice: no warning
        solve_probe_steer(M, sigma, k, method="truncated", power_iters=2)


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


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "svd"}, "method must be"),
        ({"power_iters": -1}, "power_iters"),
        ({"power_iters": 2.5}, "power_iters"),
        ({"tol": 0.0}, "tol > 0"),
        ({"oversample": -3}, "oversample"),
    ],
)
def test_bad_solver_options_get_clear_errors(options, message):
    M, sigma = _problem()
    with pytest.raises(GSSError, match=message):
        solve_probe_steer(M, sigma, 2, **options)


def test_relu_thresholds_are_never_negative():
    """The one-sided gate's percentile of mostly negative responses is floored at 0, not a
    negative level that would open the gate on negative responses (and fail the artifact's
    check)."""
    from gss.solve.thresholds import thresholds_from_responses

    responses = torch.stack([-torch.rand(200) - 1.0, torch.randn(200)], 1)
    eps, info = thresholds_from_responses(responses, "relu", 95.0)
    assert eps[0] == 0.0 and eps[1] > 0
    assert info["open_share"]["per_direction"][0] == 0.0  # no response passes 0
    eps, _ = thresholds_from_responses(responses, "relu", None, gate_share=0.05)
    assert bool((eps >= 0).all())
