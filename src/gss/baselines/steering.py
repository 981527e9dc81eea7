"""Activation-steering baselines: a static vector subtracted at every token.

Mean-difference steering (the simplest steering baseline): ``v = mean h(memorized tokens) -
mean h(general tokens)`` at one layer, and ``h <- h - alpha v`` on every token. It shares the
calibration pass (and so the token split) with GSS.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..calibrate import CalibrationStatistics
from ..hook import SteerHandle, register, split_block_output
from ..layers import resolve_layer


def mean_difference_vector(stats: CalibrationStatistics) -> Tensor:
    """``mean h_mem - mean h_gen`` at the statistics' layer (float32, CPU)."""
    return (stats.memorized_mean.mean - stats.sigma.mean).float().cpu()


class MeanDifferenceSteer:
    """Forward hook: ``h <- h - alpha * vector`` on every token (computed in float32)."""

    def __init__(self, vector: Tensor, alpha: float) -> None:
        self.vector = vector.detach().float()
        self.alpha = float(alpha)
        self._on: dict[torch.device, Tensor] = {}

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden, rebuild = split_block_output(output)
        shift = self._on.get(hidden.device)
        if shift is None:
            shift = self._on[hidden.device] = (self.alpha * self.vector).to(hidden.device)
        return rebuild((hidden.float() - shift).to(hidden.dtype))

    def attach(self, model: nn.Module, layer: int, block_path: str | None = None) -> SteerHandle:
        _, block = resolve_layer(model, layer, block_path)
        return register(block, self)
