"""Fine-tuning baselines (TinyMem): keep training the memorized model on clean data.

- clean FT: the clean twins of the memorized rows (the rows as they should read);
- extra FT: the clean set C (clean training rows without any memorized artifact);
- both FT: the union.

TinyMem continues with the restored AdamW state for 5 more epochs (lr 1e-3, batch 128). The
optimizer state is not part of a saved Hugging Face model, so here AdamW starts fresh; that is
the difference from the original, and why the grid adds lr 1e-4: fresh AdamW's first steps
move every weight by about the learning rate whatever its gradient, which at 1e-3 costs a
TinyMem model points of accuracy before the moments settle. Epochs are swept along one
training run per (model, data, kind, lr) (:class:`~gss_bench.baselines.trajectory.EpochTrajectory`);
each grid point is charged the time of every epoch up to its own.
"""

from __future__ import annotations

import torch
from torch import nn

from gss.errors import GSSError
from gss_bench.baselines.interface import Mitigation, MitigationData, SharedWork, register
from gss_bench.baselines.training import edited_copy, row_batches, sequence_nll
from gss_bench.baselines.trajectory import EpochStep, EpochTrajectory

_SHARED = SharedWork()
EPOCHS_GRID = (1, 2, 5)
LR_GRID = (1e-4, 1e-3)  # TinyMem's 1e-3, and a gentler rate for the fresh optimizer


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
    rows = _rows(data, kind)

    def start() -> tuple[nn.Module, EpochStep]:
        tuned = edited_copy(model)
        params = [p for p in tuned.parameters() if p.is_floating_point()]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
        gen = torch.Generator().manual_seed(seed)

        def epoch() -> tuple[int, bool]:
            steps = 0
            for ids, mask in row_batches(rows, batch_size, data.pad_id, gen):
                loss = sequence_nll(tuned, ids, mask).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                steps += 1
            return steps, False

        return tuned, epoch

    traj, _, _ = _SHARED.get(
        model, data, ("ft", kind, lr, batch_size, seed), lambda: EpochTrajectory(start, seed)
    )
    edited, info = traj.model_at(epochs)
    return Mitigation(edited, info={"rows": len(rows), **info})


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
