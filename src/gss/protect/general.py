"""Step 3 of `gss.protect`: the general text (the user's sample, the reference's own text,
ordinary English), each source split into a half that sets the gate thresholds and a half that
measures them, and the utility budget measured on it."""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gss.audit import AuditReport
from gss.config import EVALUATION_BATCH_SIZE
from gss.data import TextsOrIds, encode
from gss.errors import GSSError, GSSWarning
from gss.evaluate.decoding import sample_generate
from gss.evaluate.utility import perplexity
from gss.hf.forward import check_sequences, context_length
from gss.protect.config import ProtectConfig, Setting
from gss.protect.measure import Utility, utility_value
from gss.protect.ordinary import ordinary_english
from gss.statistics.capture import calibration_mode

ORDINARY = "ordinary English (built-in)"
"""The general source `ordinary.ordinary_english` gives."""
DATA = "clean rows of the data"
"""The gate source of the data's rows the audit did not flag (`SearchSpace.gate_on_data`)."""


def within_context(
    model: nn.Module, texts: TextsOrIds, tokenizer: Any, what: str
) -> list[list[int]]:
    """The token rows of ``texts``, each cut to the model's context where it is longer (as
    `gss evaluate` reads held-out text), said once; rows the model cannot read are refused."""
    rows = encode(texts, tokenizer, None)
    limit = context_length(model)
    longer = 0 if limit is None else sum(len(r) > limit[0] for r in rows)
    if limit is not None and longer:
        warnings.warn(
            f"{longer} of the {len(rows)} {what} rows are longer than the model's context "
            f"({limit[0]} positions, {limit[1]}): each is read up to its first {limit[0]} "
            "tokens.",
            GSSWarning,
            stacklevel=4,
        )
        rows = [r[: limit[0]] for r in rows]
    check_sequences((model,), rows, what)
    return rows


def ordinary_rows(model: nn.Module, tokenizer: Any, rows: int, seed: int) -> list[list[int]]:
    """``rows`` paragraphs of ordinary English as token rows of at most 96 tokens."""
    ids = encode(ordinary_english(rows, seed), tokenizer, None)
    limit = context_length(model)
    width = 96 if limit is None else min(96, limit[0])
    kept = [r[:width] for r in ids if len(r) > 1]
    try:
        check_sequences((model,), kept, "ordinary English")
    except GSSError as e:  # a tokenizer that is not the model's own: go without the source
        warnings.warn(f"protect: no ordinary English source ({e})", GSSWarning, stacklevel=4)
        return []
    return kept


def reference_text(
    reference: nn.Module,
    starts: Sequence[Sequence[int]],
    *,
    length: int = 48,
    seed: int = 0,
    batch_size: int = EVALUATION_BATCH_SIZE,
    progress: bool = False,
) -> list[list[int]]:
    """Text the reference writes (sampled at temperature 1, seeded) after each of ``starts``:
    general text in the reference's own distribution, with no data to download. Any causal LM
    forward will do (`gss.adapters_off(model)` included): no ``generate`` is needed; its KV
    cache is used where it returns one."""
    gen = torch.Generator().manual_seed(seed)
    with calibration_mode(reference):
        text = sample_generate(
            reference,
            starts,
            length,
            generator=gen,
            batch_size=batch_size,
            progress=progress,
            desc="gss: the reference's text",
        )
    return [[*s, *t] for s, t in zip(starts, text, strict=True)]


@dataclass(frozen=True)
class GeneralText:
    """Each general source's rows, halved: ``fit`` sets the gates' thresholds (and, but for
    `DATA`, is the calibration's general text), ``measure`` says how often they open and, but
    for `DATA`, is the default utility's text (the data's clean rows have their own check)."""

    fit: dict[str, list[list[int]]]
    measure: dict[str, list[list[int]]]

    @property
    def fit_rows(self) -> list[list[int]]:
        return [r for name, rows in self.fit.items() if name != DATA for r in rows]

    @property
    def measure_rows(self) -> list[list[int]]:
        return [r for name, rows in self.measure.items() if name != DATA for r in rows]


def general_text(
    s: Setting,
    config: ProtectConfig,
    report: AuditReport,
    held: Sequence[int],
    given: list[list[int]] | None,
) -> GeneralText:
    """The user's sample (``given``), text the reference writes from the first token of rows
    that are not held out, ordinary English (when there is a tokenizer) and the data's clean
    rows that the report does not read (`DomainRows`), each halved."""
    seen = [i for i in range(len(report.ids)) if i not in set(held)]  # never a held-out row
    picked = random.Random(config.seed + 1).sample(seen, min(config.reference_rows, len(seen)))
    written = reference_text(
        s.reference,
        [report.ids[i][:1] for i in picked],
        length=max(8, config.n - 1),
        seed=config.seed,
        progress=s.progress,
    )
    sources = {"reference-generated": written}
    if given is not None:
        sources = {"general (given)": given, **sources}
    if config.search.ordinary_english and s.tokenizer is not None:
        ordinary = ordinary_rows(s.model, s.tokenizer, config.search.ordinary_english, config.seed)
        if len(ordinary) > 1:
            sources[ORDINARY] = ordinary
    if config.search.gate_on_data:
        clean = report.clean_ids[::2]  # the half `checks.DomainRows` bounds the search with
        if len(clean) > 1:
            sources[DATA] = clean
    return GeneralText(
        fit={name: rows[::2] for name, rows in sources.items()},
        # a source of one row (the reference's text, from as few rows) has nothing to measure
        measure={name: rows[1::2] for name, rows in sources.items() if len(rows) > 1},
    )


@dataclass(frozen=True)
class Budget:
    """The utility every point is measured by, its unsteered value and the most it may be."""

    utility: Utility
    name: str
    base: float
    limit: float

    def record(self, config: ProtectConfig) -> dict[str, Any]:
        return {
            "measure": self.name,
            "base": self.base,
            "budget": config.budget,
            "mode": config.budget_mode,
            "limit": self.limit,
        }


def utility_budget(
    s: Setting,
    config: ProtectConfig,
    general: GeneralText,
    heldout: list[list[int]] | None,
    utility: Utility | None,
    utility_name: str,
) -> Budget:
    """The user's utility, or the perplexity of ``heldout`` (default: the general text's
    measuring half), and the limit the budget sets from its unsteered value."""
    if utility is None:
        rows = heldout if heldout is not None else general.measure_rows
        if not rows:
            raise GSSError(
                "no text is left to measure the utility on (the reference's text came from one "
                "row): pass heldout= (gss protect --heldout) or general= (--general)."
            )

        def utility(m: nn.Module) -> float:
            return perplexity(m, rows, s.pad_id, batch_size=s.batch_size)

        utility_name = "perplexity on " + ("heldout" if heldout is not None else "general text")
    base = utility_value(utility, s.model, utility_name)
    # relative: by a share of the base's size, a negative utility (minus accuracy) too
    rise = 1 + config.budget if base >= 0 else 1 - config.budget
    relative = config.budget_mode == "relative"
    limit = base * rise if relative else base + config.budget
    return Budget(utility, utility_name, base, limit)
