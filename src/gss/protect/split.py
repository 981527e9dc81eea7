"""Steps 1 and 2 of `gss.protect`: audit the fine-tuning rows and split the memorized ones,
seeded, into a half the search tunes on and a half only the final report reads."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

from gss.audit import AuditReport, audit
from gss.data import TextsOrIds
from gss.errors import GSSError, GSSWarning
from gss.protect.config import ProtectConfig, Setting
from gss.protect.measure import Candidate, extraction_window


@dataclass(frozen=True)
class Split:
    """The audit and its memorized rows halved: ``tuning`` and ``heldout`` are audit row
    indices."""

    audit: AuditReport
    tuning: list[int]
    heldout: list[int]

    @property
    def tune_rows(self) -> list[list[int]]:
        """The tuning rows' tokens: what the steer is calibrated on."""
        return [self.audit.ids[i] for i in self.tuning]

    @property
    def tune_candidates(self) -> list[Candidate]:
        """The tuning rows as the search measures them (from the prompt they were found on)."""
        return [self.audit.candidate(i) for i in self.tuning]

    @property
    def held_candidates(self) -> list[Candidate]:
        return [self.audit.candidate(i) for i in self.heldout]


def audit_and_split(
    s: Setting, config: ProtectConfig, texts: TextsOrIds, general: list[list[int]] | None
) -> Split:
    """`gss.audit` the data, then each distinct memorized window once (a copy of a tuning row
    held out would not be unseen), shuffled by the seed and halved."""
    report = audit(
        s.model,
        s.reference,
        texts,
        tokenizer=s.tokenizer,
        k=config.k,
        n=config.n,
        prefixes=config.prefixes,
        memorized_from=config.memorized_from,
        batch_size=s.batch_size,
        progress=s.progress,
    )
    _warn_if_general_is_memorized(general, report, config.n)
    firsts: dict[Any, int] = {}
    for r in report.memorized:
        firsts.setdefault(extraction_window(report.candidate(r.index), config.k, config.n), r.index)
    order = list(firsts.values())
    repeats = len(report.memorized) - len(order)
    if repeats:
        warnings.warn(
            f"{repeats} memorized row(s) repeat another's window (the same tokens up to n): "
            "each distinct row is tuned on or held out once, never both.",
            GSSWarning,
            stacklevel=3,
        )
    if len(order) < 2:
        rule = (
            f"({config.n},{config.k})-extraction"
            if report.by_k
            else "from the shortest prompt scored"
        )
        raise GSSError(
            f"the audit found {len(order)} distinct memorized row(s) of {len(report.rows)} "
            f"({rule}, not extracted by the reference): too few to tune on and hold out. "
            "Lower k or n, or pass more of the fine-tuning data."
        )
    random.Random(config.seed).shuffle(order)
    half = len(order) // 2
    return Split(report, sorted(order[:half]), sorted(order[half:]))


def _warn_if_general_is_memorized(
    general_rows: list[list[int]] | None, report: AuditReport, n: int
) -> None:
    """Warn when the general text is largely rows the model memorized (``--general`` given
    the fine-tuning data): thresholds and utility would then be measured on memorized text."""
    if not general_rows or not report.memorized:
        return
    memorized = {tuple(report.ids[r.index][:n]) for r in report.memorized}
    shared = sum(tuple(row[:n]) in memorized for row in general_rows)
    if 10 * shared >= len(general_rows):
        warnings.warn(
            f"{shared} of the {len(general_rows)} general rows are rows the model reproduces "
            f"(their first {n} tokens are memorized rows'): the gates' thresholds and the "
            "utility are then measured on memorized text. Give as general text what the model "
            "will serve but was not fine-tuned on.",
            GSSWarning,
            stacklevel=4,
        )
