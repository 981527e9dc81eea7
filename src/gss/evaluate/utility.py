"""Utility metrics for any HF causal LM: teacher-forced token accuracy and perplexity, and how
much a generation repeats itself.

Accuracy and perplexity are token-weighted over the real (non-padding) next-token targets of
every row: the first token of a row is never a target, and padding is never one. TinyMem's
accuracy counted PAD targets too (inflating it), and its perplexity averaged exp(batch mean loss)
over batches; here accuracy is correct / targets and perplexity is exp(total NLL / targets) over
all rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from gss.config import METRIC_BATCH_SIZE
from gss.data import id_row, right_pad
from gss.errors import GSSError
from gss.evaluate.decoding import RowsLike, as_rows, batch_starts, eval_mode
from gss.hf.forward import check_sequences, forward_logits

__all__ = ["perplexity", "repetition", "token_accuracy"]


def next_token_stats(
    model: torch.nn.Module,
    rows: RowsLike,
    pad_id: int | None,
    batch_size: int,
    progress: bool = False,
    starts: Sequence[int] | None = None,
) -> tuple[int, int, float]:
    """(targets, argmax hits, summed NLL in nats) over the non-padding targets of `rows`;
    `starts`: each row's first token counted as a target (the length of its prompt)."""
    all_rows = [id_row(r, i, f"row {i}") for i, r in enumerate(as_rows(rows, pad_id))]
    check_sequences((model,), all_rows, "the rows")  # a GSSError, not an IndexError in torch
    if starts is None:
        starts = [1] * len(all_rows)
    if len(starts) != len(all_rows):
        raise GSSError(f"{len(all_rows)} rows but {len(starts)} prompt lengths: give one each.")
    firsts_all = [max(int(s), 1) for s in starts]  # the first token is never a target
    kept = [(r, s) for r, s in zip(all_rows, firsts_all, strict=True) if len(r) > s]
    if not kept:
        raise GSSError("no row has a next-token target (rows need at least 2 tokens).")
    rows_, firsts = [r for r, _ in kept], [s for _, s in kept]
    pad = 0 if pad_id is None else pad_id
    n = hits = 0
    nll = 0.0
    with eval_mode(model):
        for b in batch_starts(len(rows_), batch_size, "gss: held-out perplexity", progress):
            ids, mask = right_pad(rows_[b : b + batch_size], pad)
            logits = forward_logits(model, ids, mask)[:, :-1].float().cpu()
            targets = ids[:, 1:]
            position = torch.arange(1, ids.shape[1])  # of each target in its row
            first = torch.as_tensor(firsts[b : b + batch_size])
            valid = mask[:, 1:].bool() & (position[None] >= first[:, None])
            lp = F.log_softmax(logits[valid], dim=-1)
            t = targets[valid]
            n += int(t.numel())
            hits += int((lp.argmax(-1) == t).sum())
            nll -= float(lp.gather(1, t[:, None]).sum(dtype=torch.float64))
    if not math.isfinite(nll):
        raise GSSError(
            "the model gives NaN or infinite log-probabilities on the rows, so their perplexity "
            "is undefined: check its weights and dtype (float16 can overflow; try float32 or "
            "bfloat16)."
        )
    return n, hits, nll


def token_accuracy(
    model: torch.nn.Module,
    rows: RowsLike,
    pad_id: int | None = None,
    *,
    batch_size: int = METRIC_BATCH_SIZE,
) -> float:
    """Share of next-token targets where the model's argmax is the target; padding excluded.

    `rows`: unpadded sequences of ids, a right-padded 2-d tensor (`pad_id` marks the padding),
    or an ``(input_ids, attention_mask)`` pair (right padding).
    """
    n, hits, _ = next_token_stats(model, rows, pad_id, batch_size)
    return hits / n


def perplexity(
    model: torch.nn.Module,
    rows: RowsLike,
    pad_id: int | None = None,
    *,
    batch_size: int = METRIC_BATCH_SIZE,
    prompt_lengths: Sequence[int] | None = None,
) -> float:
    """Token-weighted perplexity ``exp(sum NLL / targets)`` of `rows`; padding excluded.

    Accepts the same row forms as `token_accuracy`. With `prompt_lengths` (one per row), only
    the tokens after each row's prompt are scored: the perplexity of a reply given its prompt
    (a row with no token past its prompt adds nothing).
    """
    n, _, nll = next_token_stats(model, rows, pad_id, batch_size, starts=prompt_lengths)
    try:
        return math.exp(nll / n)
    except OverflowError:  # a mean NLL past ~709 nats (a filter that bans the text): no float
        return math.inf


def repetition(rows: Sequence[Sequence[int]], n: int = 4) -> float:
    """% of the token n-grams of the rows that repeat an earlier n-gram of the same row, pooled
    over the rows: how much generated text loops ("the address is the address is ..." scores
    high, fluent text near 0). NaN when no row has n tokens."""
    if n < 1:
        raise GSSError(f"n must be >= 1, got {n}.")
    total = repeated = 0
    for row in rows:
        ids = [int(t) for t in row]
        seen: set[tuple[int, ...]] = set()
        for i in range(len(ids) - n + 1):
            gram = tuple(ids[i : i + n])
            repeated += gram in seen
            seen.add(gram)
            total += 1
    return 100.0 * repeated / total if total else float("nan")
