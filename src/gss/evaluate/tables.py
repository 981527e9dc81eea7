"""The results of an evaluation and of a sweep as the records and tables they are reported in.

`gss evaluate` and `gss sweep` print a Markdown table and write it beside a JSON record; a
script or a notebook running the same comparison (`gss.evaluate.compare`) gets the same table
and record from these classes, so the numbers read the same wherever they come from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.artifact.files import check_outputs, record_outputs
from gss.config import EVALUATION_BATCH_SIZE
from gss.evaluate.leaks import LeakReport
from gss.evaluate.sampled import SAMPLES, TOP_P
from gss.evaluate.suite import DS_LAMBDAS, EvaluationReport
from gss.evaluate.sweep import SweepPoint, pareto_front, plot_pareto
from gss.report import markdown_table, write_json

if TYPE_CHECKING:
    from gss.artifact.steering_artifact import SteeringArtifact

__all__ = ["REPEATED", "SWEEP_OUTPUTS", "SteeringEvaluation", "SweepResult"]

# what `SweepResult.write` (`gss sweep --out`) writes
SWEEP_OUTPUTS = ("sweep.json", "sweep.md", "sweep.png")

# with secrets in the rows: how much the decoded continuations loop (LeakReport.repetition)
REPEATED = "% 4-grams repeated"


@dataclass(frozen=True)
class SteeringEvaluation:
    """The unsteered model's run and, with an artifact attached, the steered one.

    `runs`: "unsteered", then "steered" when there is an artifact; `leaks`: per run, what the
    secrets check found (empty when the rows carry no secrets); `gate_open_share`: the share of
    positions where the steered run's gate opened (None without a steered run); `reply`:
    whether the candidates were conversations whose replies were matched; `options`: the
    artifact's options the steered run overrode (its ``delta``), recorded with the numbers.
    """

    runs: dict[str, EvaluationReport]
    leaks: dict[str, LeakReport] = field(default_factory=dict)
    gate_open_share: float | None = None
    reply: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> EvaluationReport:
        """The unsteered run, which the deviation scores compare against."""
        return self.runs["unsteered"]

    def headline(self) -> str:
        """What was measured, on how much: the line above the table."""
        base = self.base
        what = (
            f"replies reproduced (their first {base.n - base.k} tokens) of {base.rows} "
            "conversations"
            if self.reply
            else f"({base.n},{base.k})-memorization of {base.rows} sequences"
        )
        steered = ", ".join(f"{k} {v:g}" for k, v in self.options.items())
        return f"{what}, perplexity on {base.heldout_tokens} held-out tokens" + (
            f"; steered with {steered}" if steered else ""
        )

    def table(self) -> str:
        """One Markdown row per run: memorization, the secrets said (with secrets in the rows),
        perplexity, the deviation scores against the unsteered run and the seconds taken."""
        rows = []
        sampled = all(r.sampled for r in self.runs.values())
        for name, report in self.runs.items():
            said = []
            if name in self.leaks:
                leak = self.leaks[name]
                said = [f"{leak.secrets_leaked:.1f}", f"{leak.repetition:.1f}"]
            rows.append(
                [
                    name,
                    f"{report.memorized:.1f}",
                    f"{report.token_match:.1f}",
                    *_sampled_cells(report, sampled),
                    *said,
                    f"{report.perplexity:.3f}",
                    *(f"{v:.2f}" for v in report.deviation_scores(self.base).values()),
                    f"{sum(report.seconds.values()):.1f}",
                ]
            )
        header = ["run", "% memorized", "% tokens matched"]
        header += [f"% sampled ({SAMPLES} draws, T=1 / top-p {TOP_P:g})"] if sampled else []
        header += ["% secrets said", REPEATED] if self.leaks else []
        header += ["perplexity", *(f"DS {lam:g}" for lam in DS_LAMBDAS), "seconds"]
        return markdown_table(header, rows)

    def record(self, model: str | None = None, steer: str | None = None) -> dict[str, Any]:
        """The JSON record: what was evaluated (``model``, ``steer``: as given), the window,
        and per run its report, deviation scores, secrets found and gate open share."""
        base = self.base
        record: dict[str, Any] = {"model": model, "steer": steer, "k": base.k, "n": base.n}
        record["reply"] = self.reply
        if self.options:
            record["options"] = dict(self.options)
        for name, report in self.runs.items():
            record[name] = {**report.to_dict(), **report.deviation_scores(base)}
            if name in self.leaks:
                record[name]["secrets"] = self.leaks[name].to_dict()
        if self.gate_open_share is not None:
            record["steered"]["gate_open_share"] = self.gate_open_share
        return record


@dataclass(frozen=True)
class SweepResult:
    """A sweep over one artifact's options, and the point selected to deploy.

    `unsteered`: the model's own run; `points`: the grid (`gss.evaluate.steering_sweep`);
    `selected`: the index of the point `gss.evaluate.select_point` chose within `tolerance`,
    or None; `leaks`: with secrets in the rows, what the unsteered model said, then each point
    (empty otherwise); `pad_id`, `batch_size`, `reply`: how the runs were made.
    """

    unsteered: EvaluationReport
    points: list[SweepPoint]
    selected: int | None
    tolerance: float
    leaks: list[LeakReport] = field(default_factory=list)
    pad_id: int = 0
    batch_size: int = EVALUATION_BATCH_SIZE
    reply: bool = False

    def table(self) -> str:
        """One Markdown row for the unsteered model and one per point (its options, what it
        measured, whether it is on the Pareto front and whether it is the selected one), then
        the selection rule."""
        leaks = self.leaks
        said = [
            [f"{x:.1f}" for x in (leak.secrets_leaked, leak.prompts_saying_others, leak.repetition)]
            for leak in leaks
        ] or [[]] * (len(self.points) + 1)
        front = {id(p) for p in pareto_front(self.points)}
        base = self.unsteered
        unsteered = [f"{base.memorized:.1f}", *said[0], f"{base.perplexity:.3f}"]
        rows = [["unsteered", "", "", "", *unsteered, "", "", ""]]
        for i, (p, point_said) in enumerate(zip(self.points, said[1:], strict=True)):
            o = p.options
            rows.append(
                [
                    "steered",
                    f"{o['delta']:g}",
                    "" if o["threshold_percentile"] is None else f"{o['threshold_percentile']:g}",
                    str(o["rank"]),
                    f"{p.report.memorized:.1f}",
                    *point_said,
                    f"{p.report.perplexity:.3f}",
                    "" if p.gate_open_share is None else f"{100 * p.gate_open_share:.1f}",
                    "yes" if id(p) in front else "",
                    "yes" if i == self.selected else "",
                ]
            )
        header = ["run", "delta", "percentile", "rank", "% memorized"]
        header += ["% secrets said", "% saying another row's", REPEATED] if leaks else []
        table = markdown_table([*header, "perplexity", "% gate open", "Pareto", "selected"], rows)
        within = f"within +{100 * self.tolerance:g}%"
        rule = f"perplexity {within}, then the lowest memorization"
        if leaks:
            rule += ", then the fewest secrets said, then the fewest rows saying another's"
        missing = "" if self.selected is not None else f" (no point is {within})"
        return table + f"\n\nselected: {rule}, then the lowest perplexity" + missing

    def record(self) -> dict[str, Any]:
        """The JSON record: the unsteered run, every point, the selected index (or null), the
        tolerance, the secrets found (with secrets in the rows) and the run settings."""
        base = self.unsteered
        return {
            "unsteered": base.to_dict(),
            "points": [p.to_dict() for p in self.points],
            "selected": self.selected,  # an index into points, or null
            "tolerance": self.tolerance,
            # with secrets in the rows: the unsteered model's leaks, then each point's
            **({"secrets": [leak.to_dict() for leak in self.leaks]} if self.leaks else {}),
            "reply": self.reply,
            "k": base.k,
            "n": base.n,
            "pad_id": self.pad_id,
            "batch_size": self.batch_size,
        }

    def plot(self, path: str | Path) -> Path:
        """The points' memorization against perplexity, beside the unsteered model's."""
        curve = [(p.report.memorized, p.report.perplexity) for p in self.points]
        base = (self.unsteered.memorized, self.unsteered.perplexity)
        return plot_pareto({"GSS sweep": curve}, base, path)

    def write(self, directory: str | Path, overwrite: bool = False) -> list[Path]:
        """``sweep.json`` (`record`), ``sweep.md`` (`table`) and ``sweep.png`` (`plot`) in
        ``directory``, replacing an earlier run's only with ``overwrite``."""
        check_outputs(directory, SWEEP_OUTPUTS, overwrite)
        out = Path(directory)
        write_json(out / "sweep.json", self.record())
        (out / "sweep.md").write_text(self.table())
        self.plot(out / "sweep.png")
        record_outputs(out, SWEEP_OUTPUTS)
        return [out / name for name in SWEEP_OUTPUTS]

    def selected_artifact(self, steer: str | Path) -> SteeringArtifact | None:
        """The selected point's artifact, ready to save and deploy: its provenance records the
        sweep (``steer``: the artifact swept, as given; the point's options and numbers, the
        tolerance). None when no point was within the tolerance."""
        if self.selected is None:
            return None
        point = self.points[self.selected]
        assert point.artifact is not None  # steering_sweep keeps each point's artifact
        how = {
            "steer": str(steer),
            "options": point.options,
            "memorized": point.report.memorized,
            "perplexity": point.report.perplexity,
            "unsteered_perplexity": self.unsteered.perplexity,
            "tolerance": self.tolerance,
        }
        provenance = point.artifact.provenance
        provenance = dataclasses.replace(provenance, extra={**provenance.extra, "sweep": how})
        return dataclasses.replace(point.artifact, provenance=provenance)


def _sampled_cells(report: EvaluationReport, shown: bool) -> list[str]:
    """The sampled attacker's cell (`EvaluationReport.sampled`), where the table shows it."""
    if not shown or report.sampled is None:
        return []
    return [f"{report.sampled['temperature_1']:.1f} / {report.sampled['top_p']:.1f}"]
