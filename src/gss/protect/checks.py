"""What every point of the search is held to besides the utility (issue 72): the perplexity
of the fine-tuning data's clean rows (what the fine-tune is for: a budget on general text alone
missed a +223% there), and how likely the steered model finds the reference's own
continuations of the tuning prompts (a steer that says what the reference would keeps it low;
one that breaks the reply into a loop sends it up)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from gss.audit import AuditReport
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.utility import perplexity
from gss.protect.config import ProtectConfig, Setting
from gss.protect.measure import FOLLOWS, Check, prompt_and_target
from gss.protect.split import Split

DOMAIN = "domain perplexity"
"""The check on the data's clean rows (no mode of the audit finds them memorized:
`AuditReport.clean_ids`)."""


@dataclass(frozen=True)
class DomainRows:
    """The data's clean rows: one half bounds every point, the other is the report's."""

    search: list[list[int]]
    report: list[list[int]]
    pad_id: int
    batch_size: int

    @classmethod
    def of(
        cls, report: AuditReport, pad_id: int, batch_size: int, search_rows: int = 16
    ) -> DomainRows:
        """At most ``search_rows`` bound the search (each point reads them; a steer's effect
        on the same rows is measured paired, so a few suffice to see a +5% rise), the other
        half of the clean rows the report."""
        clean = report.clean_ids
        return cls(clean[::2][:search_rows], clean[1::2], pad_id, batch_size)

    def perplexity(self, model: nn.Module, rows: Sequence[Sequence[int]]) -> float:
        return perplexity(model, rows, self.pad_id, batch_size=self.batch_size)

    def measure(self, model: nn.Module) -> dict[str, Any]:
        """The report half's perplexity (nothing where the data has no clean row to spare)."""
        if not self.report:
            return {}
        return {"domain_perplexity": self.perplexity(model, self.report)}


def search_checks(
    s: Setting, config: ProtectConfig, split: Split
) -> tuple[dict[str, Check], DomainRows]:
    """The checks `Judge` takes on every point, their limits set on the unsteered model, and
    the clean rows the report reads."""
    model, reference, pad_id, batch_size = s.model, s.reference, s.pad_id, s.batch_size
    space, k, n = config.search, config.k, config.n
    budget, budget_mode, tuning = config.budget, config.budget_mode, split.tune_candidates
    report = split.audit
    domain = DomainRows.of(report, pad_id, batch_size)
    checks: dict[str, Check] = {}
    if domain.search:
        share = space.domain_budget
        if share is None:
            share = budget if budget_mode == "relative" else 0.05
        base = domain.perplexity(model, domain.search)
        checks[DOMAIN] = (lambda m: domain.perplexity(m, domain.search), base * (1 + share))
    prompts = [prompt_and_target(c, k, n)[0] for c in tuning]
    own = greedy_generate(reference, prompts, n - k, pad_id=pad_id, batch_size=batch_size)
    rows = [[*p, *c] for p, c in zip(prompts, own, strict=True)]
    lengths = [len(p) for p in prompts]

    def follows(m: nn.Module) -> float:
        return perplexity(m, rows, pad_id, batch_size=batch_size, prompt_lengths=lengths)

    tolerance = space.follow_tolerance
    checks[FOLLOWS] = (follows, None if tolerance is None else follows(model) * (1 + tolerance))
    return checks, domain
