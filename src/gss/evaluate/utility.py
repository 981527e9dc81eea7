"""Utility metrics for any HF causal LM: teacher-forced token accuracy and perplexity.

Both are token-weighted over the real (non-padding) next-token targets of every row: the first
token of a row is never a target, and padding is never one. TinyMem's accuracy counted PAD
targets too (inflating it), and its perplexity averaged exp(batch mean loss) over batches; here
accuracy is correct / targets and perplexity is exp(total NLL / targets) over all rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gss.data import right_pad
from gss.evaluate._decode import RowsLike, as_rows, batch_starts, eval_mode
from gss.forward import forward_logits

__all__ = ["perplexity", "token_accuracy"]


def next_token_stats(
    model: torch.nn.Module,
    rows: RowsLike,
    pad_id: int | None,
    batch_size: int,
    progress: bool = False,
) -> tuple[int, int, float]:
    """(targets, argmax hits, summed NLL in nats) over the non-padding targets of `rows`."""
    rows_ = [r for r in as_rows(rows, pad_id) if len(r) >= 2]
    if not rows_:
        raise ValueError("no row has a next-token target (rows need at least 2 tokens)")
    pad = 0 if pad_id is None else pad_id
    n = hits = 0
    nll = 0.0
    with eval_mode(model):
        for b in batch_starts(len(rows_), batch_size, "gss: held-out perplexity", progress):
            ids, mask = right_pad(rows_[b : b + batch_size], pad)
            logits = forward_logits(model, ids, mask)[:, :-1].float().cpu()
            targets = ids[:, 1:]
            valid = mask[:, 1:].bool()
            lp = F.log_softmax(logits[valid], dim=-1)
            t = targets[valid]
            n += int(t.numel())
            hits += int((lp.argmax(-1) == t).sum())
            nll -= float(lp.gather(1, t[:, None]).sum(dtype=torch.float64))
    return n, hits, nll


def token_accuracy(
    model: torch.nn.Module, rows: RowsLike, pad_id: int | None = None, *, batch_size: int = 64
) -> float:
    """Share of next-token targets where the model's argmax is the target; padding excluded.

    `rows`: unpadded sequences of ids, a right-padded 2-d tensor (`pad_id` marks the padding),
    or an ``(input_ids, attention_mask)`` pair (right padding).
    """
    n, hits, _ = next_token_stats(model, rows, pad_id, batch_size)
    return hits / n


def perplexity(
    model: torch.nn.Module, rows: RowsLike, pad_id: int | None = None, *, batch_size: int = 64
) -> float:
    """Token-weighted perplexity ``exp(sum NLL / targets)`` of `rows`; padding excluded.

    Accepts the same row forms as `token_accuracy`.
    """
    n, _, nll = next_token_stats(model, rows, pad_id, batch_size)
    return math.exp(nll / n)
