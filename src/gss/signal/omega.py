"""The token-level memorization signal omega and the paper's pilot statistics.

``omega_t = log p_model(x_t | x_<t) - log p_ref(x_t | x_<t)``: how much more the fine-tuned
model believes token t than a reference that did not see the fine-tuning data. Large isolated
spikes mark memorized tokens; the pilot statistics describe how sparse and bursty they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gss.config import RunOptions
from gss.data import holds_ids
from gss.errors import GSSError
from gss.hf.forward import (
    check_same_vocab,
    check_sequences,
    forward_logits,
    target_mask,
    token_logprobs,
)


def nonfinite_error(bad: str, what: str) -> GSSError:
    """What to say when the ``bad`` model's log-probabilities on the ``what`` text are NaN or
    infinite: omega, and all that rests on it, would be undefined."""
    return GSSError(
        f"the {bad} gives NaN or infinite log-probabilities on the {what} text, so omega is "
        "undefined: check its weights and dtype (float16 can overflow; try float32 or "
        "bfloat16)."
    )


@torch.no_grad()
def memorization_signal(
    model: nn.Module,
    reference: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    batch_size: int | None = None,
    tokenizer: Any = None,
) -> Tensor:
    """omega for every next-token target, shape (batch, seq - 1), float32, on the CPU.

    Exact under left or right padding; targets that are padding (or whose context is only
    padding) are NaN. ``batch_size`` splits a large input into chunks. ``tokenizer``, the
    one the ids come from, lets one model pad its logits past it where the other does not
    (`gss.hf.forward.check_same_vocab`).
    """
    vocab = check_same_vocab(model, reference, tokenizer)
    if input_ids.ndim != 2:
        raise GSSError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}.")
    if input_ids.shape[1] < 2:
        raise GSSError("sequences need at least 2 tokens to have a next-token target.")
    if not holds_ids(input_ids.dtype):
        raise GSSError(f"input_ids must hold integers, got {input_ids.dtype}.")
    check_sequences((model, reference), input_ids, "input_ids")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise GSSError(
            f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
            f"{tuple(input_ids.shape)}."
        )
    step = batch_size or input_ids.shape[0]
    chunks = []
    for start in range(0, input_ids.shape[0], step):
        ids = input_ids[start : start + step]
        mask = attention_mask[start : start + step]
        lp_model = token_logprobs(forward_logits(model, ids, mask), ids, vocab).cpu()
        lp_ref = token_logprobs(forward_logits(reference, ids, mask), ids, vocab).cpu()
        valid = target_mask(mask).cpu()
        for bad, lp in (("model", lp_model), ("reference", lp_ref)):
            if not bool(torch.isfinite(lp[valid]).all()):  # else NaN reads as padding
                raise nonfinite_error(bad, "given")
        omega = lp_model - lp_ref
        chunks.append(omega.masked_fill(~valid, float("nan")))
    return torch.cat(chunks)


def omega_rows(
    model: nn.Module,
    reference: nn.Module,
    rows: Sequence[Sequence[int]],
    batch_size: int = RunOptions.batch_size,
    progress: bool = False,
    tokenizer: Any = None,
) -> Tensor:
    """omega of every row of token ids, (rows, longest - 1), NaN past each row's end;
    `progress`: a bar over the batches (two forward passes each); `tokenizer` as in
    `memorization_signal`."""
    from tqdm.auto import tqdm

    from gss.data import batches, count_batches

    out = []
    chunks = batches([list(r) for r in rows], batch_size)
    total = count_batches(len(rows), batch_size)
    for batch in tqdm(chunks, desc="gss: omega", total=total, disable=not progress, leave=False):
        omega = memorization_signal(
            model, reference, batch.input_ids, batch.attention_mask, tokenizer=tokenizer
        )
        out += list(omega)
    width = max(len(r) for r in out)
    return torch.stack([F.pad(r, (0, width - len(r)), value=float("nan")) for r in out])


@dataclass(frozen=True)
class SignalStatistics:
    """The pilot-study numbers of the paper (its Section 3), for one set of omega values."""

    tokens: int
    mean: float
    std: float
    share_above_mean: float  # paper: 18.7%
    share_positive: float
    quantiles: dict[str, float]
    burst_count: int
    burst_mean_length: float  # paper: 1.64 tokens
    burst_single_share: float  # paper: 60.8% of bursts are single tokens
    burst_histogram: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _bursts(omega: Tensor) -> list[int]:
    """Lengths of runs of consecutive omega > 0 tokens within each row (NaN ends a run)."""
    lengths: list[int] = []
    positive = (omega > 0).tolist()  # NaN > 0 is False
    for row in positive:
        run = 0
        for is_pos in row:
            if is_pos:
                run += 1
            elif run:
                lengths.append(run)
                run = 0
        if run:
            lengths.append(run)
    return lengths


def signal_statistics(omega: Tensor) -> SignalStatistics:
    """Share of tokens above the mean and burst lengths of omega > 0, ignoring NaN (padding)."""
    if omega.ndim == 1:
        omega = omega.unsqueeze(0)
    values = omega[~torch.isnan(omega)].double()
    if values.numel() == 0:
        raise GSSError("omega has no finite values: every target was padding.")
    mean = float(values.mean())
    qs = torch.tensor([0.01, 0.05, 0.5, 0.95, 0.99], dtype=torch.float64)
    quantiles = torch.quantile(values, qs).tolist() if values.numel() < 2**24 else []
    bursts = _bursts(omega)
    hist: dict[int, int] = {}
    for length in bursts:
        hist[length] = hist.get(length, 0) + 1
    return SignalStatistics(
        tokens=int(values.numel()),
        mean=mean,
        std=float(values.std()) if values.numel() > 1 else 0.0,
        share_above_mean=float((values > mean).double().mean()),
        share_positive=float((values > 0).double().mean()),
        quantiles={f"q{int(q * 100)}": v for q, v in zip(qs.tolist(), quantiles, strict=False)},
        burst_count=len(bursts),
        burst_mean_length=(sum(bursts) / len(bursts)) if bursts else 0.0,
        burst_single_share=(hist.get(1, 0) / len(bursts)) if bursts else 0.0,
        burst_histogram=dict(sorted(hist.items())),
    )
