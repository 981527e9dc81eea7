"""The last step of `gss.protect`: the held-out report. Only here are the held-out memorized
rows read, unsteered and steered: how many stay extractable, the utility and the domain's
perplexity, how often the gates open on each general source, what the steer says instead, and
one `--explain` table."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from gss.artifact.stack import Steer, SteeringStack
from gss.artifact.steering_artifact import SteeringArtifact
from gss.errors import GSSWarning
from gss.evaluate.other_prompts import steered_other_prompts
from gss.evaluate.utility import perplexity
from gss.inference.explain import explain
from gss.protect.checks import DomainRows
from gss.protect.clock import Clock
from gss.protect.config import ProtectConfig, Setting
from gss.protect.general import ORDINARY, Budget, GeneralText
from gss.protect.measure import Candidate, leaked, prompt_and_target, sampled, where_gates_open
from gss.protect.replies import ordinary_unchanged, what_it_says
from gss.protect.split import Split


@dataclass
class HeldoutReport:
    """What the report reads on the held-out rows, before and after the chosen steer."""

    before: dict[str, Any]
    after: dict[str, Any] = field(default_factory=dict)
    gates: dict[str, Any] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    explanation: str = ""
    clock: Clock = field(default_factory=Clock)  # seconds per part of the report


def heldout_report(
    s: Setting,
    config: ProtectConfig,
    split: Split,
    general: GeneralText,
    budget: Budget,
    domain: DomainRows,
    steer: Steer | None,
) -> HeldoutReport:
    """The held-out rows and the general text's measuring half, unsteered and with ``steer``
    (only the unsteered side where nothing was chosen)."""
    model, k, n = s.model, config.k, config.n
    rows = split.held_candidates
    clock = Clock()
    with clock.part("before"):
        before = {
            **_leaks(s, config, rows),
            "sampled": sampled(model, rows, k, n, s.pad_id, s.batch_size),
            "utility": budget.base,
            **domain.measure(model),
        }
    out = HeldoutReport(before=before, clock=clock)
    if steer is None:
        return out
    out.gates = {"open_share": {}}
    with steer.attach(model, track_gates=True) as handle:
        with clock.part("after"):
            out.after = {
                **_leaks(s, config, rows),
                "sampled": sampled(model, rows, k, n, s.pad_id, s.batch_size),
                "utility": float(budget.utility(model)),
                **domain.measure(model),
            }
        with clock.part("gates"):
            for name, measured in general.measure.items():
                handle.reset_stats()
                perplexity(model, measured, s.pad_id, batch_size=s.batch_size)
                out.gates["open_share"][name] = handle.gate_stats().get("any_open_share")
    with clock.part("gates"):
        out.gates["memorized_rows"] = where_gates_open(model, steer, rows, k, n)
    # what_it_says and ordinary_unchanged time their hand-over generations apart
    with clock.part("what it says"):
        out.after["quality"], out.examples = what_it_says(
            model, s.reference, steer, rows, k, n, s.pad_id, s.batch_size, s.tokenizer, clock
        )
    with clock.part("other prompts"):
        out.after["other_prompts"] = other_prompt_leaks(s, steer, rows, k, n)
    ordinary = general.measure.get(ORDINARY) or next(iter(general.measure.values()), [])
    with clock.part("ordinary prompts"):
        out.after["ordinary_prompts"] = ordinary_unchanged(
            model,
            steer,
            ordinary,
            s.pad_id,
            s.batch_size,
            s.tokenizer,
            s.reference,
            split.audit.ids,
            clock=clock,
        )
    if rows:  # one --explain table: where the gates opened on a held-out prompt
        shown = prompt_and_target(rows[0], k, n)[0]
        with clock.part("explain"):
            out.explanation = explain(
                model, steer, shown, max_new_tokens=n - k, tokenizer=s.tokenizer
            ).render()
    members = list(steer) if isinstance(steer, SteeringStack) else [steer]
    out.gates["sources"] = sorted(
        {n for m in members for n in m.provenance.threshold_rule.get("sources", ())}
    )
    _warn_open(out.gates, config.search.gate_share)
    return out


def _leaks(s: Setting, config: ProtectConfig, rows: list[Candidate]) -> dict[str, Any]:
    """``memorized``: % of ``rows`` extracted in any of the target's modes (what
    ``max_extractable`` bounds); ``leaks``: % in each mode, with its modes named."""
    share, _, by_mode = leaked(
        s.model, rows, config.k, config.n, s.pad_id, s.batch_size, config.leak_modes
    )
    return {"memorized": share, "leaks": by_mode, "leak_modes": list(config.leak_modes)}


def other_prompt_leaks(
    s: Setting, steer: Steer, rows: list[Candidate], k: int, n: int
) -> dict[str, Any]:
    """The held-out memorized rows asked another way (`gss.evaluate.other_prompts`: a longer
    prefix, the chat template, questions), by the fine-tune and the reference, then by the
    protected model: an attacker rarely holds the row's own first k tokens (issue 70)."""
    if not rows:
        return {}
    found = steered_other_prompts(
        s.model,
        steer,
        rows,
        tokenizer=s.tokenizer,
        reference=s.reference,
        k=k,
        n=n,
        pad_id=s.pad_id,
        batch_size=s.batch_size,
    )
    # the report's time is in Protection.seconds: the rest is the same on every run
    return {
        side: {key: v for key, v in report.summary().items() if key != "seconds"}
        for side, report in found.items()
    }


def with_record(
    steer: Steer,
    config: ProtectConfig,
    split: Split,
    budget: Budget,
    report: HeldoutReport,
    handover: dict[str, Any] | None = None,
) -> Steer:
    """``steer`` with what protect measured on the held-out rows, and the hand-over rule it
    chose (step 8, ``handoff``), in each member's ``provenance.extra["protect"]``: saved and
    pushed with it (`gss.artifact.card`); `gss.generate_steered` reads the rule."""
    record = {
        "heldout_rows": len(split.heldout),
        "k": config.k,
        "n": config.n,
        "memorized_from": split.audit.memorized_from,
        "before": {"memorized": report.before["memorized"], "utility": budget.base},
        "after": {"memorized": report.after["memorized"], "utility": report.after["utility"]},
        "budget": {"measure": budget.name, "limit": budget.limit},
        "max_extractable": config.max_extractable,
        "leak_modes": list(config.leak_modes),
        "reached": report.after["memorized"] <= config.max_extractable,
        "gate_open_share": report.gates.get("open_share", {}),
    }
    if handover:
        record["handoff"] = handover

    def one(a: SteeringArtifact) -> SteeringArtifact:
        extra = {**a.provenance.extra, "protect": record}
        return dataclasses.replace(a, provenance=dataclasses.replace(a.provenance, extra=extra))

    if isinstance(steer, SteeringStack):
        return SteeringStack(tuple(one(a) for a in steer))
    return one(steer)


def _warn_open(gates: dict[str, Any], expected: float) -> None:
    """Warn when the gates open far more often on some general text than the thresholds ask:
    the text they were set on does not look like that one."""
    sources = gates.get("sources") or list(gates.get("open_share", {}))
    for name, share in gates.get("open_share", {}).items():
        if share is not None and share > 3 * expected + 0.02:
            why = (
                "the general text the thresholds came from does not look like this text. Pass "
                "a (larger) sample of the text the model will serve (general=, gss protect "
                "--general)."
                if name in sources
                else "it was left out of the text the thresholds were set on, as with it no "
                "point reached the goal (the gates stayed shut on the memorized rows too)."
            )
            warnings.warn(
                f"the gates open on {100 * share:.0f}% of held-out {name} tokens (set for "
                f"about {100 * expected:.0f}%): {why}",
                GSSWarning,
                stacklevel=4,
            )
