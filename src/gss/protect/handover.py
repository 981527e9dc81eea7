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
``SearchSpace.handoff_unchanged`` of the ordinary prompts word for word, and among those one
whose replies to the tuning prompts are within step 7's allowances of the reference's own
(``fluency_ratio`` times their perplexity under it, ``loop_tolerance`` points more repeated
4-grams: on the LoRA canaries both rules met the first two goals, and the held-out replies
read 1.72x the reference's perplexity under the gates, 1.24x at any step), and then one whose
replies open with the window's first tokens (`recited_start`) not `LATE_TIE` points more often
than the other's (there every reply under the gates said the secret's first digits before the
reference spoke, at any step 3 of 15); where
neither meets the first two, the one with the fewest errors (a row reproduced and a prompt
changed alike: on the measured settings this picks the rule that left the held-out rows best,
`choose`'s tests); ties go to ``"steer"`` (the reference runs only where a gate opens). The
choice travels with the steer (its ``protect`` record), where `gss.generate_steered` and ``gss
generate`` read it (`gss.inference.handoff.recommended_gates`).
"""

from __future__ import annotations

import math
from typing import Any

from gss.artifact.stack import Steer
from gss.config import HANDOFF_GATES
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.recital import recited_start
from gss.evaluate.utility import repetition
from gss.protect.config import ProtectConfig, Setting
from gss.protect.general import DATA, ORDINARY, GeneralText
from gss.protect.measure import prompt_and_target
from gss.protect.replies import (
    handed_continuations,
    ordinary_prompts,
    reference_ppl,
    reply_overshoot,
    reproduced,
)
from gss.protect.space import SearchSpace
from gss.protect.split import Split


def handover_rule(
    s: Setting, config: ProtectConfig, split: Split, general: GeneralText, steer: Steer | None
) -> dict[str, Any]:
    """Each rule's share of tuning rows a greedy reply still reproduces (whole, or the window's
    first tokens: `recited_start`), its replies' repeated 4-grams and perplexity under the
    reference (and whether they are within step 7's allowances of the reference's own), the
    share of ordinary prompts (32 tokens) continued as the unsteered fine-tune does, and the
    rule chosen (``gates``); empty where nothing was chosen or ``handoff_unchanged`` is None."""
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
    own = greedy_generate(s.reference, prompts, width, pad_id=s.pad_id, batch_size=s.batch_size)
    yardstick = _replies(s, prompts, own)  # the reference's own replies
    rules: dict[str, dict[str, Any]] = {}
    for name in HANDOFF_GATES:
        gates = steer if name == "steer" else None  # None: at any step
        same = [a == b for a, b in zip(plain, said(gates, ordinary, 32), strict=True)]
        replies = said(gates, prompts, width)
        rep, ppl = _replies(s, prompts, replies)
        rules[name] = {
            "reproduced": reproduced(replies, originals) if prompts else None,
            "recited_start": recited_start(replies, originals, own) if prompts else None,
            "unchanged": sum(same) / len(same) if same else None,
            "repeated_4grams": rep,
            "reference_ppl": ppl,
            "fluent": _fluent((rep, ppl), yardstick, config.search),
        }
    return {
        "gates": choose(rules, goal, config.max_extractable),
        "unchanged_goal": goal,
        "tuning_rows": len(prompts),
        "ordinary_prompts": len(ordinary),
        "reference_repeated_4grams": yardstick[0],
        "reference_ppl": yardstick[1],
        "rules": rules,
    }


def _replies(s: Setting, prompts: list[list[int]], replies: list[list[int]]) -> tuple[float, float]:
    """Replies' repeated 4-grams (%) and perplexity under the reference (NaN: none)."""
    if not prompts:
        return float("nan"), float("nan")
    return repetition(replies), reference_ppl(s.reference, prompts, replies, s.pad_id, s.batch_size)


def _fluent(
    replies: tuple[float, float], yardstick: tuple[float, float], space: SearchSpace
) -> bool | None:
    """Within step 7's allowances of the reference's own replies (None: nothing to judge,
    windows shorter than a 4-gram)."""
    if any(math.isnan(v) for v in (*replies, *yardstick)):
        return None
    return reply_overshoot(replies, yardstick, space) <= 0


LATE_TIE = 10.0
"""Points of `recited_start` within which two rules count as equally late: a row or so of the
15-16 tuning prompts is noise (plain canaries: 2 and 1 of 16 tuning replies, none of either
held out), where the LoRA canaries' gates were late on all 15 and any step on 3."""


def choose(rules: dict[str, dict[str, Any]], goal: float, target: float = 0.0) -> str:
    """The rules meeting both goals (at most ``target`` % of the rows reproduced, at least
    ``goal`` of the ordinary prompts unchanged) first, and among them those whose replies are
    not judged disfluent (``fluent`` False), the fewest reproduced among them, then those whose
    replies open with the window's first tokens (``recited_start``: a late hand-over) at most
    `LATE_TIE` points more often than the fewest, then the most prompts unchanged; where none
    meets both, the fewest errors, a row reproduced and a prompt changed counting alike (in
    points), then the fewest late; then the order of `HANDOFF_GATES` (the gates: the reference
    runs less)."""

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
        pool = [r for r in both if rules[r].get("fluent") is not False] or both
        fewest = min(value(r, "reproduced", 0.0) for r in pool)
        pool = [r for r in pool if value(r, "reproduced", 0.0) == fewest]
        earliest = min(value(r, "recited_start", 0.0) for r in pool)
        pool = [r for r in pool if value(r, "recited_start", 0.0) <= earliest + LATE_TIE]
        return min(pool, key=lambda r: -value(r, "unchanged", 1.0))
    return min(
        present,
        key=lambda r: (
            value(r, "reproduced", 0.0) + 100.0 * (1.0 - value(r, "unchanged", 1.0)),
            value(r, "recited_start", 0.0),
        ),
    )
