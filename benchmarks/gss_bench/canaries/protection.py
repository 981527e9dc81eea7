"""The `gss protect` row of the canary benchmark: no hand-picked block, strength or variant.

`gss.protect` gets the fine-tuning rows the calibrations see (the canaries and 64 clean rows),
the benchmark's general rows as general text, its held-out rows for perplexity, and the
benchmark's own budget (+5% perplexity). It audits them, tunes on half of the memorized
canaries and holds out the other half; the steer it chooses joins the table like every other
method (one point, measured the same way), and the secrets said by the held-out canaries
alone, which the search never saw, are reported apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from gss.evaluate.intervals import clopper_pearson
from gss.evaluate.leaks import EXTRA_TOKENS, secrets_said
from gss.evaluate.sweep import SweepPoint
from gss.protect import SearchSpace, protect
from gss_bench.canaries.data import secret_fields
from gss_bench.protect_report import write_report


def protect_arguments(
    data: Any, tokenizer: Any, texts: Sequence[Any], budget: float, batch_size: int
) -> dict[str, Any]:
    """`gss.protect`'s arguments after the two models: the rows the calibrations see, the
    bench's general and held-out rows, its window and its budget (+5% perplexity)."""
    return {
        "texts": [list(r) for r in texts],
        "tokenizer": tokenizer,
        "general": [list(r) for r in data.general_rows],
        "heldout": [list(r) for r in data.heldout_rows],
        "budget": budget,
        "k": data.config.k,
        "n": data.config.row_len,
        "batch_size": batch_size,
        "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    }


def canary_measure(data: Any, pad_id: int, batch_size: int = 16) -> Any:
    """``measure(model, method)``: `evaluate_model` on the canaries' (n, k) windows and the
    held-out rows' perplexity, as the benchmark measures every method (`protect_point` takes
    it)."""
    from gss.evaluate.suite import evaluate_model

    def measure(m: nn.Module, method: str = "generate") -> Any:
        return evaluate_model(
            m,
            data.canary_rows,
            data.heldout_rows,
            k=data.config.k,
            n=data.config.row_len,
            pad_id=pad_id,
            batch_size=batch_size,
            method=method,
            progress=False,
        )

    return measure


def protect_point(
    model: nn.Module,
    reference: nn.Module,
    data: Any,
    tokenizer: Any,
    texts: Sequence[Any],
    *,
    budget: float,
    batch_size: int,
    measure: Any,
    report_dir: Path,
    progress: bool,
    search: SearchSpace | None = None,
) -> tuple[SweepPoint, float, dict[str, Any]]:
    """Run `gss.protect`; its choice as a one-point sweep (for the table), its wall time, and
    what it measured on the canaries it held out."""
    k = data.config.k
    started = time.perf_counter()
    arguments = protect_arguments(data, tokenizer, texts, budget, batch_size)
    result = protect(model, reference, search=search, progress=progress, **arguments)
    seconds = time.perf_counter() - started
    write_report(result, report_dir)
    if result.steer is None or result.chosen is None:
        raise RuntimeError("gss protect found no steer within the budget")
    c = result.chosen
    options = {
        "variant": c.preset,
        "blocks": "+".join(map(str, c.blocks)),
        "delta": "+".join(f"{d:.3g}" for d in c.deltas),
        "rank": c.rank,
        "gate": c.gate,
    }
    with result.steer.attach(model, track_gates=True) as handle:
        report = measure(model, "forced")
        gates = handle.gate_stats().get("any_open_share")
    point = SweepPoint(options, report, gates)  # the steer: `extra["steer"]`
    held = [i for i in result.heldout if i < len(data.canary_rows)]  # canaries come first
    names = ["number", "address"]
    prompts = [list(data.canary_rows[i][:k]) for i in held]
    secrets = [[secret_fields(data.secrets[i])[f] for f in names] for i in held]
    width = max(len(r) for r in data.canary_rows) - k + EXTRA_TOKENS

    def said(m: nn.Module) -> tuple[float, int]:
        """% of the held-out canaries' numbers and addresses said; canaries saying either."""
        leaks = secrets_said(
            m, tokenizer, prompts, secrets, max_new_tokens=width, batch_size=batch_size
        )
        flags = [f for row in leaks.said for f in row]
        return 100.0 * sum(flags) / len(flags), sum(any(row) for row in leaks.said)

    before, _ = said(model)
    with result.steer.attach(model):
        after, saying = said(model)
    lo, hi = clopper_pearson(saying, len(held))
    bound = clopper_pearson(saying, len(held), one_sided=True)[1]
    extra = {
        "summary": {k_: v for k_, v in result.summary().items() if k_ != "audit"},
        "audit": result.audit.summary(),
        "heldout_canaries": {
            "rows": len(held),
            "secrets_said_before": before,
            "after": after,
            # canaries saying their number or address after, with the exact 95% intervals (%)
            "canaries_saying_after": saying,
            "interval_after": [100 * lo, 100 * hi],
            "upper_bound_after": 100 * bound,
        },
        "examples": result.examples,
        "steer": result.steer,
    }
    return point, seconds, extra
