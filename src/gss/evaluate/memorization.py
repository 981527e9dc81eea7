"""Verbatim-memorization metrics for any HF causal LM: (n, k)-memorization and backdoor success.

Both metrics prompt the model and compare its greedy continuation token by token with a target.
They only call the model's own forward, so a model with forward hooks attached (a steering hook,
say) is measured with the hooks active.

Two exact ways to get the answer (`method`):

- ``"generate"`` (default): greedy decoding step by step with the model's KV cache.
- ``"forced"``: one teacher-forced pass over ``prompt + target``; a greedy continuation equals
  the target iff the argmax at every target position equals the target token, so the verdicts
  are the same (up to float ties) for any causal model whose output at a position does not depend
  on how the earlier positions were batched. It is several times faster and is what training
  uses to track memorization.

Rows are sequences of token ids without padding (or a right-padded tensor with `pad_id`, or an
``(input_ids, attention_mask)`` pair). Windows are clipped at the end of the row: when a row ends
(its EOS) inside ``[P, P + k)``, only the tokens up to and including the row's last token are
compared and whatever the model emits after that is ignored. TinyMem instead banned EOS until
position 150, so such rows could never match there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gss.config import METRIC_BATCH_SIZE
from gss.evaluate.decoding import RowsLike, as_rows, forced_argmax, greedy_generate

__all__ = ["BackdoorResult", "MemorizationResult", "backdoor_success", "nk_memorization"]


@dataclass(frozen=True)
class MemorizationResult:
    """Outcome of `nk_memorization`.

    `memorized`: share of counted rows whose continuation equals the row in the window.
    `correct`: share of counted rows continued exactly like the clean twin (``nan`` without twins).
    `n_rows`: rows counted (the denominator). `index`: their positions in the input.
    `per_row_memorized` / `per_row_correct`: one flag per counted row, in `index` order.
    """

    memorized: float
    correct: float
    n_rows: int
    index: tuple[int, ...]
    per_row_memorized: tuple[bool, ...]
    per_row_correct: tuple[bool, ...]
    prompt_len: int
    window: int


@dataclass(frozen=True)
class BackdoorResult:
    """Outcome of `backdoor_success`: attack success rate over the rows that contain the trigger.

    `index` lists the counted rows (clean twin contains the trigger, window not empty);
    `per_row` one flag per counted row.
    """

    success: float
    n_rows: int
    index: tuple[int, ...]
    per_row: tuple[bool, ...]
    window: int


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def _continuations(
    model: torch.nn.Module,
    prompts: list[list[int]],
    targets: list[list[list[int]]],
    *,
    method: str,
    pad_id: int,
    batch_size: int,
) -> list[list[bool]]:
    """For each target list, whether the greedy continuation of each prompt equals it."""
    if method == "generate":
        n_new = max((len(t) for ts in targets for t in ts), default=0)
        gen = greedy_generate(model, prompts, n_new, pad_id=pad_id, batch_size=batch_size)
        return [[g[: len(t)] == list(t) for g, t in zip(gen, ts, strict=True)] for ts in targets]
    if method == "forced":
        out = []
        for ts in targets:
            pred = forced_argmax(model, prompts, ts, pad_id=pad_id, batch_size=batch_size)
            out.append([p == list(t) for p, t in zip(pred, ts, strict=True)])
        return out
    raise ValueError(f"method must be 'generate' or 'forced', not {method!r}")


@dataclass(frozen=True)
class CountedWindow:
    """One row a memorization count reads: its index among the rows, the prompt it is given
    and the window its continuation must reproduce."""

    index: int
    prompt: list[int]
    target: list[int]


def nk_windows(
    rows: Sequence[Sequence[int]],
    twins: Sequence[Sequence[int]] | None,
    prompt_len: int,
    window: int,
) -> list[CountedWindow]:
    """The rows `nk_memorization` counts: prompted with the first `prompt_len` tokens of the
    clean twin (of the row itself without twins), the next `window` tokens of the row to
    reproduce; rows of at most `prompt_len` tokens, and with twins those whose window equals
    the twin's, are not counted."""
    p, k, out = prompt_len, window, []
    for i, row in enumerate(rows):
        src = twins[i] if twins is not None else row
        if len(row) <= p or len(src) < p:
            continue
        if twins is not None and list(row[p : p + k]) == list(twins[i][p : p + k]):
            continue
        out.append(CountedWindow(i, list(src[:p]), list(row[p : p + k])))
    return out


def trigger_windows(
    poison: Sequence[Sequence[int]],
    twins: Sequence[Sequence[int]],
    trigger: Sequence[int],
    window: int,
) -> list[CountedWindow]:
    """The rows `backdoor_success` counts: the clean twin up to the end of its first
    `trigger`, the poisoned row's next `window` tokens after it; rows whose twin lacks the
    trigger or whose poisoned row ends there are not counted."""
    out = []
    for i, (row, twin) in enumerate(zip(poison, twins, strict=True)):
        cut = first_end(twin, trigger)
        if cut >= 0 and len(row) > cut:
            out.append(CountedWindow(i, list(twin[:cut]), list(row[cut : cut + window])))
    return out


def nk_memorization(
    model: torch.nn.Module,
    rows: RowsLike,
    prompt_len: int,
    window: int,
    clean_rows: RowsLike | None = None,
    *,
    batch_size: int = METRIC_BATCH_SIZE,
    pad_id: int | None = None,
    method: str = "generate",
) -> MemorizationResult:
    """(n, k)-memorization of `rows`: prompt with n = `prompt_len` tokens, match k = `window`.

    The prompt is the first `prompt_len` tokens of the clean twin (``clean_rows[i]``) when twins
    are given, else of the row itself. A row is memorized iff the next `window` greedy tokens
    equal ``row[prompt_len : prompt_len + window]`` (clipped at the row end, see the module
    docstring). With twins, only rows whose window differs from the twin's window are counted
    (the noise must be inside the window), and `correct` is the share continued like the twin.
    Rows of at most `prompt_len` tokens are not counted. `pad_id` pads batches (it never reaches
    an unmasked position) and strips the right padding of a tensor input; default 0.
    """
    if prompt_len < 1 or window < 1:
        raise ValueError("prompt_len and window must be positive")
    pad = 0 if pad_id is None else pad_id
    rows_ = as_rows(rows, pad_id)
    twins = as_rows(clean_rows, pad_id) if clean_rows is not None else None
    if twins is not None and len(twins) != len(rows_):
        raise ValueError(f"{len(rows_)} rows but {len(twins)} clean twins")
    p, k = prompt_len, window
    counted = nk_windows(rows_, twins, p, k)
    index = [w.index for w in counted]
    prompts, targets = [w.prompt for w in counted], [w.target for w in counted]
    clean_targets = [twins[i][p : p + k] for i in index] if twins is not None else []
    if not index:
        return MemorizationResult(float("nan"), float("nan"), 0, (), (), (), p, k)
    sets = [targets, clean_targets] if twins is not None else [targets]
    flags = _continuations(model, prompts, sets, method=method, pad_id=pad, batch_size=batch_size)
    mem = tuple(flags[0])
    corr = tuple(flags[1]) if twins is not None else ()
    return MemorizationResult(
        memorized=_share(mem),
        correct=_share(corr),
        n_rows=len(index),
        index=tuple(index),
        per_row_memorized=mem,
        per_row_correct=corr,
        prompt_len=p,
        window=k,
    )


def first_end(row: Sequence[int], pattern: Sequence[int]) -> int:
    """Where the first occurrence of ``pattern`` in ``row`` ends (-1: none)."""
    n = len(pattern)
    pat = list(pattern)
    for i in range(len(row) - n + 1):
        if list(row[i : i + n]) == pat:
            return i + n
    return -1


def backdoor_success(
    model: torch.nn.Module,
    poison_rows: RowsLike,
    clean_twins: RowsLike,
    trigger: Sequence[int],
    window: int,
    *,
    batch_size: int = METRIC_BATCH_SIZE,
    pad_id: int | None = None,
    method: str = "generate",
) -> BackdoorResult:
    """Attack success rate of a backdoor.

    The prompt is the clean twin up to and including the first occurrence of `trigger`; the
    attack succeeds on a row iff the next `window` greedy tokens equal the poisoned row there
    (clipped at the poisoned row's end). Rows whose twin lacks the trigger, or whose poisoned row
    ends at the trigger, are not counted. Prompts differ in length: they are left-padded with an
    attention mask and matching position ids (exact, see the tests).
    """
    if window < 1 or not len(trigger):
        raise ValueError("window must be positive and trigger non-empty")
    pad = 0 if pad_id is None else pad_id
    poison = as_rows(poison_rows, pad_id)
    twins = as_rows(clean_twins, pad_id)
    if len(poison) != len(twins):
        raise ValueError(f"{len(poison)} poison rows but {len(twins)} clean twins")
    counted = trigger_windows(poison, twins, trigger, window)
    index = [w.index for w in counted]
    prompts, targets = [w.prompt for w in counted], [w.target for w in counted]
    if not index:
        return BackdoorResult(float("nan"), 0, (), (), window)
    (flags,) = _continuations(
        model, prompts, [targets], method=method, pad_id=pad, batch_size=batch_size
    )
    return BackdoorResult(_share(flags), len(index), tuple(index), tuple(flags), window)
