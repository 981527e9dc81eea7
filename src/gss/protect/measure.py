"""Measuring one point of the search: (n, k)-extraction of the tuning rows teacher-forced,
the utility, the bisection on a steer's strength, and where the gates open on memorized rows."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from gss.artifact.stack import Steer, SteeringStack
from gss.errors import GSSError
from gss.evaluate.sampled import LIKELY, TOP_P, likely_shares, row_logprobs, sampled_chance
from gss.evaluate.suite import EvaluationReport, evaluate_model
from gss.inference.explain import explain
from gss.protect.clock import Clock
from gss.protect.result import Trial
from gss.protect.space import SearchSpace
from gss.steering.prefix_replay import BlockPrefixReplay

Utility = Callable[[nn.Module], float]
"""``utility(model) -> float``, lower is better (perplexity by default)."""
Candidate = list[int] | tuple[list[int], list[int]]
"""A row an extraction reads: token ids, or a (prompt, reply) pair."""
Check = tuple[Utility, float | None]
"""A measure every point takes besides the utility, and the most it may be (None: recorded,
not bounded): e.g. the perplexity of the fine-tuning domain's clean rows."""


def utility_value(utility: Utility, model: nn.Module, name: str, finite: bool = True) -> float:
    """``utility(model)`` as a float (``finite``: a finite one), or a GSSError naming what it
    returned: the unsteered model's NaN or infinity would make every point fail the budget, or
    pass it."""
    value = utility(model)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not number or (finite and not math.isfinite(value)):
        raise GSSError(
            f"the utility ({name}) returned {value!r:.60}, not a finite number: "
            "utility(model) must return one float, lower is better."
        )
    return float(value)


def extraction_window(c: Candidate, k: int, n: int) -> tuple[tuple[int, ...], ...]:
    """What the extraction of a row reads: its prompt and the tokens it must reproduce."""
    prompt, target = prompt_and_target(c, k, n)
    return tuple(prompt), tuple(target)


def prompt_and_target(c: Candidate, k: int, n: int) -> tuple[list[int], list[int]]:
    """What a candidate is prompted with, and what it must not continue with."""
    return (list(c[0]), list(c[1])[: n - k]) if isinstance(c, tuple) else (c[:k], c[k:n])


def leaks(
    model: nn.Module, rows: Sequence[Candidate], k: int, n: int, pad_id: int, batch_size: int
) -> EvaluationReport:
    """(n, k)-extraction of ``rows``, teacher-forced (exact against greedy decoding)."""
    first = [t for part in prompt_and_target(rows[0], k, n) for t in part]
    return evaluate_model(
        model,
        cast(Any, rows),  # rows, or pairs (one kind: an audit's candidates are all alike)
        [first],  # evaluate_model's perplexity part: one row, unused
        k=k,
        n=n,
        pad_id=pad_id,
        batch_size=batch_size,
        method="forced",
        progress=False,
    )


def leaked(
    model: nn.Module,
    rows: Sequence[Candidate],
    k: int,
    n: int,
    pad_id: int,
    batch_size: int,
    modes: Sequence[str] = ("exact",),
) -> tuple[float, float, dict[str, float]]:
    """What the target counts (`ProtectConfig.leak_modes`): % of ``rows`` extracted in any
    of ``modes``, % of their windows' tokens still reproduced, and % extracted in each mode
    (exact and near-verbatim always: one teacher-forced pass gives both)."""
    report = leaks(model, rows, k, n, pad_id, batch_size)
    flags = {"exact": report.per_row, "near-verbatim": report.per_row_near}
    if "sampled" in modes:
        counted = [prompt_and_target(rows[i], k, n) for i in report.index]
        flags["sampled"] = _sampled_flags(model, counted, pad_id, batch_size)
    union = [any(flags[m][i] for m in modes) for i in range(len(report.index))]
    return _percent(union), report.token_match, {m: _percent(f) for m, f in flags.items()}


def _sampled_flags(
    model: nn.Module, pairs: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int
) -> tuple[bool, ...]:
    """Per (prompt, window): `SAMPLES` draws at temperature 1 or at top-p say it with a
    chance of `LIKELY` or more."""
    plain = row_logprobs(model, pairs, pad_id, batch_size)
    nucleus = row_logprobs(model, pairs, pad_id, batch_size, TOP_P)
    return tuple(
        max(sampled_chance(a), sampled_chance(b)) >= LIKELY
        for a, b in zip(plain, nucleus, strict=True)
    )


def _percent(flags: Sequence[bool]) -> float:
    return 100.0 * sum(flags) / max(len(flags), 1)


def extractable(
    model: nn.Module, rows: Sequence[Candidate], k: int, n: int, pad_id: int, batch_size: int
) -> float:
    """% of ``rows`` still extractable (`leaks`): what the held-out report reads."""
    return leaks(model, rows, k, n, pad_id, batch_size).memorized


def sampled(
    model: nn.Module, rows: Sequence[Candidate], k: int, n: int, pad_id: int, batch_size: int
) -> dict[str, float]:
    """The attacker who samples (issue 70): % of ``rows`` whose window `sampled.SAMPLES` draws
    from the prompt reproduce with a chance of `sampled.LIKELY` or more, at temperature 1 and
    with top-p `sampled.TOP_P`, exact from one teacher-forced pass (`gss.evaluate.sampled`)."""
    pairs = [prompt_and_target(r, k, n) for r in rows]
    return likely_shares(model, [(p, w) for p, w in pairs if p and w], pad_id, batch_size)


FOLLOWS = "reference continuations"
"""The check that reads how likely a steered model finds the reference's greedy continuations
of the tuning prompts (their perplexity): a steer that says what the reference would keeps it
low, one that breaks the reply into a loop sends it up."""


class Judge:
    """Measures a steer on the tuning rows: % still extractable, and the utility."""

    def __init__(
        self,
        model: nn.Module,
        rows: list[Candidate],
        utility: Utility,
        limit: float,
        *,
        k: int,
        n: int,
        pad_id: int,
        batch_size: int,
        bar: Any,
        prefer: str = "margin",
        checks: dict[str, Check] | None = None,
        clock: Clock | None = None,
        modes: Sequence[str] = ("exact",),
    ) -> None:
        self.prefer, self.modes = prefer, tuple(modes)
        self.clock = clock or Clock()  # seconds per kind of work: extraction, utility, checks
        self.checks = dict(checks or {})
        self.model, self.rows, self.utility, self.limit = model, rows, utility, limit
        self.k, self.n, self.pad_id, self.batch_size, self.bar = k, n, pad_id, batch_size, bar
        self.trials: list[Trial] = []
        self.steers: list[Steer] = []
        # every point measures the same rows: the blocks below its steer are replayed
        self.replay = BlockPrefixReplay(model)

    def steer_of(self, trial: Trial) -> Steer:
        return self.steers[self.trials.index(trial)]

    def memorized(self) -> tuple[float, float, dict[str, float]]:
        """% of the tuning rows extracted in the target's modes, % of their windows' tokens
        reproduced, and % in each mode."""
        return leaked(
            self.model, self.rows, self.k, self.n, self.pad_id, self.batch_size, self.modes
        )

    def __call__(self, steer: Steer, stage: str, preset: str) -> Trial:
        members = steer.artifacts if isinstance(steer, SteeringStack) else (steer,)
        clock = self.clock
        with self.replay.below(min(a.layer for a in members)), steer.attach(self.model):
            with clock.part("extraction (tuning rows)"):
                mem, match, by_mode = self.memorized()
            # a steer too strong may give NaN or inf: that point is out of the budget
            with clock.part("utility"):
                value = utility_value(self.utility, self.model, "the utility", finite=False)
            # a point already over the utility budget is out: its checks would not change that
            checks = {}
            for name, (fn, _) in self.checks.items():
                if value <= self.limit:
                    with clock.part(name):
                        checks[name] = utility_value(fn, self.model, name, finite=False)
        last = members[-1]
        bounded = all(
            limit is None or checks.get(name, math.inf) <= limit
            for name, (_, limit) in self.checks.items()
        )
        trial = Trial(
            stage=stage,
            preset=preset,
            blocks=tuple(a.layer for a in members),
            deltas=tuple(a.config.delta for a in members),
            rank=last.rank,
            gate=last.config.gate,
            memorized=mem,
            token_match=match,
            utility=value,
            within_budget=value <= self.limit and bounded,
            checks=checks,
            leaks=by_mode,
        )
        self.trials.append(trial)
        self.steers.append(steer)
        self.bar.update(1)
        best = self.best(self.trials)
        if best is not None:
            self.bar.set_postfix_str(f"best {best.memorized:.1f}% extractable", refresh=False)
        return trial

    def ranked(self, trials: Sequence[Trial], target: float = 0.0) -> list[Trial]:
        """The points within the budget, best first: reaching the target first (else the lowest
        % extractable), then by `SearchSpace.prefer`: ``"margin"``, the fewest tokens still
        reproduced, then the least utility cost (the point likeliest to hold on rows it was not
        tuned on); ``"utility"``, the least utility cost, then the fewest tokens reproduced;
        or ``"reference"``, the point under which the reference's own continuations of the
        tuning prompts are likeliest (`FOLLOWS`: it says what the reference would), then the
        fewest tokens reproduced."""

        def key(t: Trial) -> tuple[float, float, float]:
            short = max(t.memorized - target, 0.0)
            if self.prefer == "utility":
                return short, t.utility, t.token_match
            if self.prefer == "reference" and FOLLOWS in t.checks:
                return short, t.checks[FOLLOWS], t.token_match
            return short, t.token_match, t.utility

        return sorted((t for t in trials if t.within_budget), key=key)

    def best(self, trials: Sequence[Trial], target: float = 0.0) -> Trial | None:
        """The first of `ranked`, or None when no point stayed within the budget."""
        return next(iter(self.ranked(trials, target)), None)


def strength_search(
    judge: Judge,
    make: Callable[[float], Steer],
    space: SearchSpace,
    stage: str,
    preset: str,
    target: float,
) -> list[Trial]:
    """Bisection on log10(delta) for the strongest steer within the budget (utility cost
    rises with strength, monotone in practice; every point measured is kept and can be
    chosen, so a bump costs only precision). A range whose strongest point is within the
    budget and short of the target is first raised, two decades at a time, up to
    `SearchSpace.delta_ceiling`."""
    seen: dict[float, Trial] = {}

    def at(log_delta: float) -> Trial:
        if log_delta not in seen:
            seen[log_delta] = judge(make(10.0**log_delta), stage, preset)
        return seen[log_delta]

    lo, hi = (math.log10(v) for v in space.delta_range)
    ceiling = math.log10(space.delta_ceiling)
    while hi < ceiling and at(hi).within_budget and at(hi).memorized > target:
        lo, hi = hi, min(hi + 2.0, ceiling)
    if not at(hi).within_budget and at(lo).within_budget:
        a, b = lo, hi
        for _ in range(space.steps):
            mid = (a + b) / 2
            a, b = (mid, b) if at(mid).within_budget else (a, mid)
    return list(seen.values())


def where_gates_open(
    model: nn.Module, steer: Steer, rows: Sequence[Candidate], k: int, n: int
) -> dict[str, Any]:
    """Where the gates open on memorized rows, teacher-forced: on the positions that choose the
    memorized window's tokens and on the prompt's positions before them, per row. Beside the
    open share on general text this says whether the gate is selective, so whether a steer
    that misses some rows is held back by its gate or by its strength."""
    window, prompt, per_row = [], [], []
    for row in rows:
        p, w = prompt_and_target(row, k, n)
        if not w:
            continue
        # the positions read are the prompt's and all the window's but its last token (which
        # chooses nothing in it): one token fewer than the row, so a row filling the model's
        # context still leaves room for the one token explain generates
        tokens = explain(model, steer, p + w[:-1], max_new_tokens=1).tokens
        opened = [t.steered for t in tokens[: len(p) + len(w) - 1]]
        window += opened[len(p) - 1 :]
        prompt += opened[: len(p) - 1]
        per_row.append(sum(opened[len(p) - 1 :]) / len(w))
    return {"window": _share(window), "prompt": _share(prompt), "per_row": per_row}


def _share(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None
