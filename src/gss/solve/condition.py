"""The discriminant gate's condition: one direction that tells memorized tokens from general
ones, apart from the directions the steer moves along (as IBM's CAST conditions its behaviour
vector on a condition vector).

The paper's gate opens direction k where its own probe response passes eps_k, so the probes
both choose the tokens and set the amount; measured on TinyMem (docs/protect.md) they open
about as often on the tokens before a memorized span as inside it. The condition here is
Fisher's linear discriminant between the two token sets the calibration already separated,
with the general tokens' covariance as the within-class one:
``w = (Sigma_gen + jitter I)^-1 (mu_mem - mu_gen)``, from statistics the pass keeps anyway (no
second pass, no training loop). Every direction's gate opens together where ``w . h`` passes
one threshold, set on general tokens like the probes' (a percentile, or an open share).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gss.errors import GSSError


def condition_direction(sigma: Tensor, mean_memorized: Tensor, mean_general: Tensor) -> Tensor:
    """Unit ``w`` (float32, (d,)) proportional to ``(Sigma + jitter I)^-1 (mu_mem - mu_gen)``;
    the jitter (1e-6 of the mean variance, raised tenfold until Cholesky succeeds) keeps a
    rank-deficient Sigma solvable."""
    sigma64 = sigma.double()
    gap = (mean_memorized.double() - mean_general.double()).to(sigma64.device)
    if not bool(torch.isfinite(gap).all()) or float(gap.norm()) == 0.0:
        raise GSSError(
            "the memorized and general tokens have the same mean hidden state at this block, "
            "so no condition direction tells them apart: use gate='hard' (the paper's)."
        )
    scale = float(torch.diagonal(sigma64).mean().clamp_min(1e-30))
    eye = torch.eye(sigma64.shape[0], dtype=torch.float64, device=sigma64.device)
    jitter = 1e-6
    while True:
        chol, info = torch.linalg.cholesky_ex(sigma64 + jitter * scale * eye)
        if int(info) == 0 or jitter > 1:
            break
        jitter *= 10
    w = torch.cholesky_solve(gap[:, None], chol)[:, 0]
    return (w / w.norm()).float()


def with_condition(
    probe: Tensor, offset: Tensor, condition: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The rows whose responses set the gates, and what is subtracted from them: the probes
    and their offsets, and, with a condition direction, ``w`` as one row more (offset 0), so
    one matmul reads both."""
    if condition is None:
        return probe, offset
    w = condition.to(probe.device, probe.dtype)[None]
    return torch.cat([probe, w]), torch.cat([offset, offset.new_zeros(1)])


def condition_threshold(
    responses: Tensor, percentile: float | None, gate_share: float | None
) -> tuple[float, dict[str, Any]]:
    """The level the condition ``w . h`` must pass: above ``gate_share`` of the general
    tokens' responses when given, else above their ``percentile``; and the share measured."""
    if responses.ndim != 1 or responses.numel() == 0:
        raise GSSError("no condition responses on general tokens: cannot set its threshold.")
    values = responses.double()
    level = 1 - gate_share if gate_share is not None else (percentile or 95.0) / 100
    threshold = float(torch.quantile(values, level))
    share = float((values > threshold).double().mean())
    return threshold, {"condition": share, "union": share, "tokens": int(values.numel())}


__all__: Sequence[str] = ("condition_direction", "condition_threshold", "with_condition")
