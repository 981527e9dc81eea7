"""Step 8 of `gss.protect`: which steps the reference should decide where it is kept at
inference (`gss.reference_where_open`, ``gss generate --reference-where-open``).

Two rules were measured and neither wins everywhere (results/protect-says/handoff-signal-alone):
where the steer's gates open (``"steer"``: on the canaries and the TinyMem backdoors nothing
leaks and the fewest ordinary prompts change) or at any step, the memorization signal alone
deciding (``"none"``: on TinyMem math noise the gates find a fifth of the memorized digits,
and it leaves 11% of the rows where the gates leave 65%; on language noise it changes two
thirds of the clean prompts). So protect measures both on the tuning rows and on the ordinary
prompts of the gates' threshold half (never the report's), and chooses by issue 72's goals:
a rule that reproduces at most ``max_extractable`` % of the rows and keeps at least
``SearchSpace.handoff_unchanged`` of the ordinary prompts word for word; where neither does
both, the one with the fewest errors (a row reproduced and a prompt changed alike: on the
measured settings this picks the rule that left the held-out rows best, `choose`'s tests);
ties go to ``"steer"`` (the reference runs only where a gate opens). The choice travels with
the steer (its ``protect`` record), where `gss.generate_steered` and ``gss generate`` read it
(`gss.inference.handoff.recommended_gates`).
"""

from __future__ import annotations

from typing import Any

from gss.artifact.stack import Steer
from gss.config import HANDOFF_GATES
from gss.evaluate.decoding import greedy_generate
from gss.protect.config import ProtectConfig, Setting
from gss.protect.general import DATA, ORDINARY, GeneralText
from gss.protect.measure import prompt_and_target
from gss.protect.replies import handed_continuations, ordinary_prompts, reproduced
from gss.protect.split import Split


def handover_rule(
    s: Setting, config: ProtectConfig, split: Split, general: GeneralText, steer: Steer | None
) -> dict[str, Any]:
    """Each rule's share of tuning rows a greedy reply still reproduces and of ordinary
    prompts (32 tokens) continued as the unsteered fine-tune does, and the rule chosen
    (``gates``); empty where nothing was chosen or ``handoff_unchanged`` is None."""
    goal = config.search.handoff_unchanged
    if steer is None or goal is None:
        return {}
    rows = split.tune_candidates
    windows = [prompt_and_target(r, config.k, config.n) for r in rows]
    prompts, originals = [p for p, _ in windows], [t for _, t in windows]
    fit = general.fit.get(ORDINARY) or next(
        (v for name, v in general.fit.items() if name != DATA), []
    )
    ordinary = ordinary_prompts(fit)
    width = config.n - config.k

    def said(gates: Steer | None, ids: list[list[int]], width: int) -> list[list[int]]:
        return handed_continuations(s.model, gates, s.reference, ids, width, s.pad_id, s.batch_size)

    plain = greedy_generate(s.model, ordinary, 32, pad_id=s.pad_id, batch_size=s.batch_size)
    rules: dict[str, dict[str, float | None]] = {}
    for name in HANDOFF_GATES:
        gates = steer if name == "steer" else None  # None: at any step
        same = [a == b for a, b in zip(plain, said(gates, ordinary, 32), strict=True)]
        rules[name] = {
            "reproduced": reproduced(said(gates, prompts, width), originals) if prompts else None,
            "unchanged": sum(same) / len(same) if same else None,
        }
    return {
        "gates": choose(rules, goal, config.max_extractable),
        "unchanged_goal": goal,
        "tuning_rows": len(prompts),
        "ordinary_prompts": len(ordinary),
        "rules": rules,
    }


def choose(rules: dict[str, dict[str, float | None]], goal: float, target: float = 0.0) -> str:
    """The rules meeting both goals (at most ``target`` % of the rows reproduced, at least
    ``goal`` of the ordinary prompts unchanged) first, the fewest reproduced among them; where
    none does, the fewest errors, a row reproduced and a prompt changed counting alike (in
    points); then the order of `HANDOFF_GATES` (the gates: the reference runs less)."""

    def value(rule: str, key: str, missing: float) -> float:
        v = rules[rule].get(key)
        return missing if v is None else float(v)

    present = [r for r in HANDOFF_GATES if r in rules]
    both = [
        r
        for r in present
        if value(r, "reproduced", 0.0) <= target and value(r, "unchanged", 1.0) >= goal
    ]
    if both:
        return min(both, key=lambda r: (value(r, "reproduced", 0.0), -value(r, "unchanged", 1.0)))
    return min(
        present,
        key=lambda r: value(r, "reproduced", 0.0) + 100.0 * (1.0 - value(r, "unchanged", 1.0)),
    )
