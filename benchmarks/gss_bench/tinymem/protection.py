"""The `gss protect` row of the TinyMem table: no hand-picked block, strength or variant.

`gss.protect` gets the fine-tuning rows that can be memorized (noise: the noised rows; backdoor:
the backdoored training rows, each as (row up to its trigger, what follows)), the validation
halves as general text, and the table's own utility rule as its budget (math: validation
accuracy may fall by `ACC_TOLERANCE` points; language: validation perplexity may rise by
`PPL_TOLERANCE`). It audits them, tunes on half of the memorized rows and holds out the other
half; the steer it chooses is then evaluated like every other method (greedy decoding, the
test halves), and for the noise settings also on its held-out rows alone, which the search
never saw.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from torch import nn

from gss.evaluate.memorization import first_end
from gss.protect import SearchSpace, protect
from gss_bench.protect_report import write_report
from gss_bench.tinymem import methods as M
from gss_bench.tinymem.data import TinyMemData

# `gss protect` with its defaults: no hand-picked block, strength, rank, gate or variant; the
# table's utility rule is its budget. Its name in the tables.
PROTECT = "GSS protect"


def protect_inputs(data: TinyMemData) -> tuple[list[Any], int, int]:
    """The rows `protect` audits, and its (k, n): the table's own window."""
    cfg = data.config
    if data.noised:
        return [list(r) for r in data.noised], cfg.prompt_len, cfg.prompt_len + cfg.window
    pairs = []
    for row in data.poison_train:
        end = first_end(row, data.trigger)
        if 0 < end < len(row):  # every backdoored row holds its trigger
            pairs.append((list(row[:end]), list(row[end:])))
    return pairs, 1, 1 + cfg.window  # a pair's window: the first n - k tokens of its reply


def protect_arguments(data: TinyMemData, batch_size: int) -> dict[str, Any]:
    """`gss.protect`'s arguments after the two models: the rows, the table's window, and its
    utility rule as the budget."""
    val, _ = M.split_halves(data)
    texts, k, n = protect_inputs(data)
    mode: Literal["relative", "absolute"]
    if M.is_math(data):  # accuracy: higher is better, a fall of ACC_TOLERANCE points allowed

        def utility(m: nn.Module) -> float:
            return -M.utility(m, data, val, batch_size)

        budget, mode = M.ACC_TOLERANCE, "absolute"
    else:  # perplexity: lower is better, a rise of PPL_TOLERANCE (relative) allowed

        def utility(m: nn.Module) -> float:
            return M.utility(m, data, val, batch_size)

        budget, mode = M.PPL_TOLERANCE, "relative"
    return {
        "texts": texts,
        "general": M.general_rows(data),
        "utility": utility,
        "utility_name": (
            "minus validation accuracy %" if M.is_math(data) else "validation perplexity"
        ),
        "budget": budget,
        "budget_mode": mode,
        "k": k,
        "n": n,
        "batch_size": 64,
        "pad_id": data.pad_id,
    }


def protect_row(
    mem: nn.Module,
    ref: nn.Module,
    data: TinyMemData,
    base: M.Evaluation,
    batch_size: int,
    seed: int = 0,
    progress: bool = False,
    report_dir: Path | None = None,
    search: SearchSpace | None = None,
    keep: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `gss.protect` with its defaults and evaluate what it chose like the other methods.
    ``keep``: given, its ``"steer"`` is set to the steer chosen (None where none was)."""
    started = time.perf_counter()
    arguments = protect_arguments(data, batch_size)
    result = protect(mem, ref, seed=seed, search=search, progress=progress, **arguments)
    seconds = time.perf_counter() - started
    if keep is not None:
        keep["steer"] = result.steer
    if result.steer is None:
        ev = base
    else:
        with result.steer.attach(mem):
            ev = M.evaluate(mem, data, batch_size, decode="generate")
    chosen = result.chosen
    params = (
        {}
        if chosen is None
        else {
            "variant": chosen.preset,
            "blocks": "+".join(map(str, chosen.blocks)),
            "delta": "+".join(f"{d:.3g}" for d in chosen.deltas),
            "rank": chosen.rank,
            "gate": chosen.gate,
        }
    )
    row: dict[str, Any] = {
        "selected": {
            "strength": list(chosen.deltas) if chosen else None,
            "params": params,
            "within_tolerance": result.steer is not None,
            "eval": ev.to_dict(),
        },
        # one point: protect searched on its own tuning rows, not over the table's grid
        "grid": [{"strength": list(chosen.deltas) if chosen else None, "eval": ev.to_dict()}],
        "mitigation_seconds": seconds,
        "protect": {k_: v for k_, v in result.summary().items() if k_ != "audit"},
        "audit": result.audit.summary(),
        "examples": result.examples,
    }
    row["protect"]["heldout_index"] = result.heldout
    if data.noised:  # the held-out rows alone: memorized by the model, never seen by the search
        rows, share = share_on(ev, result.heldout)
        row["heldout_rows"] = {
            "rows": rows,
            "memorized": share,
            "by_method": {"Unmitigated": share_on(base, result.heldout)[1], "GSS protect": share},
        }
    if report_dir is not None:  # what gss protect itself writes: its search, figures, examples
        write_report(result, report_dir)
    return row


def share_on(ev: M.Evaluation, rows: Sequence[int]) -> tuple[int, float]:
    """How many of ``rows`` (noised-row indices) the evaluation counted, and the % of them it
    found memorized."""
    wanted = set(rows)
    flags = [f for i, f in zip(ev.index, ev.per_row, strict=True) if i in wanted]
    return len(flags), 100.0 * sum(flags) / len(flags) if flags else float("nan")
