"""TinyMem's weight-level localization baselines: find the MLP weights that carry memorization
and set them to zero.

Six methods, as in TinyMem (Sakarvadia et al.); `ratio` is always a fraction of weights:

- ``greedy``: one weight at a time, the one whose removal most raises the loss on the memorized
  rows U while lowering it on clean rows C (Maini et al. 2023).
- ``durable`` / ``durable-agg``: the weights with the largest |gradient| of the LM loss on U,
  per tensor or over all MLP tensors at once.
- ``sou``: the weights with the largest OBS saliency w^2 / (2 [F^-1]_ii), F a block-diagonal
  empirical Fisher of the loss on U (oBERT).
- ``subnet`` / ``balanced-subnet``: a learned pruning mask (edge-popup) trained to raise the
  loss on U (and, balanced, to keep it on C).

Every method edits only MLP tensors (:meth:`MLP.weight_tensors`), on a copy. C is
``data.clean`` only: TinyMem's C also held the memorized rows, which the methods clearly do not
intend (Greedy would label the same row both +1 and -1). Losses cover the whole row, PAD
excluded, like TinyMem's. The models are scored in eval mode (TinyMem has no dropout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from gss.data import right_pad
from gss.errors import GSSError
from gss_bench.baselines.interface import (
    Mitigation,
    MitigationData,
    SharedWork,
    register,
    reuse_info,
)
from gss_bench.baselines.mlp import mlp_layers, weight_of
from gss_bench.baselines.training import (
    edited_copy,
    loss_mask,
    row_batches,
    sequence_nll,
    token_nll,
)

BATCH = 64  # TinyMem's batch size for every weight-level method
RATIOS = (1e-5, 1e-4, 1e-3, 1e-2, 5e-2)  # TinyMem's ratio grid below the Subnet-only range


# --- small helpers -----------------------------------------------------------------------------


def mlp_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every MLP parameter of `model`, named ``"<layer>.<up|gate|down>.<weight|bias>"``."""
    return {
        f"{mlp.layer}.{short}": tensor
        for mlp in mlp_layers(model)
        for short, tensor in mlp.weight_tensors().items()
    }


def _check_ratio(ratio: float) -> float:
    if not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
        raise GSSError(f"ratio must be a fraction of weights in [0, 1], got {ratio!r}.")
    return float(ratio)


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GSSError(f"{name} must be a positive integer, got {value!r}.")
    return value


def _need_clean(data: MitigationData, method: str) -> None:
    if not data.clean:
        raise GSSError(
            f"{method} balances the memorized rows against clean rows, but data.clean is "
            "empty. Pass clean rows of the training distribution as the retain set."
        )


@contextmanager
def _trainable(tensors: Iterable[Tensor]) -> Iterator[list[Tensor]]:
    """Turn gradients on for `tensors` and restore their previous flags afterwards."""
    tensors = list(tensors)
    before = [t.requires_grad for t in tensors]
    for t in tensors:
        t.requires_grad_(True)
    try:
        yield tensors
    finally:
        for t, flag in zip(tensors, before, strict=True):
            t.requires_grad_(flag)


def _gradients(loss: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    """d loss / d tensor, zeros for tensors the loss does not reach."""
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True)]


def _lm_loss(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """Token-mean next-token cross-entropy of a batch over its real tokens (HF's LM loss
    without the padding)."""
    nll = token_nll(model, ids, mask)
    m = loss_mask(mask).to(nll.device)
    return (nll * m).sum() / m.sum().clamp_min(1.0)


@torch.no_grad()
def _zero_top(tensor: Tensor, scores: Tensor, k: int) -> int:
    """Zero the `k` entries of `tensor` with the highest `scores`; return how many were nonzero."""
    if k <= 0:
        return 0
    drop = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    drop[torch.topk(scores.flatten().float(), k).indices] = True
    drop = drop.view(tensor.shape).to(tensor.device)
    nonzero = int((tensor[drop] != 0).sum())
    tensor.masked_fill_(drop, 0.0)
    return nonzero


def _frozen(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


# --- score cache: Durable, Durable-agg and SOU score once per (model, data, settings) -----------


_SHARED = SharedWork()


def clear_score_cache() -> None:
    """Forget the cached scores (they are also dropped when their model or data is freed)."""
    _SHARED.clear()


def _scores(
    kind: str,
    model: nn.Module,
    data: MitigationData,
    settings: tuple,
    compute: Callable[[], dict[str, Tensor]],
) -> tuple[dict[str, Tensor], float, bool]:
    """``(scores, seconds it took to compute them, cached?)``, computed at most once per live
    (model, data, settings) with unchanged weights: a grid over `ratio` reuses them."""
    return _SHARED.get(model, data, (kind, *settings), compute)


def _score_info(seconds: float, cached: bool, pruned: int, total: int) -> dict[str, Any]:
    return {
        "score_seconds": seconds,
        "cached_score": cached,
        **reuse_info(seconds, cached),
        "pruned": pruned,
        "pruned_fraction": pruned / max(total, 1),
    }


# --- Greedy ------------------------------------------------------------------------------------


@register(
    "greedy",
    "weight",
    grid=[{"ratio": 1e-5}, {"ratio": 1e-4}],
    summary="Greedy (Maini et al.): per batch of U+C, zero the one MLP weight with the largest "
    "w * d(objective)/dw; ratio x (all parameters) iterations.",
    reduced_grid="ratio {1e-5, 1e-4} of TinyMem's {1e-5, 1e-4, 1e-3, 0.01, 0.05}: one "
    "forward and backward per zeroed weight (~0.5 s on one CPU core for the 4-layer d-128 "
    "model), so 1e-3 is ~810 iterations (~7 min) and 0.05 ~40 k. TinyMem ran Pythia at 1e-5.",
    stronger=("ratio",),
)
def greedy(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 1e-5,
    batch_size: int = BATCH,
    seed: int = 0,
) -> Mitigation:
    """Zero ``int(ratio * all parameters)`` MLP weights one by one.

    Each iteration draws the next batch of a seeded shuffle of U (y = +1) and C (y = -1),
    backpropagates ``mean_i(-B y_i l_i)`` (l_i the row's mean CE, B the batch size) and zeroes
    the weight with the largest ``w * grad`` (the first-order drop of that objective when the
    weight goes to 0), if positive. The iteration count follows TinyMem: a fraction of *all*
    trainable parameters, though only MLP weights are candidates.
    """
    ratio = _check_ratio(ratio)
    _check_count("batch_size", batch_size)
    _need_clean(data, "greedy")
    params = sum(p.numel() for p in model.parameters())
    steps = int(ratio * params)
    edited = edited_copy(model)
    named = mlp_tensors(edited)
    tensors = list(named.values())
    rows = [*data.memorized, *data.clean]
    labels = torch.tensor([1.0] * len(data.memorized) + [-1.0] * len(data.clean))
    gen = torch.Generator().manual_seed(seed)
    done, zeroed = 0, 0
    with _trainable(tensors):
        while done < steps:
            order = torch.randperm(len(rows), generator=gen)
            for start in range(0, len(rows), batch_size):
                if done >= steps:
                    break
                idx = order[start : start + batch_size]
                ids, mask = right_pad([rows[i] for i in idx.tolist()], data.pad_id)
                per_row = sequence_nll(edited, ids, mask)
                y = labels[idx].to(per_row.device)
                objective = (-len(idx) * y * per_row).mean()
                grads = _gradients(objective, tensors)
                with torch.no_grad():
                    best = (0.0, -1, -1)
                    for j, (t, g) in enumerate(zip(tensors, grads, strict=True)):
                        value, flat = (t.float() * g.float()).flatten().max(0)
                        if float(value) > best[0]:
                            best = (float(value), j, int(flat))
                    if best[1] >= 0:
                        t = tensors[best[1]]
                        t[torch.unravel_index(torch.tensor(best[2]), t.shape)] = 0.0
                        zeroed += 1
                done += 1
    _frozen(edited)
    return Mitigation(
        model=edited,
        info={"iterations": done, "pruned": zeroed, "total_params": params},
    )


# --- Durable and Durable-agg -------------------------------------------------------------------


def gradient_scores(
    model: nn.Module, data: MitigationData, batch_size: int = BATCH
) -> dict[str, Tensor]:
    """|gradient| of the LM loss on U for every MLP tensor, summed over batches of `batch_size`
    (TinyMem accumulates ``loss.backward()`` over the batches without zeroing). Float32; the
    model's weights and gradient flags are left as they were."""
    named = mlp_tensors(model)
    tensors = list(named.values())
    total = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
    with _trainable(tensors):
        for ids, mask in row_batches(data.memorized, batch_size, data.pad_id):
            grads = _gradients(_lm_loss(model, ids, mask), tensors)
            for acc, g in zip(total, grads, strict=True):
                acc += g.float()
    return {name: acc.abs() for name, acc in zip(named, total, strict=True)}


def _durable(
    model: nn.Module, data: MitigationData, ratio: float, batch_size: int, aggregate: bool
) -> Mitigation:
    ratio = _check_ratio(ratio)
    _check_count("batch_size", batch_size)
    edited = edited_copy(model)
    scores, seconds, cached = _scores(
        "grad", model, data, (batch_size,), lambda: gradient_scores(edited, data, batch_size)
    )
    named = mlp_tensors(edited)
    total = sum(t.numel() for t in named.values())
    pruned = 0
    info: dict[str, Any] = {}
    if aggregate:
        device = next(iter(scores.values())).device
        flat = torch.cat([scores[n].flatten().to(device) for n in named])
        k = int(ratio * flat.numel())
        if k > 0:
            top = torch.topk(flat, k)
            info["threshold"] = float(top.values[-1])
            drop = torch.zeros_like(flat)
            drop[top.indices] = 1.0
            start = 0
            for tensor in named.values():
                part = drop[start : start + tensor.numel()]
                start += tensor.numel()
                pruned += _zero_top(tensor, part, int(part.sum()))
    else:
        for name, tensor in named.items():
            pruned += _zero_top(tensor, scores[name], int(ratio * tensor.numel()))
    info.update(_score_info(seconds, cached, pruned, total))
    return Mitigation(model=edited, info=info)


_DURABLE_GRID = [{"ratio": r} for r in RATIOS]


@register(
    "durable",
    "weight",
    grid=_DURABLE_GRID,
    summary="Durable: zero the top-ratio fraction of each MLP tensor by |grad of the LM loss "
    "on U|.",
    stronger=("ratio",),
)
def durable(
    model: nn.Module, data: MitigationData, ratio: float = 1e-3, batch_size: int = BATCH
) -> Mitigation:
    """Zero ``int(ratio * n)`` entries of each MLP tensor (n entries), those with the largest
    accumulated |gradient| on U. The scores are cached across ratios (see `info`)."""
    return _durable(model, data, ratio, batch_size, aggregate=False)


@register(
    "durable-agg",
    "weight",
    grid=_DURABLE_GRID,
    summary="Durable-agg: as Durable, with one top-ratio |grad| threshold over all MLP tensors.",
    stronger=("ratio",),
)
def durable_agg(
    model: nn.Module, data: MitigationData, ratio: float = 1e-3, batch_size: int = BATCH
) -> Mitigation:
    """Zero the ``int(ratio * N)`` MLP entries (N over all MLP tensors) with the largest
    accumulated |gradient| on U. TinyMem ranked over all parameters but zeroed only MLP
    entries; here the ranking covers the MLP tensors, which is what the method describes."""
    return _durable(model, data, ratio, batch_size, aggregate=True)


# --- SOU: second-order (OBS) saliency with a block-diagonal empirical Fisher -------------------


class BlockFisherInverse:
    """Inverse of ``F = damping I + (1/m) sum_k g_k g_k^T``, restricted to diagonal blocks of
    `block` consecutive weights, built one gradient at a time by Sherman-Morrison (oBERT).

    Float64, because the inverse starts at ``I / damping`` (1e7 by default) and is reduced by
    subtraction, where float32 keeps only ~7 significant digits. Memory: `block` float64
    numbers per weight.
    """

    def __init__(
        self, size: int, block: int, damping: float, num_grads: int, device: torch.device
    ) -> None:
        self.size, self.block, self.num_grads = size, block, num_grads
        self.blocks = math.ceil(size / block)
        eye = torch.eye(block, dtype=torch.float64, device=device) / damping
        self.inverse = eye.expand(self.blocks, block, block).clone()

    def add(self, grad: Tensor) -> None:
        """``F^-1 <- F^-1 - (F^-1 g)(F^-1 g)^T / (m + g^T F^-1 g)`` in every block."""
        g = grad.detach().flatten().to(self.inverse.device, torch.float64)
        g = torch.nn.functional.pad(g, (0, self.blocks * self.block - self.size))
        g = g.view(self.blocks, self.block, 1)
        u = torch.bmm(self.inverse, g)
        denom = self.num_grads + (g * u).sum(dim=(1, 2), keepdim=True)
        u = u / denom.sqrt()
        self.inverse.baddbmm_(u, u.transpose(1, 2), alpha=-1.0)

    def diagonal(self) -> Tensor:
        """``[F^-1]_ii`` for every weight (float64, flat)."""
        return self.inverse.diagonal(dim1=1, dim2=2).reshape(-1)[: self.size]


def fisher_scores(
    model: nn.Module,
    data: MitigationData,
    num_grads: int = 64,
    batch_size: int = 16,
    block_size: int = 50,
    damping: float = 1e-7,
    seed: int = 0,
) -> dict[str, Tensor]:
    """OBS saliency ``w^2 / (2 [F^-1]_ii)`` of every MLP weight (float32), F the empirical Fisher
    of `num_grads` mini-batch gradients of the LM loss on U (seeded shuffles of U, cycled).

    Each gradient is one batch's own gradient, as oBERT intends. TinyMem never zeroed the
    gradients between batches, so it added running sums instead; it also recomputed all the
    gradients for every tensor. With U no larger than `batch_size` every gradient is the same
    and F has rank 1 per block. The model's weights and gradient flags are left as they were.
    """
    named = mlp_tensors(model)
    tensors = list(named.values())
    inverses = [
        BlockFisherInverse(t.numel(), block_size, damping, num_grads, t.device) for t in tensors
    ]
    gen = torch.Generator().manual_seed(seed)
    count = 0
    with _trainable(tensors):
        while count < num_grads:
            for ids, mask in row_batches(data.memorized, batch_size, data.pad_id, gen):
                if count >= num_grads:
                    break
                grads = _gradients(_lm_loss(model, ids, mask), tensors)
                for inverse, g in zip(inverses, grads, strict=True):
                    inverse.add(g)
                count += 1
    out = {}
    for (name, t), inverse in zip(named.items(), inverses, strict=True):
        w2 = t.detach().flatten().to(torch.float64) ** 2
        out[name] = (w2 / (2.0 * inverse.diagonal().to(w2.device))).float().view(t.shape)
    return out


@register(
    "sou",
    "weight",
    grid=[{"ratio": r} for r in RATIOS],
    summary="SOU (second-order unlearning): zero the top-ratio fraction of each MLP tensor by "
    "OBS saliency w^2/(2 diag F^-1), F a block-diagonal empirical Fisher on U.",
    reduced_grid="TinyMem's ratios; the Fisher uses m = 64 gradients of batches of 16 rows of U "
    "(TinyMem: 256-512 batches of 64) so that scoring takes ~16 s on one CPU core for the "
    "4-layer d-128 model.",
    stronger=("ratio",),
)
def sou(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 1e-3,
    num_grads: int = 64,
    batch_size: int = 16,
    block_size: int = 50,
    damping: float = 1e-7,
    seed: int = 0,
) -> Mitigation:
    """Zero ``int(ratio * n)`` entries of each MLP tensor, those whose removal costs the loss on
    U the most by the OBS estimate. The scores are cached across ratios (see `info`)."""
    ratio = _check_ratio(ratio)
    for name, value in (
        ("num_grads", num_grads),
        ("batch_size", batch_size),
        ("block_size", block_size),
    ):
        _check_count(name, value)
    if not damping > 0:
        raise GSSError(f"damping must be positive, got {damping!r}.")
    edited = edited_copy(model)
    settings = (num_grads, batch_size, block_size, float(damping), seed)
    scores, seconds, cached = _scores(
        "fisher",
        model,
        data,
        settings,
        lambda: fisher_scores(edited, data, num_grads, batch_size, block_size, damping, seed),
    )
    named = mlp_tensors(edited)
    pruned = sum(_zero_top(t, scores[n], int(ratio * t.numel())) for n, t in named.items())
    total = sum(t.numel() for t in named.values())
    return Mitigation(model=edited, info=_score_info(seconds, cached, pruned, total))


# --- Subnet and BalancedSubnet: a learned pruning mask -----------------------------------------


class Supermask(nn.Module):
    """Parametrization ``weight -> weight * mask``: the mask drops the `ratio` fraction of the
    weights with the lowest |score| and passes its gradient straight through to |score|."""

    def __init__(self, scores: Tensor, ratio: float) -> None:
        super().__init__()
        self.scores = nn.Parameter(scores)
        self.ratio = ratio

    def hard(self) -> Tensor:
        """The 0/1 mask (float32) the current scores give."""
        a = self.scores.detach().abs().flatten()
        keep = torch.ones_like(a)
        k = int(self.ratio * a.numel())
        if k > 0:
            keep[torch.topk(a, k, largest=False).indices] = 0.0
        return keep.view(self.scores.shape)

    def forward(self, weight: Tensor) -> Tensor:
        a = self.scores.abs()
        mask = self.hard() + (a - a.detach())  # value: the hard mask; gradient: d/d|score|
        return weight * mask.to(weight.dtype)


def _masked_weights(model: nn.Module) -> list[nn.Module]:
    """The projections whose weight matrix Subnet masks (every MLP projection)."""
    return [
        proj
        for mlp in mlp_layers(model)
        for proj in (mlp.up, mlp.gate, mlp.down)
        if proj is not None
    ]


def _init_scores(weight: Tensor, gen: torch.Generator) -> Tensor:
    """Kaiming-uniform (a = sqrt 5, i.e. U(+-1/sqrt(fan_in))) scores, seeded; fan_in as
    torch.nn.init computes it for this weight's layout."""
    fan_in = weight.shape[1] if weight.dim() > 1 else weight.shape[0]
    bound = 1.0 / math.sqrt(fan_in)
    scores = (torch.rand(weight.shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
    return scores.to(weight.device)


def _train_mask(
    edited: nn.Module,
    ratio: float,
    epochs: int,
    seed: int,
    epoch_losses: Callable[[torch.Generator], Iterator[Tensor]],
) -> dict[str, Any]:
    """Train mask scores over the frozen MLP weight matrices of `edited` with SGD (lr 0.1,
    momentum 0.9, weight decay 5e-4), `epoch_losses(gen)` yielding one epoch of losses to
    minimize; then bake the final mask into the weights (pruned weights set to 0)."""
    gen = torch.Generator().manual_seed(seed)
    projections = _masked_weights(edited)
    masks = []
    for proj in projections:
        mask = Supermask(_init_scores(weight_of(proj), gen), ratio)
        parametrize.register_parametrization(proj, "weight", mask)
        masks.append(mask)
    optimizer = torch.optim.SGD([m.scores for m in masks], lr=0.1, momentum=0.9, weight_decay=5e-4)
    last = float("nan")
    try:
        for _ in range(epochs):
            for loss in epoch_losses(gen):
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                last = float(loss.detach())
    finally:
        pruned = 0
        for proj, mask in zip(projections, masks, strict=True):
            hard = mask.hard()
            parametrize.remove_parametrizations(proj, "weight", leave_parametrized=False)
            weight = weight_of(proj)  # the plain parameter again
            with torch.no_grad():
                drop = (hard == 0).to(weight.device)
                pruned += int((weight[drop] != 0).sum())
                weight.masked_fill_(drop, 0.0)
        _frozen(edited)
    total = sum(weight_of(p).numel() for p in projections)
    return {"pruned": pruned, "pruned_fraction": pruned / total, "final_loss": last}


def _subnet_grid(ratios: Sequence[float], epochs: Sequence[int]) -> list[dict[str, Any]]:
    return [{"ratio": r, "epochs": e} for r in ratios for e in epochs]


@register(
    "subnet",
    "weight",
    grid=_subnet_grid((1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5), (1, 10)),
    summary="Subnet (edge-popup): learn a mask over the MLP weight matrices that raises the LM "
    "loss on U; the lowest-ratio fraction of |score| per matrix is pruned.",
    reduced_grid="ratio {1e-3, 0.01, 0.05, 0.1, 0.25, 0.5} x epochs {1, 10} of TinyMem's "
    "{1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.3, 0.5, 0.8} x {1, 10, 20}: ~0.8 s per epoch "
    "over ~90 rows on one CPU core; 1e-5 and 1e-4 mask almost nothing of a d-128 model.",
    stronger=("ratio", "epochs"),
)
def subnet(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 0.05,
    epochs: int = 10,
    batch_size: int = BATCH,
    seed: int = 0,
) -> Mitigation:
    """Learn which `ratio` fraction of each MLP weight matrix to prune so that the loss on U
    rises (SGD on ``-CE`` over unshuffled batches of U), then bake the mask into the weights.

    The scores start random, so a random `ratio` fraction is pruned before any training, as in
    TinyMem; `seed` fixes that draw. Biases are not masked.
    """
    ratio = _check_ratio(ratio)
    _check_count("epochs", epochs)
    _check_count("batch_size", batch_size)
    edited = edited_copy(model)

    def epoch_losses(gen: torch.Generator) -> Iterator[Tensor]:
        for ids, mask in row_batches(data.memorized, batch_size, data.pad_id):
            yield -_lm_loss(edited, ids, mask)

    info = _train_mask(edited, ratio, epochs, seed, epoch_losses)
    return Mitigation(model=edited, info=info)


def _group_mean(nll: Tensor, mask: Tensor, rows: Tensor) -> Tensor:
    """Token-mean CE over the selected rows of a batch (0, with no gradient, if none)."""
    m = mask * rows[:, None].to(mask.dtype)
    count = m.sum()
    if float(count) == 0.0:
        return nll.new_zeros(())
    return (nll * m).sum() / count


@register(
    "balanced-subnet",
    "weight",
    grid=[
        {"ratio": r, "loss_weighting": w, "epochs": 1}
        for r in (0.01, 0.05, 0.1)
        for w in (0.9, 0.5)
    ],
    summary="BalancedSubnet: Subnet trained on shuffled batches of U and C to raise the loss "
    "on U while keeping it on C: -(1-w) CE(U) + w CE(C).",
    reduced_grid="ratio {0.01, 0.05, 0.1} x w {0.9, 0.5} x 1 epoch of TinyMem's 10 ratios x "
    "w {0.9, 0.7, 0.5} x epochs {1, 10, 20}: an epoch covers all of U and C (~9 s for ~1100 "
    "rows on one CPU core).",
    stronger=("ratio",),
)
def balanced_subnet(
    model: nn.Module,
    data: MitigationData,
    ratio: float = 0.05,
    loss_weighting: float = 0.9,
    epochs: int = 1,
    batch_size: int = BATCH,
    seed: int = 0,
) -> Mitigation:
    """Subnet with the loss ``-(1 - w) CE(U rows) + w CE(C rows)`` of each shuffled batch of
    U and C (w = `loss_weighting`); a batch without U rows trains on its C term only."""
    ratio = _check_ratio(ratio)
    _check_count("epochs", epochs)
    _check_count("batch_size", batch_size)
    _need_clean(data, "balanced-subnet")
    if not 0.0 <= loss_weighting <= 1.0:
        raise GSSError(f"loss_weighting must be in [0, 1], got {loss_weighting!r}.")
    edited = edited_copy(model)
    rows = [*data.memorized, *data.clean]
    is_u = torch.zeros(len(rows), dtype=torch.bool)
    is_u[: len(data.memorized)] = True

    def epoch_losses(gen: torch.Generator) -> Iterator[Tensor]:
        order = torch.randperm(len(rows), generator=gen)
        for start in range(0, len(rows), batch_size):
            idx = order[start : start + batch_size]
            ids, mask = right_pad([rows[i] for i in idx.tolist()], data.pad_id)
            nll = token_nll(edited, ids, mask)
            m = loss_mask(mask).to(nll.device)
            u = is_u[idx].to(nll.device)
            yield -(1.0 - loss_weighting) * _group_mean(nll, m, u) + loss_weighting * _group_mean(
                nll, m, ~u
            )

    info = _train_mask(edited, ratio, epochs, seed, epoch_losses)
    return Mitigation(model=edited, info=info)
