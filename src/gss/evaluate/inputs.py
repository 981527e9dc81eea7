"""What an evaluation measures on, read from the files it is given.

`gss evaluate` and `gss sweep` (and a script doing what they do) take the candidate rows (plain
text, or conversations whose replies are matched), the held-out text and, where the candidate
rows carry a ``"secrets"`` list, a check of which secrets a model still says. This module turns
those files into token rows and that check, once, for both.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gss.config import DEFAULT_WINDOW, EVALUATION_BATCH_SIZE, RunOptions, run_options
from gss.data import TextsOrIds, encode, encode_replies, read_rows, read_texts
from gss.errors import GSSError, GSSWarning
from gss.evaluate.leaks import EXTRA_TOKENS, LeakReport, secrets_said

__all__ = ["EvaluationRows", "SecretsCheck", "evaluation_rows", "secrets_check"]


@dataclass(frozen=True)
class EvaluationRows:
    """Token rows to evaluate a model on (`gss.evaluate.evaluate_model`'s inputs).

    `memorized`: candidate rows of token ids (cut to `n` tokens), or with `reply` (prompt ids,
    reply ids) pairs whose replies are cut to ``n - k`` tokens; `heldout`: held-out rows for
    perplexity; `pad_id`: what fills batches.
    """

    memorized: list[Any] = field(repr=False)
    heldout: list[list[int]] = field(repr=False)
    k: int = DEFAULT_WINDOW.k
    n: int = DEFAULT_WINDOW.n
    pad_id: int = 0
    reply: bool = False


def evaluation_rows(
    memorized: str | Path | TextsOrIds,
    heldout: str | Path | TextsOrIds,
    tokenizer: Any,
    *,
    k: int = DEFAULT_WINDOW.k,
    n: int = DEFAULT_WINDOW.n,
    reply: bool = False,
    max_length: int = 512,
) -> EvaluationRows:
    """The rows of the files ``memorized`` (candidates: .txt or .jsonl, `gss.data.read_texts`)
    and ``heldout`` (held-out text, each row cut to ``max_length`` tokens), tokenized; either may
    instead be rows already read (`gss.data_sources.read_data`, a `datasets.Dataset`, texts).

    With ``reply``, ``memorized`` holds conversations or prompt / completion rows: each is
    prompted with everything before its reply and must continue with the reply's first
    ``n - k`` tokens (`gss.data.encode_replies`); otherwise each row is prompted with its first
    ``k`` tokens and must continue with its tokens ``k..n-1``.
    """
    rows: list[Any]  # id rows, or (prompt, reply) pairs whose first n - k tokens count
    candidates: Any = memorized
    if isinstance(memorized, (str, Path)):
        candidates = read_rows(memorized) if reply else read_texts(memorized)
    held_rows: Any = read_texts(heldout) if isinstance(heldout, (str, Path)) else heldout
    if reply:
        rows = encode_replies(candidates, tokenizer, n - k)
    else:
        rows = encode(candidates, tokenizer, n)
        longest = max((len(r) for r in rows), default=0)
        if k < longest < n:  # the headline's (n, k) would promise more than is measured
            warnings.warn(
                f"no memorized row reaches n = {n} tokens (the longest has {longest}): each is "
                f"matched to its end, so this is ({longest},{k})-memorization at most. Lower "
                "--n to what the rows hold.",
                GSSWarning,
                stacklevel=2,
            )
    held = encode(held_rows, tokenizer, max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return EvaluationRows(rows, held, k=k, n=n, pad_id=pad, reply=reply)


@dataclass(frozen=True)
class SecretsCheck:
    """Which of their secrets the prompts make a model say: ``check(model)`` greedy-decodes
    ``max_new_tokens`` after each prompt and looks for its secrets (`secrets_said`)."""

    tokenizer: Any = field(repr=False)
    prompts: list[list[int]] = field(repr=False)
    secrets: list[list[str]] = field(repr=False)
    max_new_tokens: int
    batch_size: int = EVALUATION_BATCH_SIZE
    progress: bool = True

    def __call__(self, model: torch.nn.Module) -> LeakReport:
        return secrets_said(
            model,
            self.tokenizer,
            self.prompts,
            self.secrets,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            progress=self.progress,
        )


def secrets_check(
    memorized: str | Path | Sequence[Any],
    tokenizer: Any,
    *,
    k: int = DEFAULT_WINDOW.k,
    n: int = DEFAULT_WINDOW.n,
    reply: bool = False,
    batch_size: int | None = None,
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> SecretsCheck | None:
    """The check of the candidate rows (a file, or rows as `gss.data.read_rows` gives them)
    that carry a ``"secrets"`` list, or None when no row has secrets.

    Each such row is prompted as its memorization is (its first ``k`` tokens, or with ``reply``
    the turns before its reply), and its continuation is decoded for ``n - k`` tokens and
    `EXTRA_TOKENS` more (a secret may come out a little later). ``run`` (a `gss.RunOptions`;
    or ``batch_size``, ``progress``): how the check runs; default `EVALUATION_BATCH_SIZE`
    prompts a batch, a progress bar.
    """
    opts = run_options(run, batch_size, progress, batch_default=EVALUATION_BATCH_SIZE)
    given = read_rows(memorized) if isinstance(memorized, (str, Path)) else memorized
    items = [
        (row, _secrets_of(row, place))
        for place, row in enumerate(given, 1)
        if isinstance(row, dict) and row.get("secrets") is not None
    ]
    if not items:
        return None
    rows, secrets = [row for row, _ in items], [s for _, s in items]
    if reply:
        prompts = [prompt for prompt, _ in encode_replies(rows, tokenizer)]
    else:
        ids = encode(rows, tokenizer, n)
        if len(ids) != len(rows) or any(len(r) <= k for r in ids):
            raise GSSError(
                f"a --memorized row with secrets has at most k={k} tokens: nothing is "
                "left to say after its prompt; give longer rows or a smaller --k."
            )
        prompts = [r[:k] for r in ids]
        _warn_if_secrets_in_prompts(tokenizer, prompts, secrets, k)
    return SecretsCheck(
        tokenizer,
        prompts,
        secrets,
        max_new_tokens=n - k + EXTRA_TOKENS,
        batch_size=opts.batch_size,
        progress=opts.progress,
    )


def _secrets_of(row: Mapping[str, Any], place: int) -> list[str]:
    """The row's ``"secrets"``, checked: a non-empty list of non-empty strings (numbers are
    read as their text), else one message naming the row."""
    secrets = row["secrets"]
    if (
        isinstance(secrets, (list, tuple))
        and secrets
        and all(type(x) in (str, int, float) and str(x) for x in secrets)
    ):
        return [str(x) for x in secrets]
    shown = repr(secrets) if len(repr(secrets)) <= 60 else repr(secrets)[:57] + "..."
    raise GSSError(
        f'--memorized row {place}: "secrets" must be a non-empty list of strings, the texts the '
        f'model must not say, got {shown}. Write it as "secrets": ["..."], or leave the key out '
        "for a row without secrets."
    )


def _warn_if_secrets_in_prompts(
    tokenizer: Any, prompts: Sequence[Sequence[int]], secrets: Sequence[Any], k: int
) -> None:
    """A secret already inside its row's first k tokens is in the prompt, not in what the
    model says: the check cannot count it, and says so."""
    inside = 0
    for prompt, row_secrets in zip(prompts, secrets, strict=True):
        text = tokenizer.decode(list(prompt), skip_special_tokens=True)
        if any(str(secret) and str(secret) in text for secret in row_secrets):
            inside += 1
    if inside:
        warnings.warn(
            f"{inside} of {len(prompts)} rows with secrets have a secret inside their first "
            f"k={k} tokens, the prompt: it cannot be said after it, so those rows cannot count "
            "as leaks. Lower --k, or give prompt/completion rows with --reply.",
            GSSWarning,
            stacklevel=3,
        )
