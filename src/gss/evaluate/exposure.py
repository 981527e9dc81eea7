"""Exposure of a structured secret (Carlini et al. 2019): how far up the model ranks the true
secret among strings of the same format.

A greedy or sampled check says whether the secret comes out; exposure says how much closer the
model has come to it than to a random string of its form, which an attacker who enumerates
candidates (every 12-digit number) exploits. Each candidate keeps the secret's format (its
digits, by default also its letters, replaced at random by others of their class) and is scored
by log p(candidate | prompt); with ``rank`` the true secret's place among it and the
candidates, exposure is ``log2(candidates + 1) - log2(rank)``: 0 where half the candidates are
likelier, the most (``log2(candidates + 1)`` bits) where none is as likely.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gss.config import METRIC_BATCH_SIZE, RunOptions, run_options
from gss.data import right_pad
from gss.errors import GSSError
from gss.evaluate.decoding import batch_starts, eval_mode
from gss.hf.forward import check_sequences, forward_logits, token_logprobs

CANDIDATES = 1000
"""How many same-format strings the secret is ranked among: exposure up to ~10 bits."""


@dataclass(frozen=True)
class Exposure:
    """One secret's exposure: ``rank`` among ``candidates + 1`` strings (1: the likeliest),
    ``bits`` = log2(candidates + 1) - log2(rank), ``space_bits`` = log2 of how many strings its
    format holds (the most exposure an exhaustive ranking could give)."""

    rank: int
    candidates: int
    bits: float
    space_bits: float

    @property
    def ceiling(self) -> float:
        """The most ``bits`` this many candidates can show."""
        return math.log2(self.candidates + 1)


def same_format(secret: str, count: int, seed: int = 0, letters: bool = True) -> list[str]:
    """``count`` strings of ``secret``'s format, each unlike it: each digit replaced by a
    random digit and (``letters``) each letter by a random one of its case; the rest kept."""
    pools = {c: string.digits for c in string.digits}
    if letters:
        pools |= {c: string.ascii_lowercase for c in string.ascii_lowercase}
        pools |= {c: string.ascii_uppercase for c in string.ascii_uppercase}
    if not any(c in pools for c in secret):
        raise GSSError(
            f"the secret {secret!r} has no digit{' or letter' if letters else ''} to vary: "
            "exposure needs a structured secret (an account number, a key)."
        )
    space = format_size(secret, letters)
    if space - 1 < count:
        raise GSSError(
            f"the secret's format holds {space} strings, fewer than {count} candidates and the "
            "secret: rank it among fewer (candidates=)."
        )
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < count:
        made = "".join(rng.choice(pools[c]) if c in pools else c for c in secret)
        if made != secret:
            out.add(made)
    return sorted(out)


def format_size(secret: str, letters: bool = True) -> int:
    """How many strings ``secret``'s format holds (`same_format`'s classes)."""
    size = 1
    for c in secret:
        if c.isascii() and c.isdigit():
            size *= 10
        elif letters and c.isascii() and c.isalpha():
            size *= 26
    return size


def exposure(
    model: torch.nn.Module,
    tokenizer: Any,
    prompt: Sequence[int],
    secret: str,
    *,
    candidates: int = CANDIDATES,
    letters: bool = True,
    seed: int = 0,
    pad_id: int | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> Exposure:
    """The exposure of ``secret`` (text, as it follows the prompt: " 2304 9385 4717" with its
    leading space) after ``prompt`` (token ids): the secret and ``candidates`` strings of its
    format, each scored by the sum of its tokens' log-probabilities given the prompt. ``run``
    (a `gss.RunOptions`; or ``batch_size``, ``progress``): default `METRIC_BATCH_SIZE` rows
    a batch, no progress bar."""
    opts = run_options(
        run, batch_size, progress, batch_default=METRIC_BATCH_SIZE, progress_default=False
    )
    batch_size = opts.batch_size
    if not isinstance(candidates, int) or isinstance(candidates, bool) or candidates < 1:
        raise GSSError(f"candidates must be an integer >= 1, got {candidates!r}.")
    if not prompt:
        raise GSSError("exposure needs a prompt of at least one token.")
    strings = [secret, *same_format(secret, candidates, seed, letters)]
    encoded = [list(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in strings]
    rows = [[int(t) for t in prompt] + ids for ids in encoded]
    check_sequences((model,), rows, "the prompt and its secret")
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scores: list[float] = []
    with eval_mode(model):
        for start in batch_starts(len(rows), batch_size, "gss: exposure", opts.progress):
            chunk = rows[start : start + batch_size]
            ids, mask = right_pad(chunk, pad_id)
            logp = token_logprobs(forward_logits(model, ids, mask), ids).cpu()
            for j, row in enumerate(chunk):  # the secret's tokens: positions len(prompt)..
                scores.append(float(logp[j, len(prompt) - 1 : len(row) - 1].sum()))
    # ties count against the secret: a model that cannot tell them apart exposes nothing
    rank = 1 + sum(s >= scores[0] for s in scores[1:])
    return Exposure(
        rank=rank,
        candidates=candidates,
        bits=math.log2(candidates + 1) - math.log2(rank),
        space_bits=math.log2(format_size(secret, letters)),
    )


__all__ = ["CANDIDATES", "Exposure", "exposure", "format_size", "same_format"]
