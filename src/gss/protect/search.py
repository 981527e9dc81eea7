"""`gss.protect` itself: its steps composed in order (the package's docstring lists them),
each a function of its own module, all reading one `ProtectConfig`."""

from __future__ import annotations

import time
import warnings
from typing import Any

from torch import nn

from gss.config import RunOptions
from gss.data import TextsOrIds
from gss.errors import GSSError, GSSWarning
from gss.hf.blocks import find_decoder_blocks, residual_width
from gss.hf.forward import check_models
from gss.protect.config import ProtectConfig, Setting, resolve
from gss.protect.general import Budget, general_text, utility_budget, within_context
from gss.protect.handover import handover_rule
from gss.protect.heldout import heldout_report, with_record
from gss.protect.measure import Utility
from gss.protect.result import Protection
from gss.protect.space import check_general, given_blocks
from gss.protect.split import audit_and_split
from gss.protect.stages import make_search


def protect(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    config: ProtectConfig | None = None,
    *,
    tokenizer: Any = None,
    general: TextsOrIds | None = None,
    heldout: TextsOrIds | None = None,
    utility: Utility | None = None,
    utility_name: str = "utility",
    pad_id: int = 0,
    run: RunOptions | None = None,
    **overrides: Any,
) -> Protection:
    """Audit ``texts`` (the fine-tuning data), then choose and build the steer that leaves at
    most ``max_extractable`` % of the memorized rows extractable within the utility budget.

    Args:
        model, reference, texts, tokenizer: as for `gss.calibrate` (``adapters_off(model)``
            is a reference for an adapter fine-tune).
        config: a `gss.ProtectConfig` (default: its defaults): the goal, the budget, the
            (n, k) window, the search space and the seed.
        general: a sample of the text the model will serve (the gate thresholds come from it,
            from text the reference generates and from ordinary English); optional.
        heldout: text whose perplexity is the default utility (default: the measuring half of
            the general text).
        utility: ``utility(model) -> float``, lower is better (e.g. ``lambda m: -accuracy(m)``);
            default: perplexity on ``heldout``. ``utility_name`` labels it in the report.
        pad_id: the id padding batched rows (the tokenizer's pad token). run: how the passes
            run, a `gss.RunOptions` (or its fields as keywords; one saying otherwise is refused).
        **overrides: fields of the config (``budget=0.1, search=SearchSpace(...)``) and run
            options (``batch_size``, ``progress``: `gss.config.RunOptions`).
    """
    config, options = resolve(config, dict(overrides), run)
    s = Setting(model, reference, tokenizer, pad_id, options)
    given, held_text = _read_inputs(s, config, general, heldout)
    started = time.perf_counter()
    split = audit_and_split(s, config, texts, given)
    seconds = {"audit": time.perf_counter() - started}
    text = general_text(s, config, split.audit, split.heldout, given)
    budget = utility_budget(s, config, text, held_text, utility, utility_name)
    search, domain = make_search(s, config, split, text, budget)
    seconds["general_text"] = time.perf_counter() - started - seconds["audit"]
    best = search.run()
    steer = None if best is None else search.judge.steer_of(best)
    if steer is None:
        _warn_none_within(budget)
    seconds["search"] = time.perf_counter() - started - sum(seconds.values())
    handover = handover_rule(s, config, split, text, steer)
    seconds["handover"] = time.perf_counter() - started - sum(seconds.values())
    report = heldout_report(s, config, split, text, budget, domain, steer)
    seconds["report"] = time.perf_counter() - started - sum(seconds.values())
    seconds["total"] = time.perf_counter() - started
    if steer is not None:  # the held-out report travels with the steer (its model card)
        steer = with_record(steer, config, split, budget, report, handover)
    return Protection(
        steer=steer,
        audit=split.audit,
        tuning=split.tuning,
        heldout=split.heldout,
        budget=budget.record(config),
        max_extractable=config.max_extractable,
        trials=search.judge.trials,
        chosen=best,
        before=report.before,
        after=report.after,
        gates=report.gates,
        examples=report.examples,
        seconds=seconds,
        search_seconds={"stages": search.stages.seconds, "work": search.work.seconds},
        report_seconds=report.clock.seconds,
        handover=handover,
        replies=search.replies,
        steers=search.judge.steers,
        explanation=report.explanation,
        config=config,
    )


def _warn_none_within(budget: Budget) -> None:
    warnings.warn(
        f"protect: no steer stayed within the utility budget ({budget.name} at most "
        f"{budget.limit:.4g}, from {budget.base:.4g}): nothing is chosen. Allow more (a "
        "larger budget).",
        GSSWarning,
        stacklevel=3,
    )


def _read_inputs(
    s: Setting,
    config: ProtectConfig,
    general: TextsOrIds | None,
    heldout: TextsOrIds | None,
) -> tuple[list[list[int]] | None, list[list[int]] | None]:
    """Everything that can be refused before a forward pass: the models, the options against
    this model, and the general and held-out texts, read as token rows."""
    check_models(s.model, s.reference)  # a path, or weights left on "meta"
    space = config.search
    if space.blocks is not None:  # in range
        given_blocks(space.blocks, len(find_decoder_blocks(s.model)))
    width = residual_width(s.model)
    if max(space.ranks) > width:  # each block is calibrated once, at the largest rank
        raise GSSError(
            f"ranks {space.ranks} go past the model's hidden size ({width}): give ranks in "
            f"1..{width} (SearchSpace(ranks=...))."
        )
    if config.budget_mode == "relative" and config.budget > 1:
        warnings.warn(
            f"budget {config.budget:g} lets the utility rise by {100 * config.budget:.0f}%: a "
            "relative budget is a fraction (0.05 = +5%).",
            GSSWarning,
            stacklevel=3,
        )
    given = None if general is None else within_context(s.model, general, s.tokenizer, "general")
    held = None if heldout is None else within_context(s.model, heldout, s.tokenizer, "heldout")
    if given is not None:
        check_general(len(given))
    return given, held
