"""One training run read at several epoch counts, so a grid over `epochs` trains once.

Baselines that train an edited copy (fine-tuning, gradient ascent, NPO, SimNPO) sweep the
number of epochs at otherwise equal settings. Running each grid point from scratch trains
1 + 2 + 5 epochs for a grid of (1, 2, 5); continuing one run trains 5, and its state after
epoch 2 is exactly what a 2-epoch run gives, because the optimizer, the shuffling generator and
any cycled retain batches simply carry on. Dropout draws from a random state the run owns
(seeded by its `seed`, saved between epochs), so runs are reproducible and a continued run
matches a separate one even on models trained with dropout. Only the live copy is held (no
per-epoch snapshots, which would cost one model copy per epoch); asking for fewer epochs than
the live copy has seen starts the run again from scratch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gss.errors import GSSError
from gss_bench.baselines.training import edited_copy

# trains the live copy for one epoch; returns (optimizer steps taken, stop the run now)
EpochStep = Callable[[], tuple[int, bool]]


class EpochTrajectory:
    """A copy trained one epoch at a time by ``start() -> (copy, epoch_step)``.

    :meth:`model_at` returns an independent copy after a given number of epochs (or at the
    run's early stop) and what it cost: ``reused_seconds`` are the epochs that earlier calls
    trained, so every grid point is charged the full price of its own run.
    """

    def __init__(self, start: Callable[[], tuple[nn.Module, EpochStep]], seed: int = 0) -> None:
        self._start = start
        self._seed = seed
        self._restart()

    def _restart(self) -> None:
        self.model, self._step = self._start()
        self.epochs, self.steps, self.stopped = 0, 0, False
        self.epoch_seconds: list[float] = []
        self._cuda = sorted({p.device.index or 0 for p in self.model.parameters() if p.is_cuda})
        self._rng: tuple[Tensor, list[Tensor]] | None = None

    def _epoch(self) -> tuple[int, bool]:
        """One epoch with the run's own random state (dropout), leaving the global one as is."""
        with torch.random.fork_rng(devices=self._cuda):
            if self._rng is None:
                torch.manual_seed(self._seed)
            else:
                torch.set_rng_state(self._rng[0])
                for index, state in zip(self._cuda, self._rng[1], strict=True):
                    torch.cuda.set_rng_state(state, index)
            out = self._step()
            self._rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(i) for i in self._cuda])
        return out

    def model_at(self, epochs: int) -> tuple[nn.Module, dict[str, Any]]:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise GSSError(f"epochs must be an integer >= 1, got {epochs!r}.")
        if epochs < self.epochs:
            self._restart()  # an earlier point than the live copy has passed
        reused = sum(self.epoch_seconds)
        while self.epochs < epochs and not self.stopped:
            t0 = time.perf_counter()
            self.model.train()
            steps, self.stopped = self._epoch()
            self.model.eval()
            self.steps += steps
            self.epochs += 1
            self.epoch_seconds.append(time.perf_counter() - t0)
        for p in self.model.parameters():
            p.grad = None
        info = {
            "steps": self.steps,
            "epochs_trained": self.epochs,
            "stopped_early": self.stopped,
            "reused_seconds": reused,
        }
        return edited_copy(self.model), info
