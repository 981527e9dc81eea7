"""Parameter-space unlearning baselines: gradient ascent, NPO, SimNPO, task vectors and RMU.

The first four edit a copy of every parameter with AdamW on the unlearn set U (whole rows: they
are sequence-level methods, unlike GSS's token-level signal); RMU edits only the MLPs of three
blocks, on the activations at the top one. NPO and SimNPO add a retain loss on
the clean set C and stop early when it exceeds three times its starting value, as the GSS
paper describes (its Appendix E). Learning rates and epochs are scaled to TinyMem-sized models;
the paper's own settings (LoRA, lr 1e-5) are for 1B-parameter models. A grid over epochs
continues one training run per learning rate instead of restarting for each point (the same
weights; see :mod:`gss_bench.baselines.trajectory`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gss.hf.blocks import resolve_layer
from gss.hf.forward import forward_logits
from gss.steering.attach import split_block_output
from gss_bench.baselines.activations import block_activations, default_layer
from gss_bench.baselines.interface import (
    Mitigation,
    MitigationData,
    SharedWork,
    register,
    reuse_info,
)
from gss_bench.baselines.mlp import mlp_layers
from gss_bench.baselines.training import edited_copy, row_batches, sequence_nll
from gss_bench.baselines.trajectory import EpochStep, EpochTrajectory

_SHARED = SharedWork()


def _train(
    model: nn.Module,
    data: MitigationData,
    forget_loss: Callable[[nn.Module, Tensor, Tensor], Tensor],
    key: tuple | None,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    retain_weight: float = 0.0,
    seed: int = 0,
    weight_decay: float = 0.0,
) -> tuple[nn.Module, dict[str, Any]]:
    """AdamW on ``forget_loss`` over U (+ ``retain_weight`` x NLL of C), on an edited copy.

    With a retain loss, stops when it exceeds 3x its value at the start (collapse guard).
    `key` names the loss and its own hyperparameters: calls that differ only in `epochs` share
    one training run (:class:`~gss_bench.baselines.trajectory.EpochTrajectory`, kept in this
    module's `SharedWork`); None trains without keeping anything.
    """

    def start() -> tuple[nn.Module, EpochStep]:
        edited = edited_copy(model)
        params = [p for p in edited.parameters() if p.is_floating_point()]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        gen = torch.Generator().manual_seed(seed)
        retain = (
            itertools.cycle(list(row_batches(data.clean, batch_size, data.pad_id, gen)))
            if retain_weight > 0 and data.clean
            else None
        )
        start_retain: list[float] = []

        def epoch() -> tuple[int, bool]:
            steps = 0
            for ids, mask in row_batches(data.memorized, batch_size, data.pad_id, gen):
                loss = forget_loss(edited, ids, mask)
                if retain is not None:
                    r_ids, r_mask = next(retain)
                    retain_loss = sequence_nll(edited, r_ids, r_mask).mean()
                    value = float(retain_loss.detach())
                    if not start_retain:
                        start_retain.append(value)
                    if value > 3.0 * start_retain[0]:
                        return steps, True
                    loss = loss + retain_weight * retain_loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                steps += 1
            return steps, False

        return edited, epoch

    if key is None:
        return EpochTrajectory(start, seed).model_at(epochs)
    full_key = (*key, lr, batch_size, retain_weight, seed, weight_decay)
    trajectory, _, _ = _SHARED.get(model, data, full_key, lambda: EpochTrajectory(start, seed))
    return trajectory.model_at(epochs)


def _reference_logps(model: nn.Module, data: MitigationData, batch_size: int) -> dict:
    """log p_original(row) for every row of U, keyed by the row (NPO's fixed reference)."""
    out = {}
    with torch.no_grad():
        for ids, mask in row_batches(data.memorized, batch_size, data.pad_id):
            logp = -sequence_nll(model, ids, mask, reduction="sum")
            for row, m, v in zip(ids, mask, logp, strict=True):
                out[tuple(row[m.bool()].tolist())] = float(v)
    return out


@register(
    "gradient-ascent",
    "unlearning",
    grid=[{"lr": lr, "epochs": e} for lr in (1e-4, 3e-4, 1e-3) for e in (1, 3)],
    summary="Gradient ascent on the unlearn set's log-likelihood (Jang et al. 2023).",
)
def gradient_ascent(
    model: nn.Module,
    data: MitigationData,
    lr: float = 1e-4,
    epochs: int = 1,
    batch_size: int = 32,
    seed: int = 0,
) -> Mitigation:
    """Maximize the NLL of U: no retain term, so it is the collapse-prone reference point."""

    def loss(m: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
        return -sequence_nll(m, ids, mask).mean()

    key = ("gradient-ascent",)
    edited, info = _train(
        model, data, loss, key, lr=lr, epochs=epochs, batch_size=batch_size, seed=seed
    )
    return Mitigation(edited, info=info)


@register(
    "npo",
    "unlearning",
    grid=[{"lr": lr, "epochs": e} for lr in (1e-5, 3e-5, 1e-4, 3e-4) for e in (2, 5)],
    summary="Negative preference optimization with a retain loss (Zhang et al. 2024).",
)
def npo(
    model: nn.Module,
    data: MitigationData,
    lr: float = 1e-4,
    epochs: int = 5,
    beta: float = 0.1,
    retain_weight: float = 1.0,
    batch_size: int = 16,
    seed: int = 0,
) -> Mitigation:
    """``-(2/beta) log sigmoid(-beta (log p(x) - log p_orig(x)))`` on U plus a retain NLL.

    The reference is the original model (its sequence log-probabilities computed once). The
    GSS paper weights the retain loss 50x with lr 1e-5 on LoRA adapters of 1B models; on a
    TinyMem model that barely moves, so the weight and rates here are tuned to this scale.
    """
    ref = _reference_logps(model, data, 256)

    def loss(m: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
        logp = -sequence_nll(m, ids, mask, reduction="sum")
        ref_logp = torch.tensor(
            [ref[tuple(r[k.bool()].tolist())] for r, k in zip(ids, mask, strict=True)],
            device=logp.device,
        )
        return -(2.0 / beta) * F.logsigmoid(-beta * (logp - ref_logp)).mean()

    edited, info = _train(
        model,
        data,
        loss,
        ("npo", beta),
        lr=lr,
        epochs=epochs,
        batch_size=batch_size,
        retain_weight=retain_weight,
        seed=seed,
        weight_decay=0.01,
    )
    return Mitigation(edited, info=info)


@register(
    "simnpo",
    "unlearning",
    grid=[{"lr": lr, "epochs": e} for lr in (1e-5, 3e-5, 1e-4, 3e-4) for e in (2, 5)],
    summary="SimNPO: NPO without a reference model, length-normalized (Fan et al. 2024).",
)
def simnpo(
    model: nn.Module,
    data: MitigationData,
    lr: float = 1e-4,
    epochs: int = 5,
    beta: float = 2.5,
    gamma: float = 0.0,
    retain_weight: float = 1.0,
    batch_size: int = 16,
    seed: int = 0,
) -> Mitigation:
    """``-(2/beta) log sigmoid(-(beta/|x|) log p(x) - gamma)`` on U plus a retain NLL."""

    def loss(m: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
        mean_logp = -sequence_nll(m, ids, mask)  # (1/|x|) log p(x)
        return -(2.0 / beta) * F.logsigmoid(-beta * mean_logp - gamma).mean()

    edited, info = _train(
        model,
        data,
        loss,
        ("simnpo", beta, gamma),
        lr=lr,
        epochs=epochs,
        batch_size=batch_size,
        retain_weight=retain_weight,
        seed=seed,
        weight_decay=0.01,
    )
    return Mitigation(edited, info=info)


@register(
    "task-vector",
    "unlearning",
    grid=[{"alpha": a} for a in (0.01, 0.03, 0.1, 0.3, 1.0)],
    summary="Task-vector negation: fine-tune a copy on U, subtract alpha x the change "
    "(Ilharco et al. 2023).",
    stronger=("alpha",),
)
def task_vector(
    model: nn.Module,
    data: MitigationData,
    alpha: float = 1.0,
    lr: float = 1e-2,
    epochs: int = 10,
    batch_size: int = 32,
    seed: int = 0,
) -> Mitigation:
    """``theta - alpha (theta_ft - theta)``; theta_ft: AdamW (lr 1e-2, no weight decay, batch
    32, 10 epochs, the paper's settings) on U. The fine-tune does not depend on `alpha`, so a
    grid over alpha computes it once (charged to every point as reused seconds)."""

    def finetune() -> dict[str, Tensor]:
        def nll(m: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
            return sequence_nll(m, ids, mask).mean()

        tuned, _ = _train(
            model, data, nll, None, lr=lr, epochs=epochs, batch_size=batch_size, seed=seed
        )
        base = dict(model.named_parameters())  # tied weights appear once
        return {k: (v - base[k]).detach() for k, v in tuned.named_parameters()}

    key = ("task-vector", lr, epochs, batch_size, seed)
    delta, seconds, reused = _SHARED.get(model, data, key, finetune)
    edited = edited_copy(model)
    with torch.no_grad():
        params = dict(edited.named_parameters())
        for k, d in delta.items():
            params[k].sub_(alpha * d)
    return Mitigation(edited, info=reuse_info(seconds, reused))


def _block_output(model: nn.Module, layer: int, ids: Tensor, mask: Tensor) -> Tensor:
    """Block ``layer``'s output hidden states (B, T, d) in a forward over ``ids``."""
    _, block = resolve_layer(model, layer)
    seen: list[Tensor] = []
    handle = block.register_forward_hook(
        lambda module, args, output: seen.append(split_block_output(output)[0])
    )
    try:
        forward_logits(model, ids, mask)
    finally:
        handle.remove()
    return seen[0]


@register(
    "rmu",
    "unlearning",
    grid=[{"lr": lr, "retain_weight": a} for lr in (1e-4, 1e-3, 1e-2) for a in (100.0, 1.0)],
    summary="RMU: the MLPs of three blocks push U's activations at the top one toward a random "
    "direction, C's kept (Li et al. 2024, WMDP).",
    reduced_grid="the target's scale fixed at 4x U's mean activation norm at the block (the "
    "paper's coefficient 6.5 is for Zephyr-7B's activations); 5 epochs",
)
def rmu(
    model: nn.Module,
    data: MitigationData,
    coeff: float = 4.0,
    epochs: int = 5,
    lr: float = 1e-3,
    retain_weight: float = 100.0,  # the paper's 1200 is for its activations' scale
    batch_size: int = 16,
    seed: int = 0,
) -> Mitigation:
    """Representation misdirection for unlearning: on an edited copy, AdamW on the MLP
    parameters of blocks layer-2..layer (the paper's three) with ``mse(h(U), c u) +
    retain_weight * mse(h(C), h_orig(C))`` at block ``layer`` (`MitigationData.layer`, else the
    middle block); ``u`` a seeded random unit vector and ``c`` = ``coeff`` x the mean norm of
    the original's activations on U there."""
    layer = default_layer(model, data.layer)
    gen = torch.Generator().manual_seed(seed)
    acts = block_activations(model, data.memorized, data.pad_id, layer)
    direction = torch.rand(acts.output.shape[1], generator=gen)
    target = coeff * float(acts.output.norm(dim=1).mean()) * direction / direction.norm()
    edited = edited_copy(model)
    trained = [
        p
        for mlp in mlp_layers(edited)[max(layer - 2, 0) : layer + 1]
        for proj in (mlp.up, mlp.down, mlp.gate)
        if proj is not None
        for p in proj.parameters()
    ]
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=lr)
    retain = itertools.cycle(list(row_batches(data.clean, batch_size, data.pad_id, gen)))
    for _ in range(epochs):
        for ids, mask in row_batches(data.memorized, batch_size, data.pad_id, gen):
            keep = mask.bool()
            forget = _block_output(edited, layer, ids, mask)[keep.to(target.device)]
            loss = F.mse_loss(forget, target.to(forget).expand_as(forget))
            r_ids, r_mask = next(retain)
            r_keep = r_mask.bool()
            with torch.no_grad():
                frozen = _block_output(model, layer, r_ids, r_mask)[r_keep]
            kept = _block_output(edited, layer, r_ids, r_mask)[r_keep.to(frozen.device)]
            loss = loss + retain_weight * F.mse_loss(kept, frozen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for p in trained:
        p.requires_grad_(False)
    return Mitigation(edited, info={"layer": layer, "trained_blocks": [max(layer - 2, 0), layer]})
