"""Decoding-time baselines: the model is left as it is and what it may say is filtered.

MemFree (Ippolito et al. 2023, "Preventing Verbatim Memorization in Language Models Gives a
False Sense of Privacy"): no n-gram of the output may be one of the training data's. At every
position, the tokens that would complete an n-gram of the indexed rows (the n - 1 tokens before
them and that token) are removed from the next-token distribution, the rest renormalised, so
greedy decoding takes the likeliest token that completes none. It is the first thing an engineer
reaches for: exact by construction on verbatim extraction, cheap, nothing to calibrate.

The paper keeps the n-grams in a Bloom filter to scale to a pretraining corpus; here an exact
set (a Bloom filter with no false positive) of the memorized set U, the rows a user wants kept
in, which is what gss protects: indexing the clean rows too would block the domain's ordinary
text. The filtered model is a wrapper: a teacher-forced pass reads the whole sequence, greedy
decoding the model's KV cache (the n-grams' contexts kept from the steps before), and both read
the same filtered distribution. A banned token's logit is lowered by `BAN` nats rather than set
to -inf: greedy decoding never takes it (unless every token is banned), and the perplexity stays a
number, each held-out token the filter bans costing it `BAN` nats (on the canaries' 2,016
held-out tokens one such token multiplies the perplexity by about 140): the price of the filter
on text that repeats the data, where -inf would leave it undefined.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gss.hf.forward import forward_logits, output_logits
from gss_bench.baselines.interface import Mitigation, MitigationData, register

NGRAM_SIZES = (16, 10, 6, 4)  # the grid, mildest first: a shorter n-gram blocks more
BAN = 1e4  # nats taken from a banned token's logit: probability e^-10000, never chosen


def ngram_index(rows: Sequence[Sequence[int]], n: int) -> dict[tuple[int, ...], set[int]]:
    """For every (n - 1)-token context in ``rows``, the tokens that complete an n-gram of them."""
    index: dict[tuple[int, ...], set[int]] = {}
    for row in rows:
        ids = [int(t) for t in row]
        for end in range(n - 1, len(ids)):
            index.setdefault(tuple(ids[end - n + 1 : end]), set()).add(ids[end])
    return index


class NgramFilter(nn.Module):
    """``model`` whose next-token scores never complete an n-gram of the indexed rows (the
    banned tokens' logits lowered by `BAN`: softmax renormalises over the rest)."""

    def __init__(self, model: nn.Module, rows: Sequence[Sequence[int]], n: int) -> None:
        super().__init__()
        if n < 2:
            raise ValueError(f"an n-gram filter needs n >= 2, got {n}")
        self.model, self.n = model, int(n)
        self.index = ngram_index(rows, self.n)
        self.config = getattr(model, "config", None)  # what gss reads of a model (vocab)
        self._history = torch.zeros((0, 0), dtype=torch.long)  # the ids decoded so far
        self.train(model.training)  # the model's mode: eval_mode puts the wrapper's back on it

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        use_cache: bool | None = None,
        **cache: Any,
    ) -> Any:
        """The filtered logits (B, T, V) of the whole sequence; with ``use_cache`` (greedy
        decoding), the model's output with its KV cache, the logits filtered, the n-grams'
        contexts read from the tokens of the calls since the cache was empty."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if not use_cache:
            logits = forward_logits(self.model, input_ids, mask).clone()
            self._ban(logits, input_ids, mask)
            return logits
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **cache,
        )
        first = not any(v is not None for v in cache.values())
        self._history = input_ids if first else torch.cat([self._history, input_ids], dim=1)
        logits = output_logits(out).clone()
        self._ban(logits, self._history, mask)
        out.logits = logits
        return out

    def _ban(self, logits: Tensor, ids: Tensor, mask: Tensor) -> None:
        """Lower, at each of the last ``logits.shape[1]`` positions of ``ids``, the tokens that
        would complete an indexed n-gram."""
        context, new = self.n - 1, logits.shape[1]
        tail = min(ids.shape[1], new + context - 1)  # the new positions and their contexts
        rows, real = ids[:, -tail:].tolist(), mask[:, -tail:].bool().tolist()
        for b, (row, kept) in enumerate(zip(rows, real, strict=True)):
            start = len(row) - new
            for t in range(max(context - 1, start), len(row)):
                if not all(kept[t - context + 1 : t + 1]):  # padding in the context
                    continue
                banned = self.index.get(tuple(row[t - context + 1 : t + 1]))
                if banned:
                    logits[b, t - start, list(banned)] -= BAN

    def get_base_model(self) -> nn.Module:
        """The model filtered: gss reads its KV cache argument's name there."""
        return self.model


@register(
    "memfree",
    "decoding",
    grid=[{"n": n} for n in NGRAM_SIZES],
    summary="MemFree: decoding never completes an n-gram of the memorized rows (an exact "
    "n-gram set; Ippolito et al. 2023).",
)
def memfree(model: nn.Module, data: MitigationData, n: int = 10) -> Mitigation:
    """The model wrapped in an n-gram filter of the memorized set U (the original untouched)."""
    wrapped = NgramFilter(model, data.memorized, n)
    info: dict[str, Any] = {"ngrams": sum(len(v) for v in wrapped.index.values())}
    return Mitigation(wrapped.eval(), info=info)
