"""Exact per-position gradients of memorized tokens' objectives at the layer-L output.

``g_t`` should be the gradient of token t's own objective w.r.t. the hidden state that
predicts it, ``h_{t-1}``. One backward of the summed objective gives ``h_{t-1}`` the gradients
of every later token's objective too (through attention above layer L). Here each memorized
position gets its own replica of the sequence in which the block-L output is a leaf at that
position only (elsewhere detached), so one batched backward returns each position's own
gradient, exactly. The cost grows with the number of memorized tokens, not with the sequence
length: cheap under a strict memorized-token cut.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gss.hf.forward import forward_logits
from gss.steering.attach import SteeredForward, split_block_output


class _LeafAt:
    """Block hook: the output stays as computed (detached) except at one position per row,
    where it is replaced by a leaf tensor that collects that position's gradient."""

    def __init__(self, positions: Tensor) -> None:
        self.positions = positions
        self.leaf: Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden, rebuild = split_block_output(output)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        pos = self.positions.to(hidden.device)
        self.leaf = hidden[rows, pos].detach().clone().requires_grad_(True)
        at = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        at[rows, pos] = True
        return rebuild(torch.where(at.unsqueeze(-1), self.leaf.unsqueeze(1), hidden.detach()))


def per_position_gradients(
    model: nn.Module,
    block: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    rows: Tensor,
    positions: Tensor,
    target: str = "loglik",
    ref_logits: Tensor | None = None,
    vocab: int | None = None,
    chunk: int = 16,
) -> tuple[Tensor, Tensor]:
    """Hidden states and exact own-token gradients at (row, position) pairs.

    ``positions[i]`` indexes the hidden state that predicts token ``positions[i] + 1`` of row
    ``rows[i]``. Returns ``(h, g)``, both (N, d). ``ref_logits`` (B, T, V) is needed for the
    ``toward-reference`` target; ``vocab`` the logits both models share (default: all). The
    model's weights must be frozen (no weight gradients).
    """
    hs, gs = [], []
    for start in range(0, rows.shape[0], chunk):
        r = rows[start : start + chunk]
        p = positions[start : start + chunk]
        tap = _LeafAt(p)
        handle = SteeredForward(block, tap)
        try:
            with torch.enable_grad():
                logits = forward_logits(model, input_ids[r], attention_mask[r])
        finally:
            handle.remove()
        assert tap.leaf is not None
        idx = torch.arange(r.shape[0], device=logits.device)
        p_dev = p.to(logits.device)
        logp = torch.log_softmax(logits[idx, p_dev, :vocab].float(), dim=-1)
        next_tokens = input_ids[r.cpu(), p.cpu() + 1].to(logits.device)
        objective = logp.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)
        if target == "toward-reference":
            assert ref_logits is not None
            p_ref = torch.softmax(
                ref_logits[r.to(ref_logits.device), p.to(ref_logits.device), :vocab].float(), -1
            ).to(logp.device)
            objective = objective - (p_ref * logp).sum(-1)
        (grad,) = torch.autograd.grad(objective.sum(), tap.leaf)
        hs.append(tap.leaf.detach())
        gs.append(grad)
    return torch.cat(hs), torch.cat(gs)
