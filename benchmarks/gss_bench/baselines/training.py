"""Loss and batching helpers shared by the baselines that train or score the model."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gss.data import right_pad
from gss.hf.forward import forward_logits, target_mask


def edited_copy(model: nn.Module) -> nn.Module:
    """A deep copy to edit, with gradients off everywhere (methods turn on what they train)."""
    clone = copy.deepcopy(model)
    clone.eval()
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone


def row_batches(
    rows: Sequence[Sequence[int]],
    batch_size: int,
    pad_id: int,
    generator: torch.Generator | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(input_ids, attention_mask)`` batches of `rows`, shuffled when a generator is given."""
    order = (
        torch.randperm(len(rows), generator=generator).tolist()
        if generator is not None
        else list(range(len(rows)))
    )
    for start in range(0, len(order), batch_size):
        yield right_pad([rows[i] for i in order[start : start + batch_size]], pad_id)


def loss_mask(attention_mask: Tensor, start: int | None = None) -> Tensor:
    """(B, T-1) float mask of the scored targets: real tokens, from position `start` on."""
    mask = target_mask(attention_mask)
    if start is not None:
        mask[:, : max(start - 1, 0)] = False
    return mask.float()


def token_nll(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, T-1) float32 cross-entropy of every next-token target (padding not masked)."""
    logits = forward_logits(model, input_ids, attention_mask)[:, :-1].float()
    targets = input_ids[:, 1:].to(logits.device)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


def sequence_nll(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    start: int | None = None,
    reduction: str = "mean",
) -> Tensor:
    """(B,) negative log-likelihood per row over its scored targets: ``mean`` or ``sum``."""
    nll = token_nll(model, input_ids, attention_mask)
    mask = loss_mask(attention_mask, start).to(nll.device)
    total = (nll * mask).sum(1)
    if reduction == "sum":
        return total
    return total / mask.sum(1).clamp_min(1.0)


def mean_nll(
    model: nn.Module, rows: Sequence[Sequence[int]], pad_id: int, start: int | None = None
) -> float:
    """Token-weighted mean NLL of `rows` (no gradient): the quantity unlearning moves."""
    total, count = 0.0, 0.0
    with torch.no_grad():
        for ids, mask in row_batches(rows, 256, pad_id):
            nll = token_nll(model, ids, mask)
            m = loss_mask(mask, start).to(nll.device)
            total += float((nll * m).sum())
            count += float(m.sum())
    return total / max(count, 1.0)
