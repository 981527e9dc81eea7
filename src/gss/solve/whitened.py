"""The closed-form probe/steer solve (the paper's Theorem 4.1) by a whitened SVD.

Maximise ``sum_k u_k^T M v_k`` subject to ``u_k^T Sigma u_k <= delta`` and ``||v_k|| = 1``.
With ``Sigma + jitter I = L L^T`` the problem becomes an SVD of ``L^{-1} M = U~ S V~^T``:
``probe = sqrt(delta) L^{-T} U~_K`` and ``steer = V~_K``. The probes are Sigma-orthogonal and
each meets its budget exactly. For K << d a randomized SVD of the implicit operator
``X -> L^{-1} (M X)`` avoids forming and decomposing the whole d x d matrix.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from gss.errors import GSSError, GSSWarning

SolveMethod = Literal["auto", "full", "truncated"]
TOL = 1e-5  # relative change of the top-K singular values at which subspace iteration stops
MAX_POWER_ITERS = 64


@dataclass(frozen=True)
class ProbeSteer:
    """Result of :func:`solve_probe_steer` (float64)."""

    probe: Tensor  # (K, d)
    steer: Tensor  # (K, d), unit rows
    singular_values: Tensor  # (K,) of the whitened memorization matrix
    delta: float
    jitter: float  # absolute diagonal loading that made Sigma positive definite
    method: str  # "full" or "truncated" (what "auto" chose)
    power_iters: int = 0  # subspace iterations "truncated" ran (0 for "full")
    converged: bool = True  # "truncated": its last iteration moved no singular value by `tol`

    @property
    def rank(self) -> int:
        return int(self.probe.shape[0])


def _check_inputs(M: Tensor, sigma: Tensor, rank: int, delta: float) -> int:
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise GSSError(f"M must be a square (d, d) matrix, got shape {tuple(M.shape)}.")
    d = M.shape[0]
    if sigma.shape != (d, d):
        raise GSSError(f"Sigma must be ({d}, {d}) to match M, got {tuple(sigma.shape)}.")
    if not isinstance(rank, int) or not 1 <= rank <= d:
        raise GSSError(f"rank must be an integer in 1..{d}, got {rank!r}.")
    if not delta > 0:
        raise GSSError(f"delta (the variance budget) must be > 0, got {delta!r}.")
    for name, t in (("M", M), ("Sigma", sigma)):
        if not torch.isfinite(t.sum(dtype=torch.float64)):  # NaN / Inf reach the sum
            raise GSSError(
                f"{name} contains NaN or Inf: the calibration statistics are corrupt (check the "
                "model's activations for overflow, e.g. run calibration in float32)."
            )
    if _asymmetry(sigma) > 1e-6:
        raise GSSError("Sigma is not symmetric; pass a covariance matrix.")
    return d


def _asymmetry(sigma: Tensor) -> float:
    """Relative size of ``(Sigma - Sigma^T) x`` for random x: two mat-vecs instead of a
    transposed d x d copy, which costs more than the Cholesky at d = 4096 (any asymmetry shows
    up for almost every x)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(sigma.shape[0], 2, generator=gen, dtype=sigma.dtype).to(sigma.device)
    left, right = sigma @ x, (x.T @ sigma).T
    return float((left - right).norm() / (left.norm() + right.norm()).clamp_min(1e-30))


def _cholesky(sigma: Tensor, jitter: float, max_jitter: float = 1e-3) -> tuple[Tensor, float]:
    """Cholesky of Sigma + eps I. eps starts at ``jitter`` times the mean eigenvalue and grows
    x100 per try up to ``max_jitter`` times it; a matrix that needs more is not a covariance."""
    d = sigma.shape[0]
    scale = float(torch.diagonal(sigma).mean())
    if not scale > 0:
        raise GSSError(
            "Sigma has a non-positive trace: the generalization activations are constant or "
            "empty. Use more (and more varied) text for Sigma_gen."
        )
    eye = torch.eye(d, dtype=sigma.dtype, device=sigma.device)
    eps = jitter * scale
    while True:
        factor, info = torch.linalg.cholesky_ex(sigma + eps * eye)
        if int(info) == 0:
            return factor, eps
        if eps >= max_jitter * scale:
            break
        eps = min(max(eps * 100.0, 1e-10 * scale), max_jitter * scale)
    min_eig = float(torch.linalg.eigvalsh(sigma)[0])
    raise GSSError(
        f"Sigma is not positive semi-definite even after adding {eps:.3g} to its diagonal "
        f"(smallest eigenvalue {min_eig:.3g}). It was not built as a covariance of real "
        "activations; check the statistics, or raise `jitter`."
    )


def _fix_signs(u: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Make each steer's largest-magnitude entry positive (SVD signs are arbitrary)."""
    idx = v.abs().argmax(dim=0)
    signs = torch.sign(v[idx, torch.arange(v.shape[1])])
    signs[signs == 0] = 1
    return u * signs, v * signs


@dataclass(frozen=True)
class _Truncated:
    left: Tensor  # (d, K) left singular vectors of the whitened matrix
    values: Tensor  # (K,)
    right: Tensor  # (d, K)
    iterations: int
    converged: bool
    window_ratio: float  # smallest window Ritz value / K-th: near 1, the spectrum is flat there


def _truncated_svd(
    L: Tensor,
    M: Tensor,
    rank: int,
    oversample: int,
    power_iters: int | None,
    tol: float,
    seed: int,
) -> _Truncated:
    """Randomized SVD (Halko et al.) of ``A = L^{-1} M`` using only products with A and A^T.

    Subspace iteration on a window of ``rank + oversample`` vectors runs until the top ``rank``
    Ritz values change by less than ``tol`` (relative) from one iteration to the next, up to
    ``MAX_POWER_ITERS``, or exactly ``power_iters`` times when given. A fixed count is not
    enough in general: the error in sigma_k shrinks like (sigma_{window+1} / sigma_k)^2 an
    iteration, so a spectrum that is flat across the window's edge needs many more.

    The range finder runs in float32 (it reads L and M once per product and is bound by memory
    bandwidth: half the bytes, half the time); the final projection ``Q^T A`` and its SVD run in
    float64, so the result is the exact SVD of A restricted to the subspace found.
    """
    d = M.shape[0]
    width = min(d, rank + oversample)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    omega = torch.randn(d, width, generator=gen, dtype=torch.float32).to(M.device)
    L32, M32 = L.float(), M.float()

    def a_mul(x: Tensor, low: Tensor, mat: Tensor) -> Tensor:
        return torch.linalg.solve_triangular(low, mat @ x, upper=False)

    def at_mul(y: Tensor, low: Tensor, mat: Tensor) -> Tensor:
        return mat.T @ torch.linalg.solve_triangular(low.T, y, upper=True)

    # a window as wide as the space spans all of it: the projection below is exact at once
    limit = 0 if width == d else MAX_POWER_ITERS if power_iters is None else power_iters
    q, _ = torch.linalg.qr(a_mul(omega, L32, M32))
    ritz: Tensor | None = None
    converged, iterations = width == d, 0  # converged: the last iteration moved no value by tol
    while iterations < limit:
        z, _ = torch.linalg.qr(at_mul(q, L32, M32))
        y = a_mul(z, L32, M32)  # A Z: its singular values are the Ritz values of the window
        previous, ritz = ritz, torch.linalg.svdvals(y)
        q, _ = torch.linalg.qr(y)
        iterations += 1
        if previous is not None:
            # float32 rounds the products by ~1e-7 sigma_1, so a value far below sigma_1 is
            # judged against sigma_1 / 100: relative to itself it would never settle
            scale = torch.maximum(ritz[:rank], ritz[0] * 1e-2).clamp_min(1e-30)
            change = (ritz[:rank] - previous[:rank]).abs() / scale
            converged = bool(change.max() < tol)  # one host sync an iteration
            if converged and power_iters is None:
                break
    q, _ = torch.linalg.qr(q.to(M.dtype))
    b = at_mul(q, L, M).T  # (width, d) = Q^T A, in float64
    ub, s, vh = torch.linalg.svd(b, full_matrices=False)
    window_ratio = float(s[-1] / s[rank - 1].clamp_min(1e-300))
    return _Truncated(
        (q @ ub)[:, :rank], s[:rank], vh[:rank].T, iterations, converged, window_ratio
    )


def solve_probe_steer(
    M: Tensor,
    sigma: Tensor,
    rank: int,
    delta: float = 1.0,
    *,
    jitter: float = 1e-6,
    method: SolveMethod = "auto",
    oversample: int = 16,
    power_iters: int | None = None,
    tol: float = TOL,
    seed: int = 0,
) -> ProbeSteer:
    """Solve for K = ``rank`` probe/steer pairs.

    Args:
        M: (d, d) memorization matrix E_mem[h g^T].
        sigma: (d, d) generalization covariance (or second moment).
        rank: number of directions K.
        delta: variance budget per probe; each probe meets ``u^T Sigma u = delta``.
        jitter: diagonal loading, relative to the mean eigenvalue of Sigma; raised
            automatically (x100 per try) if Sigma is numerically singular.
        method: ``"full"`` SVD, ``"truncated"`` randomized SVD of the implicit whitened
            operator, or ``"auto"`` (truncated when K <= d / 8 and d >= 1024).
        oversample: extra vectors in the truncated method's window (K + oversample).
        power_iters: subspace iterations of the truncated method; None (default) iterates
            until no top-K singular value moves by more than ``tol`` (relative) in one
            iteration, up to ``MAX_POWER_ITERS``, and warns if that is not reached.
        tol: that convergence tolerance (the range finder runs in float32, whose rounding
            moves the values by ~1e-7).
        seed: seed of the truncated method's random start.
    """
    d = _check_inputs(M, sigma, rank, delta)
    if method not in ("auto", "full", "truncated"):
        raise GSSError(f"method must be 'auto', 'full' or 'truncated', got {method!r}.")
    if power_iters is not None and not (isinstance(power_iters, int) and power_iters >= 0):
        raise GSSError(
            f"power_iters must be None (until converged) or an int >= 0, got {power_iters!r}."
        )
    if not (isinstance(oversample, int) and oversample >= 0) or not tol > 0:
        raise GSSError(
            f"oversample must be an int >= 0 and tol > 0, got {oversample!r} and {tol!r}."
        )
    if method == "auto":
        method = "truncated" if (d >= 1024 and rank <= d // 8) else "full"
    M64 = M.to(torch.float64)
    L, eps = _cholesky(sigma.to(torch.float64), jitter)  # reads the lower triangle only
    if method == "full":
        whitened = torch.linalg.solve_triangular(L, M64, upper=False)
        u_t, s, vh = torch.linalg.svd(whitened)
        u_t, s, v = u_t[:, :rank], s[:rank], vh[:rank].T
        iterations, converged = 0, True
    else:
        found = _truncated_svd(L, M64, rank, oversample, power_iters, tol, seed)
        u_t, s, v = found.left, found.values, found.right
        iterations, converged = found.iterations, found.converged
        if not converged and power_iters is None:
            _warn_unconverged(found, rank)
    u_t, v = _fix_signs(u_t, v)
    probe = (delta**0.5) * torch.linalg.solve_triangular(L.T, u_t, upper=True)
    return ProbeSteer(
        probe=probe.T.contiguous(),
        steer=v.T.contiguous(),
        singular_values=s,
        delta=float(delta),
        jitter=eps,
        method=method,
        power_iters=iterations,
        converged=converged,
    )


def _warn_unconverged(found: _Truncated, rank: int) -> None:
    warnings.warn(
        f"solve_probe_steer: the truncated SVD did not settle to tol in {found.iterations} "
        f"iterations; the smallest singular value of its window is {found.window_ratio:.3f} "
        f"of direction {rank}'s. Near 1, the spectrum of the whitened memorization matrix is flat "
        "past the last directions, which the statistics then determine poorly: a smaller rank "
        "keeps the well-determined ones; method='full' decomposes exactly.",
        GSSWarning,
        stacklevel=3,
    )
