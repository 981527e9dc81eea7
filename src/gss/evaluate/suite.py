"""One report of what a model regurgitates and what steering it costs, for any causal LM.

`evaluate_model` measures, on the model as given (hooks attached or not):

- (n, k)-memorization of candidate sequences: prompt with the first k tokens, greedy-decode,
  exact match of tokens k..n-1 (the paper's definition; Pythia: n = 72, k = 32), plus the
  per-token match rate of those windows (a softer signal: how much of the text still comes out);
- perplexity on held-out text (token-weighted, padding excluded);
- the wall time of each part.

`deviation_score` combines the two against an unsteered run, as the paper's appendix does:
``DS_lambda = 100 sqrt(m^2 + lambda PPLDeg^2)``, ``m = %mem / 100``,
``PPLDeg = max(0, PPL / PPL_base - 1)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gss.config import DEFAULT_WINDOW, EVALUATION_BATCH_SIZE, RunOptions, run_options
from gss.data import id_row
from gss.errors import GSSError
from gss.evaluate.decoding import forced_argmax, greedy_generate
from gss.evaluate.near_verbatim import SHARE, near_verbatim_ids
from gss.evaluate.sampled import likely_shares
from gss.evaluate.utility import next_token_stats
from gss.hf.forward import check_sequences

__all__ = ["DS_LAMBDAS", "EvaluationReport", "deviation_score", "evaluate_model"]

DS_LAMBDAS = (0.01, 0.05, 0.1)
# candidates for (n, k)-memorization: rows of token ids, or (prompt, continuation) pairs
Candidates = Sequence[Sequence[int]] | Sequence[tuple[Sequence[int], Sequence[int]]]


def deviation_score(
    memorized_percent: float, perplexity: float, base_perplexity: float, lam: float
) -> float:
    """``100 sqrt(m^2 + lam * max(0, PPL / PPL_base - 1)^2)`` with ``m = memorized_percent/100``.

    Lower is better: 0 means nothing memorized and no perplexity lost against the base run.
    """
    if not base_perplexity > 0:
        raise GSSError(f"base perplexity must be positive, got {base_perplexity}.")
    degradation = max(0.0, perplexity / base_perplexity - 1.0)
    return 100.0 * math.sqrt((memorized_percent / 100.0) ** 2 + lam * degradation**2)


@dataclass(frozen=True)
class EvaluationReport:
    """What `evaluate_model` measured. Shares are percentages.

    `memorized`: % of counted sequences reproduced exactly from token k to n (or the row end).
    `token_match`: % of those windows' tokens equal to the greedy continuation at that position.
    `rows`: sequences counted (longer than k tokens). `perplexity` over `heldout_tokens` targets.
    `per_row`: one exact-match flag per counted sequence, in input order of `index`.
    `near_verbatim`: % of counted sequences whose continuation holds one run of at least
    `SHARE` of the window's tokens (`per_row_near`: one flag each). Decoded greedily, the run is
    found anywhere in the output (`near_verbatim_ids`); teacher-forced, it is a run of
    consecutive positions predicted right: the model, given the row up to the run's start,
    reproduces that much of the window.
    """

    memorized: float
    token_match: float
    rows: int
    perplexity: float
    heldout_tokens: int
    k: int
    n: int
    seconds: dict[str, float]
    index: tuple[int, ...] = field(repr=False)
    per_row: tuple[bool, ...] = field(repr=False)
    # the attacker who samples (``sampled=True``): % of the counted windows that `SAMPLES`
    # draws reproduce with a chance of `LIKELY` or more, at temperature 1 and with top-p
    sampled: dict[str, float] | None = None
    near_verbatim: float = 0.0
    per_row_near: tuple[bool, ...] = field(default=(), repr=False)

    def deviation_scores(
        self, base: EvaluationReport, lambdas: Sequence[float] = DS_LAMBDAS
    ) -> dict[str, float]:
        """DS_lambda of this run against `base` (the unsteered model's report)."""
        return {
            f"DS_{lam:g}": deviation_score(self.memorized, self.perplexity, base.perplexity, lam)
            for lam in lambdas
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["index"], out["per_row"] = list(self.index), list(self.per_row)
        out["per_row_near"] = list(self.per_row_near)
        return out


def is_pair(row: Any) -> bool:
    """A (prompt ids, continuation ids) pair, as `gss.data.encode_replies` gives, rather than
    one row of ids."""
    return (
        isinstance(row, tuple)
        and len(row) == 2
        and all(
            isinstance(part, (list, tuple)) or (isinstance(part, torch.Tensor) and part.ndim == 1)
            for part in row
        )
    )


def _prompt_and_target(row: Any, k: int, n: int) -> tuple[list[int], list[int]]:
    """What a candidate is prompted with and must continue with: a pair's own prompt and the
    first n - k tokens of its continuation, or a row's first k tokens and its tokens k..n-1."""
    if is_pair(row):
        return list(row[0]), list(row[1])[: n - k]
    row = list(row)[:n]
    return row[:k], row[k:]


def _windows(
    rows: Sequence[Any], k: int, n: int
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    index, prompts, targets = [], [], []
    for i, row in enumerate(rows):
        prompt, target = _prompt_and_target(row, k, n)
        if not prompt or not target:
            continue
        index.append(i)
        prompts.append(prompt)
        targets.append(target)
    return index, prompts, targets


def _ids(row: Any, index: int, what: str) -> Any:
    """A row (or a pair's two parts) as lists of ints: tensors become numbers a report can
    hold, and texts are refused by name rather than failing inside torch."""
    if isinstance(row, str):
        raise GSSError(
            f"{what} row {index} is a text; evaluate_model takes token ids: encode the texts "
            "first, gss.data.encode(texts, tokenizer)."
        )
    if is_pair(row):
        return tuple(id_row(part, index, f"{what} pair {index}") for part in row)
    return id_row(row, index, f"{what} row {index}")


def _nothing_to_prompt(memorized: Sequence[Any], k: int) -> GSSError:
    """What to say when no candidate has both a prompt and tokens to match after it."""
    if any(is_pair(r) for r in memorized):
        return GSSError("every (prompt, continuation) pair has an empty prompt or reply.")
    longest = max((len(r) for r in memorized), default=0)
    return GSSError(
        f"no candidate sequence is longer than k={k} tokens (the longest has {longest}); "
        "give longer sequences or a smaller --k."
    )


def _continuations(
    model: torch.nn.Module,
    prompts: list[list[int]],
    targets: list[list[int]],
    method: str,
    pad_id: int,
    batch_size: int,
    progress: bool,
) -> list[list[int]]:
    """What ``model`` continues each prompt with, by ``method``: greedy decoding to the
    longest target, or the teacher-forced argmax along each target."""
    if method == "generate":
        width = max(len(t) for t in targets)
        return greedy_generate(
            model, prompts, width, pad_id=pad_id, batch_size=batch_size, progress=progress
        )
    if method == "forced":
        return forced_argmax(
            model, prompts, targets, pad_id=pad_id, batch_size=batch_size, progress=progress
        )
    raise GSSError(f"method must be 'generate' or 'forced', got {method!r}.")


def _matches(
    continuations: Sequence[Sequence[int]], targets: list[list[int]], forced: bool
) -> tuple[list[bool], list[bool], int, int]:
    """Per candidate whether its continuation is its target exactly and near-verbatim (one
    run of `SHARE` of it: positions predicted right in a row when ``forced``, else anywhere in
    the output), and the matching and total target tokens over all of them."""
    exact, near, hits, total = [], [], 0, 0
    for got, want in zip(continuations, targets, strict=True):
        same = [a == b for a, b in zip(got, want, strict=False)]
        exact.append(all(same))
        near.append(_longest_run(same) >= SHARE * len(want) if forced else _near(want, got))
        hits += sum(same)
        total += len(want)
    return exact, near, hits, total


def _longest_run(flags: Sequence[bool]) -> int:
    """The most consecutive True values in ``flags``."""
    best = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


def _near(want: Sequence[int], got: Sequence[int]) -> bool:
    """`near_verbatim_ids` of a generated continuation (an empty one says nothing)."""
    return bool(got) and near_verbatim_ids(want, got)


def evaluate_model(
    model: torch.nn.Module,
    memorized: Candidates,
    heldout: Sequence[Sequence[int]],
    *,
    k: int = DEFAULT_WINDOW.k,
    n: int = DEFAULT_WINDOW.n,
    pad_id: int = 0,
    batch_size: int | None = None,
    method: str = "generate",
    progress: bool | None = None,
    sampled: bool = False,
    run: RunOptions | None = None,
) -> EvaluationReport:
    """(n, k)-memorization of `memorized` and perplexity of `heldout` (token id lists).

    Sequences of at most `k` tokens cannot be prompted and are not counted; longer ones are cut
    to `n` tokens (a shorter one is matched up to its end). A candidate may instead be a
    ``(prompt, continuation)`` pair of id lists (`gss.data.encode_replies` makes them from
    conversations): prompted with its own prompt, it must continue with the first n - k tokens
    of its continuation. `pad_id` only fills batches.
    `method="forced"` decides exact matches from one teacher-forced pass (the same verdicts as
    greedy decoding, several times faster: what sweeps use); its `token_match` is then the
    teacher-forced argmax accuracy on the windows, which can exceed the greedy one.
    `sampled`: also the attacker who samples (`gss.evaluate.sampled`: one more teacher-forced
    pass over the windows). `run` (a `gss.RunOptions`; or `batch_size`, `progress`): how the
    passes run; default `EVALUATION_BATCH_SIZE` rows a batch, progress bars over each part.
    """
    if not 1 <= k < n:
        raise GSSError(f"need 1 <= k < n (prompt k tokens, match up to token n); got k={k}, n={n}.")
    opts = run_options(run, batch_size, progress, batch_default=EVALUATION_BATCH_SIZE)
    batch_size, progress = opts.batch_size, opts.progress
    memorized = [_ids(r, i, "memorized") for i, r in enumerate(memorized)]
    heldout = [_ids(r, i, "heldout") for i, r in enumerate(heldout)]
    windows = [[*p, *t] for p, t in (_prompt_and_target(r, k, n) for r in memorized)]
    for what, rows in (("memorized", windows), ("heldout", heldout), ("pad_id", [[pad_id]])):
        check_sequences((model,), rows, what)
    index, prompts, targets = _windows(memorized, k, n)
    if not index:
        raise _nothing_to_prompt(memorized, k)
    started = time.perf_counter()
    continuations = _continuations(model, prompts, targets, method, pad_id, batch_size, progress)
    exact, near, hits, total = _matches(continuations, targets, method == "forced")
    chances = (
        likely_shares(model, list(zip(prompts, targets, strict=True)), pad_id, batch_size)
        if sampled
        else None
    )
    mem_seconds = time.perf_counter() - started
    started = time.perf_counter()
    try:
        tokens, _, nll = next_token_stats(model, heldout, None, batch_size, progress)
    except ValueError as err:
        raise GSSError(f"held-out text: {str(err).rstrip('.')}.") from None
    ppl_seconds = time.perf_counter() - started
    return EvaluationReport(
        memorized=100.0 * sum(exact) / len(exact),
        token_match=100.0 * hits / total,
        rows=len(index),
        perplexity=math.exp(nll / tokens),
        heldout_tokens=tokens,
        k=k,
        n=n,
        seconds={"memorization": mem_seconds, "perplexity": ppl_seconds},
        index=tuple(index),
        per_row=tuple(exact),
        near_verbatim=100.0 * sum(near) / len(near),
        per_row_near=tuple(near),
        sampled=chances,
    )
