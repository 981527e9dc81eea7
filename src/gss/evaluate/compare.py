"""A steered model against its unsteered self, in one call: the runs `gss evaluate` and
`gss sweep` make, for any script to make the same way.

`evaluate_steering` measures the model, then the model with an artifact attached;
`sweep_and_select` measures the model, then a grid over the artifact's options, and selects
the point to deploy. Both run the secrets check on every model they measure when the rows
carry secrets (`gss.evaluate.inputs.secrets_check`). Their results print and save as tables
and records (`gss.evaluate.tables`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gss.artifact.stack import Steer
from gss.artifact.steering_artifact import SteeringArtifact
from gss.config import EVALUATION_BATCH_SIZE, RunOptions, run_options
from gss.evaluate.inputs import EvaluationRows
from gss.evaluate.leaks import LeakReport
from gss.evaluate.suite import EvaluationReport, evaluate_model
from gss.evaluate.sweep import check_grid, check_tolerance, select_point, steering_sweep
from gss.evaluate.tables import SteeringEvaluation, SweepResult

__all__ = ["evaluate_steering", "sweep_and_select"]

# what looks for the rows' secrets in a model's continuations (`gss.evaluate.inputs.SecretsCheck`)
SecretsCheckFn = Callable[[torch.nn.Module], LeakReport]


def evaluate_steering(
    model: torch.nn.Module,
    artifact: Steer | None,
    rows: EvaluationRows,
    *,
    delta: float | None = None,
    secrets: SecretsCheckFn | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> SteeringEvaluation:
    """(n, k)-memorization (greedy decoding, and the attacker who samples) and held-out
    perplexity of ``model`` (`evaluate_model`) on ``rows``, and with ``artifact`` attached
    (at strength ``delta``: None for its own) when there is one; ``secrets``: run on each,
    when given. ``run`` (or ``batch_size``, ``progress``) as `evaluate_model` takes them."""
    opts = run_options(run, batch_size, progress, batch_default=EVALUATION_BATCH_SIZE)
    leaks: dict[str, LeakReport] = {}

    def measure(name: str) -> EvaluationReport:
        report = evaluate_model(
            model,
            rows.memorized,
            rows.heldout,
            k=rows.k,
            n=rows.n,
            pad_id=rows.pad_id,
            sampled=True,
            run=opts,
        )
        if secrets is not None:
            leaks[name] = secrets(model)
        return report

    runs = {"unsteered": measure("unsteered")}
    gates: dict[str, Any] = {}
    options: dict[str, Any] = {"delta": delta} if delta is not None else {}
    if artifact is not None:
        with artifact.attach(model, track_gates=True, **options) as handle:
            runs["steered"] = measure("steered")
            gates = handle.gate_stats()
    return SteeringEvaluation(
        runs,
        leaks,
        gates["any_open_share"] if gates else None,
        reply=rows.reply,
        options=options if artifact is not None else {},
    )


def sweep_and_select(
    model: torch.nn.Module,
    artifact: SteeringArtifact,
    rows: EvaluationRows,
    *,
    deltas: Sequence[float] | None = None,
    percentiles: Sequence[float] | None = None,
    ranks: Sequence[int] | None = None,
    general: Sequence[Sequence[int]] | None = None,
    tolerance: float = 0.05,
    secrets: SecretsCheckFn | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> SweepResult:
    """``model`` unsteered, then every point of `steering_sweep` over ``deltas`` x
    ``percentiles`` x ``ranks`` (``general``: token rows that set the percentiles' thresholds),
    all teacher-forced; ``secrets``: run on the unsteered model and on each point, when given.
    The selected point is `select_point`'s within ``tolerance``, the secrets said and the rows
    saying another's deciding too when the rows carry secrets. ``run`` (or ``batch_size``,
    ``progress``) as `evaluate_model` takes them."""
    check_tolerance(tolerance)  # a bad tolerance fails before any work
    check_grid(artifact, deltas, percentiles, ranks)  # and so does a bad grid value
    opts = run_options(run, batch_size, progress, batch_default=EVALUATION_BATCH_SIZE)
    common: dict[str, Any] = {"k": rows.k, "n": rows.n, "pad_id": rows.pad_id, "run": opts}
    memorized, heldout = rows.memorized, rows.heldout
    base = evaluate_model(model, memorized, heldout, method="forced", **common)
    points = steering_sweep(
        model,
        artifact,
        memorized,
        heldout,
        deltas=deltas,
        percentiles=percentiles,
        ranks=ranks,
        general=general,
        **common,
    )
    leaks: list[LeakReport] = []  # unsteered, then each point: what it says of the secrets
    if secrets is not None:
        leaks.append(secrets(model))
        for p in points:
            assert p.artifact is not None
            with p.artifact.attach(model):
                leaks.append(secrets(model))
    chosen = select_point(
        points,
        base.perplexity,
        tolerance=tolerance,
        secrets_said=[leak.secrets_leaked for leak in leaks[1:]] if leaks else None,
        others_said=[leak.prompts_saying_others for leak in leaks[1:]] if leaks else None,
    )
    return SweepResult(
        base,
        points,
        chosen,
        tolerance,
        leaks,
        pad_id=rows.pad_id,
        batch_size=opts.batch_size,
        reply=rows.reply,
    )
