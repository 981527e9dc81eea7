"""Evaluate a TinyMem model (steered or not) and run each method's strength sweep.

Every method is evaluated the same way: % memorized (noise: (n,k)-memorization of the noised
rows, prompted with the clean prefix; backdoor: attack success on held-out triggered rows),
the share of those rows continued exactly like their clean twin, and utility (math: token
accuracy averaged over the clean test sets; language: perplexity on held-out text). Utility is
measured on two halves of each test set: the *validation* half picks each method's strength,
the *test* half is what the tables report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gss.artifact.steering_artifact import SteeringArtifact
from gss.calibrate import build_artifact
from gss.evaluate import backdoor_success, nk_memorization, perplexity, token_accuracy
from gss.statistics.collect import CalibrationStatistics, collect_statistics
from gss_bench.baselines import MitigationData, get_method
from gss_bench.baselines.steering import MeanDifferenceSteer, mean_difference_vector
from gss_bench.tinymem.data import TinyMemData

# Strength grids: delta for the subspace methods, alpha for mean-difference steering.
DELTAS: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
ALPHAS: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
# The selection rule: the lowest % memorized among grid points whose validation utility stays
# within this tolerance of the unmitigated model's (accuracy points / relative perplexity).
ACC_TOLERANCE = 1.0
PPL_TOLERANCE = 0.10
MAX_CLEAN_ROWS = 2000  # clean training rows handed to the baselines (retain / extra FT)


@dataclass(frozen=True)
class Evaluation:
    memorized: float  # % of the counted rows reproduced (noise) or attack success (backdoor)
    correct: float  # % of the counted rows continued exactly like the clean twin
    rows: int  # rows the two percentages rest on
    utility: float  # test half: accuracy % (math) or perplexity (language)
    val_utility: float  # validation half, used only to choose strengths
    seconds: float
    index: tuple[int, ...] = field(default=(), repr=False)  # counted rows
    per_row: tuple[bool, ...] = field(default=(), repr=False)  # memorized flag per counted row
    decode: str = "generate"  # how % memorized was decoded (see `evaluate`)
    decode_check: dict[str, Any] | None = None  # a generate result: did "forced" agree?

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["index"], out["per_row"]
        return out


def is_math(data: TinyMemData) -> bool:
    return data.setting.startswith("math")


def split_halves(data: TinyMemData) -> tuple[dict[str, list], dict[str, list]]:
    """(validation, test) halves of every clean test set: even rows / odd rows."""
    val = {name: list(rows[0::2]) for name, rows in data.test.items()}
    test = {name: list(rows[1::2]) for name, rows in data.test.items()}
    return val, test


def utility(model: nn.Module, data: TinyMemData, sets: dict[str, list], bs: int) -> float:
    """Math: token accuracy % averaged over the sets; language: perplexity on `main`."""
    if is_math(data):
        accs = [token_accuracy(model, rows, data.pad_id, batch_size=bs) for rows in sets.values()]
        return 100.0 * sum(accs) / len(accs)
    return perplexity(model, sets["main"], data.pad_id, batch_size=bs)


def evaluate(
    model: nn.Module, data: TinyMemData, batch_size: int = 256, decode: str = "generate"
) -> Evaluation:
    """One evaluation pass of ``model`` as it is now (hooks included).

    ``decode="generate"`` decodes greedily step by step (the metric's definition);
    ``"forced"`` checks the same exact match in one teacher-forced pass (greedy output equals a
    target iff the argmax equals it at every target position), which the sweeps use.
    """
    t0 = time.perf_counter()
    cfg = data.config
    val, test = split_halves(data)
    with torch.no_grad():
        if data.noised:
            res = nk_memorization(
                model,
                data.noised,
                cfg.prompt_len,
                cfg.window,
                data.clean_twins,
                batch_size=batch_size,
                pad_id=data.pad_id,
                method=decode,
            )
            memorized, correct, rows = res.memorized, res.correct, res.n_rows
            index, per_row = res.index, res.per_row_memorized
        else:
            res_b = backdoor_success(
                model,
                data.poison_test,
                data.poison_clean_twins,
                data.trigger,
                cfg.window,
                batch_size=batch_size,
                pad_id=data.pad_id,
                method=decode,
            )
            memorized, rows = res_b.success, res_b.n_rows
            index, per_row = res_b.index, res_b.per_row
            clean = backdoor_success(
                model,
                data.poison_clean_twins,
                data.poison_clean_twins,
                data.trigger,
                cfg.window,
                batch_size=batch_size,
                pad_id=data.pad_id,
                method=decode,
            )
            correct = clean.success
        test_utility = utility(model, data, test, batch_size)
        val_utility = utility(model, data, val, batch_size)
    return Evaluation(
        memorized=100.0 * memorized,
        correct=100.0 * correct,
        rows=rows,
        utility=test_utility,
        val_utility=val_utility,
        seconds=time.perf_counter() - t0,
        index=tuple(index),
        per_row=tuple(per_row),
        decode=decode,
    )


def within_tolerance(ev: Evaluation, base: Evaluation, data: TinyMemData) -> bool:
    if is_math(data):
        return ev.val_utility >= base.val_utility - ACC_TOLERANCE
    return ev.val_utility <= base.val_utility * (1 + PPL_TOLERANCE)


def select(points: Sequence[dict[str, Any]], base: Evaluation, data: TinyMemData) -> dict:
    """The selection rule (see module constants); falls back to the weakest setting."""
    ok = [p for p in points if within_tolerance(p["eval"], base, data)]
    if not ok:
        return {**points[0], "within_tolerance": False}
    best = min(ok, key=lambda p: (p["eval"].memorized, -p["eval"].correct, p["strength"]))
    return {**best, "within_tolerance": True}


def calibration_rows(data: TinyMemData, base: Evaluation) -> list:
    """The paper's calibration set: the training rows the unmitigated model memorized.

    Noise: the memorized noised rows (TinyMem's ``mem_seq``); backdoor: the backdoored
    training rows. Falls back to all noised rows when none was memorized.
    """
    if data.noised:
        rows = [data.noised[i] for i, hit in zip(base.index, base.per_row, strict=True) if hit]
        return rows or list(data.noised)
    return list(data.poison_train)


def general_rows(data: TinyMemData, limit: int = 1000) -> list:
    """Held-out clean rows for Sigma_gen and the thresholds: the validation halves."""
    val, _ = split_halves(data)
    rows = [r for rs in val.values() for r in rs]
    return rows[:limit]


def sweep(
    model: nn.Module,
    data: TinyMemData,
    make_handle: Callable[[float], Any],
    strengths: Sequence[float],
    batch_size: int,
    base: Evaluation | None = None,
    patience: int | None = 2,
    skip: Callable[[float, list[dict[str, Any]]], bool] | None = None,
) -> list[dict[str, Any]]:
    """Evaluate the model with ``make_handle(strength)`` attached, for ascending strengths.

    With ``base`` and a ``patience``, stop after that many consecutive points outside the
    utility tolerance: damage grows with strength, and the selection rule cannot pick such
    points. ``skip(strength, points so far)`` leaves out a point for the same reason.
    ``make_handle`` returns a hook handle or a baseline's Mitigation (then its
    ``model`` is evaluated); either is removed after the evaluation.
    """
    points: list[dict[str, Any]] = []
    misses = 0

    def run(strength: float, decode: str) -> Evaluation:
        handle = make_handle(strength)  # a hook handle, or a Mitigation (its edited model)
        try:
            return evaluate(getattr(handle, "model", model), data, batch_size, decode=decode)
        finally:
            handle.remove()

    for strength in sorted(strengths):
        if skip is not None and skip(strength, points):
            continue
        ev = run(strength, "forced")
        points.append({"strength": strength, "eval": ev})
        if base is not None and patience is not None:
            misses = 0 if within_tolerance(ev, base, data) else misses + 1
            if misses >= patience:
                break
    if base is not None:
        # the point the rule picks, decoded greedily step by step: the metric as defined
        chosen = select(points, base, data)
        for point in points:
            if point["strength"] == chosen["strength"]:
                point["eval"] = confirm(point["eval"], run(point["strength"], "generate"))
    return points


def confirm(forced: Evaluation, generated: Evaluation) -> Evaluation:
    """The step-by-step result, noting whether the one-pass check agreed with it row by row."""
    agrees = forced.per_row == generated.per_row and forced.correct == generated.correct
    return replace(generated, decode_check={"forced_agrees": agrees, "forced": forced.memorized})


def gss_sweep(
    model: nn.Module,
    data: TinyMemData,
    artifact: SteeringArtifact,
    deltas: Sequence[float] | None = None,
    batch_size: int = 256,
    base: Evaluation | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    deltas = DELTAS if deltas is None else deltas
    return sweep(
        model,
        data,
        lambda d: artifact.attach(model, delta=d, **options),
        deltas,
        batch_size,
        base,
    )


def mean_diff_sweep(
    model: nn.Module,
    data: TinyMemData,
    stats: CalibrationStatistics,
    alphas: Sequence[float] = ALPHAS,
    batch_size: int = 256,
    base: Evaluation | None = None,
) -> list[dict[str, Any]]:
    vector = mean_difference_vector(stats)
    return sweep(
        model,
        data,
        lambda a: MeanDifferenceSteer(vector, a).attach(model, stats.layer),
        alphas,
        batch_size,
        base,
    )


def baseline_data(data: TinyMemData, base: Evaluation, layer: int) -> MitigationData:
    """What every baseline gets: U = the calibration rows GSS uses (memorized noised rows, or
    the backdoored training rows), their clean twins, C = up to `MAX_CLEAN_ROWS` clean
    training rows (the reference model's training set), the prompt length (noise settings;
    a backdoor's continuation starts at its trigger, so those score whole rows) and GSS's
    layer for the activation methods."""
    memorized = calibration_rows(data, base)
    if data.noised:
        twin_of = dict(zip(data.noised, data.clean_twins, strict=True))
        twins = [twin_of[r] for r in memorized]
    else:
        twins = list(data.poison_train_twins)
    clean = list(data.reference_train)
    step = max(1, len(clean) // MAX_CLEAN_ROWS)
    return MitigationData(
        memorized=memorized,
        clean=clean[::step][:MAX_CLEAN_ROWS],
        pad_id=data.pad_id,
        clean_twins=twins,
        prompt_len=data.config.prompt_len if data.noised else None,
        layer=layer,
    )


def baseline_sweep(
    model: nn.Module,
    data: TinyMemData,
    name: str,
    mdata: MitigationData,
    batch_size: int = 256,
    base: Evaluation | None = None,
    made: dict[int, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every point of the baseline's default grid, evaluated like the GSS sweeps.

    A grid point's strength is its index (grids go mildest first); its parameters and the
    method's full time (its own plus any shared work it reused) are added to the point.
    Edited copies are kept until the sweep ends, so the selected point is re-decoded without
    re-training; hook methods are re-attached (their fit is cached). With `base`, a point is
    skipped when a milder one along the method's `stronger` hyperparameters already broke the
    utility tolerance (:meth:`~gss_bench.baselines.Method.dominated`): the rule could not pick it.
    ``made``: filled with each point's Mitigation by its index, for the caller to read after.
    """
    method = get_method(name)
    made = {} if made is None else made

    def skip(index: float, points: list[dict[str, Any]]) -> bool:
        if base is None:  # never: `skip` is only passed on with a base
            return False
        failed = [
            method.grid[int(p["strength"])]
            for p in points
            if not within_tolerance(p["eval"], base, data)
        ]
        return method.dominated(method.grid[int(index)], failed)

    def make(index: float) -> Any:
        i = int(index)
        if i not in made or made[i].model is model:  # new, or a hook method to attach again
            made[i] = method.run(model, mdata, **method.grid[i])
        return made[i]

    points = sweep(
        model,
        data,
        make,
        range(len(method.grid)),
        batch_size,
        base,
        patience=None,
        skip=skip if base is not None else None,
    )
    for point in points:
        result = made[int(point["strength"])]
        point["params"] = dict(method.grid[int(point["strength"])])
        point["seconds"] = result.total_seconds
        point["info"] = {k: v for k, v in result.info.items() if isinstance(v, int | float | str)}
    return points


def calibrate_layer(
    model: nn.Module,
    reference: nn.Module,
    texts: list,
    gen_texts: list,
    layer: int,
    preset: str = "gss",
    **options: Any,
) -> CalibrationStatistics:
    return collect_statistics(
        model,
        reference,
        texts,
        preset,
        layer=layer,
        gen_texts=gen_texts,
        batch_size=64,
        progress=False,
        **options,
    )


def signal_strength(stats: CalibrationStatistics) -> float:
    """Top singular value of the whitened memorization matrix: the first-order change of the
    memorized tokens' log-likelihood per unit probe variance on general tokens."""
    from gss.layer_scan import signal_strength as strength

    return strength(stats.memorization.value, stats.sigma.covariance)


def summarize(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON-ready copy of a sweep."""
    return [{**p, "eval": p["eval"].to_dict()} for p in points]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = sum(vals) / len(vals)
    sd = (sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
    return m, sd


__all__ = [
    "ALPHAS",
    "DELTAS",
    "Evaluation",
    "build_artifact",
    "calibrate_layer",
    "calibration_rows",
    "evaluate",
    "gss_sweep",
    "mean_diff_sweep",
    "select",
]
