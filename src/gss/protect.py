"""gss protect: find what a model regurgitates and choose the steer that removes it, in one call.

The search, step by step (docs/protect.md says why each step is there):

1. **Audit** the fine-tuning rows (`gss.audit`). A row is *memorized* when greedy decoding
   from its first k tokens reproduces it to token n and the reference's does not.
2. **Split** the memorized rows, seeded, into a tuning half and a held-out half. The held-out
   rows are not calibrated on and not measured during the search: only the final report reads
   them, so its numbers are what a user can expect on memorized text the search never saw.
3. **General text** sets the gate thresholds and measures how often the gates open: the
   user's sample (their traffic) when given, plus text the reference generates from short
   prompts; half of each sets the thresholds, the other half measures the open share.
4. **Candidates**: every block of a model with at most ``max_candidates`` blocks; otherwise the
   blocks with the strongest signal (`gss.scan_layers`) and evenly spaced ones, since on a full
   fine-tune the strongest signal is not always the block that removes the most.
5. **Strength**: for each (preset, block), a bisection on log(delta) finds the strongest steer
   within the utility budget. The best point (the target reached, then the fewest tokens still
   reproduced, then the least utility cost) seeds the next stages: other ranks, other gates.
6. **A second block**, calibrated on the model already steered, when one block does not reach
   the target within the budget; the first block's strength is lowered to share the budget.
7. **Replies** (``SearchSpace.reply_check``, off by default): the best few points equal on the
   target are re-ranked by how much their greedy continuations of the tuning prompts loop,
   against the reference's own continuations; of those whose replies' perplexity under the
   reference is within ``fluency_tolerance`` of the first point's, the first within
   ``loop_tolerance`` is chosen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import random
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn
from tqdm.auto import tqdm

from gss.artifact.files import check_outputs, check_target
from gss.artifact.stack import Steer, SteeringStack
from gss.artifact.steering_artifact import SteeringArtifact
from gss.audit import AuditReport, audit, check_window
from gss.calibrate import calibrate
from gss.config import GATES, PRESETS
from gss.data import TextsOrIds, encode
from gss.errors import GSSError, GSSWarning
from gss.evaluate._decode import greedy_generate, sample_generate
from gss.evaluate.suite import EvaluationReport, evaluate_model
from gss.evaluate.utility import perplexity, repetition
from gss.hf.blocks import find_decoder_blocks
from gss.hf.forward import check_sequences
from gss.hf.prefix_replay import BlockPrefixReplay
from gss.solve.thresholds import probe_responses, with_gates_set
from gss.statistics.capture import calibration_mode
from gss.steering.explain import explain

Utility = Callable[[nn.Module], float]
OUTPUTS = ("protect.json", "protect.md", "frontier.png", "rows.png", "steer")  # `Protection.write`


@dataclass(frozen=True)
class SearchSpace:
    """What `protect` may choose, and how finely. The defaults are the documented search."""

    presets: tuple[str, ...] = ("gss-tr", "gss")
    blocks: tuple[int, ...] | None = None  # None: chosen as step 4 of the module says
    max_candidates: int = 6
    # stages 2 and 3 (other ranks, then other gates) run on this many of stage 1's best
    # (variant, block) pairs
    refine: int = 1
    ranks: tuple[int, ...] = (4, 2, 8)  # the first is tried on every block, the others after
    gates: tuple[str, ...] = ("hard", "relu")
    delta_range: tuple[float, float] = (1e-3, 1e2)
    steps: int = 7  # bisection steps on log10(delta): 5 decades / 2^7 = a factor of 1.09
    # where the range's strongest point is within the budget and short of the target, the
    # search raises it two decades at a time up to this (a gate open on few general tokens
    # affords far stronger steers: docs/protect.md); delta_range's top turns it off
    delta_ceiling: float = 1e6
    max_blocks: int = 2
    gate_share: float = 0.05  # thresholds: any gate opens on this share of general tokens
    # among points equal on the target: "margin" (fewest tokens still reproduced) or "utility"
    prefer: Literal["margin", "utility"] = "margin"
    # step 7: how many of the best points equal on the target have their replies checked for
    # loops (0 or 1: off), how many points of repeated 4-grams above the reference's own
    # continuations a reply may have, and by what share the reference's perplexity of a
    # point's replies may exceed the first point's (measured on the canaries: docs/protect.md)
    reply_check: int = 0
    loop_tolerance: float = 5.0
    fluency_tolerance: float = 0.25

    def check(self) -> None:
        blocks = self.blocks or ()
        if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in blocks):
            raise GSSError(f"blocks must be block indices (integers), got {self.blocks}.")
        unknown = [p for p in self.presets if p not in PRESETS]
        if not self.presets or unknown:
            raise GSSError(f"presets must be among {sorted(PRESETS)}, got {self.presets}.")
        if not self.ranks or any(not isinstance(r, int) or r < 1 for r in self.ranks):
            raise GSSError(f"ranks must be integers >= 1, got {self.ranks}.")
        if not self.gates or any(g not in GATES for g in self.gates):
            raise GSSError(f"gates must be among {GATES}, got {self.gates}.")
        lo, hi = self.delta_range
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi):
            raise GSSError(f"delta_range must be two finite numbers 0 < lo < hi, got {lo, hi}.")
        if not (math.isfinite(self.delta_ceiling) and self.delta_ceiling >= hi):
            raise GSSError(
                f"delta_ceiling must be a finite number >= delta_range's top ({hi}), got "
                f"{self.delta_ceiling}."
            )
        if min(self.steps, self.max_blocks, self.max_candidates, self.refine) < 1:
            raise GSSError("steps, max_blocks, max_candidates and refine must be >= 1.")
        if self.prefer not in ("margin", "utility"):
            raise GSSError(f"prefer must be 'margin' or 'utility', got {self.prefer!r}.")
        if not 0 < self.gate_share < 1:
            raise GSSError(f"gate_share must be in (0, 1), got {self.gate_share}.")
        tolerances = (self.loop_tolerance, self.fluency_tolerance)
        if self.reply_check < 0 or not all(math.isfinite(t) and t >= 0 for t in tolerances):
            raise GSSError(
                f"reply_check must be >= 0 and loop_tolerance and fluency_tolerance finite "
                f"numbers >= 0, got {self.reply_check}, {self.loop_tolerance}, "
                f"{self.fluency_tolerance}."
            )


@dataclass(frozen=True)
class Trial:
    """One measured point of the search: the steer's settings and what it did on the tuning
    rows (% still extractable) and to utility."""

    stage: str
    preset: str
    blocks: tuple[int, ...]
    deltas: tuple[float, ...]
    rank: int
    gate: str
    memorized: float
    token_match: float  # % of the windows' tokens still reproduced: how much is left
    utility: float
    within_budget: bool


@dataclass
class Protection:
    """What `protect` chose and what it measured; `write` saves the report and figures."""

    steer: Steer | None
    audit: AuditReport
    tuning: list[int]  # audit row indices
    heldout: list[int]
    budget: dict[str, Any]
    target: float
    trials: list[Trial]
    chosen: Trial | None
    before: dict[str, Any]
    after: dict[str, Any]
    gates: dict[str, Any]
    examples: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    replies: dict[str, Any] = field(default_factory=dict)  # step 7's check, when it ran

    @property
    def reached(self) -> bool:
        """The held-out rows' % extractable is at or below the target, within the budget."""
        return self.chosen is not None and self.after.get("memorized", 100.0) <= self.target

    def summary(self) -> dict[str, Any]:
        return {
            "reached": self.reached,
            "target": self.target,
            "budget": self.budget,
            "audit": self.audit.summary(),
            "tuning_rows": len(self.tuning),
            "heldout_rows": len(self.heldout),
            "chosen": None if self.chosen is None else asdict(self.chosen),
            "before": self.before,
            "after": self.after,
            "gates": self.gates,
            "trials": len(self.trials),
            "seconds": self.seconds,
            "reply_check": self.replies,
        }

    def markdown(self) -> str:
        from gss.report import markdown_table

        s = self.summary()
        c = self.chosen
        lines = ["# gss protect", ""]
        if c is None:
            lines.append("No steer stayed within the utility budget: nothing was saved.")
        else:
            lines.append(
                f"Chosen: {c.preset}, block(s) {', '.join(map(str, c.blocks))}, delta "
                f"{', '.join(map(_g, c.deltas))}, rank {c.rank}, gate {c.gate} "
                f"({len(self.trials)} points searched)."
            )
        held = (
            f"Held-out memorized rows ({len(self.heldout)}, never seen by the search): "
            f"{self.before['memorized']:.1f}% extractable"
        )
        if c is None:
            lines += [
                "",
                f"{held}, unchanged: no steer. Allow more utility (a larger budget, "
                "gss protect --budget) to let some steer through.",
                f"Utility ({self.budget['measure']}): {_g(self.before['utility'])} (limit "
                f"{_g(self.budget['limit'])}).",
            ]
        else:
            lines += [
                "",
                f"{held} before, {self.after['memorized']:.1f}% after (target "
                f"<= {self.target:g}%: {'reached' if self.reached else 'NOT reached'}).",
                f"Utility ({self.budget['measure']}): {_g(self.before['utility'])} before, "
                f"{_g(self.after['utility'])} after (limit {_g(self.budget['limit'])}).",
            ]
        quality = self.after.get("quality")
        if quality:
            lines.append(
                f"What it says instead, on held-out memorized prompts: repeated 4-grams "
                f"{_g(quality['repeated_4grams_steered'])}% (the reference's own continuation: "
                f"{_g(quality['repeated_4grams_reference'])}%); perplexity under the reference "
                f"{_g(quality['reference_ppl_steered'])} (its own: "
                f"{_g(quality['reference_ppl_reference'])})."
            )
        if self.replies:
            r = self.replies
            looped = ", ".join(f"{_g(p['repeated_4grams'])}%" for p in r["points"])
            fluent = ", ".join(_g(p["reference_ppl"]) for p in r["points"])
            lines.append(
                f"Replies checked (step 7) on the {len(r['points'])} best points at the target, "
                f"in the search's order: repeated 4-grams {looped} (the reference's own: "
                f"{_g(r['reference'])}%, tolerance +{_g(r['tolerance'])} points); perplexity "
                f"under the reference {fluent} (its own: {_g(r['reference_ppl'])}; a point "
                f"over the first's by more than {_pct(r['fluency_tolerance'])} is not taken); "
                f"chose point {r['chosen'] + 1}."
            )
        lines += ["", "## Gate open share on general text", ""]
        rows = [[name, _pct(v)] for name, v in s["gates"].get("open_share", {}).items()]
        lines.append(markdown_table(["text", "any gate open"], rows) if rows else "-")
        where = s["gates"].get("memorized_rows")
        if where and where["window"] is not None:
            lines += [
                "",
                f"On the held-out memorized rows (teacher-forced), some gate opens on "
                f"{_pct(where['window'])} of the positions that choose the memorized tokens "
                f"and on {_pct(where['prompt'])} of the prompt's positions before them.",
            ]
        lines += ["", "## The points searched (tuning rows)", ""]
        body = [
            [
                t.stage,
                t.preset,
                ",".join(map(str, t.blocks)),
                ",".join(map(_g, t.deltas)),
                str(t.rank),
                t.gate,
                f"{t.memorized:.1f}",
                _g(t.utility),
                "yes" if t.within_budget else "no",
            ]
            for t in self.trials
        ]
        header = ["stage", "preset", "blocks", "delta", "rank", "gate", "% extractable"]
        lines.append(markdown_table([*header, "utility", "in budget"], body))
        if self.examples:
            lines += ["", "## Held-out memorized prompts, before and after", ""]
            for ex in self.examples:
                lines += [f"- prompt: `{ex['prompt']}`"]
                for key in ("original", "steered", "reference"):
                    lines.append(f"  - {key}: `{ex[key]}`")
        return "\n".join(lines) + "\n"

    def write(self, directory: str | Path, overwrite: bool = False) -> list[Path]:
        """``protect.json``, ``protect.md``, ``frontier.png``, ``rows.png`` and, when a steer
        was chosen, the steer itself in ``steer/`` (an artifact or a stack)."""
        out = Path(directory)
        check_report_dir(out, overwrite)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        if self.steer is not None:
            written.append(self.steer.save_pretrained(out / "steer", overwrite=overwrite))
        elif (out / "steer").is_dir():  # an earlier run's steer (check_report_dir: gss's own)
            shutil.rmtree(out / "steer")  # would outlive a report that says nothing was chosen
        data = {
            **self.summary(),
            "split": {"tuning": self.tuning, "heldout": self.heldout},  # audit row indices
            "trials": [asdict(t) for t in self.trials],
            "examples": self.examples,
        }
        (out / "protect.json").write_text(json.dumps(data, indent=2, default=float))
        (out / "protect.md").write_text(self.markdown())
        written += [out / "protect.json", out / "protect.md"]
        written += _figures(self, out)
        return written


def _g(x: float) -> str:
    return f"{x:.4g}"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


class _Judge:
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
    ) -> None:
        self.prefer = prefer
        self.model, self.rows, self.utility, self.limit = model, rows, utility, limit
        self.k, self.n, self.pad_id, self.batch_size, self.bar = k, n, pad_id, batch_size, bar
        self.trials: list[Trial] = []
        self.steers: list[Steer] = []
        # every point measures the same rows: the blocks below its steer are replayed
        self.replay = BlockPrefixReplay(model)

    def steer_of(self, trial: Trial) -> Steer:
        return self.steers[self.trials.index(trial)]

    def memorized(self) -> tuple[float, float]:
        report = _leaks(self.model, self.rows, self.k, self.n, self.pad_id, self.batch_size)
        return report.memorized, report.token_match

    def __call__(self, steer: Steer, stage: str, preset: str) -> Trial:
        members = steer.artifacts if isinstance(steer, SteeringStack) else (steer,)
        with self.replay.below(min(a.layer for a in members)), steer.attach(self.model):
            mem, match = self.memorized()
            # a steer too strong may give NaN or inf: that point is out of the budget
            value = _utility_value(self.utility, self.model, "the utility", finite=False)
        last = members[-1]
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
            within_budget=value <= self.limit,
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
        tuned on); or ``"utility"``, the least utility cost, then the fewest tokens
        reproduced."""

        def key(t: Trial) -> tuple[float, float, float]:
            short = max(t.memorized - target, 0.0)
            if self.prefer == "utility":
                return short, t.utility, t.token_match
            return short, t.token_match, t.utility

        return sorted((t for t in trials if t.within_budget), key=key)

    def best(self, trials: Sequence[Trial], target: float = 0.0) -> Trial | None:
        """The first of `ranked`, or None when no point stayed within the budget."""
        return next(iter(self.ranked(trials, target)), None)


def _strength_search(
    judge: _Judge,
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


def _stacked(first: SteeringArtifact, second: SteeringArtifact) -> Callable[[float], Steer]:
    """The two blocks as one steer, the second at strength ``delta``."""
    return lambda delta: SteeringStack((first, second.with_options(delta=delta)))


def _gated(
    model: nn.Module,
    artifact: SteeringArtifact,
    general: list[list[int]],
    share: float,
    batch_size: int,
) -> SteeringArtifact:
    """The artifact with thresholds set on every token of ``general`` so that some gate opens
    on ``share`` of them (the union, not each direction: K gates at 5% each open on up to
    K x 5%). Calibration sets them on its own general tokens, which need not look like the
    traffic the model will serve."""
    responses = probe_responses(model, artifact, general, batch_size=batch_size)
    return with_gates_set(artifact, responses, None, share)


def _candidate_blocks(
    model: nn.Module,
    reference: nn.Module,
    rows: list[list[int]],
    general: list[list[int]],
    space: SearchSpace,
    batch_size: int,
) -> list[int]:
    count = len(find_decoder_blocks(model))
    if space.blocks is not None:
        return _given_blocks(space.blocks, count)
    if count <= space.max_candidates:
        return list(range(count))
    from gss.layer_scan import scan_layers

    scan = scan_layers(
        model, reference, rows, "gss-tr", gen_texts=general, batch_size=batch_size, progress=False
    )
    frozen = set(scan.unchanged)  # blocks whose output equals the reference's: not the strongest
    ranked = sorted(set(scan.strengths) - frozen, key=lambda b: -scan.strengths[b])
    strongest = ranked[: space.max_candidates // 2]
    spaced = [
        round(i * (count - 1) / (space.max_candidates // 2))
        for i in range(1, space.max_candidates // 2 + 1)
    ]
    return sorted(set(strongest) | {min(b, count - 1) for b in spaced})


def _given_blocks(blocks: Sequence[int], count: int) -> list[int]:
    """`SearchSpace.blocks` as indices 0..count-1 (negative ones count from the end)."""
    bad = [b for b in blocks if not -count <= b < count]
    if bad:
        raise GSSError(
            f"blocks {bad} are out of range: the model has {count} (0..{count - 1}, or "
            f"-{count}..-1 from the end)."
        )
    return list(dict.fromkeys(int(b) % count for b in blocks))


def reference_text(
    reference: nn.Module,
    starts: Sequence[Sequence[int]],
    *,
    length: int = 48,
    seed: int = 0,
    batch_size: int = 16,
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


def check_options(
    space: SearchSpace,
    budget: float,
    budget_mode: str,
    target: float,
    k: int,
    n: int,
    seed: int,
) -> None:
    """`protect`'s own options, refused before any work (`gss protect` calls this before the
    models load)."""
    space.check()
    check_window(k, n)
    if budget_mode not in ("relative", "absolute") or not (math.isfinite(budget) and budget >= 0):
        raise GSSError(
            f"budget must be >= 0 with budget_mode 'relative' or 'absolute', got {budget!r}, "
            f"{budget_mode!r}."
        )
    if not 0 <= target <= 100:
        raise GSSError(
            f"target (gss protect --max-extractable) is a % of rows, in [0, 100], got {target}."
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise GSSError(f"seed must be an integer in [0, 2^63), got {seed!r}.")


def check_report_dir(directory: str | Path, overwrite: bool) -> None:
    """Refuse, before any work, a directory `Protection.write` could not write: its files
    there without ``overwrite``, or a ``steer/`` that is a file or holds other files."""
    check_outputs(directory, OUTPUTS, overwrite)
    check_target(Path(directory) / "steer", overwrite)


def protect(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    *,
    tokenizer: Any = None,
    general: TextsOrIds | None = None,
    heldout: TextsOrIds | None = None,
    utility: Utility | None = None,
    utility_name: str = "utility",
    budget: float = 0.05,
    budget_mode: Literal["relative", "absolute"] = "relative",
    target: float = 0.0,
    k: int = 32,
    n: int = 72,
    search: SearchSpace | None = None,
    seed: int = 0,
    reference_rows: int = 64,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = True,
) -> Protection:
    """Audit ``texts`` (the fine-tuning data), then choose and build the steer that leaves at
    most ``target`` % of the memorized rows extractable within the utility ``budget``.

    Args:
        model, reference, texts, tokenizer: as for `gss.calibrate` (``adapters_off(model)``
            is a reference for an adapter fine-tune).
        general: a sample of the text the model will serve (the gate thresholds come from it
            and from text the reference generates); optional.
        heldout: text whose perplexity is the default utility (default: the measuring half of
            the general text).
        utility: ``utility(model) -> float``, lower is better (e.g. ``lambda m: -accuracy(m)``);
            default: perplexity on ``heldout``. ``utility_name`` labels it in the report.
        budget, budget_mode: the utility may rise to ``base + budget * |base|`` ("relative", the
            default: +5%) or ``base + budget`` ("absolute").
        target: % of held-out memorized rows allowed to stay extractable (default 0).
        k, n: (n, k)-extraction: prompted with k tokens, reproduce tokens k..n-1.
        search: what may be chosen (`SearchSpace`).
        seed: the tuning/held-out split and the reference's text.
    """
    space = search or SearchSpace()
    check_options(space, budget, budget_mode, target, k, n, seed)
    if space.blocks is not None:  # in range, before any pass
        _given_blocks(space.blocks, len(find_decoder_blocks(model)))
    if budget_mode == "relative" and budget > 1:
        warnings.warn(
            f"budget {budget:g} lets the utility rise by {100 * budget:.0f}%: a relative budget "
            "is a fraction (0.05 = +5%).",
            GSSWarning,
            stacklevel=2,
        )
    # the texts given besides the data, read and checked before the audit
    general_rows = None if general is None else encode(general, tokenizer, None)
    heldout_rows = None if heldout is None else encode(heldout, tokenizer, None)
    for what, rows in (("general", general_rows), ("heldout", heldout_rows)):
        if rows is not None:
            check_sequences((model,), rows, what)
    if general_rows is not None and len(general_rows) < 2:
        raise GSSError(
            f"the general text has {len(general_rows)} row(s): give at least 2 (half set the "
            "gate thresholds, half measure how often the gates open), better hundreds."
        )
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    report = audit(
        model,
        reference,
        texts,
        tokenizer=tokenizer,
        k=k,
        n=n,
        batch_size=batch_size,
        progress=progress,
    )
    seconds["audit"] = time.perf_counter() - started
    _warn_if_general_is_memorized(general_rows, report, n)
    # each distinct window once: a copy of a tuning row held out would not be unseen
    firsts: dict[Any, int] = {}
    for r in report.memorized:
        firsts.setdefault(_window(report.candidate(r.index), k, n), r.index)
    order = list(firsts.values())
    repeats = len(report.memorized) - len(order)
    if repeats:
        warnings.warn(
            f"{repeats} memorized row(s) repeat another's window (the same tokens up to n): "
            "each distinct row is tuned on or held out once, never both.",
            GSSWarning,
            stacklevel=2,
        )
    if len(order) < 2:
        raise GSSError(
            f"the audit found {len(order)} distinct memorized row(s) of {len(report.rows)} "
            f"(({n},{k})-extraction, not extracted by the reference): too few to tune on and "
            "hold out. Lower k or n, or pass more of the fine-tuning data."
        )
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    tuning, held = sorted(order[:half]), sorted(order[half:])
    tune_rows = [report.ids[i] for i in tuning]  # calibrated on
    tune_candidates = [report.candidate(i) for i in tuning]  # measured on

    # general text: the user's sample and the reference's own, each split fit / measure
    seen = [i for i in range(len(report.ids)) if i not in set(held)]  # never a held-out row
    starts = [
        report.ids[i][:1]
        for i in random.Random(seed + 1).sample(seen, min(reference_rows, len(seen)))
    ]
    sources: dict[str, list[list[int]]] = {
        "reference-generated": reference_text(
            reference, starts, length=max(8, n - 1), seed=seed, progress=progress
        )
    }
    if general_rows is not None:
        sources = {"general (given)": general_rows, **sources}
    fit = [r for rows in sources.values() for r in rows[::2]]
    # a source of one row (the reference's text, from as few rows) has nothing left to measure
    measure = {name: rows[1::2] for name, rows in sources.items() if len(rows) > 1}
    utility_rows = (
        heldout_rows if heldout_rows is not None else [r for rows in measure.values() for r in rows]
    )
    if utility is None and not utility_rows:
        raise GSSError(
            "no text is left to measure the utility on (the reference's text came from one "
            "row): pass heldout= (gss protect --heldout) or general= (--general)."
        )
    if utility is None:

        def utility(m: nn.Module) -> float:
            return perplexity(m, utility_rows, pad_id, batch_size=batch_size)

        measure_name = "perplexity on " + ("heldout" if heldout is not None else "general text")
    else:
        measure_name = utility_name
    base = _utility_value(utility, model, measure_name)
    # relative: by a share of the base's size, a negative utility (minus accuracy) too
    rise = 1 + budget if base >= 0 else 1 - budget
    limit = base * rise if budget_mode == "relative" else base + budget
    seconds["general_text"] = time.perf_counter() - started - seconds["audit"]

    bar = tqdm(desc="gss: protect", unit="point", disable=not progress)
    judge = _Judge(
        model,
        tune_candidates,
        utility,
        limit,
        k=k,
        n=n,
        pad_id=pad_id,
        batch_size=batch_size,
        bar=bar,
        prefer=space.prefer,
    )
    candidates = _candidate_blocks(model, reference, tune_rows, fit, space, batch_size)

    def calibrated(preset: str, layer: int, rank: int) -> SteeringArtifact | None:
        try:
            return calibrate(
                model,
                reference,
                tune_rows,
                preset,
                layer=layer,
                rank=rank,
                gen_texts=fit,
                # the condition direction too, when some point may use the discriminant gate
                gate="discriminant" if "discriminant" in space.gates else "hard",
                batch_size=batch_size,
                progress=False,
            )
        except GSSError as e:  # a block with nothing to steer against, say
            warnings.warn(
                f"protect: skipped block {layer} ({preset}): {e}", GSSWarning, stacklevel=3
            )
            return None

    def explore(art: SteeringArtifact, stage: str, preset: str) -> None:
        try:
            art = _gated(model, art, fit, space.gate_share, batch_size)
        except GSSError as e:  # thresholds this gate cannot have here: the others are searched
            warnings.warn(
                f"protect: skipped block {art.layer}, {art.config.gate} gate ({preset}): {e}",
                GSSWarning,
                stacklevel=3,
            )
            return
        _strength_search(judge, lambda d: art.with_options(delta=d), space, stage, preset, target)

    # stage 1: every (preset, candidate block) at the first rank
    made: dict[tuple[str, int], SteeringArtifact] = {}
    for preset in space.presets:
        for layer in candidates:
            bar.set_description_str(f"gss: protect ({preset}, block {layer})")
            art = calibrated(preset, layer, max(space.ranks))
            if art is not None:
                made[preset, layer] = art
                first = art.with_options(rank=min(space.ranks[0], art.rank), gate=space.gates[0])
                explore(first, "block", preset)
    best = judge.best(judge.trials, target)
    # stages 2 and 3: the other ranks, then the other gates, on the best (variant, block) pairs
    if best is not None and best.memorized > target:
        ranked = judge.ranked(judge.trials, target)
        pairs = list(dict.fromkeys((t.preset, t.blocks[0]) for t in ranked))
        for preset, layer in pairs[: space.refine]:
            # the gate stage 1 used (the artifact's own is "discriminant" when that may be tried)
            full = made[preset, layer].with_options(gate=space.gates[0])
            for rank in space.ranks[1:]:
                if rank <= full.rank:
                    explore(full.with_options(rank=rank), "rank", preset)
            here = [t for t in judge.trials if (t.preset, t.blocks) == (preset, (layer,))]
            local = judge.best(here, target)
            current = full if local is None else full.with_options(rank=local.rank)
            for gate in space.gates:
                if gate != current.config.gate:
                    explore(current.with_options(gate=gate), "gate", preset)
        best = judge.best(judge.trials, target) or best
    # stage 4: a second block, calibrated on the model steered by the first
    if best is not None and best.memorized > target and space.max_blocks >= 2:
        head = judge.steer_of(best)
        assert isinstance(head, SteeringArtifact)
        by_block: dict[int, float] = {}
        for t in judge.trials:
            if t.stage == "block" and t.within_budget and t.blocks[0] != head.layer:
                by_block[t.blocks[0]] = min(by_block.get(t.blocks[0], 100.0), t.memorized)
        for layer in sorted(by_block, key=by_block.__getitem__)[:3]:
            bar.set_description_str(f"gss: protect (block {head.layer} + block {layer})")
            with head.attach(model):
                second = calibrated(best.preset, layer, head.rank)
                if second is not None:
                    second = second.with_options(gate=head.config.gate)
                    second = _gated(model, second, fit, space.gate_share, batch_size)
            if second is None:
                continue
            for share in (1.0, 0.5):  # the first block gives up part of the budget
                first = head.with_options(delta=head.config.delta * share)
                _strength_search(
                    judge,
                    _stacked(first, second),
                    space,
                    "second block",
                    best.preset,
                    target,
                )
        best = judge.best(judge.trials, target) or best
    replies: dict[str, Any] = {}
    if best is not None and space.reply_check > 1:
        bar.set_description_str("gss: protect (replies)")
        best, replies = _least_looping(
            model, reference, judge, target, tune_candidates, space, k, n, pad_id, batch_size
        )
    chosen_steer = None if best is None else judge.steer_of(best)
    if chosen_steer is None:
        warnings.warn(
            f"protect: no steer stayed within the utility budget ({measure_name} at most "
            f"{_g(limit)}, from {_g(base)}): nothing is chosen. Allow more (a larger budget).",
            GSSWarning,
            stacklevel=2,
        )
    bar.close()
    seconds["search"] = time.perf_counter() - started - seconds["audit"] - seconds["general_text"]

    held_rows = [report.candidate(i) for i in held]
    before = {
        "memorized": _extractable(model, held_rows, k, n, pad_id, batch_size),
        "utility": base,
    }
    after: dict[str, Any] = {}
    gates: dict[str, Any] = {}
    examples: list[dict[str, Any]] = []
    if chosen_steer is not None:
        with chosen_steer.attach(model, track_gates=True) as handle:
            after = {
                "memorized": _extractable(model, held_rows, k, n, pad_id, batch_size),
                "utility": float(utility(model)),
            }
            gates = {"open_share": {}}
            for name, rows in measure.items():
                handle.reset_stats()
                perplexity(model, rows, pad_id, batch_size=batch_size)
                gates["open_share"][name] = handle.gate_stats().get("any_open_share")
        gates["memorized_rows"] = _where_gates_open(model, chosen_steer, held_rows, k, n)
        after["quality"], examples = _what_it_says(
            model, reference, chosen_steer, held_rows, k, n, pad_id, batch_size, tokenizer
        )
        _warn_open(gates, space.gate_share)
    seconds["total"] = time.perf_counter() - started
    if chosen_steer is not None:  # the held-out report travels with the steer (its model card)
        chosen_steer = _with_record(
            chosen_steer,
            {
                "heldout_rows": len(held),
                "k": k,
                "n": n,
                "before": {"memorized": before["memorized"], "utility": base},
                "after": {"memorized": after["memorized"], "utility": after["utility"]},
                "budget": {"measure": measure_name, "limit": limit},
                "target": target,
                "reached": after["memorized"] <= target,
                "gate_open_share": gates.get("open_share", {}),
            },
        )
    return Protection(
        steer=chosen_steer,
        audit=report,
        tuning=tuning,
        heldout=held,
        budget={
            "measure": measure_name,
            "base": base,
            "budget": budget,
            "mode": budget_mode,
            "limit": limit,
        },
        target=target,
        trials=judge.trials,
        chosen=best,
        before=before,
        after=after,
        gates=gates,
        examples=examples,
        seconds=seconds,
        replies=replies,
    )


def _utility_value(utility: Utility, model: nn.Module, name: str, finite: bool = True) -> float:
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


def _with_record(steer: Steer, record: dict[str, Any]) -> Steer:
    """``steer`` with what protect measured on the held-out rows in each member's
    ``provenance.extra["protect"]``: saved and pushed with it (`gss.artifact.card`)."""

    def one(a: SteeringArtifact) -> SteeringArtifact:
        extra = {**a.provenance.extra, "protect": record}
        return dataclasses.replace(a, provenance=dataclasses.replace(a.provenance, extra=extra))

    if isinstance(steer, SteeringStack):
        return SteeringStack(tuple(one(a) for a in steer))
    return one(steer)


Candidate = list[int] | tuple[list[int], list[int]]  # a row, or a (prompt, reply) pair


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
            stacklevel=3,
        )


def _window(c: Candidate, k: int, n: int) -> tuple[tuple[int, ...], ...]:
    """What the extraction of a row reads: its prompt and the tokens it must reproduce."""
    prompt, target = _split(c, k, n)
    return tuple(prompt), tuple(target)


def _split(c: Candidate, k: int, n: int) -> tuple[list[int], list[int]]:
    """What a candidate is prompted with, and what it must not continue with."""
    return (list(c[0]), list(c[1])[: n - k]) if isinstance(c, tuple) else (c[:k], c[k:n])


def _leaks(
    model: nn.Module, rows: Sequence[Candidate], k: int, n: int, pad_id: int, batch_size: int
) -> EvaluationReport:
    """(n, k)-extraction of ``rows``, teacher-forced (exact against greedy decoding)."""
    first = [t for part in _split(rows[0], k, n) for t in part]
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


def _extractable(
    model: nn.Module, rows: Sequence[Candidate], k: int, n: int, pad_id: int, batch_size: int
) -> float:
    return _leaks(model, rows, k, n, pad_id, batch_size).memorized


def _where_gates_open(
    model: nn.Module, steer: Steer, rows: Sequence[Candidate], k: int, n: int
) -> dict[str, Any]:
    """Where the gates open on memorized rows, teacher-forced: on the positions that choose the
    memorized window's tokens and on the prompt's positions before them, per row. Beside the
    open share on general text this says whether the gate is selective, so whether a steer
    that misses some rows is held back by its gate or by its strength."""
    window, prompt, per_row = [], [], []
    for row in rows:
        p, w = _split(row, k, n)
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


def _least_looping(
    model: nn.Module,
    reference: nn.Module,
    judge: _Judge,
    target: float,
    rows: Sequence[Candidate],
    space: SearchSpace,
    k: int,
    n: int,
    pad_id: int,
    batch_size: int,
) -> tuple[Trial, dict[str, Any]]:
    """Step 7: of the ``space.reply_check`` best points equal on the target, the first (in the
    search's order) whose greedy continuations of the tuning prompts repeat no more 4-grams
    than the reference's own continuations plus ``space.loop_tolerance`` points; else the one
    that repeats fewest. Only points whose continuations' perplexity under the reference is
    within ``space.fluency_tolerance`` of the first point's are taken: fewer repeats alone
    also reward replies that stop reading as language (measured, docs/protect.md). The margin
    rule alone picks the strongest steer, which may stop a leak by breaking the reply into a
    loop."""
    ranked = judge.ranked(judge.trials, target)
    gap = max(ranked[0].memorized - target, 0.0)
    pool = [t for t in ranked if max(t.memorized - target, 0.0) == gap][: space.reply_check]
    prompts = [_split(r, k, n)[0] for r in rows]

    def replies(m: nn.Module) -> tuple[float, float]:
        out = greedy_generate(m, prompts, n - k, pad_id=pad_id, batch_size=batch_size)
        return repetition(out), _reference_ppl(reference, prompts, out, pad_id, batch_size)

    own, own_ppl = replies(reference)
    if math.isnan(own):  # windows shorter than a 4-gram: nothing to judge
        return ranked[0], {}
    judged = []
    for trial in pool:
        with judge.steer_of(trial).attach(model):
            judged.append(replies(model))
    looped = [rep for rep, _ in judged]
    most = judged[0][1] * (1 + space.fluency_tolerance)
    fluent = [i for i, (_, ppl) in enumerate(judged) if i == 0 or ppl <= most]
    calm = [i for i in fluent if looped[i] <= own + space.loop_tolerance]
    chosen = calm[0] if calm else min(fluent, key=looped.__getitem__)
    record = {
        "reference": own,
        "reference_ppl": own_ppl,
        "tolerance": space.loop_tolerance,
        "fluency_tolerance": space.fluency_tolerance,
        "chosen": chosen,
        "points": [
            {**asdict(t), "repeated_4grams": rep, "reference_ppl": ppl}
            for t, (rep, ppl) in zip(pool, judged, strict=True)
        ],
    }
    return pool[chosen], record


def _reference_ppl(
    reference: nn.Module,
    prompts: Sequence[Sequence[int]],
    replies: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int,
) -> float:
    """The replies' perplexity under the reference, given their prompts."""
    rows = [list(p) + list(r) for p, r in zip(prompts, replies, strict=True)]
    lengths = [len(p) for p in prompts]
    return perplexity(reference, rows, pad_id, batch_size=batch_size, prompt_lengths=lengths)


def _what_it_says(
    model: nn.Module,
    reference: nn.Module,
    steer: Steer,
    rows: Sequence[Candidate],
    k: int,
    n: int,
    pad_id: int,
    batch_size: int,
    tokenizer: Any,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The steered continuations of held-out memorized prompts beside the reference's own:
    repeated 4-grams and perplexity under the reference (a steer that breaks the reply into a
    loop is not the same as one that answers like the base model)."""
    prompts = [_split(r, k, n)[0] for r in rows]
    originals = [_split(r, k, n)[1] for r in rows]
    width = n - k
    with steer.attach(model):
        steered = greedy_generate(model, prompts, width, pad_id=pad_id, batch_size=batch_size)
    own = greedy_generate(reference, prompts, width, pad_id=pad_id, batch_size=batch_size)

    quality = {
        "repeated_4grams_steered": repetition(steered),
        "repeated_4grams_reference": repetition(own),
        "reference_ppl_steered": _reference_ppl(reference, prompts, steered, pad_id, batch_size),
        "reference_ppl_reference": _reference_ppl(reference, prompts, own, pad_id, batch_size),
    }

    def text(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))

    examples = [
        {
            "prompt": text(p),
            "original": text(r),
            "steered": text(s),
            "reference": text(o),
        }
        for p, r, s, o in list(zip(prompts, originals, steered, own, strict=True))[:4]
    ]
    return quality, examples


def _warn_open(gates: dict[str, Any], expected: float) -> None:
    """Warn when the gates open far more often on some general text than the thresholds ask:
    the text they were set on does not look like that one."""
    for name, share in gates.get("open_share", {}).items():
        if share is not None and share > 3 * expected + 0.02:
            warnings.warn(
                f"the gates open on {100 * share:.0f}% of held-out {name} tokens (set for "
                f"about {100 * expected:.0f}%): the general text the thresholds came from does "
                "not look like this text. Pass a (larger) sample of the text the model will "
                "serve (general=, gss protect --general).",
                GSSWarning,
                stacklevel=3,
            )


def _figures(result: Protection, out: Path) -> list[Path]:
    from gss.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in dict.fromkeys(t.stage for t in result.trials):
        pts = [t for t in result.trials if t.stage == stage]
        ax.scatter([t.utility for t in pts], [t.memorized for t in pts], label=stage, s=18)
    if result.chosen is not None:
        ax.scatter(
            [result.chosen.utility],
            [result.chosen.memorized],
            marker="*",
            s=200,
            color="black",
            label="chosen",
            zorder=5,
        )
    ax.axvline(result.budget["limit"], color="grey", linestyle="--", label="budget")
    ax.set_xlabel(result.budget["measure"])
    ax.set_ylabel("% of tuning rows extractable")
    ax.set_title("gss protect: the points searched")
    ax.legend(fontsize=8)
    paths = [save_figure(fig, out / "frontier.png")]
    fig, ax = plt.subplots(figsize=(6, 3))
    before = result.before.get("memorized", 0.0)
    after = result.after.get("memorized")
    if after is None:  # no steer was chosen: the rows stand as they were
        ax.bar(["before", "after (no steer)"], [before, before], color=["tab:red", "tab:grey"])
    else:
        ax.bar(["before", "after"], [before, after], color=["tab:red", "tab:green"])
    ax.set_ylabel("% of held-out memorized rows extractable")
    ax.set_ylim(0, 100)
    ax.set_title(f"{len(result.heldout)} held-out memorized rows")
    paths.append(save_figure(fig, out / "rows.png"))
    return paths


__all__ = ["Protection", "SearchSpace", "Trial", "protect", "reference_text"]
