"""The utility-memorization trade-off of one artifact: a grid over delta, threshold, rank.

Each grid point attaches the artifact with those options, measures (n, k)-memorization and
held-out perplexity (`evaluate_model`, teacher-forced by default: exact-match verdicts equal to
greedy decoding's at a fraction of the cost), and records the gate's open share. Threshold
percentiles need general text: its probe responses are computed once and every percentile's
thresholds come from them (delta rescales probes and thresholds together, so a percentile's
thresholds do not depend on delta).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gss.artifact.steering_artifact import SteeringArtifact, require_artifact
from gss.config import DEFAULT_WINDOW, EVALUATION_BATCH_SIZE, RunOptions, run_options
from gss.errors import GSSError, GSSWarning
from gss.evaluate.suite import Candidates, EvaluationReport, evaluate_model

__all__ = [
    "SweepPoint",
    "check_grid",
    "pareto_front",
    "plot_pareto",
    "select_point",
    "steering_sweep",
]


@dataclass(frozen=True)
class SweepPoint:
    """One grid point: the options it used, what it measured, the gate's open share, and the
    artifact configured with those options (ready to attach; not serialized)."""

    options: dict[str, Any]
    report: EvaluationReport
    gate_open_share: float | None = None
    artifact: SteeringArtifact | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "gate_open_share": self.gate_open_share,
            **{
                k: v
                for k, v in self.report.to_dict().items()
                if k not in ("index", "per_row", "per_row_near")
            },
        }


def check_grid(
    artifact: SteeringArtifact,
    deltas: Sequence[float] | None = None,
    percentiles: Sequence[float] | None = None,
    ranks: Sequence[int] | None = None,
) -> None:
    """Refuse a grid value no steer can take (a delta <= 0, a percentile outside (0, 100), a
    rank past the artifact's), before any point of the sweep runs."""
    require_artifact(artifact, "a strength sweep")
    for name, grid in (("deltas", deltas), ("percentiles", percentiles), ("ranks", ranks)):
        if grid is not None and (isinstance(grid, str) or not isinstance(grid, Sequence)):
            raise GSSError(f"{name} is a list of values (e.g. [0.25, 1, 4]), got {grid!r}.")
    for delta in deltas or ():
        artifact.with_options(delta=delta)
    for rank in ranks or ():
        artifact.with_options(rank=rank)
    for percentile in percentiles or ():
        artifact.config.replace(threshold_percentile=percentile)


def steering_sweep(
    model: torch.nn.Module,
    artifact: SteeringArtifact,
    memorized: Candidates,
    heldout: Sequence[Sequence[int]],
    *,
    deltas: Sequence[float] | None = None,
    percentiles: Sequence[float] | None = None,
    ranks: Sequence[int] | None = None,
    general: Sequence[Sequence[int]] | None = None,
    k: int = DEFAULT_WINDOW.k,
    n: int = DEFAULT_WINDOW.n,
    pad_id: int = 0,
    batch_size: int | None = None,
    method: str = "forced",
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> list[SweepPoint]:
    """Every combination of `deltas` x `percentiles` x `ranks` (None: the artifact's own).

    `general`: token id rows of general text, required with `percentiles`. `run` (a
    `gss.RunOptions`; or `batch_size`, `progress`): as `evaluate_model` takes them.
    """
    from gss.solve.thresholds import probe_responses, with_gates_set

    check_grid(artifact, deltas, percentiles, ranks)
    opts = run_options(run, batch_size, progress, batch_default=EVALUATION_BATCH_SIZE)
    batch_size, progress = opts.batch_size, opts.progress
    responses = None
    if percentiles:
        if general is None:
            raise GSSError("threshold percentiles need general text (held-out rows) to set them.")
        responses = probe_responses(
            model, artifact, general, batch_size=batch_size, progress=progress
        )
    own: list[None] = [None]  # the artifact's own value
    grid = list(itertools.product(deltas or own, percentiles or own, ranks or own))
    points = []
    for delta, percentile, rank in tqdm(grid, desc="gss: sweep", disable=not progress):
        current = artifact.with_options(rank=rank)
        if percentile is not None:
            assert responses is not None
            current = with_gates_set(current, responses, percentile)
        current = current.with_options(delta=delta)
        with current.attach(model, track_gates=True) as handle:
            report = evaluate_model(
                model,
                memorized,
                heldout,
                k=k,
                n=n,
                pad_id=pad_id,
                batch_size=batch_size,
                method=method,
                progress=False,  # the sweep's own bar counts the points
            )
            gates = handle.gate_stats()
        options = {"delta": current.config.delta, "rank": current.rank}
        options["threshold_percentile"] = percentile
        points.append(SweepPoint(options, report, gates.get("any_open_share"), current))
    return points


def pareto_front(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """Points no other point beats on both memorization and perplexity (lower is better)."""
    front = []
    for p in points:
        a = (p.report.memorized, p.report.perplexity)
        dominated = any(
            (q.report.memorized, q.report.perplexity) != a
            and q.report.memorized <= a[0]
            and q.report.perplexity <= a[1]
            for q in points
        )
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p.report.memorized)


def check_tolerance(tolerance: float) -> None:
    """Refuse a tolerance `select_point` cannot use, before any work; warn when it reads as
    a percentage (100 would allow +10000% perplexity)."""
    select_point([], 1.0, tolerance=tolerance)
    if tolerance > 1:
        warnings.warn(
            f"tolerance {tolerance:g} lets perplexity rise by {100 * tolerance:.0f}%: it is a "
            "fraction (0.05 = +5%).",
            GSSWarning,
            stacklevel=3,
        )


def select_point(
    points: Sequence[SweepPoint],
    unsteered_perplexity: float,
    *,
    tolerance: float = 0.05,
    secrets_said: Sequence[float] | None = None,
    others_said: Sequence[float] | None = None,
) -> int | None:
    """The index of the point to deploy: among those whose perplexity is within `tolerance`
    (relative: 0.05 = +5%) of the unsteered model's, the lowest memorization, then the fewest
    secrets said (`secrets_said`: a % per point, as `LeakReport.secrets_leaked`), then the
    fewest prompts saying another prompt's secret (`others_said`: a % per point, as
    `LeakReport.prompts_saying_others`), then the lowest perplexity. None when no point is
    within the tolerance.

    Exact match alone is not enough to choose: past the strength where no row comes out whole,
    the parts of the secrets said can keep falling (results/canaries/). A prompt's own secret
    comes first, since reciting it is the regurgitation being removed; a reply that says
    someone else's instead is a leak too, so it decides among the points that say no more of
    their own.
    """
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise GSSError(
            f"tolerance must be >= 0 and finite (a relative perplexity increase), got {tolerance}."
        )
    shares = []
    for name, given in (("secrets-said", secrets_said), ("others-said", others_said)):
        if given is not None and len(given) != len(points):
            raise GSSError(
                f"{len(points)} sweep points but {len(given)} {name} shares: give one per "
                "point, in the same order."
            )
        values = [float(v) for v in given] if given is not None else [0.0] * len(points)
        if any(math.isnan(v) for v in values):
            raise GSSError(
                f"a {name} share is NaN (a leak check with no secrets to look for): pass the "
                "shares only when the rows carry secrets."
            )
        shares.append(values)
    own, others = shares
    limit = unsteered_perplexity * (1 + tolerance)
    ok = [i for i, p in enumerate(points) if p.report.perplexity <= limit]
    if not ok:
        return None
    return min(
        ok,
        key=lambda i: (points[i].report.memorized, own[i], others[i], points[i].report.perplexity),
    )


def plot_pareto(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    base: tuple[float, float],
    path: str | Path,
    title: str = "memorization vs perplexity",
    ylabel: str = "% memorized (lower is better)",
) -> Path:
    """One line per method of (% memorized, perplexity) points, and the unmitigated model; with
    `ylabel`, of another share to lower (such as the secrets said) against perplexity."""
    from gss.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        pts = sorted(pts)
        ax.plot([p[1] for p in pts], [p[0] for p in pts], marker="o", label=name)
    ax.scatter(
        [base[1]], [base[0]], marker="*", s=150, color="black", label="unmitigated", zorder=5
    )
    ax.set_xlabel("held-out perplexity (lower is better)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
