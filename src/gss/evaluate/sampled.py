"""Sampled extraction without sampling: the chance that one of N samples reproduces a window.

Greedy decoding is the weakest attacker (issue 70): a row it misses is often drawn within a
few hundred samples at temperature 1 (Hayes et al. 2024). One sample reproduces a window
exactly with the product of its tokens' probabilities under the sampler, so the teacher-forced
pass the audit already makes gives that chance exactly, for temperature 1 and for top-p
(nucleus) sampling, and N independent samples reproduce it at least once with
``1 - (1 - p) ** N``: no generation per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gss.data import right_pad
from gss.errors import GSSError
from gss.evaluate.decoding import eval_mode, greedy_generate
from gss.hf.forward import forward_logits

SAMPLES = 100
"""How many samples the attacker draws per prompt (`sampled_chance`): a few hundred is what
Hayes et al. needed; 100 keeps the rate comparable across reports."""

TOP_P = 0.9
"""The nucleus the second sampler keeps (transformers' ``top_p``)."""

LIKELY = 0.5
"""A row counts as sample-extractable when N samples reproduce it with at least this chance."""

Processor = Callable[[Tensor, Tensor], Tensor]  # a LogitsProcessor: (ids so far, scores) -> scores


def window_logprobs(
    logits: Tensor, ids: Tensor, start: int, end: int, top_p: float | None = None
) -> Tensor:
    """log P(one sample from each position reproduces tokens ``start..end-1``), per row:
    ``logits`` (B, T, V) of ``ids`` (B, T), teacher-forced; temperature 1, or nucleus
    sampling with ``top_p`` as transformers' `TopPLogitsWarper` keeps it (the most probable
    tokens until their mass reaches top_p, at least one; -inf when a target falls outside)."""
    if not 1 <= start < end <= ids.shape[1]:
        raise GSSError(f"a window needs 1 <= start < end <= {ids.shape[1]}, got {start}, {end}.")
    logp = torch.log_softmax(logits[:, start - 1 : end - 1].float(), dim=-1)
    targets = ids[:, start:end].to(logp.device).unsqueeze(-1)
    chosen = logp.gather(-1, targets).squeeze(-1)  # (B, W)
    if top_p is None:
        return chosen.sum(-1)
    if not 0 < top_p <= 1:
        raise GSSError(f"top_p must be in (0, 1], got {top_p}.")
    probs = logp.exp()
    ordered = probs.sort(-1, descending=True).values
    above = ordered.cumsum(-1) - ordered  # the mass of the tokens more probable than each
    kept = above < top_p
    kept[..., 0] = True
    mass = (ordered * kept).sum(-1)  # the nucleus the sampler renormalises over
    # a target is kept when the tokens more probable than it hold less than top_p (ties count
    # as more probable: a tie at the edge is the sampler's to break, not the attacker's)
    target_above = (probs * (probs > chosen.exp().unsqueeze(-1))).sum(-1)
    inside = target_above < top_p  # the most probable token too: nothing is above it
    per_token = torch.where(inside, chosen - mass.log(), torch.full_like(chosen, -math.inf))
    return per_token.sum(-1)


def row_logprobs(
    model: torch.nn.Module,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    batch_size: int,
    top_p: float | None = None,
    processor: Processor | None = None,
) -> list[float]:
    """`window_logprobs` of each (prompt, window) pair, teacher-forced in right-padded
    batches: what a sampling attacker's chance on rows outside an audit is read from.

    ``processor``: a transformers ``LogitsProcessor`` a generation runs on each step's scores
    (`gss.reference_where_open`'s, whose choice at a step depends on the steps before): the
    window is then forced step by step through the model's KV cache and the processed scores
    are read, exact for the sampler that runs the processor (one forward a token)."""
    if processor is not None:
        return _stepwise_logprobs(model, pairs, pad_id, batch_size, (top_p,), processor)[0]
    out: list[float] = []
    with eval_mode(model):
        for start in range(0, len(pairs), batch_size):
            chunk = [([*p], [*w]) for p, w in pairs[start : start + batch_size]]
            ids, mask = right_pad([p + w for p, w in chunk], pad_id)
            logits = forward_logits(model, ids, mask)
            for j, (p, w) in enumerate(chunk):
                end = len(p) + len(w)
                one = window_logprobs(logits[j : j + 1], ids[j : j + 1], len(p), end, top_p)
                out.append(float(one[0]))
    return out


def _stepwise_logprobs(
    model: torch.nn.Module,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    batch_size: int,
    top_ps: Sequence[float | None],
    processor: Processor,
) -> list[list[float]]:
    """`row_logprobs` through ``processor``, for each of ``top_ps`` from one pass: batches of
    pairs whose windows have one length decoded by `greedy_generate` with the window's tokens
    chosen, each step's log-probability of its token added up as the step is scored."""
    out = [[0.0] * len(pairs) for _ in top_ps]
    groups: dict[int, list[int]] = {}
    for i, (_, window) in enumerate(pairs):
        groups.setdefault(len(window), []).append(i)
    for width, members in groups.items():
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            # one batch, rows in greedy_generate's order (by prompt length, stable)
            chunk = sorted(chunk, key=lambda i: len(pairs[i][0]))
            windows = torch.tensor([list(pairs[i][1]) for i in chunk], dtype=torch.long)
            totals = torch.zeros(len(top_ps), len(chunk), dtype=torch.float64)
            step = [0]

            def force(
                scores: Tensor, windows: Tensor = windows, totals: Tensor = totals, step=step
            ) -> Tensor:
                chosen = windows[:, step[0] : step[0] + 1].to(scores.device)
                ids = torch.cat([torch.zeros_like(chosen), chosen], dim=1)
                logits = scores.float().unsqueeze(1).expand(-1, 2, -1)  # position 0 predicts
                for at, top_p in enumerate(top_ps):
                    totals[at] += window_logprobs(logits, ids, 1, 2, top_p).double().cpu()
                step[0] += 1
                return chosen

            greedy_generate(
                model,
                [pairs[i][0] for i in chunk],
                width,
                pad_id=pad_id,
                batch_size=len(chunk),
                choose=force,
                processor=processor,
            )
            for at in range(len(top_ps)):
                for i, lp in zip(chunk, totals[at].tolist(), strict=True):
                    out[at][i] = float(lp)
    return out


def likely_shares(
    model: torch.nn.Module,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    batch_size: int,
    samples: int = SAMPLES,
    processor: Processor | None = None,
) -> dict[str, float]:
    """% of the (prompt, window) ``pairs`` that ``samples`` draws reproduce with a chance of
    `LIKELY` or more, at temperature 1 and with top-p `TOP_P` (empty without pairs), each step's
    scores through ``processor`` where given (`row_logprobs`)."""
    if not pairs:
        return {}
    return {
        name: 100.0 * sum(sampled_chance(lp, samples) >= LIKELY for lp in lps) / len(pairs)
        for name, lps in sampler_logprobs(model, pairs, pad_id, batch_size, processor).items()
    }


def sampler_logprobs(
    model: torch.nn.Module,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    batch_size: int,
    processor: Processor | None = None,
) -> dict[str, list[float]]:
    """`row_logprobs` at temperature 1 (``temperature_1``) and with top-p `TOP_P` (``top_p``),
    through ``processor`` in one stepwise pass for both where given."""
    samplers = {"temperature_1": None, "top_p": TOP_P}
    if processor is None:
        logprobs = [row_logprobs(model, pairs, pad_id, batch_size, p) for p in samplers.values()]
    else:
        logprobs = _stepwise_logprobs(
            model, pairs, pad_id, batch_size, list(samplers.values()), processor
        )
    return dict(zip(samplers, logprobs, strict=True))


def sampled_chance(logprob: float, samples: int = SAMPLES) -> float:
    """The chance that at least one of ``samples`` independent samples reproduces a window
    one sample reproduces with probability ``exp(logprob)``."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise GSSError(f"samples must be an integer >= 1, got {samples!r}.")
    if logprob == -math.inf:
        return 0.0
    if logprob >= 0.0:  # one sample always reproduces it
        return 1.0
    # 1 - (1 - p)^N, accurate for p near 0 (log1p) and near 1 (expm1)
    return -math.expm1(samples * math.log1p(-math.exp(logprob)))


__all__ = [
    "LIKELY",
    "SAMPLES",
    "TOP_P",
    "likely_shares",
    "row_logprobs",
    "sampled_chance",
    "sampler_logprobs",
    "window_logprobs",
]
