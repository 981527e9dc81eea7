"""LUNAR (Shen et al. 2025): redirect the unlearn set's activations by retraining one MLP
output projection.

At block l, ``r = a_ref - a_f`` is the difference between the mean (over rows of the
sequence-averaged) block output of the clean set and of the unlearn set. The block's MLP output
projection is retrained so that on the unlearn set the block outputs ``h_0 + coeff * r`` (the
original output moved by r) while on clean rows it keeps ``h_0``: LUNAR's retain term, which
the GSS paper's description (forget term only) leaves out. Everything else stays frozen, so the
block output is ``rest + W a + b`` with fixed ``rest`` and neurons ``a``: the fit runs on
activations cached in one forward pass, which is exactly training the projection in place.
The result is a weight edit (a copy), not a hook.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gss_bench.baselines.activations import BlockActivations, block_activations, default_layer
from gss_bench.baselines.interface import (
    Mitigation,
    MitigationData,
    SharedWork,
    register,
    reuse_info,
)
from gss_bench.baselines.mlp import bias_of, is_conv1d, mlp_layers, weight_of
from gss_bench.baselines.training import edited_copy

MAX_CLEAN_ROWS = 256  # clean rows kept for the retain term and a_ref
_SHARED = SharedWork()


@register(
    "lunar",
    "steering",
    grid=[{"coeff": c} for c in (0.5, 1.0, 2.0, 4.0)],
    summary="LUNAR: retrain one MLP output projection so the unlearn set's activations move "
    "toward the clean mean (Shen et al. 2025).",
    stronger=("coeff",),
)
def lunar(
    model: nn.Module,
    data: MitigationData,
    coeff: float = 2.0,
    epochs: int = 20,
    lr: float = 1e-3,
    retain_weight: float = 1.0,
    batch_tokens: int = 512,
    seed: int = 0,
) -> Mitigation:
    """Fit the down projection of block `data.layer` (default the middle) with Adam."""
    layer = default_layer(model, data.layer)

    def read() -> tuple[BlockActivations, BlockActivations]:
        clean = list(data.clean)[:MAX_CLEAN_ROWS]
        return (
            block_activations(model, data.memorized, data.pad_id, layer, neurons=True),
            block_activations(model, clean, data.pad_id, layer, neurons=True),
        )

    (forget, retain), seconds, reused = _SHARED.get(model, data, ("lunar", layer), read)
    r = retain.row_means().mean(0) - forget.row_means().mean(0)

    edited = edited_copy(model)
    down = mlp_layers(edited)[layer].down
    down_w, down_b = weight_of(down), bias_of(down)
    conv = is_conv1d(down)
    weight = (down_w.detach().float() if conv else down_w.detach().float().T).clone()
    bias0 = down_b.detach().float().clone() if down_b is not None else None

    def projected(acts: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return acts @ w + (b if b is not None else 0.0)

    # rest = output - the projection's own contribution, fixed during the fit
    rest_f = forget.output - projected(forget.neurons, weight, bias0)
    rest_r = retain.output - projected(retain.neurons, weight, bias0)
    target_f = forget.output + coeff * r
    w = weight.clone().requires_grad_(True)
    b = bias0.clone().requires_grad_(True) if bias0 is not None else None
    opt = torch.optim.Adam([p for p in (w, b) if p is not None], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n_f, n_r = len(target_f), len(rest_r)
    steps_per_epoch = max(1, (n_f + batch_tokens - 1) // batch_tokens)
    for _ in range(epochs):
        order_f = torch.randperm(n_f, generator=gen)
        order_r = torch.randperm(n_r, generator=gen)
        for step in range(steps_per_epoch):
            i = order_f[step * batch_tokens : (step + 1) * batch_tokens]
            j = order_r[step * batch_tokens : (step + 1) * batch_tokens]
            loss = (rest_f[i] + projected(forget.neurons[i], w, b) - target_f[i]).pow(2).mean()
            if retain_weight > 0 and len(j):
                moved = rest_r[j] + projected(retain.neurons[j], w, b) - retain.output[j]
                loss = loss + retain_weight * moved.pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        new = w.detach() if conv else w.detach().T
        down_w.copy_(new.to(down_w.dtype))
        if b is not None and down_b is not None:  # b exists exactly when down_b does
            down_b.copy_(b.detach().to(down_b.dtype))
    info = {"layer": layer, "r_norm": float(r.norm()), "forget_tokens": n_f, "retain_tokens": n_r}
    return Mitigation(edited, info={**info, **reuse_info(seconds, reused)})
