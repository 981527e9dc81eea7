"""Activation-steering baselines that act on every token through a hook.

- Mean-difference steering (the simplest steering baseline): ``v = mean h(memorized tokens) -
  mean h(general tokens)`` at one layer, and ``h <- h - alpha v`` on every token. It shares the
  calibration pass (and so the token split) with GSS.
- AlphaSteer: a matrix ``h <- h + strength * h @ Delta`` whose row space avoids the general
  activations (their null space), so it moves memorized activations and leaves general ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gss.hf.blocks import resolve_layer
from gss.statistics.collect import CalibrationStatistics
from gss.steering.attach import SteerHandle, register, split_block_output
from gss_bench.baselines.activations import block_activations, default_layer
from gss_bench.baselines.interface import Mitigation, MitigationData, SharedWork, reuse_info
from gss_bench.baselines.interface import register as register_method

_SHARED = SharedWork()
MAX_CLEAN_ROWS = 256  # clean rows whose activations define the general set


def mean_difference_vector(stats: CalibrationStatistics) -> Tensor:
    """``mean h_mem - mean h_gen`` at the statistics' layer (float32, CPU)."""
    return (stats.memorized_mean.mean - stats.sigma.mean).float().cpu()


class _StaticSteer:
    """A steer of one block's output that rewrites its hidden states in float32, attached as
    gss attaches its own (``gss.steering.attach.register``)."""

    def __init__(self, tensor: Tensor) -> None:
        self._tensor = tensor.detach().float()
        self._on: dict[torch.device, Tensor] = {}

    def _tensor_on(self, device: torch.device) -> Tensor:
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = self._tensor.to(device)
        return found

    def steer(self, hidden: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden, rebuild = split_block_output(output)
        return rebuild(self.steer(hidden.float()).to(hidden.dtype))

    def attach(self, model: nn.Module, layer: int, block_path: str | None = None) -> SteerHandle:
        _, block = resolve_layer(model, layer, block_path)
        return register(block, self, model)


class MeanDifferenceSteer(_StaticSteer):
    """Steer: ``h <- h - alpha * vector`` on every token (computed in float32)."""

    def __init__(self, vector: Tensor, alpha: float) -> None:
        self.vector = vector.detach().float()
        self.alpha = float(alpha)
        super().__init__(self.alpha * self.vector)

    def steer(self, hidden: Tensor) -> Tensor:
        return hidden - self._tensor_on(hidden.device)


class MatrixSteer(_StaticSteer):
    """Steer: ``h <- h + strength * h @ delta`` on every token (float32)."""

    def __init__(self, delta: Tensor, strength: float) -> None:
        self.strength = float(strength)
        super().__init__(self.strength * delta)

    def steer(self, hidden: Tensor) -> Tensor:
        return hidden + hidden @ self._tensor_on(hidden.device)


def alphasteer_matrix(
    general: Tensor, memorized: Tensor, null_ratio: float = 0.5, ridge: float = 1e-2
) -> Tensor:
    """The (d, d) steering matrix of AlphaSteer for token activations (rows) of the two sets.

    ``P`` projects onto the null space of the general activations (the eigenvectors of their
    uncentred second moment with the smallest eigenvalues, a `null_ratio` share of d), so
    ``h_gen P ~ 0``; ``W`` is the ridge least-squares fit of ``h_mem P W = r`` with
    ``r = mean h_gen - mean h_mem``; the matrix is ``P W``.
    """
    d = general.shape[1]
    second = general.T @ general / len(general)
    _, vecs = torch.linalg.eigh(second.double())
    n_null = max(1, round(null_ratio * d))
    null = vecs[:, :n_null]  # ascending eigenvalues: the least-used directions
    proj = null @ null.T
    r = (general.mean(0) - memorized.mean(0)).double()
    x = memorized.double() @ proj
    gram = x.T @ x
    lam = ridge * float(torch.trace(gram)) / d + 1e-12
    rhs = x.T @ r.expand(len(x), d)
    w = torch.linalg.solve(gram + lam * torch.eye(d, dtype=gram.dtype), rhs)
    return (proj @ w).float()


@register_method(
    "alphasteer",
    "steering",
    grid=[{"strength": s} for s in (0.25, 0.5, 1.0, 2.0)],
    summary="AlphaSteer: a steering matrix constrained to the general activations' null "
    "space, fitted to map memorized activations to the clean-minus-memorized mean "
    "(Sheng et al. 2025).",
    stronger=("strength",),
)
def alphasteer(
    model: nn.Module,
    data: MitigationData,
    strength: float = 1.0,
    null_ratio: float = 0.5,
    ridge: float = 1e-2,
) -> Mitigation:
    """A hook on block `data.layer` (default the middle) adding ``strength * h @ (P W)``.

    The original steers the prompt once at the layer input from the last prompt token; here the
    matrix applies to every token's block output, like the other steering baselines, so the
    generated continuation is steered too. Memorized activations are those of the unlearn rows'
    tokens after the prompt (their memorized continuations); general ones those of the clean
    rows.
    """
    layer = default_layer(model, data.layer)

    def fit() -> Tensor:
        clean = list(data.clean)[:MAX_CLEAN_ROWS]
        gen = block_activations(model, clean, data.pad_id, layer).output
        mem_acts = block_activations(model, data.memorized, data.pad_id, layer)
        keep = _after_prompt(mem_acts.row, data.prompt_len)
        return alphasteer_matrix(gen, mem_acts.output[keep], null_ratio, ridge)

    key = ("alphasteer", layer, null_ratio, ridge)
    delta, seconds, reused = _SHARED.get(model, data, key, fit)
    handle = MatrixSteer(delta, strength).attach(model, layer)
    return Mitigation(model, handle=handle, info={"layer": layer, **reuse_info(seconds, reused)})


def _after_prompt(row: Tensor, prompt_len: int | None) -> Tensor:
    """Mask of the tokens at or after position `prompt_len` of their row (all if None)."""
    if prompt_len is None:
        return torch.ones_like(row, dtype=torch.bool)
    first = torch.ones_like(row, dtype=torch.bool)
    first[1:] = row[1:] != row[:-1]
    starts = torch.nonzero(first).squeeze(1)
    position = torch.arange(len(row)) - starts.repeat_interleave(
        torch.diff(torch.cat([starts, torch.tensor([len(row)])]))
    )
    return position >= prompt_len
