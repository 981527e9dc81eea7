"""Fine-tuning baselines (TinyMem): keep training the memorized model on clean data.

- clean FT: the clean twins of the memorized rows (the rows as they should read);
- extra FT: the clean set C (clean training rows without any memorized artifact);
- both FT: the union.

TinyMem continues with the restored AdamW state for 5 more epochs (lr 1e-3, batch 128). The
optimizer state is not part of a saved Hugging Face model, so here AdamW starts fresh; that is
the difference from the original, and why the grid adds lr 1e-4: fresh AdamW's first steps
move every weight by about the learning rate whatever its gradient, which at 1e-3 costs a
TinyMem model points of accuracy before the moments settle. Epochs are swept along one
trajectory per (model, data, kind, lr), trained once and snapshotted per epoch; each grid
point is charged the time of every epoch up to its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import GSSError
from .interface import Mitigation, MitigationData, SharedWork, register
from .training import edited_copy, row_batches, sequence_nll

_SHARED = SharedWork()
EPOCHS_GRID = (1, 2, 5)
LR_GRID = (1e-4, 1e-3)  # TinyMem's 1e-3, and a gentler rate for the fresh optimizer


@dataclass
class _Trajectory:
    """A copy being fine-tuned epoch by epoch, with a snapshot and the seconds of each epoch."""

    model: nn.Module
    rows: Sequence[Sequence[int]]
    pad_id: int
    lr: float
    batch_size: int
    seed: int
    snapshots: list[dict[str, Tensor]] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    _opt: torch.optim.Optimizer | None = None
    _gen: torch.Generator | None = None

    def advance_to(self, epochs: int) -> None:
        if self._opt is None:
            for p in self.model.parameters():
                p.requires_grad_(p.is_floating_point())
            self._opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.1)
            self._gen = torch.Generator().manual_seed(self.seed)
        while len(self.snapshots) < epochs:
            t0 = time.perf_counter()
            self.model.train()
            for ids, mask in row_batches(self.rows, self.batch_size, self.pad_id, self._gen):
                loss = sequence_nll(self.model, ids, mask).mean()
                self._opt.zero_grad(set_to_none=True)
                loss.backward()
                self._opt.step()
            self.model.eval()
            self.snapshots.append(
                {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            )
            self.epoch_seconds.append(time.perf_counter() - t0)


def _rows(data: MitigationData, kind: str) -> list:
    twins, clean = list(data.clean_twins), list(data.clean)
    rows = {"clean": twins, "extra": clean, "both": twins + clean}[kind]
    if not rows:
        need = "clean_twins" if kind == "clean" else "clean"
        raise GSSError(f"{kind} FT needs rows to train on, but MitigationData.{need} is empty.")
    return rows


def _finetune(
    model: nn.Module,
    data: MitigationData,
    kind: str,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
) -> Mitigation:
    if epochs < 1:
        raise GSSError(f"epochs must be >= 1, got {epochs}.")

    def start() -> _Trajectory:
        return _Trajectory(edited_copy(model), _rows(data, kind), data.pad_id, lr, batch_size, seed)

    traj, _, _ = _SHARED.get(model, data, ("ft", kind, lr, batch_size, seed), start)
    done_before = len(traj.snapshots)
    traj.advance_to(epochs)
    edited = edited_copy(model)
    edited.load_state_dict(traj.snapshots[epochs - 1])
    reused = sum(traj.epoch_seconds[: min(done_before, epochs)])
    info: dict[str, Any] = {"rows": len(traj.rows), "reused_seconds": reused}
    return Mitigation(edited, info=info)


def _register(kind: str, summary: str) -> None:
    def apply(
        model: nn.Module,
        data: MitigationData,
        epochs: int = 5,
        lr: float = 1e-3,
        batch_size: int = 128,
        seed: int = 0,
    ) -> Mitigation:
        return _finetune(model, data, kind, epochs, lr, batch_size, seed)

    apply.__doc__ = f"{summary} AdamW (lr 1e-3, weight decay 0.1, batch 128) for `epochs`."
    grid = [{"lr": lr, "epochs": e} for lr in LR_GRID for e in EPOCHS_GRID]
    register(f"{kind}-ft", "fine-tuning", grid, summary)(apply)


_register("clean", "Fine-tune on the clean twins of the memorized rows.")
_register("extra", "Fine-tune on the clean set (clean training rows).")
_register("both", "Fine-tune on the clean twins and the clean set together.")
