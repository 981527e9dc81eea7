"""The memorization-signal pilot of a fine-tune, as one report: does omega single out tokens?

Before calibrating, `gss signal` (or a script) checks that omega, the fine-tuned model's
log-probability minus the reference's, is positive on a minority of tokens in short bursts
(the paper's Section 3), on conversations also where in them it is (the replies or the rest),
and how it compares with normal text. This module computes omega over text files' rows and
gathers those statistics into one record and one figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gss.config import RunOptions, run_options
from gss.data import TextsOrIds, encode
from gss.signal.omega import SignalStatistics, omega_rows, signal_statistics

__all__ = ["SignalReport", "omega_all_zero", "omega_of_texts", "signal_report"]


def omega_of_texts(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    texts: TextsOrIds,
    tokenizer: Any,
    *,
    max_length: int = 512,
    batch_size: int | None = None,
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> Tensor:
    """omega of each of ``texts`` (as `gss.data.read_texts` gives them, cut to ``max_length``
    tokens): (rows, longest - 1), NaN past each row's end (`gss.signal.omega.omega_rows`).
    ``run`` (a `gss.RunOptions`; or ``batch_size``, ``progress``): as `gss.calibrate`'s."""
    opts = run_options(run, batch_size, progress)
    rows = encode(texts, tokenizer, max_length)
    return omega_rows(model, reference, rows, opts.batch_size, opts.progress, tokenizer)


def omega_all_zero(omega: Tensor) -> bool:
    """Whether omega is 0 on every token: the reference gives the model's own log-probabilities
    (is it the fine-tuned model itself?)."""
    return not bool(omega.nan_to_num().any())


@dataclass(frozen=True)
class SignalReport:
    """omega on the data and its statistics; `replies`: on conversations, omega on their
    replies and on the rest (`gss.signal.replies.reply_signal_of_rows`), else None; `normal`:
    omega on normal text, if given, and `normal_statistics` its statistics."""

    omega: Tensor = field(repr=False)
    statistics: SignalStatistics
    replies: dict[str, Any] | None = None
    normal: Tensor | None = field(default=None, repr=False)
    normal_statistics: SignalStatistics | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON record: ``data``, then ``replies`` and ``normal`` where there are some."""
        out: dict[str, Any] = {"data": self.statistics.to_dict()}
        if self.replies is not None:
            out["replies"] = self.replies
        if self.normal_statistics is not None:
            out["normal"] = self.normal_statistics.to_dict()
        return out

    def plot(self, path: str | Path, title: str) -> Path:
        """The omega and burst-length histograms, normal text's omega beside the data's."""
        from gss.report import plot_signal

        return plot_signal(self.omega, self.statistics, path, title, self.normal)


def signal_report(
    omega: Tensor,
    texts: TextsOrIds | None = None,
    tokenizer: Any | None = None,
    *,
    max_length: int | None = None,
    normal: Tensor | None = None,
) -> SignalReport:
    """The statistics of ``omega`` (`omega_of_texts` of ``texts``), and of ``normal`` (omega on
    normal text) when given. With the ``texts`` and their ``tokenizer`` and ``max_length``, for
    conversations: omega on their replies and on the rest, with a `GSSWarning` when the rest
    looks untouched by the fine-tune (`gss.signal.replies.warn_if_replies_alone`)."""
    from gss.signal.replies import reply_signal_of_rows, warn_if_replies_alone
    from gss.signal.tokens import reply_masks

    statistics = signal_statistics(omega)
    replies = None
    if texts is not None:
        replies = reply_signal_of_rows(omega, reply_masks(texts, tokenizer, max_length))
        warn_if_replies_alone(replies, stacklevel=3)
    normal_statistics = signal_statistics(normal) if normal is not None else None
    return SignalReport(omega, statistics, replies, normal, normal_statistics)
