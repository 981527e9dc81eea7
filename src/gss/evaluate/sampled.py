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
        return _stepwise_logprobs(model, pairs, pad_id, batch_size, top_p, processor)
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
    top_p: float | None,
    processor: Processor,
) -> list[float]:
    """`row_logprobs` through ``processor``: each batch of pairs of one prompt and window
    length decoded by `greedy_generate` with the window's tokens chosen, the scores each step
    saw kept."""
    out = [0.0] * len(pairs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (prompt, window) in enumerate(pairs):
        groups.setdefault((len(prompt), len(window)), []).append(i)
    for (_, width), members in groups.items():
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            windows = torch.tensor([list(pairs[i][1]) for i in chunk], dtype=torch.long)
            seen: list[Tensor] = []

            def force(scores: Tensor, windows: Tensor = windows, seen: list = seen) -> Tensor:
                seen.append(scores.float().cpu())
                return windows[:, len(seen) - 1 : len(seen)].to(scores.device)

            # one batch of equal-length prompts keeps its order (greedy_generate sorts by length)
            greedy_generate(
                model,
                [pairs[i][0] for i in chunk],
                width,
                pad_id=pad_id,
                batch_size=len(chunk),
                choose=force,
                processor=processor,
            )
            logits = torch.stack([*seen, seen[-1]], dim=1)  # position t predicts window[t]
            ids = torch.cat([torch.zeros_like(windows[:, :1]), windows], dim=1)
            for i, lp in zip(chunk, window_logprobs(logits, ids, 1, width + 1, top_p), strict=True):
                out[i] = float(lp)
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
        name: 100.0
        * sum(
            sampled_chance(lp, samples) >= LIKELY
            for lp in row_logprobs(model, pairs, pad_id, batch_size, top_p, processor)
        )
        / len(pairs)
        for name, top_p in (("temperature_1", None), ("top_p", TOP_P))
    }


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
    "window_logprobs",
]
