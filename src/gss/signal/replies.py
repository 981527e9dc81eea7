"""Whether a chat fine-tune looks trained on its replies alone, read from the signal itself.

A fine-tune whose loss covered only the assistant's messages (``trl``'s ``assistant_only_loss``,
``completion_only_loss``) leaves the other tokens where the base model had them: their omega is
noise around 0, so the default rule (omega > 0) marks about half of them memorized. On the
secret-sharer chat fine-tune of SmolLM2-135M trained that way (``gss bench canaries --chat
--replies-only``), omega averaged 2.17 nats on the replies and -0.04 outside them (48% of those
above 0), and GSS calibrated with every token memorizable removed nothing within +5% perplexity,
while ``replies_only=True`` removed every secret. Trained on every token, the same conversations
averaged 1.93 inside and 4.34 outside. So calibration, the layer scan and `gss signal`, when
their text holds conversations or prompt-completion rows and nothing restricts the memorized
set, compare the two means and warn when the outside one is a small share of the inside one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gss import distributed
from gss.data import Batch, right_pad
from gss.errors import GSSWarning

__all__ = ["ReplySignal", "reply_signal_of_rows", "warn_if_replies_alone"]

OUTSIDE_SHARE = 0.2  # warn when omega outside the replies averages below this share of inside
MIN_TOKENS = 64  # on each side, before the means say anything
# below this mean on the replies (nats) the fine-tune barely moved them, and two means near 0
# differ by noise alone (two random tiny models: 0.02 and -0.03); the canaries' replies: 2.17
MIN_REPLY_OMEGA = 0.5


class ReplySignal:
    """Running sums of omega on the replies and on the other tokens of the rows whose replies
    `masks` locate (None: a row without replies, or no check at all)."""

    def __init__(self, masks: Sequence[Tensor | None] | None) -> None:
        self.masks = masks
        self.sums: dict[str, Any] = {
            "rows": 0 if masks is None else sum(m is not None for m in masks),
            "reply_tokens": 0,
            "reply_omega": 0.0,
            "other_tokens": 0,
            "other_omega": 0.0,
        }

    def update(self, batch: Batch, omega: Tensor, valid: Tensor) -> None:
        """Add a batch's omega (B, T-1) at its valid targets."""
        if self.masks is None:
            return
        rows = batch.index.tolist()
        found = [self.masks[i] if i < len(self.masks) else None for i in rows]
        if all(m is None for m in found):
            return
        width = batch.input_ids.shape[1]
        empty = torch.zeros(width, dtype=torch.bool)
        inside = right_pad([m if m is not None else empty for m in found], 0)[0].bool()
        known = torch.tensor([m is not None for m in found])[:, None]
        inside = inside[:, 1:width].to(valid.device)
        known = known.to(valid.device)
        omega = omega.detach().float()
        for side, where in (("reply", valid & known & inside), ("other", valid & known & ~inside)):
            self.sums[f"{side}_tokens"] += int(where.sum())
            self.sums[f"{side}_omega"] += float(omega[where].sum())

    def result(self) -> dict[str, Any] | None:
        """The counts and means over every rank, or None where no row had replies."""
        if self.masks is None:
            return None
        sums: dict[str, Any] = dict(self.sums)
        distributed.sum_counts(sums, list(sums))
        if not sums["reply_tokens"]:
            return None
        other = sums["other_tokens"]
        return {
            "rows": sums["rows"],
            "reply_tokens": sums["reply_tokens"],
            "reply_omega_mean": sums["reply_omega"] / sums["reply_tokens"],
            "other_tokens": other,
            "other_omega_mean": sums["other_omega"] / other if other else None,
        }


def reply_signal_of_rows(
    omega: Tensor, masks: Sequence[Tensor | None] | None
) -> dict[str, Any] | None:
    """`ReplySignal.result` of omega rows as `gss.signal.omega.omega_rows` gives them (rows, longest
    - 1; NaN past each row's end), the rows `masks` (`gss.signal.tokens.reply_masks`) cover."""
    signal = ReplySignal(masks)
    rows, width = omega.shape
    ids = torch.zeros(rows, width + 1, dtype=torch.long)
    signal.update(Batch(ids, torch.ones_like(ids), torch.arange(rows)), omega, ~omega.isnan())
    return signal.result()


def warn_if_replies_alone(result: dict[str, Any] | None, stacklevel: int = 3) -> None:
    """Warn when the tokens outside the replies look untouched by the fine-tune (`result`:
    `ReplySignal.result`)."""
    if result is None or result["other_omega_mean"] is None or distributed.rank() != 0:
        return
    inside, outside = result["reply_omega_mean"], result["other_omega_mean"]
    enough = min(result["reply_tokens"], result["other_tokens"]) >= MIN_TOKENS
    if not enough or inside < MIN_REPLY_OMEGA or outside >= OUTSIDE_SHARE * inside:
        return
    warnings.warn(
        f"omega averages {inside:.2f} nats on the {result['reply_tokens']} tokens of the "
        f"replies but {outside:.2f} on the {result['other_tokens']} other tokens of the "
        "same conversations: the fine-tune looks trained on the replies alone. Every token "
        "is memorizable in this calibration, so about half of the untrained ones (their "
        "omega is noise around 0) count as memorized and pull the steer away from the "
        "replies. Pass replies_only=True (--replies-only), or rows with 'labels'.",
        GSSWarning,
        stacklevel=stacklevel,
    )
