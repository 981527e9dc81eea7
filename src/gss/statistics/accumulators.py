"""Streaming, mergeable float64 accumulators for Sigma_gen and M = E_mem[h g^T].

Both hold O(d^2) numbers whatever the corpus size: activations are folded in batch by batch
and never kept. Accumulators built on different shards combine exactly with ``merge``, and
across ``torch.distributed`` ranks with ``all_reduce``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gss.errors import GSSError


def _check_rows(x: Tensor, dim: int, what: str) -> None:
    if x.ndim != 2 or x.shape[1] != dim:
        raise GSSError(f"{what} must be (N, {dim}), got {tuple(x.shape)}.")
    if not torch.isfinite(x).all():
        raise GSSError(
            f"{what} contain NaN or Inf. The model produced non-finite activations: check its "
            "dtype (fp16 overflows are common; calibrate in float32 or bfloat16) and its inputs."
        )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class CovarianceAccumulator:
    """Running mean and centred scatter of rows h (Chan et al.'s parallel update)."""

    def __init__(self, dim: int, device: torch.device | str | None = None) -> None:
        self.dim = dim
        self.count = 0
        self._mean = torch.zeros(dim, dtype=torch.float64, device=device)
        self._scatter = torch.zeros(dim, dim, dtype=torch.float64, device=device)

    def update(self, h: Tensor) -> None:
        """Fold in rows ``h`` of shape (N, d)."""
        _check_rows(h, self.dim, "activations")
        n = h.shape[0]
        if n == 0:
            return
        x = h.detach().to(self._mean.device, torch.float64)
        batch_mean = x.mean(0)
        centred = x - batch_mean
        self._combine(n, batch_mean, centred.T @ centred)

    def _combine(self, n: int, mean: Tensor, scatter: Tensor) -> None:
        total = self.count + n
        diff = mean - self._mean
        self._scatter += scatter + torch.outer(diff, diff) * (self.count * n / total)
        self._mean += diff * (n / total)
        self.count = total

    def merge(self, other: CovarianceAccumulator) -> CovarianceAccumulator:
        """Fold another accumulator into this one (in place) and return self."""
        if other.dim != self.dim:
            raise GSSError(f"cannot merge statistics of dimension {other.dim} into {self.dim}.")
        if other.count:
            self._combine(
                other.count, other._mean.to(self._mean.device), other._scatter.to(self._mean.device)
            )
        return self

    def all_reduce(self) -> CovarianceAccumulator:
        """Combine across all ranks of the default process group (no-op without one)."""
        if not _distributed():
            return self
        # Shift by rank 0's mean so the summed scatter stays well conditioned.
        shift = self._mean.clone()
        dist.broadcast(shift, src=0)
        count = torch.tensor([float(self.count)], dtype=torch.float64, device=self._mean.device)
        dev = self._mean - shift
        first = dev * self.count
        second = self._scatter + torch.outer(dev, dev) * self.count
        for t in (count, first, second):
            dist.all_reduce(t)
        total = int(count.item())
        if total:
            mean_dev = first / total
            self._mean = shift + mean_dev
            self._scatter = second - torch.outer(mean_dev, mean_dev) * total
        self.count = total
        return self

    @property
    def mean(self) -> Tensor:
        return self._mean

    @property
    def covariance(self) -> Tensor:
        """Centred covariance E[(h - mu)(h - mu)^T] (population normalisation)."""
        self._require()
        return self._scatter / self.count

    @property
    def second_moment(self) -> Tensor:
        """Uncentred second moment E[h h^T]."""
        self._require()
        return self._scatter / self.count + torch.outer(self._mean, self._mean)

    def _require(self) -> None:
        if self.count == 0:
            raise GSSError(
                "no generalization tokens were seen, so Sigma_gen is undefined. Raise the "
                "memorized-token cut (omega_threshold, or a smaller memorized_quantile), add "
                "text, or pass gen_texts (held-out text)."
            )


class _SumAccumulator:
    """A float64 running sum of per-token terms and their count: mergeable, all-reducible."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | str | None) -> None:
        self.count = 0
        self._sum = torch.zeros(shape, dtype=torch.float64, device=device)

    def merge(self, other: _SumAccumulator) -> _SumAccumulator:
        if other._sum.shape != self._sum.shape:
            raise GSSError(
                f"cannot merge statistics of shape {tuple(other._sum.shape)} into "
                f"{tuple(self._sum.shape)}."
            )
        self._sum += other._sum.to(self._sum.device)
        self.count += other.count
        return self

    def all_reduce(self) -> _SumAccumulator:
        """Sum over all ranks of the default process group (no-op without one)."""
        if not _distributed():
            return self
        count = torch.tensor([float(self.count)], dtype=torch.float64, device=self._sum.device)
        dist.all_reduce(count)
        dist.all_reduce(self._sum)
        self.count = int(count.item())
        return self


class CrossMomentAccumulator(_SumAccumulator):
    """Running E[w h g^T] over memorized tokens (w = 1 unless weights are given)."""

    def __init__(self, dim: int, device: torch.device | str | None = None) -> None:
        super().__init__((dim, dim), device)
        self.dim = dim

    def update(self, h: Tensor, g: Tensor, weight: Tensor | None = None) -> None:
        """Fold in rows of activations ``h`` and gradients ``g``, both (N, d)."""
        _check_rows(h, self.dim, "activations")
        _check_rows(g, self.dim, "gradients")
        if h.shape[0] != g.shape[0]:
            raise GSSError(f"{h.shape[0]} activations but {g.shape[0]} gradients.")
        if h.shape[0] == 0:
            return
        x = h.detach().to(self._sum.device, torch.float64)
        y = g.detach().to(self._sum.device, torch.float64)
        if weight is not None:
            x = x * weight.detach().to(x.device, torch.float64).reshape(-1, 1)
        self._sum += x.T @ y
        self.count += h.shape[0]

    @property
    def value(self) -> Tensor:
        """M = E[h g^T] over the tokens seen."""
        if self.count == 0:
            raise GSSError(
                "the memorized-token set is empty, so M is undefined: no token passed the "
                "memorized-token rule. Lower omega_threshold (or use a top-quantile rule), "
                "check that the reference differs from the model, or add the memorized text."
            )
        return self._sum / self.count


class MeanAccumulator(_SumAccumulator):
    """Running mean of rows h (e.g. the memorized tokens' activations for mean steering)."""

    def __init__(self, dim: int, device: torch.device | str | None = None) -> None:
        super().__init__((dim,), device)
        self.dim = dim

    def update(self, h: Tensor) -> None:
        _check_rows(h, self.dim, "activations")
        self._sum += h.detach().to(self._sum.device, torch.float64).sum(0)
        self.count += h.shape[0]

    @property
    def mean(self) -> Tensor:
        if self.count == 0:
            raise GSSError("no rows were accumulated, so their mean is undefined.")
        return self._sum / self.count
